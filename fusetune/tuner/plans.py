"""The plans of a search's points (space.make_plan), computed at once in separate processes.

Enumerating a matmul kernel's search space for one point (about a million raw configs, each
collapsed to its canonical form: 4,000-30,000 distinct ones) takes 5-10 s of one CPU. Done by
each point's tuner as it starts, that was CPU time between points in which its GPU did nothing,
and with `--devices` it held the interpreter lock of the process that drives every device, so
the other devices waited too: planning did not get faster with more GPUs.

`PlansAhead` starts every point's plan in a pool of spawned processes when the search starts;
a tuner takes its point's plan when it needs it (waiting only for that one), and a device that
joins a point reuses the plan already made. Where no pool can be used (one point, one process,
or a kernel spec that a fresh process cannot look up by name, such as one made by a test) the
plans are made in this process, as before.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from fusetune.gpus import GpuSpec
from fusetune.kernels._spec import KernelSpec, Point
from fusetune.tuner.space import Plan, SearchSpace, make_plan


def _ignore_interrupts() -> None:
    # Ctrl-C stops the search in the parent; the pool's processes end with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _plan_of(kernel: str, space: SearchSpace, point: Point, gpu: GpuSpec) -> Plan:
    from fusetune.kernels import get_spec

    return make_plan(space, get_spec(kernel), point, gpu)


def _registered(spec: KernelSpec) -> bool:
    from fusetune.kernels import REGISTRY

    return REGISTRY.get(spec.name) is spec


class PlansAhead:
    """Every point's Plan, started in up to `processes` spawned processes at construction."""

    def __init__(self, space: SearchSpace, spec: KernelSpec, points: Sequence[Point],
                 gpu: GpuSpec, processes: int) -> None:
        self.space, self.spec, self.gpu = space, spec, gpu
        self._lock = threading.Lock()
        self._plans: dict[Point, Plan] = {}
        self._futures: dict[Point, Future[Plan]] = {}
        self._pool: ProcessPoolExecutor | None = None
        distinct = list(dict.fromkeys(points))
        n = min(processes, len(distinct))
        if n > 1 and _registered(spec):
            self._pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_ignore_interrupts)
            self._futures = {p: self._pool.submit(_plan_of, spec.name, space, p, gpu)
                             for p in distinct}

    @property
    def parallel(self) -> bool:
        """Whether the plans are being made in other processes."""
        return self._pool is not None

    def get(self, point: Point) -> Plan:
        """The plan of `point`: from the pool (waiting for it), from an earlier call, or made
        here (a point the pool was not given, or a pool that failed)."""
        with self._lock:
            plan = self._plans.get(point)
            future = self._futures.get(point)
        if plan is not None:
            return plan
        if future is not None:
            try:
                plan = future.result()
            except Exception:  # a pool that broke (a killed process): plan here instead
                plan = None
        if plan is None:
            plan = make_plan(self.space, self.spec, point, self.gpu)
        with self._lock:
            return self._plans.setdefault(point, plan)

    def close(self) -> None:
        """Stops the pool: plans not started yet are dropped, processes still planning are
        terminated (else this process would wait for them at exit: after a Ctrl-C in the
        search's first seconds, up to a plan's whole time)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        running = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in running:
            if proc.is_alive():
                proc.terminate()
