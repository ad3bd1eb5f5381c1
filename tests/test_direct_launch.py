"""fusetune.kernels._direct: a repeated launch goes straight to the compiled kernel, with the
arguments in the kernel's order, and only where Triton would pick the same compiled kernel."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor
from triton_run import genuine_triton_run

from fusetune.kernels import _direct, _replay


def _body(X, Y, n, eps, FLAG, BLOCK=16):  # a kernel's parameters; never run
    pass


class FakeKernel:
    """A compiled kernel's launch entry points, recording what they are given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def launch_metadata(self, grid: Any, stream: Any, *values: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        self.launches.append(args)


class FakeJit(JITFunction):
    """A JITFunction whose own run (Triton's path) only counts and hands out FakeKernels: one
    per specialization, as Triton's cache would."""

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        self.slow.append((grid, args, kwargs))
        return self.kernel


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> Any:
    genuine_triton_run(monkeypatch)
    fn = FakeJit(_body)
    fn.slow, fn.kernel = [], FakeKernel()
    launch = _direct.DirectLaunch(fn)
    launch.enabled = True  # whatever Triton this machine has
    launch._driver = SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: "stream"))
    return launch


def test_repeated_launch_skips_the_binding(launcher: Any) -> None:
    x, y = torch.zeros(64), torch.zeros(64)
    launcher[(3, 2)](x, y, 48, 1e-5, FLAG=True, num_warps=4)
    assert len(launcher.fn.slow) == 1 and launcher.hits == 0
    launcher[(5,)](x, y, 32, 2e-5, FLAG=True, num_warps=4)  # same specialization
    assert len(launcher.fn.slow) == 1 and launcher.hits == 1
    grid0, grid1, grid2, stream, function, meta, _, _, _, *values = \
        launcher.fn.kernel.launches[-1]
    assert (grid0, grid1, grid2, stream, function, meta) == (5, 1, 1, "stream", "function",
                                                              "metadata")
    # every parameter in the kernel's order: the call's, then the keywords, then defaults
    assert values[:5] == [x, y, 32, 2e-5, True] and values[5] == 16


def test_a_set_launch_hook_is_handed_to_the_launch(launcher: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):  # Triton's path, then the short one
        launcher[(1,)](x, y, 32, 1e-5, FLAG=True)
    assert launcher.fn.kernel.launches[-1][6:9] == (None, None, None)  # no hook, no metadata
    enter = knobs.runtime.launch_enter_hook
    if not hasattr(enter, "calls"):
        pytest.skip("this Triton's launch hooks are not chains")
    monkeypatch.setattr(enter, "calls", [print])  # e.g. a profiler's
    launcher[(1,)](x, y, 32, 1e-5, FLAG=True)
    assert launcher.fn.kernel.launches[-1][7] is enter


@pytest.mark.parametrize("change", ["alignment", "int_one", "int_not_16", "int_64_bits",
                                    "dtype", "constexpr", "options"])
def test_another_specialization_takes_tritons_path(launcher: Any, change: str) -> None:
    x, y = torch.zeros(64), torch.zeros(64)
    args: dict[str, Any] = dict(a=(x, y, 32, 1e-5), kw=dict(FLAG=True, num_warps=4))
    launcher[(1,)](*args["a"], **args["kw"])
    new_a, new_kw = list(args["a"]), dict(args["kw"])
    if change == "alignment":
        new_a[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int_one":
        new_a[2] = 1
    elif change == "int_not_16":
        new_a[2] = 33
    elif change == "int_64_bits":
        new_a[2] = 2**32
    elif change == "dtype":
        new_a[1] = y.half()
    elif change == "constexpr":
        new_kw["FLAG"] = False
    else:
        new_kw["num_warps"] = 8
    launcher[(1,)](*new_a, **new_kw)
    assert len(launcher.fn.slow) == 2 and launcher.hits == 0


def test_other_arguments_and_observers_take_tritons_path(launcher: Any,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    x = torch.zeros(64)
    descriptor = object()  # e.g. a TMA descriptor: never cached
    for _ in range(2):
        launcher[(1,)](x, descriptor, 32, 1e-5, FLAG=True)
    assert len(launcher.fn.slow) == 2 and launcher.hits == 0
    launcher[(1,)](x, x, 32, 1e-5, FLAG=True)
    real_run = JITFunction.run

    def observing_run(self: Any, *a: Any, **k: Any) -> Any:
        return real_run(self, *a, **k)

    monkeypatch.setattr(JITFunction, "run", observing_run)  # e.g. the tuner's launch watcher
    launcher[(1,)](x, x, 32, 1e-5, FLAG=True)
    assert len(launcher.fn.slow) == 4 and launcher.hits == 0
    monkeypatch.setattr(JITFunction, "run", real_run)  # the watcher gone
    launcher[(1,)](x, x, 32, 1e-5, FLAG=True)
    assert launcher.hits == 1


def test_a_tma_descriptor_takes_the_short_path(launcher: Any) -> None:
    # A TensorDescriptor is keyed by all it holds but its base's address, and handed on as it
    # is (the compiled kernel's launcher makes the tensor map of each launch); the launch is
    # noted for a replay like any other (which remakes the descriptor, test below).
    x, base, again = torch.zeros(64), torch.zeros(64, 64), torch.zeros(64, 64)

    def desc(t: torch.Tensor, block: tuple[int, int] = (16, 16)) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t, list(block))

    launcher[(1,)](x, desc(base), 32, 1e-5, FLAG=True)  # Triton's path
    d = desc(again)
    rec = _replay.Recording()
    _replay.recordings().append(rec)
    try:
        launcher[(1,)](x, d, 32, 1e-5, FLAG=True)
    finally:
        _replay.recordings().pop()
    assert len(launcher.fn.slow) == 1 and launcher.hits == 1
    assert launcher.fn.kernel.launches[-1][10] is d
    assert rec.ok and rec.launches[0][3][1] is d
    # another block shape, dtype or shape: another specialization (or possibly one)
    for other in (desc(again, (32, 16)), desc(again.half()), desc(torch.zeros(32, 64))):
        launcher[(1,)](x, other, 32, 1e-5, FLAG=True)
    assert len(launcher.fn.slow) == 4 and launcher.hits == 1


def _replay_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan.run's Triton parts for a machine without a GPU (device 0 current), and Triton's own
    JITFunction.run (a wrapped one would make the replay decline)."""
    from triton import knobs

    genuine_triton_run(monkeypatch)
    monkeypatch.setattr(_replay, "_parts", (knobs.runtime, SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: "stream"), JITFunction))
    if _replay.hook_set(knobs.runtime.launch_enter_hook):
        pytest.skip("a launch hook is set in this process")


def _descriptor_plan(x: torch.Tensor, over: torch.Tensor) -> Any:
    """The plan of a recorded call on input x with one launch of (out, a descriptor `over`, 3)."""
    out = torch.empty(64, 64)
    rec = _replay.Recording()
    rec.devices.add(0)
    fn = SimpleNamespace(pre_run_hooks=[])  # the @triton.jit function launched
    rec.launches.append((fn, FakeKernel(), (1, 1, 1),
                         (out, TensorDescriptor.from_tensor(over, [16, 32]), 3)))
    return _replay.Plan.build(rec, [x], out)


def test_a_replay_remakes_each_descriptor_over_the_new_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _replay_anywhere(monkeypatch)
    x = torch.zeros(4, 64, 64)
    plan = _descriptor_plan(x, x.view(256, 64))  # a 2-D view of the whole input
    assert plan is not None
    new = torch.ones(4, 64, 64)
    (kernel, *_), = plan.launches
    out = plan.run([new])
    assert out is not None
    *_, out_ptr, d, three = kernel.launches[-1]
    assert out_ptr == out.data_ptr() and three == 3
    assert d.base is new and d.base.data_ptr() != x.data_ptr()
    assert (list(d.shape), list(d.strides), list(d.block_shape)) == ([256, 64], [64, 1],
                                                                       [16, 32])
    # a descriptor over part of a tensor, or over it read as another type: no plan
    assert _descriptor_plan(x, x.view(256, 64)[16:]) is None
    assert _descriptor_plan(x, x.view(torch.int32).view(256, 64)) is None


def _torch_plan(calls: Any, inputs: list[torch.Tensor], result: torch.Tensor,
                stacks: tuple[tuple[torch.Tensor, ...], ...] = (),
                scratch: tuple[torch.Tensor, ...] = ()) -> Any:
    """The plan of a recorded call whose launches are the torch calls `calls` ((fn, arguments
    with out last) each), as torch_call notes them for a CUDA tensor."""
    rec = _replay.Recording()
    rec.devices.add(0)
    rec.launches = [(fn, None, None, values) for fn, values in calls]
    rec.stacks, rec.scratch = list(stacks), list(scratch)
    return _replay.Plan.build(rec, inputs, result)


def test_a_replay_repeats_torch_calls_on_views_of_the_new_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An FP8-style chunked GEMM: each chunk of w's rows into a workspace (scratch), then
    # addmm of the residual's columns into the output's columns.
    _replay_anywhere(monkeypatch)
    x, w, r = torch.randn(3, 8), torch.randn(10, 8), torch.randn(3, 10)
    out, ws = torch.empty(3, 10), torch.empty(6, 8)
    calls = [(torch.mul, (w[:6], 2.0, ws)), (torch.addmm, (r[:, :6], x, ws.t(), out[:, :6])),
             (torch.mul, (w[6:], 2.0, ws[:4])),
             (torch.addmm, (r[:, 6:], x, ws[:4].t(), out[:, 6:]))]
    for fn, (*args, o) in calls:
        fn(*args, out=o)
    plan = _torch_plan(calls, [x, w, r], out, scratch=(ws,))
    assert plan is not None
    for _ in range(2):
        new = [torch.randn(3, 8), torch.randn(10, 8), torch.randn(3, 10)]
        got = plan.run(new)
        torch.testing.assert_close(got, new[0] @ (2 * new[1]).T + new[2])
        assert got.data_ptr() not in (t.data_ptr() for t in new)
    assert plan.runs == 2
    # an argument made in the call with content (not an input, output or scratch): no plan
    made = r + 1
    assert _torch_plan([(torch.addmm, (made, x, w.t(), out))], [x, w, r], out) is None
    # an argument of another dtype than the tensor it lies in: no plan
    assert _torch_plan([(torch.mm, (x, w.view(torch.int32).t(), out))], [x, w], out) is None


def test_a_replay_of_a_stacked_operand_checks_the_new_inputs_are_a_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _replay_anywhere(monkeypatch)

    def parts() -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.randn(10, 8)
        return both[:4], both[4:]

    x, (w1, w3) = torch.randn(3, 8), parts()
    both = torch.as_strided(w1, (10, 8), (8, 1))  # as _unfused.stacked makes it
    out = torch.empty(3, 10)
    calls = [(torch.mm, (x, both.t(), out))]
    torch.mm(x, both.t(), out=out)
    # without the stack noted, a view past the input it starts in makes no plan
    assert _torch_plan(calls, [x, w1, w3], out) is None
    plan = _torch_plan(calls, [x, w1, w3], out, stacks=((w1, w3),))
    assert plan is not None and plan.stacks == [(1, 2)]
    x2, (a, b) = torch.randn(3, 8), parts()
    torch.testing.assert_close(plan.run([x2, a, b]), x2 @ torch.cat([a, b]).T)
    # the same shapes, not one stack (or in another order): the replay declines
    assert plan.run([x2, torch.randn(4, 8), torch.randn(6, 8)]) is None
    c = torch.randn(10, 8)
    assert plan.run([x2, c[6:], c[:6]]) is None
    assert plan.runs == 1


def test_a_torch_call_of_a_cpu_tensor_makes_no_plan() -> None:
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    out, plan = _replay.record(
        lambda: _replay.torch_call(torch.mm, (x, w.t()), torch.empty(2, 3)), [x, w])
    torch.testing.assert_close(out, x @ w.T)
    assert plan is None


def test_not_a_jit_function_is_launched_as_it_is() -> None:
    stand_in = object()
    assert _direct.direct(stand_in) is stand_in


@pytest.mark.gpu
def test_gpu_direct_launches_match_tritons(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusetune
    from fusetune.kernels import rmsnorm as rmsnorm_mod

    genuine_triton_run(monkeypatch)
    fusetune.tables.reset()  # no memo entry of another test
    launch = _direct.direct(rmsnorm_mod._rmsnorm_kernel)
    hits = launch.hits
    base = torch.randn(4 * 1000 + 1, device="cuda")
    w = torch.rand(1000, device="cuda") + 0.5
    with torch.no_grad():
        for start in (0, 0, 1, 1, 0):  # 16-byte aligned rows, then rows 4 bytes off, then back
            x = base[start:start + 4000].view(4, 1000)
            want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
            got = fusetune.rmsnorm(x, w, eps=1e-5)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The aligned repeats replay the first call (fusetune.kernels._replay); the unaligned
    # calls cannot (their kernel is another specialization): the second of them takes the
    # direct launch's short path.
    ((_, plan),) = rmsnorm_mod._MEMO.values()
    assert plan.runs == 2 and launch.hits - hits >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37])
def test_gpu_repeated_matmul_launches_match_the_first(rows: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmul launchers' repeated calls (the memo of their checks, the replay of their
    launches) give what their first call gave, at decode and prefill rows, bf16."""
    import fusetune
    from fusetune.kernels import ffn as ffn_mod
    from fusetune.kernels import linear as linear_mod
    from fusetune.kernels import qkv as qkv_mod
    from fusetune.kernels.rope import rotary_tables

    genuine_triton_run(monkeypatch)
    fusetune.tables.reset()  # no memo entry of another test
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16)

    d, hidden, hd = 512, 1024, 64
    x, r = randn(1, rows, d), randn(1, rows, d)
    norm = randn(d, scale=0.1) + 1
    w1, w3, wd = randn(hidden, d, scale=d**-0.5), randn(hidden, d, scale=d**-0.5), \
        randn(d, hidden, scale=hidden**-0.5)
    wq, wk, wv = (randn(n, d, scale=d**-0.5) for n in (d, d // 4, d // 4))
    cos, sin = rotary_tables(torch.arange(rows, device="cuda")[None], hd, theta=1e4,
                             dtype=torch.bfloat16)

    def calls() -> list[torch.Tensor]:
        h = fusetune.ffn(x, norm, w1, w3, eps=1e-5)
        return [h, fusetune.linear(h, wd, residual=r),
                *fusetune.qkv(x, norm, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd,
                              interleaved=False)]

    with torch.no_grad():
        first = calls()
        for _ in range(3):
            for a, b in zip(calls(), first, strict=True):
                assert torch.equal(a, b)
    # The repeated calls replayed their first call's launches (fusetune.kernels._replay; TMA
    # descriptors remade over the new tensors), or where a call has no plan took the full path.
    for module in (ffn_mod, linear_mod, qkv_mod):
        ((_, plan),) = module._MEMO.values()
        assert (plan is None and rows > 1) or plan.runs == 3


@pytest.mark.gpu
def test_gpu_tma_launches_on_the_short_path_read_each_calls_tensors(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A TMA config served from a table, repeated (a replay remaking the descriptors over each
    call's tensors), computes on the new tensors: every call against the same config read by
    pointers. (Only a looked-up config is memoized: one handed in is checked every call.)"""
    import fusetune
    from fusetune.gpus import current_gpu
    from fusetune.kernels import ffn as ffn_mod

    genuine_triton_run(monkeypatch)
    monkeypatch.delenv(fusetune.tables.ENV_VAR, raising=False)
    tma = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "PASSES": 2,
           "SPLIT_K": 1, "TMA": 1, "num_warps": 4, "num_stages": 3}
    d, hidden, rows = 512, 1024, 256
    table = tmp_path / "tma.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        current_gpu().name: {"ffn": [{"dims": {"dim": d, "hidden": hidden},
                                      "dtype": "bfloat16", "batch": rows, "seq": 1,
                                      "config": tma}]}}}))
    fusetune.load_tables(table)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16)

    norm = randn(d, scale=0.1) + 1
    w1, w3 = randn(hidden, d, scale=d**-0.5), randn(hidden, d, scale=d**-0.5)
    try:
        with torch.no_grad():
            for _ in range(4):
                x = randn(rows, d)  # a new tensor (and address) every call
                got = fusetune.ffn(x, norm, w1, w3, eps=1e-5)
                want = fusetune.ffn(x, norm, w1, w3, eps=1e-5, config={**tma, "TMA": 0})
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        # the table's config was served, its repeats replayed the first call with descriptors
        ((config, plan),) = ffn_mod._MEMO.values()
        assert config["TMA"] == 1 and plan is not None and plan.runs == 3
        assert any(fields is not None for *_, slots in plan.launches for *_, fields in slots)
    finally:
        fusetune.tables.reset()
