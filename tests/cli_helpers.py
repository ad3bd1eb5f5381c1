"""What the tests of the `fusetune` command share: running it in-process, and the environment
of a `fusetune` subprocess on Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import fusetune.tables
from fusetune import cli


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def interp_env() -> dict[str, str]:
    """This environment with the interpreter on and no user tables (FUSETUNE_TABLES) loaded."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env.pop(fusetune.tables.ENV_VAR, None)
    return env


@dataclass
class Ran:
    """What a `fusetune` command ended with and printed (as subprocess.CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


def run_interpreted(cwd: Path, *args: str, timeout_s: float = 300) -> Ran:
    """`fusetune ARGS` run in `cwd` on Triton's interpreter, as `python -m fusetune.cli ARGS`
    with interp_env() runs it.

    Without CUDA this process runs the interpreter already (conftest set TRITON_INTERPRET before
    any kernel was decorated), so the command runs here: a subprocess would add only its start
    (importing torch, Triton, Optuna and SQLAlchemy: seconds) to the same code. As in a new
    process, no lookup tables are loaded when it starts (none that this process loaded, none of
    FUSETUNE_TABLES), and those it loads are dropped after it. With CUDA the kernels here were
    decorated for the GPU: the command runs in a subprocess."""
    if torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "-m", "fusetune.cli", *args], cwd=cwd,
                              env=interp_env(), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        return Ran(proc.returncode, proc.stdout, proc.stderr)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(fusetune.tables.ENV_VAR, raising=False)
        fusetune.tables.reset()
        try:
            r = CliRunner().invoke(cli.main, list(args))
        finally:
            fusetune.tables.reset()
    stderr = r.stderr
    if r.exc_info is not None and not isinstance(r.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*r.exc_info))  # as Python prints it
    return Ran(r.exit_code, r.stdout, stderr)
