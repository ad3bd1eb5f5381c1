"""Launching compiled Triton kernels without Triton's per-call argument binding.

`kernel[grid](*args, **kwargs)` binds every argument in Python on every call: it specializes
each one (a tensor's dtype and 16-byte alignment, an integer's width, whether it is 1 or a
multiple of 16), builds the cache key and finds the compiled kernel. At decode sizes a
kernel's GPU time is a few microseconds, less than that binding, so a model's decode step is
bound by the CPU. `direct(kernel)[grid](*args, **kwargs)` means the same launch; it keeps each
compiled kernel under a key made of the same properties of the arguments (and the constexpr
values and launch options), so that a repeated call goes straight to the compiled kernel's
launcher with the current stream, as Triton's own `run` does after its lookup.

The first call of each key goes through Triton's path (which compiles where needed), and so
does every call where the short path cannot tell what Triton would do: under the interpreter,
with a pre-run hook, an argument that is not a tensor, number, bool, None or TMA descriptor,
or a Triton whose launch call is not the one this module was written against. A TMA
descriptor (`TensorDescriptor`) enters the key with everything it holds but its base's
address (its base's dtype and 16-byte alignment), more than Triton specializes on, and is
handed to the compiled kernel's launcher as Triton's own path hands it, which turns it into
the tensor map at every launch.
So does every call while something observes Triton's launches by replacing or wrapping
`JITFunction.run` (the tuner reads each config's registers and spills, and compiles without
running, that way; `_replay.launches_watched`): it sees every launch.

Each launch is also noted for `_replay`, which repeats a launcher's launches for a call
signature it has recorded (a TMA descriptor remade over the new call's tensor); a launch left
to Triton's path leaves the call without a replay.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from fusetune.kernels._replay import (
    hook_set,
    launches_watched,
    note_launch,
    note_unrecordable,
)

# Triton releases whose JITFunction.run ends in the launch call made below (read and checked
# against their sources): kernel.run(grid_0, grid_1, grid_2, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *bound argument values).
_SUPPORTED = ((3, 6), (3, 7), (3, 8), (3, 9))
_INT32 = (-(2**31), 2**31 - 1)
_MAX_KEYS = 512  # per kernel; more distinct launches than a model makes start the cache afresh


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor, *_ = triton.__version__.split(".")
    return int(major), int(minor)


class DirectLaunch:
    """jit_fn[grid](*args, **kwargs) with the compiled kernel looked up from the arguments'
    specialization (see the module's docstring). Use through `direct(jit_fn)`."""

    def __init__(self, fn: Any) -> None:
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self.fn = fn
        self._jit = JITFunction
        self.enabled = isinstance(fn, JITFunction) and _triton_version() in _SUPPORTED
        self.names: list[str] = list(getattr(fn, "arg_names", ()))
        self.defaults = {p.name: p.default for p in getattr(fn, "params", ())
                         if getattr(p, "has_default", False)}
        self.kernels: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}  # kernel, tail
        self._driver = driver
        self._knobs = knobs
        self.hits = 0  # calls that took the short path (for tests)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: int
             ) -> tuple[Any, ...] | None:
        """What Triton's binder specializes on, or None where an argument is of a kind the
        short path does not handle."""
        key: list[Any] = [device, *kwargs.items()]
        for a in args:
            kind = _KINDS.get(a.__class__)
            if kind is None:
                if not isinstance(a, torch.Tensor):
                    return None
                kind = _tensor_key
            key.append(kind(a))
        return tuple(key)

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> None:
        fn = self.fn
        if not self.enabled or fn.pre_run_hooks or launches_watched(self._jit):  # Triton's path
            note_unrecordable()
            fn[grid](*args, **kwargs)
            return
        active = self._driver.active
        device = active.get_current_device()
        key = self._key(args, kwargs, device)
        try:
            entry = self.kernels.get(key) if key is not None else None
        except TypeError:  # a value in the key that cannot be hashed: Triton's path
            key = entry = None
        if entry is None:
            kernel = fn[grid](*args, **kwargs)
            tail = self.names[len(args):]
            if (key is None or kernel is None
                    or not all(n in kwargs or n in self.defaults for n in tail)):
                note_unrecordable()
                return
            if len(self.kernels) >= _MAX_KEYS:
                self.kernels.clear()
                self.hits = 0
            # the keyword values are part of the key: the tail is fixed per entry
            entry = self.kernels[key] = (kernel, tuple(kwargs[n] if n in kwargs
                                                       else self.defaults[n] for n in tail))
            note_launch(device, fn, kernel, grid, args + entry[1])
            return
        kernel, tail = entry
        values = args + tail
        note_launch(device, fn, kernel, grid, values)
        stream = active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        runtime = self._knobs.runtime
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        if hook_set(enter) or hook_set(exit_):
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(grid, stream, *values), enter, exit_, *values)
        else:  # no hook to hand launch metadata to (Triton 3.6+ keeps empty hook chains)
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                       None, None, *values)
        self.hits += 1


def _tensor_key(a: torch.Tensor) -> tuple[Any, bool]:
    return a.dtype, a.data_ptr() % 16 == 0


def _descriptor_key(d: TensorDescriptor) -> tuple[Any, ...]:
    # every field (shape, strides, block shape, padding, ...), lists as tuples, the base
    # tensor by its dtype and alignment
    return (TensorDescriptor, *(
        (name, _tensor_key(v) if isinstance(v, torch.Tensor)
         else tuple(v) if isinstance(v, list) else v)
        for name, v in sorted(vars(d).items())))


def _int_key(a: int) -> Any:
    return 1 if a == 1 else (a % 16 == 0, _INT32[0] <= a <= _INT32[1], a < 2**63)


# How each argument type enters the key (Triton specializes on no float or bool value).
_KINDS: dict[type, Any] = {
    torch.Tensor: _tensor_key, torch.nn.Parameter: _tensor_key, int: _int_key,
    bool: lambda a: bool, float: lambda a: float, type(None): lambda a: None,
    TensorDescriptor: _descriptor_key,
}

_launchers: dict[int, DirectLaunch] = {}


def direct(fn: Any) -> Any:
    """The launcher of the @triton.jit function `fn`: indexing it by a grid and calling it
    launches as fn[grid](...) does. Under the interpreter (or for anything but a JITFunction,
    such as a test's stand-in) it is `fn` itself."""
    kept = _launchers.get(id(fn))  # by id: a JITFunction hashes its source on every call
    if kept is not None and kept.fn is fn:
        return kept
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        note_unrecordable()  # launched as it is, unseen by a replay
        return fn
    launcher = _launchers[id(fn)] = DirectLaunch(fn)
    return launcher
