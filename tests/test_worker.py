"""The worker subprocess: crashing, hanging and failing configs become results, not crashes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_kernels import MODES, SPEC, nap, point, point_3x

from fusetune import gpus
from fusetune.db.store import Store
from fusetune.tuner.bench import Outcome
from fusetune.tuner.children import start_child
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import Param, SearchSpace
from fusetune.tuner.study import Context, PointTuner, SearchOptions
from fusetune.tuner.worker import Worker

REF = "fake_kernels:SPEC"
# Seconds a config may take before it is a timeout: a right config of fake_kernels takes
# milliseconds, and each hanging one costs the test this long.
TIMEOUT_S = 2


@pytest.fixture(scope="module")
def shared_worker() -> Iterator[Worker]:
    """One worker for this module's tests: starting a process (importing torch) takes seconds,
    and these tests are about what a running worker does, not about its first start."""
    w = Worker(REF, "interpreter", "cpu", timeout_s=TIMEOUT_S)
    yield w
    w.close()


@pytest.fixture
def worker(shared_worker: Worker) -> Worker:
    """The module's worker, running (restarted if the last test left it dead) on the first
    kernel and point, its restarts counted from this test's start."""
    shared_worker.spec_ref = REF
    shared_worker.set_point(point(), 0)
    shared_worker.restarts = 0
    return shared_worker


def cfg(mode: int) -> dict[str, int]:
    return {"MODE": mode, "num_warps": 4}


def test_each_failure_is_an_outcome_and_the_worker_comes_back(worker: Worker) -> None:
    expected = {1: "ok", 2: "crashed", 3: "timeout", 4: "runtime_error", 5: "wrong_result",
                6: "crashed"}
    reasons = {}
    for mode, status in expected.items():
        t0 = time.monotonic()
        out = worker.evaluate(cfg(mode))
        assert out.status == status, (MODES[mode], out)
        assert out.status == "ok" or out.reason, out
        assert time.monotonic() - t0 < 60
        reasons[mode] = (out.reason, worker._last_death)  # as the failure left them
        # After every failure, a right config still works in the (restarted) worker.
        assert worker.evaluate(cfg(1)).status == "ok"
    assert worker.restarts == 3  # crash, hang, lost device
    crash_reason, crash_death = reasons[2]
    assert "SIGSEGV" in crash_reason or "139" in crash_death
    assert f"no result within {TIMEOUT_S:g} s" in reasons[3][0]


def test_one_worker_serves_two_kernels_and_comes_back_on_the_current_one(worker: Worker) -> None:
    # MODE 1 is right for fake_kernels:SPEC, wrong for SPEC_3X (whose reference is 3x); MODE 5
    # the other way round: the statuses tell which kernel's reference the worker checked.
    w = worker
    w.set_point(point(), 0)
    assert [w.evaluate(cfg(m)).status for m in (1, 5)] == ["ok", "wrong_result"]
    assert w._proc is not None
    pid = w._proc.pid
    w.spec_ref = "fake_kernels:SPEC_3X"
    w.set_point(point_3x(), 0)
    assert [w.evaluate(cfg(m)).status for m in (1, 5)] == ["wrong_result", "ok"]
    assert not isinstance(w.timing(cfg(5)), Outcome)
    assert w._proc.pid == pid and w.restarts == 0  # the same process
    # restarted after a crash: on the kernel and point set last
    assert w.evaluate(cfg(2)).status == "crashed"
    assert w.restarts == 1 and w._proc.pid != pid
    assert [w.evaluate(cfg(m)).status for m in (1, 5)] == ["wrong_result", "ok"]
    w.spec_ref = REF  # and back to the first kernel, in the new process
    w.set_point(point(), 0)
    assert [w.evaluate(cfg(m)).status for m in (1, 5)] == ["ok", "wrong_result"]
    assert w.restarts == 1


def test_time_of_a_crashing_config_is_an_outcome(worker: Worker) -> None:
    q = worker.timing(cfg(1))
    assert not isinstance(q, Outcome) and q[0] <= q[1] <= q[2]
    assert isinstance(worker.timing(cfg(2)), Outcome)
    assert not isinstance(worker.timing(cfg(1)), Outcome)


def test_time_says_why_it_failed_and_keeps_a_healthy_worker(worker: Worker) -> None:
    assert not isinstance(worker.timing(cfg(1)), Outcome)
    out = worker.timing(cfg(4))  # raises: reported, the worker goes on
    assert f"{out.status}: {out.reason}" == "runtime_error: RuntimeError: planted runtime error"
    assert worker.restarts == 0
    out = worker.timing(cfg(6))  # a lost CUDA context: the worker is replaced
    assert out.status == "crashed" and "illegal memory access" in out.reason
    assert worker.restarts == 1
    out = worker.timing(cfg(2))
    assert isinstance(out, Outcome) and "139" in out.reason + worker._last_death
    assert not isinstance(worker.timing(cfg(1)), Outcome)


def test_a_search_over_bad_configs_ends_with_the_right_winner(tmp_path: Path,
                                                             worker: Worker) -> None:
    url = f"sqlite:///{tmp_path}/ft.db"
    space = SearchSpace("fake", (Param("MODE", "values", tuple(MODES)),
                                 Param("num_warps", "pow2", (4,))), "test")
    ctx = Context(SPEC, space, gpus.INTERPRETER, "interpreter", "cpu", Store(url),
                  open_storage(url), "t", "v", worker)
    res = PointTuner(ctx, point(), SearchOptions(trials=10, rounds=1)).run()
    statuses = {r.config["MODE"]: r.status for r in ctx.store.results(
        ctx.store.point_id(ctx.key(point()))).values()}
    assert statuses == {1: "ok", 2: "crashed", 3: "timeout", 4: "runtime_error",
                        5: "wrong_result", 6: "crashed"}
    assert res.winner == cfg(1)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signals")
def test_a_starting_child_outlives_ctrl_c() -> None:
    # Ctrl-C signals the whole process group: a child still importing torch died of it (and
    # printed a traceback); started by start_child, it goes on, and the parent stops it.
    spawn = mp.get_context("spawn")
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # else children ignore it anyway
        plain = spawn.Process(target=nap)
        plain.start()
        os.kill(plain.pid, signal.SIGINT)
        plain.join(timeout=60)
        assert plain.exitcode != 0  # the signal does reach a child started plainly
    child = spawn.Process(target=nap)
    start_child(child)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # restored here
    os.kill(child.pid, signal.SIGINT)
    child.join(timeout=60)
    assert child.exitcode == 0
