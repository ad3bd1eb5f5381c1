"""A launcher's launches for a call signature it has run before, repeated with new tensors.

After the call memo (_call_memo) a decode-size call still runs the launcher's Python around
its launches (reshapes, FP8 views, workspaces, argument lists) and the argument handling of
each launch: more CPU time than the kernels take on the GPU. Everything in it but the tensors'
addresses follows from the memo's key (shapes, strides, dtypes, devices, the other
arguments) and the config. So the first call of a signature runs in full under `record`,
which notes every launch made through `_direct` (the compiled kernel, its grid and its
argument values), and `Plan.build` ties each tensor argument to an address inside one of
the call's inputs, its outputs, or a `scratch` buffer. A later call of the same signature
runs `Plan.run`: new outputs and scratch buffers, then the same compiled kernels launched
with the new tensors' addresses, nothing else.

A launcher's torch call that launches kernels of its own (cuBLAS's GEMMs in the unfused form,
_unfused) goes through `torch_call`, which notes the function and its tensor arguments (each a
view: shape, strides and where it starts) for the replay to call again on views of the same
places in the new tensors; its choice of kernels stays torch's, call by call. Where one
argument is a stack of several inputs (`note_stacked`: the views of one stacked weight that
fusetune.patch makes), the replay first checks that the new inputs are such a stack too.

A plan is made only where the replay is sure to do what the full path does:
- every launch of the call went through `direct`'s own launch or `torch_call` (none through
  Triton's path alone: an observed or unsupported Triton; no torch call of a CPU tensor);
- every tensor argument lies in exactly one input, output or scratch buffer (a torch call's
  whole view in it, or in the stack it starts), and every TMA
  descriptor's base is one of them whole (the replay makes the same descriptor over the new
  tensor: a TMA launch's tensor map is made from the descriptor at every launch). A tensor the
  call makes with content (a contiguous copy, a bias of zeros) is none of these, and a call
  whose inputs overlap (x passed as the residual too) cannot tell them apart: no plan;
- outputs are fresh dense tensors the replay can allocate the same way, each written by a
  launch;
- scratch buffers are `scratch` allocations, whose content the launches write before they
  read it (split-K partial sums, a norm pass's rows).
A replay declines (returns None, and the caller takes the full path) where Triton would pick
another compiled kernel (an address whose 16-byte alignment differs from the recording's; a
launcher's choice of TMA descriptors follows it too), on another current device, while
something watches Triton's launches (a launch hook, a kernel's pre-run hook, or a wrapped
`JITFunction.run`), or inside another launcher's recording (whose plan must see every launch).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

T = TypeVar("T")

_INPUT, _OUTPUT, _SCRATCH = 0, 1, 2  # where a tensor argument's address comes from


class Recording:
    """The launches of one call (kernel, grid, argument values) and its scratch buffers; `ok`
    turns False when a launch could not be noted."""

    def __init__(self) -> None:
        # (@triton.jit function, compiled kernel, grid, argument values) of each launch; a
        # torch call: (the torch function, None, None, its arguments with `out` last)
        self.launches: list[tuple[Any, Any, tuple[int, int, int] | None, tuple[Any, ...]]] = []
        self.scratch: list[torch.Tensor] = []
        self.stacks: list[tuple[torch.Tensor, ...]] = []  # inputs used as one stacked tensor
        self.devices: set[int] = set()  # the current device at each launch
        self.ok = True


_local = threading.local()


def recordings() -> list[Recording]:
    """The recordings open on this thread (innermost last): a launch is noted in every one,
    so that a launcher calling another keeps the inner launches in its own plan."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def note_launch(device: int, fn: Any, kernel: Any, grid: tuple[int, ...],
                values: tuple[Any, ...]) -> None:
    """Called by `_direct` for every launch it makes of the @triton.jit function `fn` with its
    compiled `kernel` on `device` (a no-op unless a recording is open)."""
    stack = getattr(_local, "stack", None)
    if stack:
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        for rec in stack:
            rec.devices.add(device)
            rec.launches.append((fn, kernel, g, values))


def torch_call(fn: Callable[..., torch.Tensor], args: tuple[Any, ...],
               out: torch.Tensor) -> torch.Tensor:
    """fn(*args, out=out) (torch.mm, torch.addmm), noted in the open recordings for a replay
    to make the same call on the new tensors' views; a CPU tensor's call makes no plan."""
    result = fn(*args, out=out)
    stack = getattr(_local, "stack", None)
    if stack:
        entry = (fn, None, None, (*args, out))
        for rec in stack:
            if out.is_cuda:
                rec.devices.add(out.get_device())
                rec.launches.append(entry)
            else:
                rec.ok = False
    return result


def note_stacked(parts: Sequence[torch.Tensor]) -> None:
    """Called where a launcher uses `parts` (inputs, each following the one before it in one
    storage) as one stacked tensor: a replay checks that its inputs are such a stack too."""
    for rec in getattr(_local, "stack", None) or ():
        rec.stacks.append(tuple(parts))


def note_unrecordable() -> None:
    """Called by `_direct` for a launch it left to Triton: the open recordings make no plan."""
    for rec in getattr(_local, "stack", None) or ():
        rec.ok = False


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for a buffer that a launcher's launches write before they read it (a
    replay allocates a new one of the same shape)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    for rec in getattr(_local, "stack", None) or ():
        rec.scratch.append(t)
    return t


def record(run: Callable[[], T], inputs: Sequence[torch.Tensor | None]) -> tuple[T, Plan | None]:
    """run() (a launcher's full path on `inputs`, returning a fresh tensor or a tuple of them)
    with its launches noted: (its result, the plan that repeats it, or None)."""
    stack = recordings()
    rec = Recording()
    stack.append(rec)
    try:
        result = run()
    finally:
        stack.pop()
    return result, Plan.build(rec, inputs, result)


_parts: tuple[Any, Any, Any] | None = None


def triton_parts() -> tuple[Any, Any, Any]:
    """(Triton's runtime knobs, its active driver, JITFunction), imported once."""
    global _parts
    if _parts is None:
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        _parts = (knobs.runtime, driver.active, JITFunction)
    return _parts


def launches_watched(jit: Any) -> bool:
    """Whether something observes Triton's launches by replacing `jit.run` (JITFunction's):
    under another name, or as a functools.wraps wrapper keeping Triton's (the tuner's launch
    observer). Triton's own run is a plain function."""
    run = jit.run
    return run.__qualname__ != "JITFunction.run" or hasattr(run, "__wrapped__")


def hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is set: None, or a HookChain with no hook in it, is not."""
    return hook is not None and getattr(hook, "calls", None) != []


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last one."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _tensor(source: int, i: int, inputs: Sequence[torch.Tensor | None],
            outputs: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor]) -> torch.Tensor:
    t = (inputs, outputs, scratch)[source][i]
    assert t is not None  # a region is made of a tensor only
    return t


def _owner(regions: list[tuple[int, int, int, int]], ptr: int
           ) -> tuple[int, int, int, int] | None:
    """The one region (first byte, end, source, index) that address `ptr` lies in; None where
    it lies in none (a tensor the call made with content) or in several (inputs that
    overlap)."""
    owners = [r for r in regions if r[0] <= ptr < r[1]]
    return owners[0] if len(owners) == 1 else None


def _fresh(t: torch.Tensor) -> bool:
    """Whether t is all of a storage of its own, densely laid out (what empty_strided makes)."""
    return (t.storage_offset() == 0 and t.numel() > 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and _extent(t) == t.numel() * t.element_size())


class Plan:
    """The launches of a recorded call, their tensor arguments as slots into the tensors the
    call uses (an input, output or scratch buffer, and a byte offset into it); see the module
    docstring."""

    def __init__(self, device: int, outputs: list[tuple[Any, ...]], single: bool,
                 scratch: list[tuple[Any, ...]], uses: list[tuple[int, int]],
                 alignment: list[tuple[int, int, bool]], fns: list[Any],
                 launches: list[tuple[Any, tuple[int, int, int] | None, list[Any],
                                      tuple[tuple[Any, ...], ...]]],
                 stacks: list[tuple[int, ...]]) -> None:
        self.device = device
        self.outputs = outputs  # (shape, stride, dtype, device) of each output
        self.single = single  # the launcher returns one tensor (else a tuple)
        self.scratch = scratch  # (shape, dtype, device) of each scratch buffer
        self.uses = uses  # (source, index) of each tensor the launches read or write
        # (use, offset, whether 16-byte aligned) of each address: Triton specializes on it
        self.alignment = alignment
        self.fns = fns  # the @triton.jit functions launched (their pre-run hooks)
        # (kernel, grid, argument values (None at the tensors), (position, use, offset,
        # descriptor fields or None) slots); a torch call: (its function, None, its arguments
        # (None at the tensors), (position, use, offset in elements, shape, strides) slots)
        self.launches = launches
        self.stacks = stacks  # the inputs (indices) that must be one stack, in order
        self.runs = 0  # replays (for tests)

    @classmethod
    def build(cls, rec: Recording, inputs: Sequence[torch.Tensor | None], result: Any
              ) -> Plan | None:
        if not rec.ok or not rec.launches or len(rec.devices) != 1:
            return None
        single = isinstance(result, torch.Tensor)
        outputs = [result] if single else list(result)
        if not all(isinstance(t, torch.Tensor) and _fresh(t) for t in outputs):
            return None
        if not all(_fresh(t) for t in rec.scratch):
            return None
        regions = []  # (first byte, end, source, index)
        for source, tensors in ((_INPUT, inputs), (_OUTPUT, outputs), (_SCRATCH, rec.scratch)):
            for i, t in enumerate(tensors):
                if t is not None and t.numel() > 0:
                    start = t.data_ptr()
                    regions.append((start, start + _extent(t), source, i))
        stacks: list[tuple[int, ...]] = []  # each stack's inputs, by index
        ends: dict[int, int] = {}  # the end of the stack an input starts, where it starts one
        for parts in rec.stacks:
            found = [next((i for i, t in enumerate(inputs) if t is p), None) for p in parts]
            at = [i for i in found if i is not None]
            if len(at) != len(parts):
                return None  # a stack of tensors made in the call
            stacks.append(tuple(at))
            last = parts[-1]
            ends[at[0]] = max(ends.get(at[0], 0), last.data_ptr() + _extent(last))
        uses: dict[tuple[int, int], int] = {}
        alignment: set[tuple[int, int, bool]] = set()
        launches = []
        for fn, kernel, grid, values in rec.launches:
            if grid is None:  # a torch call of the function `fn`
                call = cls._torch_slots(values, regions, ends, uses, inputs, outputs,
                                        rec.scratch)
                if call is None:
                    return None
                launches.append((fn, None, *call))
                continue
            slots = []
            for pos, v in enumerate(values):
                fields = None
                if v.__class__ is TensorDescriptor:
                    fields = {k: f for k, f in vars(v).items() if k != "base"}
                    v = v.base
                elif not isinstance(v, torch.Tensor):
                    if isinstance(getattr(v, "base", None), torch.Tensor):
                        return None  # a descriptor of another kind over this call's tensor
                    continue
                ptr = v.data_ptr()
                owner = _owner(regions, ptr)
                if owner is None:
                    return None  # made in the call with content, or inputs that overlap
                start, _, source, i = owner
                if fields is not None and (ptr != start or v.dtype != _tensor(
                        source, i, inputs, outputs, rec.scratch).dtype):
                    return None  # a descriptor over part of a tensor, or another type of it
                use = uses.setdefault((source, i), len(uses))
                slots.append((pos, use, ptr - start, fields))
                alignment.add((use, ptr - start, ptr % 16 == 0))
            # the template keeps no tensor of this call alive
            template = [None if isinstance(v, (torch.Tensor, TensorDescriptor)) else v
                        for v in values]
            launches.append((kernel, grid, template, tuple(slots)))
        if any((_OUTPUT, i) not in uses for i in range(len(outputs))):
            return None  # an output no launch writes: the full path fills it otherwise
        # the @triton.jit functions launched (not the torch calls' functions)
        fns = list({id(fn): fn for fn, _, grid, _ in rec.launches if grid is not None}.values())
        return cls(next(iter(rec.devices)),
                   [(t.shape, t.stride(), t.dtype, t.device) for t in outputs], single,
                   [(t.shape, t.dtype, t.device) for t in rec.scratch], list(uses),
                   sorted(alignment), fns, launches, stacks)

    @staticmethod
    def _torch_slots(values: tuple[Any, ...], regions: list[tuple[int, int, int, int]],
                     ends: dict[int, int], uses: dict[tuple[int, int], int],
                     inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
                     scratch: Sequence[torch.Tensor]
                     ) -> tuple[list[Any], tuple[tuple[Any, ...], ...]] | None:
        """(argument template, slots) of a torch call's arguments, or None where a tensor
        argument is not a view of one input, output or scratch buffer of the same dtype."""
        slots = []
        for pos, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                continue
            ptr = v.data_ptr()
            owner = _owner(regions, ptr)
            if owner is None:
                return None
            start, end, source, i = owner
            if source == _INPUT:
                end = max(end, ends.get(i, 0))
            base = _tensor(source, i, inputs, outputs, scratch)
            size = v.element_size()
            if (v.dtype != base.dtype or (ptr - start) % size
                    or ptr + _extent(v) > end):
                return None
            use = uses.setdefault((source, i), len(uses))
            slots.append((pos, use, (ptr - start) // size, tuple(v.shape), v.stride()))
        template = [None if isinstance(v, torch.Tensor) else v for v in values]
        return template, tuple(slots)

    def run(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        """The recorded call repeated on `inputs` (the same signature): its result, or None
        where the replay declines (see the module docstring)."""
        runtime, active, jit = triton_parts()
        if (hook_set(runtime.launch_enter_hook) or hook_set(runtime.launch_exit_hook)
                or launches_watched(jit) or any(fn.pre_run_hooks for fn in self.fns)
                or getattr(_local, "stack", None)):  # a recording open: its launches go there
            return None
        if active.get_current_device() != self.device:
            return None
        for stack in self.stacks:  # the inputs a launch reads as one stack are one still
            first = inputs[stack[0]]
            assert first is not None  # a stack is made of tensors only
            storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
            for i in stack:
                t = inputs[i]
                assert t is not None
                if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
                    return None
                offset += t.numel()
        outputs = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                   for shape, stride, dtype, device in self.outputs]
        scratch = [torch.empty(shape, dtype=dtype, device=device)
                   for shape, dtype, device in self.scratch]
        sources = (inputs, outputs, scratch)
        tensors = [sources[source][i] for source, i in self.uses]
        ptrs = [t.data_ptr() for t in tensors]
        for use, offset, aligned in self.alignment:
            if ((ptrs[use] + offset) % 16 == 0) != aligned:
                return None  # Triton would take another compiled kernel (and TMA another path)
        stream = active.get_current_stream(self.device)
        for kernel, grid, template, slots in self.launches:
            values = template.copy()
            if grid is None:  # a torch call, on views of the new tensors
                for pos, use, offset, shape, stride in slots:
                    t = tensors[use]
                    values[pos] = t.as_strided(shape, stride, t.storage_offset() + offset)
                kernel(*values[:-1], out=values[-1])
                continue
            g0, g1, g2 = grid
            for pos, use, offset, fields in slots:
                values[pos] = (ptrs[use] + offset if fields is None
                               else TensorDescriptor(tensors[use], **fields))
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None,
                       None, *values)
        self.runs += 1
        return outputs[0] if self.single else tuple(outputs)
