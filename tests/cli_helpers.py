"""What the tests of the `fusetune` command share: running it in-process, and the environment
of a `fusetune` subprocess on Triton's interpreter."""

from __future__ import annotations

import os

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
