"""Compiling configs ahead of the GPU, in parallel CPU processes.

Timing a config on the GPU takes a fraction of a second; compiling it (Triton's frontend, LLVM,
ptxas) often takes longer, on one CPU core. `CompileAhead` keeps a few spawned processes that
compile the configs the GPU will run next. For a config, a compile process calls the kernel's
launcher on inputs of the point's shapes, made on the same device as the evaluator makes them
(`make_inputs`, `make_outputs`: same dtypes, strides and pointer alignment, so the same Triton
specialization and cache key), with Triton's JIT in warmup mode (`launches.compile_only`: it
compiles, writes Triton's on-disk cache and launches nothing). When the GPU process runs the
config, its JIT finds the kernels in that cache (same TRITON_CACHE_DIR: the processes inherit
the environment) and only loads them.

Nothing here can fail a search. A config that fails to compile, a compile process that dies or
one that hangs (killed after `timeout_s`) leave the config not compiled ahead; the GPU process
compiles it itself and records whatever happens then. After `MAX_DEATHS_IN_A_ROW` processes died
without answering, compiling ahead stops for the rest of the run (say, a device the compile
processes cannot use).

Each process holds the current point's inputs on the device (a CUDA context and one copy of the
inputs per process); launchers' scratch buffers are given back after every config.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import importlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from fusetune.spec import Config, KernelSpec, Point
from fusetune.tuner.children import death, start_child
from fusetune.tuner.space import config_key

# What became of a config handed to `CompileAhead.submit` (see `CompileAhead.wait`).
PENDING = "pending"  # queued, no process has it yet
COMPILING = "compiling"  # a process is compiling it
COMPILED = "compiled"  # in Triton's cache: the GPU process only loads it
FAILED = "failed"  # the compile raised (the GPU process will record why)
CRASHED = "crashed"  # its compile process died
TIMEOUT = "timeout"  # its compile process did not answer in time and was killed
SKIPPED = "skipped"  # the GPU wanted it before any process took it: not compiled ahead
NOT_SUBMITTED = "not submitted"

DEFAULT_COMPILER = "fusetune.tuner.compile_ahead:warmup_compiler"
MAX_WORKERS_DEFAULT = 8
MAX_DEATHS_IN_A_ROW = 8
STOP_WAIT_S = 5.0
START_S = 120.0  # allowed to a new compile process to start (import torch, set up the device)

# (spec, point, device) -> a function that compiles one config of that point (raises if not)
Compiler = Callable[[Config], None]
CompilerFactory = Callable[[KernelSpec, Point, str], Compiler]


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(devices: int = 1, cpus: int | None = None) -> int:
    """Compile processes per device by default: half the CPUs shared by the devices, at most
    MAX_WORKERS_DEFAULT each (the other half stays for the processes that launch and time)."""
    cpus = available_cpus() if cpus is None else cpus
    return min(MAX_WORKERS_DEFAULT, cpus // (2 * max(1, devices)))


def resolve_workers(requested: int | None, backend: str, devices: int = 1,
                    default_on: bool = True) -> tuple[int, str | None]:
    """(compile processes to use, a note to show or None) for --compile-workers `requested`
    (None: the default, default_workers if `default_on`, else off) on `backend`. Only CUDA
    compiles anything: the interpreter runs the kernels' Python, so compiling ahead is off
    there. The search leaves it off unless asked: over the few configs a search times, the
    compile processes' start-up costs about what compiling ahead saves; the exhaustive grid,
    where every config is known ahead, has it on."""
    if requested is not None and requested < 0:
        raise ValueError(f"--compile-workers {requested}: expected 0 (off) or a positive number "
                         "of processes")
    if backend != "cuda":
        note = (f"--compile-workers {requested} is ignored: the {backend} backend compiles "
                "nothing" if requested else None)
        return 0, note
    if requested is None:
        return (default_workers(devices) if default_on else 0), None
    return requested, None


def warmup_compiler(spec: KernelSpec, point: Point, device: str) -> Compiler:
    """The compile step of the compile processes: the kernel's own launcher, on inputs and
    outputs made as the evaluator makes them, with Triton's JIT compiling without launching."""
    from fusetune.tuner.launches import compile_only

    inputs = spec.make_inputs(point, device)
    outputs = spec.make_outputs(inputs)

    def compile_config(config: Config) -> None:
        with compile_only():
            spec.launch(inputs, outputs, config)

    return compile_config


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _release_memory(device: str, collect: bool = False) -> None:
    """Gives the device memory this process no longer uses back (launchers' scratch buffers;
    with `collect`, the last point's inputs), so that the GPU process keeps room."""
    if collect:
        gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _serve(conn: Connection, device: str, compiler_ref: str) -> None:
    """A compile process: says ("ready",) once set up, then answers each ("compile", spec_ref,
    point, key, config) with ("done", key, state, reason, seconds). Each message names its
    kernel: one process serves every kernel of a run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if device.startswith("cuda"):  # Triton compiles for the current device's target
        import torch

        torch.cuda.set_device(torch.device(device))
    from fusetune.tuner.worker import resolve_spec

    factory: CompilerFactory = _resolve(compiler_ref)
    conn.send(("ready",))
    current: tuple[str, Point, Compiler] | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] != "compile":
            return
        _, spec_ref, point, key, config = msg
        t0 = time.perf_counter()
        try:
            if current is None or current[:2] != (spec_ref, point):
                current = None
                _release_memory(device, collect=True)
                current = (spec_ref, point, factory(resolve_spec(spec_ref), point, device))
            current[2](config)
            reply = ("done", key, COMPILED, "", time.perf_counter() - t0)
        except Exception as exc:  # a config that does not compile: the GPU process will say why
            reply = ("done", key, FAILED, _one_line(exc), time.perf_counter() - t0)
        _release_memory(device)
        conn.send(reply)


@dataclass
class CompileStats:
    """What the compile processes did in a run."""

    workers: int
    submitted: int = 0
    compiled: int = 0
    failed: int = 0  # the compile raised
    crashed: int = 0  # the process died on it
    timeouts: int = 0  # the process hung on it and was killed
    skipped: int = 0  # the GPU process wanted it before a compile process took it
    seconds: float = 0.0  # compile processes' seconds spent on the configs they answered
    disabled: str = ""  # why compiling ahead stopped, if it did

    def since(self, earlier: CompileStats) -> CompileStats:
        """What was done after `earlier`, a copy of these stats taken then (the processes
        serve several searches: one search's share)."""
        counts = {f.name: getattr(self, f.name) - getattr(earlier, f.name)
                  for f in dataclasses.fields(self) if f.name not in ("workers", "disabled")}
        return CompileStats(self.workers, disabled=self.disabled, **counts)

    def summary(self) -> str:
        parts = [f"{self.compiled} of {self.submitted} configs compiled ahead by "
                 f"{self.workers} processes ({self.seconds:.1f} s of compiling)"]
        for n, what in ((self.failed, "failed to compile"), (self.crashed, "crashed"),
                        (self.timeouts, "timed out"),
                        (self.skipped, "reached by the GPU first")):
            if n:
                parts.append(f"{n} {what}")
        if self.disabled:
            parts.append(f"stopped: {self.disabled}")
        return "; ".join(parts)


class _Slot:
    """One compile process and the config it is compiling."""

    def __init__(self) -> None:
        self.proc: mp.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.ready = False  # it said it is set up
        self.task: tuple[Point, str] | None = None
        self.deadline = math.inf


class CompileAhead:
    """`workers` compile processes for `device` (see the module's docstring).

    `submit(point, configs)` queues configs in the order the GPU will want them; `wait(point,
    config)`, just before the GPU runs one, waits for its compile if a process has it, and takes
    it off the queue if none has yet (the GPU compiles it itself: waiting would not be quicker).
    Configs of one point at a time: submitting configs of another point drops those still
    queued. A background thread starts the processes (at once, so that they are ready when
    the first configs come), hands configs to idle ones and watches for deaths and hangs.
    `compiler_ref` ("module:function", a `CompilerFactory`) is what the processes run; tests
    replace it.

    `spec_ref`: the kernel of the configs submitted from now on (a registered kernel's name or
    "module:attribute", see `worker.resolve_spec`). The processes serve any kernel: a caller
    tuning several kernels reassigns `spec_ref` before submitting another kernel's configs and
    keeps the processes; configs already queued keep the kernel they were submitted with.
    """

    def __init__(self, spec_ref: str, device: str, workers: int, timeout_s: float = 300.0,
                 compiler_ref: str = DEFAULT_COMPILER) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: a CompileAhead needs at least 1 process "
                             "(0 means not compiling ahead: make none)")
        self.spec_ref, self.device, self.timeout_s = spec_ref, device, timeout_s
        self.compiler_ref = compiler_ref
        self.stats = CompileStats(workers)
        self._ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
        self._cond = threading.Condition()
        # (spec_ref, point, config key, config), in the order the GPU will want them
        self._queue: collections.deque[tuple[str, Point, str, Config]] = collections.deque()
        self._state: dict[tuple[Point, str], str] = {}
        self._point: tuple[str, Point] | None = None  # (spec_ref, point) of the last submit
        self._slots = [_Slot() for _ in range(workers)]
        self._deaths_in_a_row = 0
        self._closed = False
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._loop, name="fusetune-compile-ahead",
                                        daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------

    def submit(self, point: Point, configs: Iterable[Config]) -> None:
        """Queues `configs` of `point` (those not submitted before) behind the queued ones."""
        with self._cond:
            if self._closed or self.stats.disabled:
                return
            if (self.spec_ref, point) != self._point:
                self._point = (self.spec_ref, point)
                self._queue.clear()
                self._state = {k: s for k, s in self._state.items() if s == COMPILING}
            for c in configs:
                key = config_key(c)
                if (point, key) in self._state:
                    continue
                self._state[(point, key)] = PENDING
                self._queue.append((self.spec_ref, point, key, dict(c)))
                self.stats.submitted += 1
            self._assign()  # idle processes start on them now, not when the thread wakes
        self._wake()

    def state(self, point: Point, config: Config) -> str:
        """What became of `config` so far (PENDING, COMPILING, COMPILED, ...)."""
        with self._cond:
            return self._state.get((point, config_key(config)), NOT_SUBMITTED)

    def wait(self, point: Point, config: Config, cancel: threading.Event | None = None) -> str:
        """Called when the GPU is about to run `config`: waits for its compile if a process
        has it (at most until that process's deadline), takes it off the queue if none has
        yet. Returns its state: COMPILED when the GPU process will find it compiled.

        `cancel`: once set, the wait raises KeyboardInterrupt (as Ctrl-C does), so that
        another thread can stop a search waiting here."""
        k = (point, config_key(config))
        with self._cond:
            state = self._state.get(k, NOT_SUBMITTED)
            if state == PENDING:
                self._queue = collections.deque(t for t in self._queue if t[1:3] != k)
                self._state[k] = state = SKIPPED
                self.stats.skipped += 1
            while state == COMPILING and not self._closed:
                if cancel is not None and cancel.is_set():
                    raise KeyboardInterrupt("the search is stopping")
                self._cond.wait(0.1 if cancel is not None else 1.0)
                state = self._state.get(k, NOT_SUBMITTED)
            return state

    def close(self) -> None:
        """Stops the processes (one in the middle of a compile is killed) and the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._wake()
        self._thread.join(STOP_WAIT_S)
        for slot in self._slots:
            self._stop(slot, kill=slot.task is not None)
        for c in (self._wake_r, self._wake_w):
            c.close()

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread -----------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # closed already
            self._wake_w.send_bytes(b"w")

    def _loop(self) -> None:
        try:
            self._serve_processes()
        except Exception as exc:  # never seen; but then no config waits for this thread
            with self._cond:
                self._disable(f"its thread failed: {_one_line(exc)}")
                for k, state in self._state.items():
                    if state == COMPILING:
                        self._state[k] = CRASHED
                self._cond.notify_all()

    def _serve_processes(self) -> None:
        with self._cond:
            for slot in self._slots:
                if slot.proc is None and not self._closed:
                    try:
                        self._start(slot)
                    except Exception:  # tried again when there is a config for it
                        self._stop(slot, kill=True)
        while True:
            with self._cond:
                if self._closed:
                    return
                self._assign()
                # busy ones, and those starting (their "ready", or their death, is news too)
                watched = [s for s in self._slots if s.conn is not None
                           and (s.task is not None or not s.ready)]
                deadline = min((s.deadline for s in watched if s.task is not None),
                               default=math.inf)
            timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            ready = wait([self._wake_r] + [s.conn for s in watched if s.conn is not None],
                         timeout)
            with self._cond:
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                for slot in watched:
                    if slot.conn is not None and slot.conn in ready:
                        self._answer(slot)
                    elif slot.task is not None and time.monotonic() > slot.deadline:
                        self._lost(slot, TIMEOUT, f"no answer within {self.timeout_s:g} s")
                self._cond.notify_all()

    def _assign(self) -> None:
        """Hands queued configs to idle processes (starting them as needed)."""
        for slot in self._slots:
            if not self._queue or self.stats.disabled:
                return
            if slot.task is not None:
                continue
            spec_ref, point, key, config = self._queue.popleft()
            slot.task, slot.deadline = (point, key), time.monotonic() + self.timeout_s
            self._state[(point, key)] = COMPILING
            try:
                if slot.proc is None or not slot.proc.is_alive():
                    self._start(slot)
                if not slot.ready:
                    slot.deadline += START_S  # until it says it is ready
                assert slot.conn is not None
                slot.conn.send(("compile", spec_ref, point, key, config))
            except Exception as exc:  # could not start it, or it is gone already
                self._lost(slot, CRASHED, _one_line(exc))

    def _start(self, slot: _Slot) -> None:
        self._stop(slot, kill=True)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.device, self.compiler_ref),
                                 daemon=True, name="fusetune-compile")
        start_child(proc)
        child.close()
        slot.proc, slot.conn, slot.ready = proc, parent, False

    def _stop(self, slot: _Slot, kill: bool) -> None:
        proc, conn = slot.proc, slot.conn
        slot.proc = slot.conn = None
        if conn is not None:
            if not kill:
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
            conn.close()
        if proc is not None:
            if kill and proc.is_alive():
                proc.kill()
            proc.join(timeout=STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=STOP_WAIT_S)

    def _answer(self, slot: _Slot) -> None:
        assert slot.conn is not None
        try:
            msg = slot.conn.recv()
        except (EOFError, OSError):
            assert slot.proc is not None
            slot.proc.join(timeout=1)
            self._lost(slot, CRASHED, death(slot.proc, "the compile process"))
            return
        if msg[0] == "ready":
            slot.ready = True
            if slot.task is not None:  # the config's own time begins
                slot.deadline = time.monotonic() + self.timeout_s
            return
        assert slot.task is not None
        _, _key, state, _reason, seconds = msg
        self._deaths_in_a_row = 0
        self.stats.seconds += seconds
        if state == COMPILED:
            self.stats.compiled += 1
        else:
            self.stats.failed += 1
        self._finish(slot, state)

    def _lost(self, slot: _Slot, state: str, reason: str) -> None:
        """The process of `slot` died or hung (on its config, if it had one: that config is not
        compiled ahead); it is stopped, and a new one starts for the next config."""
        if slot.task is not None:
            if state == TIMEOUT:
                self.stats.timeouts += 1
            else:
                self.stats.crashed += 1
            self._finish(slot, state)
        self._stop(slot, kill=True)
        self._deaths_in_a_row += 1
        if self._deaths_in_a_row >= MAX_DEATHS_IN_A_ROW:
            self._disable(f"{self._deaths_in_a_row} compile processes in a row died or hung, "
                          f"the last: {reason}")

    def _disable(self, why: str) -> None:
        """No more compiling ahead in this run: the queued configs are left to the GPU."""
        if not self.stats.disabled:
            self.stats.disabled = why
        for _, point, key, _ in self._queue:
            self._state[(point, key)] = SKIPPED
        self._queue.clear()

    def _finish(self, slot: _Slot, state: str) -> None:
        assert slot.task is not None
        if slot.task in self._state:  # else: a config of a point submitted before
            self._state[slot.task] = state
        slot.task, slot.deadline = None, math.inf
