"""Compiling ahead of the GPU: the order configs compile in, what the GPU's wait does, failures
that never reach the search, the grid and the search wired to it, and the option's defaults.

Triton's interpreter compiles nothing, so the compile step is faked (fake_kernels.fake_compiler:
it logs, sleeps, raises, dies or hangs as the config's MODE says); one test runs the real
compile step (the kernel's launcher in Triton's warmup mode) on the fake kernels. The `gpu` test
checks on a GPU that the evaluating process then loads what the compile processes compiled."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from cli_helpers import run_interpreted
from fake_kernels import LOG_ENV, SPEC, point, point_3x
from optuna.trial import TrialState

from fusetune import gpus
from fusetune.db.store import Store
from fusetune.spec import Config, Point
from fusetune.tuner import compile_ahead
from fusetune.tuner.compile_ahead import (
    COMPILED,
    COMPILING,
    CRASHED,
    FAILED,
    NOT_SUBMITTED,
    PENDING,
    SKIPPED,
    TIMEOUT,
    CompileAhead,
    default_workers,
    resolve_workers,
)
from fusetune.tuner.grid import run_grid
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import Param, SearchSpace, config_key
from fusetune.tuner.study import Context, PointTuner, SearchOptions

FAKE = "fake_kernels:SPEC"
FAKE_COMPILER = "fake_kernels:fake_compiler"


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the fakes log to, from every process (set before any process starts)."""
    path = tmp_path / "log"
    path.touch()
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


def cfg(i: int, mode: int = 1, sleep_ms: int = 0) -> Config:
    return {"MODE": mode, "ID": i, "SLEEP_MS": sleep_ms}


def events(log: Path) -> list[tuple[str, str, int, float]]:
    """(event, what, pid, time) of the log's lines, in time order."""
    out = []
    for line in log.read_text().splitlines():
        m = re.fullmatch(r"(\w+) (.*) pid=(\d+) t=([\d.]+)", line)
        assert m, line
        out.append((m[1], m[2], int(m[3]), float(m[4])))
    return sorted(out, key=lambda e: e[3])


def settle(pool: CompileAhead, p: Point, configs: Sequence[Config], timeout: float = 120
           ) -> list[str]:
    """The configs' states once none is queued or compiling (polled: `wait` would skip queued
    ones)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [pool.state(p, c) for c in configs]
        if not {PENDING, COMPILING} & set(states):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.05)


def test_configs_compile_in_the_order_submitted_on_several_processes(log: Path) -> None:
    configs = [cfg(i, sleep_ms=300) for i in range(8)]
    with CompileAhead(FAKE, "cpu", 2, timeout_s=60, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), configs)
        pool.submit(point(), configs[:3])  # submitted again: nothing new
        assert settle(pool, point(), configs) == [COMPILED] * 8
        assert pool.stats.submitted == pool.stats.compiled == 8
    ev = events(log)
    keys = [config_key(c) for c in configs]
    starts = {what: (pid, t) for kind, what, pid, t in ev if kind == "start"}
    assert sorted(starts) == sorted(keys)
    assert sum(1 for e in ev if e[0] == "start") == len(keys)  # each once
    pids = {pid for pid, _ in starts.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # each process got its configs in the order submitted
        mine = sorted((t, keys.index(k)) for k, (p, t) in starts.items() if p == pid)
        assert [i for _, i in mine] == sorted(i for _, i in mine)
    # handed out in order, as processes free up: config i starts once i - 1 others ended
    end_times = sorted(t for kind, _, _, t in ev if kind == "end")
    for i, k in enumerate(keys[2:], start=2):
        assert sum(1 for t in end_times if t <= starts[k][1]) >= i - 1, (i, ev)
    # in parallel: a compile started while another one was still running
    spans = {}
    for kind, what, _, t in ev:
        if kind in ("start", "end"):
            spans.setdefault(what, []).append(t)
    assert any(s1 < s2 < e1 for (s1, e1) in spans.values() for (s2, _) in spans.values())


def test_a_compile_that_raises_dies_or_hangs_is_only_not_compiled_ahead(log: Path) -> None:
    configs = [cfg(0, mode=4), cfg(1), cfg(2, mode=2), cfg(3), cfg(4, mode=3), cfg(5)]
    # timeout_s: the hanging config costs the test this long; the others take milliseconds
    with CompileAhead(FAKE, "cpu", 1, timeout_s=1.5, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), configs)
        while pool.state(point(), configs[4]) != COMPILING:  # the hanging one
            time.sleep(0.05)
        t0 = time.monotonic()
        assert pool.wait(point(), configs[4]) == TIMEOUT  # waited for, then given up
        assert time.monotonic() - t0 < 30
        states = settle(pool, point(), configs)
        stats = pool.stats
    assert states == [FAILED, COMPILED, CRASHED, COMPILED, TIMEOUT, COMPILED]
    assert (stats.compiled, stats.failed, stats.crashed, stats.timeouts) == (3, 1, 1, 1)
    assert not stats.disabled
    # a new process after the one that died and after the one that hung
    pids = [pid for kind, _, pid, _ in events(log) if kind == "start"]
    assert len(set(pids)) == 3
    summary = stats.summary()
    assert "3 of 6 configs compiled ahead" in summary and "1 crashed" in summary


def test_the_gpu_takes_a_config_that_no_process_has_yet(log: Path) -> None:
    # (the process takes seconds to start: `slow` is still compiling when the GPU wants c)
    slow, b, c = cfg(0, sleep_ms=500), cfg(1), cfg(2)
    with CompileAhead(FAKE, "cpu", 1, timeout_s=60, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), [slow, b, c])
        assert pool.state(point(), slow) == COMPILING
        t0 = time.monotonic()
        assert pool.wait(point(), c) == SKIPPED  # queued: the GPU compiles it, no waiting
        assert time.monotonic() - t0 < 0.5
        assert pool.wait(point(), slow) == COMPILED  # being compiled: waited for
        assert pool.wait(point(), cfg(9)) == NOT_SUBMITTED
        assert settle(pool, point(), [b]) == [COMPILED]
        assert pool.stats.skipped == 1
    started = [what for kind, what, _, _ in events(log) if kind == "start"]
    assert started == [config_key(slow), config_key(b)]


def test_another_point_drops_the_configs_queued_for_the_last(log: Path) -> None:
    other = Point.make("fake", {"dim": 32}, 2, 1, "float32")
    a = [cfg(0, sleep_ms=300), cfg(1), cfg(2)]
    with CompileAhead(FAKE, "cpu", 1, timeout_s=60, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), a)
        pool.submit(other, [cfg(7)])
        assert [pool.state(point(), c) for c in a[1:]] == [NOT_SUBMITTED] * 2
        assert settle(pool, other, [cfg(7)]) == [COMPILED]
    ev = events(log)
    assert [what for kind, what, _, _ in ev if kind == "start"] == [config_key(a[0]),
                                                                   config_key(cfg(7))]
    assert [what for kind, what, _, _ in ev if kind == "inputs"] == [point().label, other.label]


def test_the_processes_serve_the_kernel_of_each_submit(log: Path) -> None:
    a, b = [cfg(0), cfg(1)], [cfg(2), cfg(3), cfg(4, mode=4)]
    with CompileAhead(FAKE, "cpu", 1, timeout_s=60, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), a)
        assert settle(pool, point(), a) == [COMPILED] * 2
        before = dataclasses.replace(pool.stats)
        pool.spec_ref = "fake_kernels:SPEC_3X"
        pool.submit(point_3x(), b)
        assert settle(pool, point_3x(), b) == [COMPILED, COMPILED, FAILED]
        since = pool.stats.since(before)
    assert (since.submitted, since.compiled, since.failed) == (3, 2, 1)
    assert "2 of 3 configs compiled ahead by 1 processes" in since.summary()
    ev = events(log)
    assert [what for kind, what, _, _ in ev if kind in ("spec", "inputs")] == [
        "fake", point().label, "fake3x", point_3x().label]
    assert len({pid for kind, _, pid, _ in ev if kind == "start"}) == 1  # one process for both


def test_processes_that_keep_dying_stop_compiling_ahead(log: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_ahead, "MAX_DEATHS_IN_A_ROW", 2)
    configs = [cfg(0, mode=2), cfg(1, mode=2), cfg(2), cfg(3)]
    with CompileAhead(FAKE, "cpu", 1, timeout_s=60, compiler_ref=FAKE_COMPILER) as pool:
        pool.submit(point(), configs)
        assert settle(pool, point(), configs) == [CRASHED, CRASHED, SKIPPED, SKIPPED]
        assert "2 compile processes in a row died" in pool.stats.disabled
        pool.submit(point(), [cfg(4)])  # nothing is compiled ahead any more
        assert pool.state(point(), cfg(4)) == NOT_SUBMITTED
        assert "stopped: 2 compile processes" in pool.stats.summary()


def test_the_compile_step_runs_the_launcher_with_triton_in_warmup_mode(log: Path) -> None:
    ok, bad = {"MODE": 7, "num_warps": 4}, {"MODE": 4, "num_warps": 4}
    with CompileAhead("fake_jit:SPEC", "cpu", 1, timeout_s=60) as pool:  # the real compile step
        pool.submit(point(), [ok, bad])
        assert settle(pool, point(), [ok, bad]) == [COMPILED, FAILED]
    # the launcher's two Triton kernels compiled (their JIT called with warmup=True), none run
    kinds = [(kind, what) for kind, what, _, _ in events(log) if kind in ("warmup", "launch")]
    assert kinds == [("warmup", "main"), ("warmup", "finish"), ("warmup", "main")]


def test_compiling_ahead_is_off_on_the_interpreter() -> None:
    assert resolve_workers(None, "interpreter") == (0, None)
    n, note = resolve_workers(3, "interpreter")
    assert n == 0 and note is not None and "--compile-workers 3 is ignored" in note
    assert resolve_workers(0, "cuda") == (0, None)
    assert resolve_workers(5, "cuda") == (5, None)
    assert resolve_workers(None, "cuda") == (default_workers(), None)
    assert resolve_workers(None, "cuda", default_on=False) == (0, None)  # search's default
    assert resolve_workers(4, "cuda", default_on=False) == (4, None)
    assert [default_workers(cpus=n) for n in (1, 4, 16, 128)] == [0, 2, 8, 8]
    assert default_workers(devices=4, cpus=16) == 2
    with pytest.raises(ValueError, match="--compile-workers -1: expected 0"):
        resolve_workers(-1, "cuda")
    with pytest.raises(ValueError, match="workers=0"):
        CompileAhead(FAKE, "cpu", 0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="runs a search on Triton's interpreter")
def test_the_search_on_the_interpreter_says_it_does_not_compile_ahead(tmp_path: Path) -> None:
    proc = run_interpreted(
        tmp_path, "search", "--kernel", "rmsnorm", "--backend", "interpreter", "--db",
        f"sqlite:///{tmp_path}/ft.db", "--dim", "64", "--batch", "1", "--seq", "1", "--dtype",
        "float16", "--trials", "2", "--compile-workers", "3")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, out[-3000:]
    assert "--compile-workers 3 is ignored: the interpreter backend compiles nothing" in out
    assert "Compiling and checking in the evaluating process" in out
    assert "compiled ahead" not in out


# ---- the grid and the search, compiling ahead -------------------------------------------------


def fake_context(url: str, modes: tuple[int, ...], compiler: CompileAhead | None) -> Context:
    space = SearchSpace("fake", (Param("MODE", "values", modes),
                                 Param("num_warps", "pow2", (1, 2, 4))), "test")
    return Context(SPEC, space, gpus.INTERPRETER, "interpreter", "cpu", Store(url),
                   open_storage(url), "t", "v", None, compiler)


def test_the_grid_runs_each_config_after_its_compile(tmp_path: Path, log: Path) -> None:
    pool = CompileAhead(FAKE, "cpu", 2, timeout_s=60, compiler_ref=FAKE_COMPILER)
    ctx = fake_context(f"sqlite:///{tmp_path}/ft.db", (1, 4, 5, 7), pool)
    try:
        tuner = PointTuner(ctx, point(), SearchOptions(rounds=1))
        run = run_grid(tuner)
    finally:
        ctx.close()
    statuses = {(r.config["MODE"], r.config["num_warps"]): r.status
                for r in ctx.store.results(tuner.point_id).values()}
    expected = {1: "ok", 4: "runtime_error", 5: "wrong_result", 7: "ok"}
    assert statuses == {(m, w): expected[m] for m in expected for w in (1, 2, 4)}
    assert run.timed == 12 and run.result is not None and run.result.winner is not None
    stats = pool.stats
    assert stats.submitted == 12 and stats.compiled + stats.failed + stats.skipped == 12
    assert stats.failed <= 3  # MODE 4 raises in the compile step too
    ev = events(log)
    ended = {what: t for kind, what, _, t in ev if kind == "end"}
    first_run: dict[str, float] = {}
    for kind, what, _, t in ev:
        if kind == "run":
            first_run.setdefault(what, t)
    # every config that the compile processes finished was waited for: run only after that
    assert ended and all(ended[k] < first_run[k] for k in ended), (ended, first_run)
    assert run.compiled_ahead == len(ended) >= 2  # the first two: one per process, waited for
    assert run.compile_s > 0


def test_the_search_asks_a_batch_when_it_compiles_ahead(tmp_path: Path, log: Path) -> None:
    def overlapping(ctx: Context, tuner: PointTuner) -> tuple[int, list[TrialState]]:
        """(trials asked before an earlier one was told, the trials' states)."""
        import optuna

        trials = optuna.load_study(study_name=tuner.key.study_name,
                                   storage=ctx.storage).get_trials(deepcopy=False)
        told = [t for t in trials if t.datetime_complete is not None]
        overlaps = sum(1 for a in told for b in told if a.number < b.number
                       and b.datetime_start < a.datetime_complete)
        return overlaps, [t.state for t in trials]

    results = {}
    for ahead in (False, True):
        pool = (CompileAhead(FAKE, "cpu", 2, timeout_s=60, compiler_ref=FAKE_COMPILER)
                if ahead else None)
        ctx = fake_context(f"sqlite:///{tmp_path}/ft{ahead}.db", (1, 4, 5, 7), pool)
        try:
            tuner = PointTuner(ctx, point(), SearchOptions(trials=7, rounds=1))
            res = tuner.run()
        finally:
            ctx.close()
        overlaps, states = overlapping(ctx, tuner)
        assert TrialState.RUNNING not in states  # batch members never run were failed
        rows = ctx.store.results(tuner.point_id)
        assert len(rows) == 7 and res.n_new == 7  # the budget, each config once
        assert res.winner is not None and res.winner["MODE"] in (1, 7)
        results[ahead] = (overlaps, res.compiled_ahead)
    assert results[False] == (0, 0)  # one config at a time
    overlaps, ahead = results[True]
    assert overlaps > 0 and ahead >= 1


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_evaluating_process_loads_what_the_compile_processes_compiled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fusetune.kernels import get_spec
    from fusetune.tables import gpu_for_device
    from fusetune.tuner.worker import Worker

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # for the processes started below
    spec = get_spec("ffn")
    p = Point.make("ffn", {"dim": 1024, "hidden": 2048}, 1, 16, "float16")
    base = spec.default_config(p, gpu_for_device(torch.device("cuda")))
    configs = list({config_key(c): c for c in (
        spec.canonical({**base, "BLOCK_K": 64, "num_stages": stages, "SPLIT_K": split}, p)
        for stages in (2, 3) for split in (1, 2))}.values())
    assert len(configs) == 4
    with CompileAhead("ffn", "cuda:0", 2, timeout_s=300) as pool:
        pool.submit(p, configs)
        assert settle(pool, p, configs, timeout=300) == [COMPILED] * 4
    compiled = sorted(cache.rglob("*.cubin"))
    assert len(compiled) >= 4  # (split-K configs have a finishing kernel too)
    worker = Worker("ffn", "cuda", "cuda:0", timeout_s=300)
    try:
        worker.set_point(p, 0)
        outcomes = [worker.evaluate(c) for c in configs]
    finally:
        worker.close()
    assert [o.status for o in outcomes] == ["ok"] * 4, outcomes
    # Same cache keys: the evaluating process compiled nothing, it loaded every kernel
    assert sorted(cache.rglob("*.cubin")) == compiled
