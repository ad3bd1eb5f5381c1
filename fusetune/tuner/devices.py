"""A search on several GPUs of one host at once: one benchmark worker per device, the points of
the grid shared out between them as a queue.

Each device gets a thread of this process and a `Context` of its own: its own connections to the
database (fusetune's `Store`, Optuna's storage) and its own worker subprocess, bound to that
device. A device that is free takes the next point that no device has started, in the grid's
order, and tunes it as a one-device search does (`PointTuner`: the same sampler, budget and
winner selection). Once every point is started, a free device joins a point that another device
is still sampling, each such point once: the per-config claims in ft_running share the point's
budget between them as between two searches, so no config is evaluated twice and the point gets
its `--trials` configs in all (plus at most one per device that joined, the trials that were
running when the budget was reached). The device that took the point picks the winner, after
the configs the others are evaluating on it are stored, from every stored result of the point.
When no point is left to start or to join, a device stops.

Stopping (`DeviceSearch.stop`, or Ctrl-C in the thread that called `run`) makes every worker
call raise KeyboardInterrupt in its device's thread, which fails the trial it was running with
the reason `interrupted`, as Ctrl-C does in a one-device search: finished results stay stored,
and the same search run again resumes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fusetune.spec import Point
from fusetune.tuner.study import Context, PointResult, PointTuner, Progress, SearchOptions

JOIN_POLL_S = 0.2  # how often the calling thread looks whether the devices are done
STOP_WAIT_S = 60.0  # how long a stopping search waits for its devices' threads


class Display(Protocol):
    """What a device search reports while it runs; called from the devices' threads."""

    def start(self, device: str, point: Point, joined: bool) -> Progress:
        """`device` begins `point` (`joined`: another device took it first); returns the
        callback for that point's progress, as a one-device search gets."""
        ...

    def done(self, device: str, point: Point, result: PointResult | None) -> None:
        """`device` is done with `point`: its result, or None when it only joined."""
        ...


class _Quiet:
    def start(self, device: str, point: Point, joined: bool) -> Progress:
        return lambda done, target, msg: None

    def done(self, device: str, point: Point, result: PointResult | None) -> None:
        pass


@dataclass
class DeviceStats:
    """What one device did in a search."""

    device: str
    points: int = 0  # points it took and picked the winner of
    joined: int = 0  # points it helped another device with
    evaluated: int = 0  # configs it ran (pruned ones run nowhere)


@dataclass
class _Job:
    index: int  # in the grid's order
    point: Point
    joined: bool
    started: float  # time.monotonic() when the first device took the point


@dataclass
class _Slot:
    point: Point
    started: float
    devices: set[str]
    sampling: bool = True  # until the device that took it starts picking the winner


class PointQueue:
    """Hands out points to devices: each point to one device, in order; then, to a free
    device, a point that others are still sampling and it has not joined (the one with the
    fewest devices on it, the earliest first). Thread-safe."""

    def __init__(self, points: Sequence[Point]) -> None:
        self._points = list(points)
        self._next = 0
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()

    def take(self, device: str) -> _Job | None:
        """The next job for `device`, or None when nothing is left for it."""
        with self._lock:
            if self._next < len(self._points):
                index, self._next = self._next, self._next + 1
                slot = _Slot(self._points[index], time.monotonic(), {device})
                self._slots[index] = slot
                return _Job(index, slot.point, False, slot.started)
            open_slots = [(len(s.devices), i) for i, s in self._slots.items()
                          if s.sampling and device not in s.devices]
            if not open_slots:
                return None
            _, index = min(open_slots)
            slot = self._slots[index]
            slot.devices.add(device)
            return _Job(index, slot.point, True, slot.started)

    def sampled(self, index: int) -> None:
        """The device that took point `index` is picking its winner: nobody joins it now."""
        with self._lock:
            self._slots[index].sampling = False


class DeviceFailedError(RuntimeError):
    """A device's thread failed with an error (not an interruption); the others were stopped."""

    def __init__(self, device: str, exc: BaseException) -> None:
        super().__init__(f"{device}: {type(exc).__name__}: {exc}")
        self.device = device


class DeviceSearch:
    """Tunes `points` on every context's device at once; see the module's docstring.

    `contexts`: one per device, each with its own worker (`Context.worker`; the worker's calls
    are what a stop interrupts) and its own `Store` and storage on the same database; their
    `device` names them (and is recorded with each result they evaluate).

    `close_contexts`: `run` closes the contexts (stops their workers and compile processes)
    when it ends; False leaves them to the caller, who may reuse the processes for another
    search (several kernels one after the other) and closes them once.
    """

    def __init__(self, contexts: Sequence[Context], points: Sequence[Point],
                 options: SearchOptions, display: Display | None = None,
                 close_contexts: bool = True) -> None:
        if not contexts:
            raise ValueError("a device search needs at least one device")
        names = [c.device for c in contexts]
        repeated = sorted({d for d in names if names.count(d) > 1})
        if repeated:
            raise ValueError(f"devices given twice: {', '.join(repeated)}")
        for ctx in contexts:
            if ctx.worker is None:
                raise ValueError(f"{ctx.device}: a device search runs configs in a worker "
                                 "process per device; this context has none")
        self.contexts = list(contexts)
        self.points = list(points)
        self.options = options
        self.display: Display = display or _Quiet()
        self.close_contexts = close_contexts
        self.stats = {c.device: DeviceStats(c.device) for c in contexts}
        self._queue = PointQueue(points)
        self._results: list[PointResult | None] = [None] * len(points)
        self._errors: list[DeviceFailedError] = []
        self._stop = threading.Event()
        for ctx in self.contexts:
            assert ctx.worker is not None
            ctx.worker.cancel = self._stop

    def stop(self) -> None:
        """Stops every device (from any thread): `run` then raises KeyboardInterrupt."""
        self._stop.set()

    def run(self) -> list[PointResult]:
        """Tunes every point; returns their results in the grid's order. Closes the contexts
        (their workers and compile processes) unless `close_contexts` is False.

        Raises KeyboardInterrupt when stopped before the end (every finished trial is stored;
        run again to resume), DeviceFailedError when a device's thread failed."""
        # The calling thread waits on events the devices' threads set when they end, never in
        # Thread.join: a KeyboardInterrupt raised in join (Python 3.11) marks the thread it
        # waited for as ended while it runs on, and its worker would be closed under it.
        ended = [threading.Event() for _ in self.contexts]
        threads = [threading.Thread(target=self._serve, args=(ctx, end), daemon=True,
                                    name=f"fusetune-{ctx.device}")
                   for ctx, end in zip(self.contexts, ended, strict=True)]
        try:
            for t in threads:
                t.start()
            for end in ended:
                while not end.wait(JOIN_POLL_S):
                    pass
        except KeyboardInterrupt:
            self._stop.set()
            deadline = time.monotonic() + STOP_WAIT_S
            for end in ended:
                end.wait(max(0.0, deadline - time.monotonic()))
            raise
        finally:
            if self.close_contexts:
                for ctx in self.contexts:
                    ctx.close()
        if self._errors:
            raise self._errors[0] from self._errors[0].__cause__
        if self._stop.is_set():
            raise KeyboardInterrupt("the device search was stopped")
        return [r for r in self._results if r is not None]

    def _serve(self, ctx: Context, ended: threading.Event) -> None:
        """One device's thread: takes jobs until none is left or the search stops; sets
        `ended` when it returns."""
        stats = self.stats[ctx.device]
        try:
            while not self._stop.is_set():
                job = self._queue.take(ctx.device)
                if job is None:
                    return
                options = self.options
                if job.joined and options.time_budget_s is not None:
                    # What is left of the point's budget, counted from when the first device
                    # took it (its own clock starts a little later): this one stops no later.
                    left = options.time_budget_s - (time.monotonic() - job.started)
                    if left <= 0:
                        continue
                    options = dataclasses.replace(options, time_budget_s=left)
                tuner = PointTuner(ctx, job.point, options,
                                   self.display.start(ctx.device, job.point, job.joined))
                try:
                    tuner.sample()
                finally:
                    stats.evaluated += tuner.n_new
                if job.joined:
                    stats.joined += 1
                    self.display.done(ctx.device, job.point, None)
                    continue
                self._queue.sampled(job.index)
                result = tuner.finish()
                self._results[job.index] = result
                stats.points += 1
                self.display.done(ctx.device, job.point, result)
        except KeyboardInterrupt:
            pass  # stopping: the trial in flight was failed as interrupted
        except BaseException as exc:
            error = DeviceFailedError(ctx.device, exc)
            error.__cause__ = exc
            self._errors.append(error)
            self._stop.set()
        finally:
            ended.set()
