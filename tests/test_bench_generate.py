"""benchmarks/bench_generate.py refuses, in one line, what it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_generate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("interpret", [None, "", "0"])
def test_cpu_without_the_interpreter_is_one_line(interpret: str | None,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # On the CPU fusetune's kernels run through Triton's interpreter, which must be switched
    # on before they load: the script says so and stops before building anything.
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(sys, "argv", ["bench_generate", "--device", "cpu", "--model", "tiny"])
    monkeypatch.setattr(bench_generate, "build", lambda *a: pytest.fail("built a model"))
    assert bench_generate.main() == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "--device cpu runs fusetune's kernels through Triton's interpreter: set "
        "TRITON_INTERPRET=1 in the environment"], err


def test_cpu_without_the_interpreter_ends_without_a_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_generate", "--device", "cpu",
                           "--model", "tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
