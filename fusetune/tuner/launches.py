"""Triton's JIT seen from outside a launcher: the compiled kernels it ran, and compiling without
running.

A kernel launched as `kernel[grid](...)` goes through `triton.runtime.jit.JITFunction.run`,
which compiles the kernel for those arguments (or takes it from its caches), launches it unless
`warmup=True`, and returns the `CompiledKernel` (Triton 3.6 and 3.9 alike). Both helpers here
wrap that method for the duration of a `with` block and put the original back afterwards, so
the kernels and their launchers stay as they are, whatever number of kernels a config launches
(a norm pass, the main kernel, a split-K finish).

Under Triton's interpreter kernels are `InterpretedFunction`s that never go through
`JITFunction.run`: nothing is seen (the statistics stay unknown) and nothing is compiled.

The wrapper is on the class while some thread is inside such a block, and acts only for the
threads that are: a launch from another thread is neither forced to warm up nor collected.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

RunMethod = Callable[..., Any]


@dataclass(frozen=True)
class KernelStats:
    """What the compiled kernels of one config use, as the CUDA driver reports it on loading.

    A config may launch several kernels; its figures are those that limit it:
    - `n_regs`: registers per thread of the kernel that uses the most (occupancy is limited
      kernel by kernel, so the largest is the one that can hold a config back);
    - `n_spills`: registers spilled to local memory, summed over the distinct kernels (each
      spill costs memory traffic wherever it is; 0 means none of them spills);
    - `smem_bytes`: shared memory per program of the kernel that uses the most.
    None: unknown (nothing was compiled for a GPU, e.g. under the interpreter)."""

    n_regs: int | None = None
    n_spills: int | None = None
    smem_bytes: int | None = None


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def kernel_stats(kernels: Iterable[Any]) -> KernelStats:
    """The `KernelStats` of the compiled kernels one config launched (each counted once).

    `n_regs` and `n_spills` are filled in by Triton when the kernel is loaded on the GPU (its
    first launch); `metadata.shared` when it is compiled."""
    distinct = {id(k): k for k in kernels}.values()
    regs, spills, smem = [], [], []
    for k in distinct:
        if (r := _count(getattr(k, "n_regs", None))) is not None:
            regs.append(r)
        if (s := _count(getattr(k, "n_spills", None))) is not None:
            spills.append(s)
        if (b := _count(getattr(getattr(k, "metadata", None), "shared", None))) is not None:
            smem.append(b)
    return KernelStats(max(regs) if regs else None, sum(spills) if spills else None,
                       max(smem) if smem else None)


class _Hook:
    """One wrapper around `JITFunction.run`, installed while any thread is inside a block of
    `launched_kernels` or `compile_only` and removed when the last one leaves. What it does is
    per thread: it forces warmup and collects kernels only for the threads inside a block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original: RunMethod | None = None
        self._local = threading.local()

    def _state(self) -> Any:
        local = self._local
        if not hasattr(local, "sinks"):
            local.sinks, local.warmup = [], 0
        return local

    @contextmanager
    def active(self) -> Iterator[Any]:
        """Installs the wrapper (first user) for the block; yields this thread's state."""
        from triton.runtime.jit import JITFunction

        with self._lock:
            if self._users == 0:
                original = JITFunction.__dict__["run"]
                self._original = original
                JITFunction.run = self._wrap(original)
            self._users += 1
        try:
            yield self._state()
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    JITFunction.run = self._original
                    self._original = None

    def _wrap(self, run: RunMethod) -> RunMethod:
        hook = self

        @functools.wraps(run)
        def observed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = hook._state()
            if state.warmup:
                kwargs["warmup"] = True
            kernel = run(self, *args, **kwargs)
            if kernel is not None:
                for sink in state.sinks:
                    sink.append(kernel)
            return kernel

        return observed_run


_HOOK = _Hook()


@contextmanager
def launched_kernels(into: list[Any] | None = None) -> Iterator[list[Any]]:
    """Collects the compiled kernel of every Triton launch this thread makes inside the block,
    in order, into `into` (a new list if None), which it yields."""
    found: list[Any] = [] if into is None else into
    with _HOOK.active() as state:
        state.sinks.append(found)
        try:
            yield found
        finally:
            # by identity: two sinks holding the same kernels are equal lists
            del state.sinks[next(i for i, s in enumerate(state.sinks) if s is found)]


@contextmanager
def compile_only() -> Iterator[None]:
    """Inside the block, the Triton launches this thread makes compile their kernel (and store
    it in Triton's on-disk cache) without running it: `JITFunction.run` gets `warmup=True`. A
    later launch of the same kernel with arguments of the same types and specialization (pointer
    alignment, integers divisible by 16 or equal to 1), in any process with the same Triton
    cache directory, loads it from that cache instead of compiling it."""
    with _HOOK.active() as state:
        state.warmup += 1
        try:
            yield
        finally:
            state.warmup -= 1
