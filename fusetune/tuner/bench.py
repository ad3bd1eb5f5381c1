"""Evaluating one config at one point: launch, check against the reference, time.

Every failure becomes an `Outcome` with a status and a reason; nothing here raises for a bad
config, except `DeviceLostError` when the GPU context is unusable after an illegal access.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fusetune.spec import Config, KernelSpec, Point
from fusetune.tuner.launches import KernelStats, kernel_stats, launched_kernels

# Statuses of a result; "ok" is the only one that can win.
STATUSES = ("ok", "infeasible", "oor", "compile_error", "runtime_error", "wrong_result",
            "timeout", "crashed")
BACKENDS = ("cuda", "interpreter")


class DeviceLostError(RuntimeError):
    """The CUDA context is unusable (illegal memory access, device-side assert, ...)."""


@dataclass
class Outcome:
    status: str
    reason: str = ""
    time_us: float | None = None  # median
    p20_us: float | None = None
    p80_us: float | None = None
    rel_err: float | None = None
    compile_s: float | None = None
    # The compiled kernels of the config (see launches.KernelStats; None: unknown)
    n_regs: int | None = None  # registers per thread, the most any of its kernels uses
    n_spills: int | None = None  # spilled registers, all its kernels together
    smem_bytes: int | None = None  # shared memory per program, the most any kernel uses

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def with_stats(self, stats: KernelStats) -> Outcome:
        """This outcome with the compiled kernels' figures."""
        self.n_regs, self.n_spills, self.smem_bytes = (stats.n_regs, stats.n_spills,
                                                       stats.smem_bytes)
        return self


_FATAL_MARKERS = ("illegal memory access", "illegal address", "device-side assert",
                  "unspecified launch failure", "misaligned address", "an illegal instruction")


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(status, one-line reason) for an exception raised while compiling or launching."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    msg = " ".join(str(exc).split())[:500] or type(exc).__name__
    if isinstance(exc, OutOfResources):
        return "oor", msg
    if isinstance(exc, CompilationError):
        return "compile_error", msg
    name = type(exc).__name__
    if "PTXAS" in name.upper() or "compil" in name.lower():
        return "compile_error", f"{name}: {msg}"
    if name == "InterpreterError" and _language_check(exc.__cause__):
        # Triton's interpreter runs the kernel's Python: what a compile would refuse on a GPU
        # (a static_assert, a shape or range the language rejects) raises while it runs.
        return "compile_error", f"{name}: {msg} (the compiler's check, in the interpreter)"
    if any(m in msg.lower() for m in _FATAL_MARKERS):
        return "crashed", f"{name}: {msg}"
    return "runtime_error", f"{name}: {msg}"


def _language_check(exc: BaseException | None) -> bool:
    """Whether `exc` was raised by Triton's language layer (its checks of shapes, ranges and
    types, or a static_assert), not by the kernel's memory accesses or the host."""
    tb = exc.__traceback__ if exc is not None else None
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    path = code.co_filename.replace("\\", "/")
    return "/triton/language/" in path or code.co_name == "_new_static_assert"


# Points whose roofline floor (floor_us) is below this many µs are timed as graph replays.
GRAPH_BELOW_US = 150.0
# A plain launch is timed only where its launch path's host time is below this share of the
# L2 flush that do_bench runs before each call (which the GPU spends while the host prepares
# the launch): beyond it, the timing would include the GPU waiting for the host.
HOST_SHARE_OF_FLUSH = 0.5


T = TypeVar("T")


def round_order(items: Sequence[T], r: int) -> list[T]:
    """The order of interleaved timing round `r`: each round starts one item further on, since
    a timing can depend on what ran just before it (clocks under the previous load), so that
    each item takes each place in turn."""
    start = r % len(items)
    return [*items[start:], *items[:start]]


def floor_us(spec: KernelSpec, point: Point, device: str | torch.device) -> float:
    """The point's roofline floor (Cost.floor_us) at the datasheet rates of `device`'s GPU:
    its memory bandwidth and the peak of the point's products (GpuSpec.peak_tflops: FP8
    activations on FP8 tensor cores at the FP8 rate; 1 TB/s and 100 TFLOP/s where the catalogue
    has no figure)."""
    from fusetune.tables import gpu_for_device

    gpu = gpu_for_device(torch.device(device))
    peak = gpu.peak_tflops(point.dtype, point.activations) or 100.0
    floor = spec.cost(point).floor_us(gpu.bandwidth_gbs or 1000.0, peak)
    assert floor is not None  # both rates are given
    return floor


def host_us(fn: Callable[[], None], calls: int = 5) -> float:
    """Median host time of a call of `fn` (a launch that has run before), in µs: from the call
    to its return, the GPU idle before it (not synchronized after: the launch's own time)."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


_flush_us: dict[str, float] = {}


def flush_us(device: str) -> float:
    """GPU time of do_bench's L2 flush on `device` (its cache buffer zeroed), in µs, measured
    once per process and device."""
    if device not in _flush_us:
        from triton import runtime

        drv = runtime.driver.active
        cache = drv.get_empty_cache_for_benchmark()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        times = []
        for _ in range(5):
            start.record()
            cache.zero_()  # what do_bench's clear_cache does
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        _flush_us[device] = statistics.median(times)
    return _flush_us[device]


def captured_launch(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` (a launch that has run before: compiled) captured in a CUDA graph; the returned
    replay holds `fn` and the graph, whose private memory pool keeps what the launch
    allocated (split-K workspaces). Where the launch cannot be captured, `fn` itself: its
    plain launches are timed instead. The capture errors only for this thread's calls
    (thread_local), so other devices' threads of a multi-GPU search do not disturb it."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception:  # a launch path that synchronizes or queries the GPU: plain launches
        torch.cuda.synchronize()
        _end_rng_capture()
        return fn
    return functools.partial(_replay, graph, fn)


def _end_rng_capture() -> None:
    """Takes the CUDA random generators out of graph-capture mode after a capture that failed.

    A capture that fails leaves them in it (torch 2.11): the process's next torch.randn on the
    GPU, the next point's inputs for instance, raises "Offset increment outside graph capture
    encountered unexpectedly". An empty capture, which ends normally, restores them (the
    seed and offset are kept). Errors thread-local, as in captured_launch: other devices'
    threads of a multi-GPU search may be calling CUDA meanwhile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            pass


def _replay(graph: torch.cuda.CUDAGraph, launch: Callable[[], None]) -> None:
    graph.replay()  # `launch` is an argument only to keep what it holds alive


class Evaluator:
    """Holds one point's inputs, reference and outputs; evaluates configs against them."""

    def __init__(self, spec: KernelSpec, point: Point, backend: str, device: str | torch.device,
                 seed: int = 0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.spec, self.point, self.backend, self.device = spec, point, backend, device
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.inputs = spec.make_inputs(point, device)
        torch.random.set_rng_state(gen_state)
        self.reference = spec.reference(self.inputs)
        self.outputs = spec.make_outputs(self.inputs)
        self.tolerance = spec.tolerance[point.dtype]
        # Timed as CUDA-graph replays (see time) where the point's kernels are short.
        self.graphs = backend == "cuda" and floor_us(spec, point, device) < GRAPH_BELOW_US

    def _sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize()

    def _run(self, config: Config) -> Callable[[], None]:
        spec, inputs, outputs = self.spec, self.inputs, self.outputs
        return lambda: spec.launch(inputs, outputs, config)

    def check(self, config: Config) -> Outcome:
        """Compiles and runs `config` once on NaN-poisoned outputs; compares with the reference.
        The outcome has the registers, spills and shared memory of the kernels it launched."""
        kernels: list[Any] = []
        return self._check(config, kernels).with_stats(kernel_stats(kernels))

    def _check(self, config: Config, kernels: list[Any]) -> Outcome:
        for t in self.outputs.values():
            # An element the kernel fails to write stays NaN (integers: their largest value)
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool:
                t.fill_(torch.iinfo(t.dtype).max)
        t0 = time.perf_counter()
        try:
            with launched_kernels(kernels):
                self._run(config)()
                self._sync()
        except Exception as exc:  # every failure is a result, never a crash of the search
            status, reason = classify_exception(exc)
            if status == "crashed":
                raise DeviceLostError(reason) from exc
            return Outcome(status, reason, compile_s=time.perf_counter() - t0)
        compile_s = time.perf_counter() - t0
        worst = 0.0
        tol = self.spec.tolerance_for(self.point)  # the point's mode's, whatever the config
        for name, ref in self.reference.items():
            out = self.outputs[name]
            out = out if out.dtype == torch.float64 else out.float()
            ref = ref if ref.is_floating_point() else ref.float()
            if not torch.isfinite(out).all():
                bad = int((~torch.isfinite(out)).sum())
                return Outcome("wrong_result", f"{name}: {bad} non-finite elements "
                               "(unwritten or overflowed)", rel_err=math.inf, compile_s=compile_s)
            err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)
                        .clamp_min(1e-30))
            worst = max(worst, err)
            if err > tol:
                return Outcome("wrong_result", f"{name}: relative error {err:.2e} > "
                               f"{tol:.1e} for {self.point.dtype}", rel_err=err,
                               compile_s=compile_s)
        return Outcome("ok", rel_err=worst, compile_s=compile_s)

    def time(self, config: Config, rep_ms: int = 100) -> tuple[float, float, float]:
        """(p20, p50, p80) in µs. CUDA: triton's do_bench with the L2 flushed between runs.
        Points whose roofline floor is under GRAPH_BELOW_US are timed over replays of a CUDA
        graph of the launch (captured_launch): timing their plain launches timed the CPU
        wherever the launch path's Python took longer than do_bench's L2 flush (decode-sized
        kernels with many arguments, split-K's two launches). Longer kernels hide the launch
        path and are timed as plain launches (no capture, no graph memory per config), unless
        the config's launch path takes the host longer than HOST_SHARE_OF_FLUSH of do_bench's
        L2 flush (an unfused config's several launches and cuBLAS calls): graph replays then
        too."""
        fn = self._run(config)
        if self.backend == "cuda":
            from triton.testing import do_bench

            if self.graphs or host_us(fn) > HOST_SHARE_OF_FLUSH * flush_us(self.device):
                fn = captured_launch(fn)
            q = do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
            return q[0] * 1e3, q[1] * 1e3, q[2] * 1e3
        # Interpreter: wall-clock of a few runs; meaningless as performance, kept for the flow.
        samples = []
        for _ in range(2):  # the fewest runs its quantiles take: only the flow is checked
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        qs = statistics.quantiles(samples, n=5, method="inclusive")
        return qs[0], statistics.median(samples), qs[3]

    def evaluate(self, config: Config) -> Outcome:
        """check, then time if the result is right."""
        out = self.check(config)
        if not out.ok:
            return out
        q = self.timing(config)
        if isinstance(q, Outcome):
            q.compile_s, q.n_regs, q.n_spills, q.smem_bytes = (out.compile_s, out.n_regs,
                                                               out.n_spills, out.smem_bytes)
            return q
        out.p20_us, out.time_us, out.p80_us = q
        return out

    def timing(self, config: Config, rep_ms: int = 100) -> tuple[float, float, float] | Outcome:
        """time(config, rep_ms), or the outcome of its failure; DeviceLostError if the CUDA
        context is gone."""
        try:
            return self.time(config, rep_ms)
        except Exception as exc:  # a failure is a result, never a crash of the search
            status, reason = classify_exception(exc)
            if status == "crashed":
                raise DeviceLostError(reason) from exc
            return Outcome(status, reason)
