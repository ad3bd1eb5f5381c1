"""Heartbeats of running trials, and telling a dead process's trial from a live one's."""

from __future__ import annotations

import os
import socket
import threading
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import TYPE_CHECKING

from fusetune.db.store import Store

if TYPE_CHECKING:
    from fusetune.db.models import RunningRow

HEARTBEAT_S = 10.0  # how often a running trial's heartbeat is written
GRACE_S = 60.0  # a heartbeat older than this means the process that wrote it is gone
HOST = socket.gethostname()
# Claims that a Heartbeat of this process holds now, as (row id, point id, trial number) of
# ft_running: the threads of one search on several devices may share a point, and each must see
# the others' claims as live.
_HELD: set[tuple[int, int, int]] = set()
_HELD_LOCK = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)  # SQLite drops tz


def is_stale(row: RunningRow | None, started: datetime | None, now: datetime | None = None,
             grace_s: float = GRACE_S) -> bool:
    """Whether a RUNNING trial belongs to no live process.

    Its claim row is missing and the trial is older than the grace period (a live search writes
    the row right after asking for the trial), or its process on this host is gone, or its
    heartbeat is older than the grace period (another host, or a reused pid). A trial claimed
    by this very process is stale unless one of its threads holds the claim now (a search on
    several devices): a claim left by an earlier run is one its process no longer runs."""
    now = now or datetime.now(timezone.utc)
    grace = timedelta(seconds=grace_s)
    if row is None:
        return started is None or now - _aware(started) > grace
    if row.host == HOST and row.pid == os.getpid():
        with _HELD_LOCK:
            return (row.id, row.point_id, row.trial_number) not in _HELD
    if row.host == HOST and not _pid_alive(row.pid):
        return True
    return now - _aware(row.heartbeat_at) > grace


class ClaimedElsewhere(Exception):
    """The trial, or its config, is being evaluated by another live search right now."""

    def __init__(self, claim: RunningRow) -> None:
        super().__init__(f"trial {claim.trial_number} (config {claim.config_key}) is being "
                         f"evaluated by pid {claim.pid} on {claim.host}")
        self.claim = claim


class Heartbeat:
    """Claims a trial (and its config) for this process and beats for it in a thread while the
    block runs.

    Entering raises `ClaimedElsewhere` when another live search holds that trial or config; a
    claim left by a dead process is removed and taken over. The database's unique indexes
    decide races: of two searches claiming one config at once, exactly one gets it."""

    def __init__(self, store: Store, point_id: int, trial_number: int,
                 interval_s: float = HEARTBEAT_S, config_key: str | None = None) -> None:
        self.store, self.point_id, self.trial_number = store, point_id, trial_number
        self.config_key = config_key
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._id: int | None = None

    @property
    def _held(self) -> tuple[int, int, int]:
        assert self._id is not None
        return (self._id, self.point_id, self.trial_number)

    def _claim(self) -> int:
        for _ in range(5):
            # The row and its entry in _HELD appear at once for this process's other threads:
            # one that read the row before the entry would take this live claim for a dead one.
            with _HELD_LOCK:
                got = self.store.claim_running(self.point_id, self.trial_number, HOST,
                                               os.getpid(), self.config_key)
                if got is not None:
                    _HELD.add((got, self.point_id, self.trial_number))
                    return got
            holder = self.store.claim_of(self.point_id, self.trial_number, self.config_key)
            if holder is None:
                continue  # released between the failed insert and this read: try again
            if not is_stale(holder, None):
                raise ClaimedElsewhere(holder)
            self.store.release(holder.id)  # its process is gone
        raise RuntimeError(f"could not claim trial {self.trial_number} (config "
                           f"{self.config_key}): its claim changed hands 5 times")

    def __enter__(self) -> Heartbeat:
        self._id = self._claim()
        self._thread = threading.Thread(target=self._run, name="fusetune-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                assert self._id is not None
                self.store.beat(self._id)
            except Exception:  # a missed beat only delays the next; never kill the search
                pass

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._id is not None:
            # Live until its row is gone (so that no other thread takes it over meanwhile); a
            # row id that the release frees comes back with another trial number.
            try:
                self.store.release(self._id)
            finally:
                with _HELD_LOCK:
                    _HELD.discard(self._held)
