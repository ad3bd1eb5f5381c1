"""fusetune.kernels._replay: a launcher's repeated call (same metadata, gradients off) repeats
the launches of its first call with the new tensors' addresses, and only where that is what
the full path would launch.

The kernels here are stand-ins with real JITFunction signatures (the launchers' own kernels'
parameters): Triton's path hands out a fake compiled kernel that records its launches, so that
every argument a launch receives can be compared with the call's tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_direct_launch import FakeJit, FakeKernel, genuine_triton_run
from triton.runtime.jit import JITFunction

import fusetune
import fusetune.runtime
import fusetune.tables
from fusetune.kernels import _direct, _replay
from fusetune.kernels import ffn as ffn_mod
from fusetune.kernels import linear as linear_mod
from fusetune.kernels import qkv as qkv_mod
from fusetune.kernels import rmsnorm as rmsnorm_mod
from fusetune.kernels.rope import rotary_tables

pytestmark = [
    pytest.mark.filterwarnings("ignore::fusetune.FusetuneWarning"),
    # CPU tensors pass the launchers' checks under Triton's interpreter only; on a GPU
    # machine test_direct_launch's GPU tests replay the real kernels.
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs where Triton interprets"),
]

FakeLaunch = tuple[Any, ...]  # (grid0, grid1, grid2, stream, function, metadata, 3 hooks, *values)


ACTIVE = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: "stream")


@pytest.fixture
def fake(fresh_tables: None, monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], FakeJit]:
    """fake(module, name): the kernel `name` of `module` replaced by a FakeJit for the test."""
    genuine_triton_run(monkeypatch)
    # Triton 3.6+ keeps its launch hooks as chains, empty unless a hook was added
    monkeypatch.setattr(_replay, "_parts", (SimpleNamespace(
        launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=None), ACTIVE,
        JITFunction))

    def install(module: Any, name: str) -> FakeJit:
        fn = FakeJit(getattr(module, name).fn)
        fn.kernel, fn.slow = FakeKernel(), []  # Triton's path: one entry a launch
        launch = _direct.direct(fn)
        launch.enabled = True  # whatever Triton this machine has
        launch._driver = SimpleNamespace(active=ACTIVE)
        monkeypatch.setattr(module, name, fn)
        return fn

    return install


def _only_plan(module: Any) -> Any:
    (entry,) = module._MEMO.values()
    return entry[1]


def _values(fn: FakeJit, launch: FakeLaunch) -> dict[str, Any]:
    return dict(zip(fn.arg_names, launch[9:], strict=False))


def test_a_repeated_linear_call_launches_with_the_new_tensors(fake: Any) -> None:
    k = fake(linear_mod, "_linear_kernel")
    w = torch.randn(16, 32)
    with torch.no_grad():
        fusetune.linear(torch.randn(3, 32), w, residual=torch.randn(3, 16))
        plan = _only_plan(linear_mod)
        assert plan is not None and len(k.slow) == 1
        x2, r2 = torch.randn(3, 32), torch.randn(3, 16)
        y2 = fusetune.linear(x2, w, residual=r2)
    assert plan.runs == 1 and len(k.slow) == 1  # the replay; Triton's path was not taken again
    (launch,) = k.kernel.launches
    assert launch[3] == "stream"  # the current stream, asked for at the replay
    got = _values(k, launch)
    assert (got["X"], got["W"], got["R"], got["OUT"]) == (x2.data_ptr(), w.data_ptr(),
                                                           r2.data_ptr(), y2.data_ptr())
    assert y2.shape == (3, 16) and y2.dtype == x2.dtype
    # the integers and constexprs are the first call's; no tensor of that call is kept
    (template,) = [t for _, _, t, _ in plan.launches]
    assert not any(isinstance(v, torch.Tensor) for v in template)
    assert (got["M"], got["N"], got["K"]) == (3, 16, 32)


def test_split_k_replays_both_launches_with_one_new_workspace(
        fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    k = fake(linear_mod, "_linear_kernel")
    lookup = fusetune.runtime.cached_config

    def split_two(*args: Any, **kwargs: Any) -> dict[str, int]:
        return {**lookup(*args, **kwargs), "BLOCK_M": 1, "SPLIT_K": 2, "TMA": 0}

    monkeypatch.setattr(fusetune.runtime, "cached_config", split_two)
    w = torch.randn(16, 64)
    with torch.no_grad():
        fusetune.linear(torch.randn(2, 64), w)
        x2 = torch.randn(2, 64)
        y2 = fusetune.linear(x2, w)
    assert _only_plan(linear_mod).runs == 1
    main, finish = (_values(k, launch) for launch in k.kernel.launches)
    assert (main["FINISH"], finish["FINISH"]) == (False, True)
    assert main["WS"] == finish["WS"]  # the partial sums one launch writes, the other reads
    assert main["WS"] not in (x2.data_ptr(), w.data_ptr(), y2.data_ptr())
    assert main["X"] == x2.data_ptr() and finish["OUT"] == y2.data_ptr()


def test_qkv_replays_the_norm_pass_of_another_launcher_inside(
        fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """PASSES = 2: qkv's launches include the RMSNorm pass (rmsnorm's kernel), whose output is
    a scratch buffer the matmul then reads."""
    kq, kn = fake(qkv_mod, "_qkv_kernel"), fake(rmsnorm_mod, "_rmsnorm_kernel")
    lookup = fusetune.runtime.cached_config

    def two_passes(spec: Any, *args: Any, **kwargs: Any) -> dict[str, int]:
        cfg = lookup(spec, *args, **kwargs)
        return {**cfg, "PASSES": 2, "SPLIT_K": 1, "TMA": 0} if spec.name == "qkv" else cfg

    monkeypatch.setattr(fusetune.runtime, "cached_config", two_passes)
    d, hd = 32, 8
    g, wq, wk, wv = torch.rand(d) + 0.5, torch.randn(d, d), torch.randn(16, d), torch.randn(16, d)
    cos, sin = rotary_tables(torch.arange(3)[None], hd, theta=10000.0)
    with torch.no_grad():
        fusetune.qkv(torch.randn(1, 3, d), g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd,
                     interleaved=False)
        x2 = torch.randn(1, 3, d)
        q, k, v = fusetune.qkv(x2, g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd,
                               interleaved=False)
    assert _only_plan(qkv_mod).runs == 1 and (len(kq.slow), len(kn.slow)) == (1, 1)
    norm, = (_values(kn, launch) for launch in kn.kernel.launches)
    main, = (_values(kq, launch) for launch in kq.kernel.launches)
    assert norm["X"] == x2.data_ptr() and norm["W"] == g.data_ptr()
    assert main["X"] == norm["Y"]  # the normalized rows
    assert (main["OQ"], main["OK"], main["OV"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert q.shape == (1, 3, 4, hd) and k.shape == v.shape == (1, 3, 2, hd)


def test_unaligned_addresses_and_observers_take_the_full_path(
        fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    k = fake(rmsnorm_mod, "_rmsnorm_kernel")
    base, w = torch.randn(3 * 40 + 1), torch.rand(40) + 0.5
    with torch.no_grad():
        fusetune.rmsnorm(base[:120].view(3, 40), w, eps=1e-5)
        plan = _only_plan(rmsnorm_mod)
        # the same metadata 4 bytes off a 16-byte boundary: Triton specializes on alignment
        fusetune.rmsnorm(base[1:121].view(3, 40), w, eps=1e-5)
        assert plan.runs == 0 and len(k.slow) == 2
        real_run = JITFunction.run

        def observing_run(self: Any, *a: Any, **kw: Any) -> Any:
            return real_run(self, *a, **kw)

        monkeypatch.setattr(JITFunction, "run", observing_run)  # e.g. the tuner's watcher
        fusetune.rmsnorm(base[:120].view(3, 40), w, eps=1e-5)
        assert plan.runs == 0 and len(k.slow) == 3
        monkeypatch.setattr(JITFunction, "run", real_run)
        runtime = _replay.triton_parts()[0]
        monkeypatch.setattr(runtime.launch_enter_hook, "calls", [print])  # e.g. a profiler
        fusetune.rmsnorm(base[:120].view(3, 40), w, eps=1e-5)
        assert plan.runs == 0
        monkeypatch.setattr(runtime.launch_enter_hook, "calls", [])
        fusetune.rmsnorm(base[:120].view(3, 40), w, eps=1e-5)
    assert plan.runs == 1 and len(k.slow) == 3


def test_an_address_aligned_now_but_not_when_recorded_takes_the_full_path(fake: Any) -> None:
    k = fake(rmsnorm_mod, "_rmsnorm_kernel")
    base, w = torch.randn(3 * 40 + 1), torch.rand(40) + 0.5
    with torch.no_grad():
        fusetune.rmsnorm(base[1:121].view(3, 40), w, eps=1e-5)  # recorded 4 bytes off
        plan = _only_plan(rmsnorm_mod)
        fusetune.rmsnorm(base[:120].view(3, 40), w, eps=1e-5)  # Triton: the aligned kernel
    assert plan.runs == 0 and len(k.slow) == 2


def test_a_wrapping_observer_and_pre_run_hooks_take_tritons_path(
        fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's launch observer wraps JITFunction.run with functools.wraps (Triton's name
    kept): it must see every launch, the first and the repeated ones."""
    k = fake(rmsnorm_mod, "_rmsnorm_kernel")
    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    real_run = JITFunction.run

    @functools.wraps(real_run)
    def observed_run(self: Any, *a: Any, **kw: Any) -> Any:
        return real_run(self, *a, **kw)

    with torch.no_grad():
        fusetune.rmsnorm(x, w, eps=1e-5)
        plan = _only_plan(rmsnorm_mod)
        monkeypatch.setattr(JITFunction, "run", observed_run)
        fusetune.rmsnorm(x, w, eps=1e-5)
        # no replay, and the direct launch went through Triton's path (the fake's run)
        assert plan.runs == 0 and len(k.slow) == 2
        monkeypatch.setattr(JITFunction, "run", real_run)
        monkeypatch.setattr(k, "pre_run_hooks", [lambda *a, **kw: None])
        fusetune.rmsnorm(x, w, eps=1e-5)
        assert plan.runs == 0 and len(k.slow) == 3  # both through Triton's path
        monkeypatch.setattr(k, "pre_run_hooks", [])
        fusetune.rmsnorm(x, w, eps=1e-5)
    assert plan.runs == 1


def test_no_plan_for_an_output_no_launch_writes() -> None:
    rec = _replay.Recording()
    x, out, other = torch.randn(4), torch.empty(4), torch.empty(4)
    rec.devices.add(0)
    rec.launches.append((None, "kernel", (1, 1, 1), (x, 4)))  # reads x; out is never written
    assert _replay.Plan.build(rec, [x], out) is None
    rec.launches.append((None, "kernel", (1, 1, 1), (x, out, 4)))
    plan = _replay.Plan.build(rec, [x], out)
    assert plan is not None and plan.uses == [(0, 0), (1, 0)]
    assert _replay.Plan.build(rec, [x], (out, other)) is None


def test_a_decision_made_before_tables_were_loaded_is_not_kept(fresh_tables: None) -> None:
    since = linear_mod._MEMO.generation()
    fusetune.tables.reset()  # e.g. load_tables on another thread, between lookup and keep
    linear_mod._MEMO.keep(("key",), ("config", None), since)
    assert ("key",) not in linear_mod._MEMO
    linear_mod._MEMO.keep(("key",), ("config", None), linear_mod._MEMO.generation())
    assert linear_mod._MEMO[("key",)] == ("config", None)


def test_no_plan_where_a_replay_could_differ(fake: Any) -> None:
    kl = fake(linear_mod, "_linear_kernel")
    kq = fake(qkv_mod, "_qkv_kernel")
    fake(rmsnorm_mod, "_rmsnorm_kernel")
    x = torch.randn(3, 16)
    with torch.no_grad():
        # x is the residual too: the launch's two addresses cannot be told apart
        fusetune.linear(x, torch.randn(16, 16), residual=x)
        assert _only_plan(linear_mod) is None
        # bk and bv are made as zeros inside the call (content a replay would not make)
        d, hd = 32, 8
        cos, sin = rotary_tables(torch.arange(3)[None], hd, theta=10000.0)
        fusetune.qkv(torch.randn(1, 3, d), torch.ones(d), torch.randn(d, d),
                     torch.randn(16, d), torch.randn(16, d), cos, sin, eps=1e-5, head_dim=hd,
                     interleaved=False, bq=torch.zeros(d))
        assert _only_plan(qkv_mod) is None
    assert len(kl.slow) == 1 and len(kq.slow) == 1


def test_no_plan_under_the_interpreter_or_with_gradients(fresh_tables: None) -> None:
    with torch.no_grad():
        y = fusetune.linear(torch.randn(3, 32), torch.randn(16, 32))
    assert _only_plan(linear_mod) is None and y.shape == (3, 16)
    ffn_mod._MEMO.clear()
    x = torch.randn(2, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        fusetune.ffn(x, torch.ones(32), torch.randn(8, 32), torch.randn(8, 32), eps=1e-5)
    assert len(ffn_mod._MEMO) == 0
