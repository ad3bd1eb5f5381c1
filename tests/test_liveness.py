"""Running trials: heartbeats, and failing only the trials of dead processes."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import fusetune.tables
from fusetune.db.models import RunningRow
from fusetune.db.store import Store
from fusetune.tuner import liveness
from fusetune.tuner.search import open_storage
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


def test_heartbeat_claims_beats_and_releases(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path}/ft.db")
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


@pytest.mark.slow
def test_a_live_search_keeps_its_trial_a_killed_one_loses_it(tmp_path: Path) -> None:
    db = tmp_path / "ft.db"
    url = f"sqlite:///{db}"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(fusetune.tables.ENV_VAR, None)
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
            if db.exists():
                try:
                    with sqlite3.connect(db, timeout=60) as con:
                        claimed = con.execute("SELECT COUNT(*) FROM ft_running").fetchone()[0]
                except sqlite3.OperationalError:  # tables not created yet
                    pass
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


@pytest.mark.slow
def test_two_searches_share_one_sqlite_file(tmp_path: Path) -> None:
    # Two processes write to the same SQLite database at once (different points): neither
    # fails with "database is locked" and every result of both is there.
    url = f"sqlite:///{tmp_path}/ft.db"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(fusetune.tables.ENV_VAR, None)

    def start(batch: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "fusetune.cli", "search", "--kernel", "rmsnorm", "--backend",
             "interpreter", "--db", url, "--dim", "64", "--batch", batch, "--seq", "1,2",
             "--dtype", "float16", "--trials", "6"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start("1"), start("3")]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "database is locked" not in out
    store = Store(url)
    points = store.points()
    assert {(p.batch, p.seq) for p in points} == {(1, 1), (1, 2), (3, 1), (3, 2)}
    for p in points:
        assert sum(1 for r in store.results(p.id).values() if r.status == "ok") >= 6
    assert len(store.winners()) == 4
