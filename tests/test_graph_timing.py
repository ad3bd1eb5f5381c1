"""The evaluator times CUDA launches as graph replays (captured_launch), and falls back to plain
launches where a launch path cannot be captured."""

from __future__ import annotations

import functools

import pytest
import torch

from fusetune.kernels import get_spec
from fusetune.spec import Point
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

    torch.manual_seed(0)
    expected = torch.randn(3, device="cuda")
    torch.manual_seed(0)
    replay = captured_launch(launch)
    assert replay is launch
    replay()
    torch.cuda.synchronize()
    assert float(x[0]) >= 1
    # The failed capture left the GPU's random generator usable, in its state: a failed capture
    # leaves it in capture mode, and the next randn on the device raised.
    torch.testing.assert_close(torch.randn(3, device="cuda"), expected)


def test_which_points_are_timed_as_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode-sized points (roofline floor under GRAPH_BELOW_US on the device) are timed as
    # graph replays; prefill-sized ones as plain launches; the interpreter never captures.
    import fusetune.tables
    from fusetune import gpus, models
    from fusetune.tuner.bench import GRAPH_BELOW_US, floor_us

    monkeypatch.setattr(fusetune.tables, "gpu_for_device", lambda device=None: gpus.resolve("h100"))
    spec = get_spec("ffn")
    dims = spec.dims_from_model(models.preset("llama-2-7b"))
    decode = Point.make("ffn", dims, 1, 1, "float16")
    prefill = Point.make("ffn", dims, 1, 4096, "float16")
    # 180 MB of weights at 3.35 TB/s; 4096 rows: 0.74 TFLOP at the fp16 peak
    assert 50 < floor_us(spec, decode, "cuda") < GRAPH_BELOW_US < floor_us(spec, prefill, "cuda")
    # FP8 activations at 1024 rows: 0.18 TFLOP, 187 µs at the fp16 peak but 93 µs at the FP8
    # one they multiply at: timed as graph replays, as a launch path slower than the kernel
    # would time the CPU. Weight-only FP8 multiplies at the 16-bit rate.
    fp8 = Point.make("ffn", dims, 1024, 1, "float16", "fp8-e4m3", "fp8")
    assert 80 < floor_us(spec, fp8, "cuda") < GRAPH_BELOW_US
    weight_only = Point.make("ffn", dims, 1024, 1, "float16", "fp8-e4m3")
    assert floor_us(spec, weight_only, "cuda") > GRAPH_BELOW_US
    assert floor_us(spec, Point.make("ffn", dims, 1024, 1, "float16"), "cuda") > GRAPH_BELOW_US
    small = Point.make("ffn", {"dim": 64, "hidden": 48}, 1, 3, "float32")
    assert not Evaluator(spec, small, "interpreter", "cpu").graphs


@pytest.mark.gpu
def test_a_launch_path_longer_than_the_flush_is_timed_as_graph_replays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A prefill-sized point is timed as plain launches, unless a config's launch path keeps the
    # host busier than do_bench's L2 flush hides (the GPU would wait for it in the timing).
    import time

    from fusetune.tuner import bench

    flush = bench.flush_us("cuda")
    assert 5 < flush < 2000  # 256 MB zeroed
    assert bench.host_us(lambda: time.sleep(2 * flush * 1e-6)) > flush
    spec = get_spec("ffn")
    point = Point.make("ffn", {"dim": 4096, "hidden": 14336}, 1, 4096, "bfloat16")
    ev = Evaluator(spec, point, "cuda", "cuda")
    assert not ev.graphs
    from fusetune.tables import gpu_for_device

    config = spec.canonical(spec.default_config(point, gpu_for_device(torch.device("cuda"))),
                            point)
    assert ev.check(config).ok
    captured: list[int] = []
    real = bench.captured_launch
    monkeypatch.setattr(bench, "captured_launch", lambda fn: captured.append(1) or real(fn))
    monkeypatch.setattr(bench, "host_us", lambda fn: 0.1 * flush)
    ev.time(config, rep_ms=5)
    assert captured == []  # a launch path the flush hides: plain launches
    monkeypatch.setattr(bench, "host_us", lambda fn: 2 * flush)
    ev.time(config, rep_ms=5)
    assert captured == [1]
