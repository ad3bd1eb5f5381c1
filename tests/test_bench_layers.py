"""benchmarks/bench_layers.py on the CPU: the flow and its table (the interpreter's bfloat16
rounding differs from the GPU's, so the numbers themselves are the GPU's to judge)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_layers


@pytest.mark.hf
def test_every_layer_compared_with_float32(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_layers", "--device", "cpu", "--model", "tiny",
                                      "--tokens", "8", "--slack", "1000"])
    assert bench_layers.main() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| output", "| embeddings", "| layer 0", "| layer 1, final norm"]
    for row in rows[2:]:  # every layer's error is measured, and finite
        own, patched = (float(v) for v in row.split(" | ")[1:3])
        assert 0 < own < 0.1 and 0 < patched < 0.1
    monkeypatch.setattr(sys, "argv", ["bench_layers", "--device", "cpu", "--model", "tiny",
                                      "--tokens", "8", "--slack", "0"])
    assert bench_layers.main() == 1  # a slack no 16-bit path meets: the exit status says so
