"""The evaluator times CUDA launches as graph replays (captured_launch), and falls back to plain
launches where a launch path cannot be captured."""

from __future__ import annotations

import functools

import pytest
import torch

from fusetune.kernels import get_spec
from fusetune.kernels._spec import Point
from fusetune.tuner.bench import Evaluator, captured_launch


@pytest.mark.gpu
def test_launch_is_captured_and_replays() -> None:
    spec = get_spec("rmsnorm")
    point = Point.make("rmsnorm", {"dim": 4096}, 1, 64, "float16")
    ev = Evaluator(spec, point, "cuda", "cuda")
    config = {"BLOCK_D": 4096, "ROWS": 1, "num_warps": 8, "num_stages": 1}
    assert ev.check(config).ok  # compiles
    replay = captured_launch(lambda: spec.launch(ev.inputs, ev.outputs, config))
    assert isinstance(replay, functools.partial)  # a graph, not the plain launch
    ev.outputs["y"].fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(ev.outputs["y"].float(), ev.reference["y"], atol=2e-2,
                               rtol=2e-2)
    p20, p50, p80 = ev.time(config)
    assert 0 < p20 <= p50 <= p80


@pytest.mark.gpu
def test_launch_that_cannot_be_captured_runs_plain() -> None:
    x = torch.zeros(4, device="cuda")

    def launch() -> None:
        x.add_(1)
        float(x.sum())  # a host read: not allowed while capturing

    replay = captured_launch(launch)
    assert replay is launch
    replay()
    torch.cuda.synchronize()
    assert float(x[0]) >= 1
