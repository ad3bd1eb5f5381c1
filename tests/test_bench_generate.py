"""benchmarks/bench_generate.py refuses, in one line, what it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_a_case_out_of_memory_is_reported_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # transformers' batched_mm experts of Mixtral-8x7B ask for 56 GiB at a 128-token prompt:
    # that case is a row saying so, and the other batch sizes and cases still run.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", [
        "bench_generate", "--device", "cpu", "--model", "tiny", "--layers", "1",
        "--batch", "1,2", "--prompt", "4", "--new", "2", "--repeat", "1",
        "--check-positions", "2", "--cases", "hf-eager", "--dtype", "float32"])
    real = bench_generate.run_case

    def run_case(model: object, ids: torch.Tensor, *args: object, **kwargs: object
                 ) -> dict[str, float]:
        if ids.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 56.00 GiB. "
                                         "GPU 0 has a total capacity of 139.80 GiB")
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(bench_generate, "run_case", run_case)
    assert bench_generate.main() == 0
    out = capsys.readouterr().out
    assert "hf-eager             b=2 p=4: out of GPU memory (CUDA out of memory)" in out, out
    assert "| hf-eager | 2 | 4 | out of GPU memory |" in out, out
    assert any(line.startswith("| hf-eager | 1 | 4 | ") and "out of" not in line
               for line in out.splitlines()), out
