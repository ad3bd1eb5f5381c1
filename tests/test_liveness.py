"""Running trials: heartbeats, failing only the trials of dead processes, and several searches
writing to one database (SQLite and PostgreSQL: see the `db_url` fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError, ProgrammingError

import fusetune.tables
from fusetune import gpus
from fusetune.db.models import RunningRow
from fusetune.db.store import Store
from fusetune.kernels import get_spec
from fusetune.spec import Point
from fusetune.tuner import liveness
from fusetune.tuner.search import open_storage
from fusetune.tuner.space import config_key, load_space, make_plan
from fusetune.tuner.study import _fail_stale_trials

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=timezone.utc)


def row(host: str, pid: int, age_s: float) -> RunningRow:
    return RunningRow(point_id=1, trial_number=0, host=host, pid=pid,
                      heartbeat_at=NOW - timedelta(seconds=age_s))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_is_stale_rules() -> None:
    live_other = os.getppid()  # the process that runs the tests: alive, not this one
    here = liveness.HOST
    assert not liveness.is_stale(None, NOW - timedelta(seconds=5), NOW)  # just asked
    assert liveness.is_stale(None, NOW - timedelta(seconds=600), NOW)  # never claimed
    assert not liveness.is_stale(row(here, live_other, 5), None, NOW)
    assert liveness.is_stale(row(here, dead_pid(), 5), None, NOW)  # killed: stale at once
    assert liveness.is_stale(row(here, os.getpid(), 5), None, NOW)  # this process starts over
    assert not liveness.is_stale(row("other-host", 12345, 5), None, NOW)
    assert liveness.is_stale(row("other-host", 12345, 600), None, NOW)
    # SQLite gives back naive datetimes: read as UTC.
    naive = row("other-host", 1, 5)
    naive.heartbeat_at = naive.heartbeat_at.replace(tzinfo=None)
    assert not liveness.is_stale(naive, None, NOW)


def test_heartbeat_claims_beats_and_releases(db_url: str) -> None:
    store = Store(db_url)
    from fusetune.db.store import PointKey

    pid = store.point_id(PointKey("interpreter", "rmsnorm", {"dim": 8}, 1, 1, "float16", "",
                                  "interpreter", "h", "t", "v"))
    with liveness.Heartbeat(store, pid, 7, interval_s=0.05):
        first = store.running(pid)[7].heartbeat_at
        time.sleep(0.3)
        later = store.running(pid)[7]
        assert later.heartbeat_at > first
        assert (later.host, later.pid) == (liveness.HOST, os.getpid())
    assert store.running(pid) == {}


def test_a_claim_is_live_for_the_other_threads_from_its_first_instant(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The threads of one search on several devices share a point. A thread that reads another
    # one's claim row the instant it is written must see it live, not take it for the leftover
    # of an earlier run and take it over (both then ran the config).
    store = Store(db_url)
    from fusetune.db.store import PointKey

    pid = store.point_id(PointKey("interpreter", "rmsnorm", {"dim": 8}, 1, 1, "float16", "",
                                  "interpreter", "h", "t", "v"))
    real = store.claim_running
    outcome: list[BaseException | None] = []

    def other_thread() -> None:
        try:
            with liveness.Heartbeat(store, pid, 8, config_key="K"):
                outcome.append(None)  # took the config over
        except BaseException as exc:  # the test reads it
            outcome.append(exc)

    def claim_then_race(*args: object, **kwargs: object) -> int | None:
        got = real(*args, **kwargs)  # type: ignore[arg-type]
        if threading.current_thread() is main:
            # the row is committed; another thread reads it before this claim returns
            racer.start()
            time.sleep(0.3)
        return got

    main = threading.current_thread()
    racer = threading.Thread(target=other_thread)
    monkeypatch.setattr(store, "claim_running", claim_then_race)
    with liveness.Heartbeat(store, pid, 7, config_key="K"):
        racer.join(timeout=10)
        assert len(outcome) == 1 and isinstance(outcome[0], liveness.ClaimedElsewhere), outcome
        assert set(store.running(pid)) == {7}
    assert store.running(pid) == {}


def search_env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(fusetune.tables.ENV_VAR, None)
    return env


def claimed_trials(url: str) -> int:
    """Rows in ft_running (0 while the tables are not made yet)."""
    try:
        store = Store(url)
    except (OperationalError, ProgrammingError):
        return 0
    try:
        with store.session() as s:
            return s.scalar(select(func.count()).select_from(RunningRow)) or 0
    finally:
        store.engine.dispose()


@pytest.mark.slow
def test_a_live_search_keeps_its_trial_a_killed_one_loses_it(db_url: str,
                                                              tmp_path: Path) -> None:
    url = db_url
    env = search_env()
    cmd = [sys.executable, "-m", "fusetune.cli", "search", "--kernel", "rmsnorm", "--backend",
           "interpreter", "--db", url, "--dim", "256", "--batch", "16", "--seq", "16",
           "--dtype", "float16", "--trials", "30"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        claimed = 0
        while time.monotonic() < deadline and not claimed:
            assert proc.poll() is None, "the search ended before a trial was seen running"
            time.sleep(0.05)
            claimed = claimed_trials(url)
        assert claimed, "no trial was claimed within 120 s"
        store = Store(url)
        (point,) = store.points()
        storage = open_storage(url)
        study = optuna.load_study(study_name=point.study_name, storage=storage)
        # A second search starting on the point must leave the live process's trial alone.
        assert _fail_stale_trials(study, storage, store, point.id) == 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        running = [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
        if running:  # killed mid-trial (usual): now its trial is stale at once
            assert _fail_stale_trials(study, storage, store, point.id) == len(running)
            failed = {t.number: t for t in study.get_trials(states=(TrialState.FAIL,))}
            assert all(failed[n].user_attrs["reason"].startswith("interrupted")
                       for n in running)
            assert store.running(point.id) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_search(url: str, cwd: Path, batch: str, trials: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fusetune.cli", "search", "--kernel", "rmsnorm", "--backend",
         "interpreter", "--db", url, "--dim", "64", "--batch", batch, "--seq", "1,2",
         "--dtype", "float16", "--trials", str(trials)],
        cwd=cwd, env=search_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_all(procs: list[subprocess.Popen[str]]) -> None:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "database is locked" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_two_searches_share_one_database(db_url: str, tmp_path: Path) -> None:
    # Two processes write to the same database at once (different points): neither fails
    # ("database is locked" on SQLite) and every result of both is there.
    finish_all([start_search(db_url, tmp_path, "1", 6), start_search(db_url, tmp_path, "3", 6)])
    store = Store(db_url)
    points = store.points()
    assert {(p.batch, p.seq) for p in points} == {(1, 1), (1, 2), (3, 1), (3, 2)}
    for p in points:
        assert sum(1 for r in store.results(p.id).values() if r.status == "ok") >= 6
    assert len(store.winners()) == 4


@pytest.mark.slow
def test_two_searches_of_the_same_points_share_the_work(db_url: str, tmp_path: Path) -> None:
    # Two processes (as on two hosts) search the same points at once. Every config is
    # evaluated once, by one of them; together they reach each point's budget (and overshoot
    # it by at most the one trial the other was running); nothing is lost; one winner a point.
    trials = 8
    finish_all([start_search(db_url, tmp_path, "1,3", trials) for _ in range(2)])
    store = Store(db_url)
    storage = open_storage(db_url)
    spec = get_spec("rmsnorm")
    points = store.points()
    assert {(p.batch, p.seq) for p in points} == {(1, 1), (1, 2), (3, 1), (3, 2)}
    for p in points:
        plan = make_plan(load_space(spec), spec, Point.make("rmsnorm", {"dim": 64}, p.batch,
                                                            p.seq, "float16"), gpus.INTERPRETER)
        target = min(trials, len(plan.feasible))
        results = store.results(p.id)
        assert all(r.status == "ok" for r in results.values()), results
        assert target <= len(results) <= target + 1, (p.batch, p.seq, len(results))
        # One evaluation per config: the trials told with a measured value (not a repeat of a
        # stored one) name every config once, and each is a stored result.
        study = optuna.load_study(study_name=p.study_name, storage=storage)
        evaluated = Counter(
            config_key(t.user_attrs["config"]) for t in study.get_trials(
                states=(TrialState.COMPLETE,)) if "repeat_of" not in t.user_attrs)
        assert evaluated and max(evaluated.values()) == 1, evaluated.most_common(3)
        assert set(evaluated) <= set(results)
        assert not study.get_trials(states=(TrialState.RUNNING,))
    assert store.running(points[0].id) == {}
    assert len(store.winners()) == 4
