"""The benchmark worker: configs are compiled, checked and timed in a subprocess.

A config that kills the process (segfault, illegal memory access that poisons the CUDA
context) or never returns (a hanging kernel or compile) takes down the worker, not the search:
the parent records the config as `crashed` or `timeout` with the reason, starts a new worker on
the same point and goes on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from fusetune.spec import Config, KernelSpec, Point
from fusetune.tuner.bench import DeviceLostError, Evaluator, Outcome
from fusetune.tuner.children import death, start_child

EXIT_DEVICE_LOST = 3
CANCEL_POLL_S = 0.1  # how often a call waiting for the worker looks whether it was cancelled


def resolve_spec(ref: str) -> KernelSpec:
    """The kernel `ref` names: a registered kernel's name, an entry point's, or
    "module:attribute" of a kernel declared with fusetune.autotune (or any KernelSpec)."""
    from fusetune.kernels import get_spec

    return get_spec(ref)


def _serve(conn: Connection, backend: str, device: str) -> None:
    """The worker's loop: ("point", spec_ref, point, seed) | ("eval", config) | ("time",
    config). The point names its kernel: one process serves every kernel of a run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if backend == "cuda":  # Triton launches and do_bench time on the current device
        import torch

        torch.cuda.set_device(torch.device(device))
    evaluator: Evaluator | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "point":
            _, spec_ref, point, seed = msg
            evaluator = None  # the last point's tensors go before the next point's are made
            evaluator = Evaluator(resolve_spec(spec_ref), point, backend, device, seed=seed)
            conn.send(("ready",))
        elif kind in ("eval", "time"):
            assert evaluator is not None, "a point must be set before configs are run"
            try:
                if kind == "eval":
                    conn.send(("outcome", evaluator.evaluate(msg[1])))
                else:  # times, or the outcome of a failure (the worker goes on)
                    q = evaluator.timing(msg[1])
                    conn.send(("outcome", q) if isinstance(q, Outcome) else ("times", q))
            except DeviceLostError as exc:  # the context is gone: report, then die
                conn.send(("outcome", Outcome("crashed", str(exc))))
                os._exit(EXIT_DEVICE_LOST)
        else:
            return


# Seconds a worker may take to start and load a point, whatever the trial timeout.
LOAD_TIMEOUT_S = 120.0


class Worker:
    """One worker process for one device; restarted after a crash or a timeout.

    `spec_ref`: the kernel of the points set from now on, a registered kernel's name or
    "module:attribute" of a KernelSpec (see `resolve_spec`). The process serves any kernel: a
    caller tuning several kernels reassigns `spec_ref` before `set_point` of another kernel's
    point and keeps the process (its start-up, importing torch and Triton and creating the
    CUDA context, is paid once). A point already set keeps its kernel until the next
    `set_point`, also across a restart.

    `cancel`: once this event is set, a call waiting for the worker (or about to start it)
    raises KeyboardInterrupt within CANCEL_POLL_S, as Ctrl-C does in the main thread: the config
    it was running is neither a result nor a failure. It lets another thread stop a search whose
    calls run in this thread (several devices at once)."""

    def __init__(self, spec_ref: str, backend: str, device: str, timeout_s: float,
                 cancel: threading.Event | None = None) -> None:
        self.spec_ref, self.backend, self.device = spec_ref, backend, device
        self.timeout_s = timeout_s
        self.cancel = cancel
        self.restarts = 0
        self._ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._point: tuple[str, Point, int] | None = None  # (spec_ref, point, seed) now set

    @property
    def _load_timeout_s(self) -> float:
        # Starting the process (importing torch and Triton, creating the CUDA context) and
        # building a point's inputs and reference are no config's doing: a short trial timeout
        # would fail them on a loaded or cold machine.
        return max(self.timeout_s, LOAD_TIMEOUT_S)

    # -- process management --------------------------------------------------------------------

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise KeyboardInterrupt("the search is stopping")

    def _start(self) -> None:
        self._check_cancel()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.backend, self.device),
                                 daemon=True, name="fusetune-worker")
        start_child(proc)
        child.close()
        self._proc, self._conn = proc, parent
        if self._point is not None:
            reply = self._call(("point", *self._point), self._load_timeout_s)
            if reply is None or reply[0] != "ready":
                raise RuntimeError(f"the benchmark worker could not load {self._point[1].label}: "
                                   f"{self._last_death}")

    def _stop(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=30)

    def _restart(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def _call(self, msg: tuple[Any, ...], timeout_s: float) -> tuple[Any, ...] | None:
        """Sends `msg`; the reply, or None if the worker died or did not answer in time."""
        self._check_cancel()
        if self._proc is None:
            self._start()
        assert self._conn is not None and self._proc is not None
        try:
            self._conn.send(msg)
            if self._wait(timeout_s):
                return self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            pass
        self._proc.join(timeout=1)
        self._last_death = death(self._proc, "the worker")
        return None

    _last_death = ""

    def _wait(self, timeout_s: float) -> bool:
        """Whether a reply is there within `timeout_s`; see `cancel`."""
        assert self._conn is not None
        if self.cancel is None:
            return self._conn.poll(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._conn.poll(max(0.0, min(left, CANCEL_POLL_S))):
                return True
            self._check_cancel()
            if left <= 0:
                return False

    # -- the evaluator interface ---------------------------------------------------------------

    def set_point(self, point: Point, seed: int) -> None:
        """Makes `point`'s inputs and reference, of the kernel `spec_ref` names, in the
        process: the configs that follow run on them."""
        self._point = (self.spec_ref, point, seed)
        if self._proc is None:
            self._start()
        else:
            reply = self._call(("point", *self._point), self._load_timeout_s)
            if reply is None:
                self._restart()

    def evaluate(self, config: Config) -> Outcome:
        reply = self._call(("eval", config), self.timeout_s)
        if reply is None:
            timed_out = self._proc is not None and self._proc.is_alive()
            reason = (f"no result within {self.timeout_s:g} s (hang in compile or kernel)"
                      if timed_out else self._last_death)
            self._restart()
            return Outcome("timeout" if timed_out else "crashed", reason)
        out: Outcome = reply[1]
        if self._proc is not None:
            self._proc.join(timeout=0.5 if out.status == "crashed" else 0)
            if not self._proc.is_alive():  # it died after reporting a lost device
                self._restart()
        return out

    def timing(self, config: Config) -> tuple[float, float, float] | Outcome:
        """(p20, p50, p80) µs, or the outcome of a failure: the config raised (the worker goes
        on), crashed the worker or hung it (it is restarted)."""
        reply = self._call(("time", config), self.timeout_s)
        if reply is not None and reply[0] == "outcome":
            out: Outcome = reply[1]
            if out.status == "crashed" and self._proc is not None:
                self._proc.join(timeout=0.5)
            if self._proc is None or not self._proc.is_alive():
                self._restart()
            return out
        if reply is None or reply[0] != "times":
            timed_out = self._proc is not None and self._proc.is_alive()
            self._restart()
            return (Outcome("timeout", f"no timing within {self.timeout_s:g} s") if timed_out
                    else Outcome("crashed", self._last_death))
        return reply[1]


    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("stop",))
        self._stop()
