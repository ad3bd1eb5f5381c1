"""`@fusetune.autotune`: any `@triton.jit` kernel, tuned offline by fusetune's tuner, launched
at run time with the config the tables hold for its key.

    @fusetune.autotune(space={...} or configs=[triton.Config(...)], key=["M", "N", "K"],
                       make_inputs=..., grid=..., reference=...)
    @triton.jit
    def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, ..., BLOCK_M: tl.constexpr, ...): ...

    matmul_kernel[grid](a, b, c, M, N, K, ...)  # as under @triton.autotune

The decorator makes the kernel a `KernelSpec` (`.spec`) like fusetune's own, so that `fusetune
search --kernel package.module:matmul_kernel` tunes it (Optuna over the space, pruning,
the correctness gate, crash isolation, resume, several GPUs, PostgreSQL) and `fusetune export`
writes its winners. A point is the key arguments' values (its dims), the dtype of the first
tensor argument (its dtype) and the dtypes of the other tensors where they differ (its
`weights` field); it has no rows, and the lookup answers only the exact key: a config tuned
for one key may not serve another.

At a call the config comes from the tables (loaded or FUSETUNE_TABLES, then the shipped ones
and the package's own `tables=`, then the per-user cache of configs tuned at run time); an
entry tuned for another version of the kernel's source is never served, one of another Triton
version as `other_triton` says. Where none answers, `on_miss` says what happens: "default"
(the default config, a warning naming the search command), "tune" (time the configs now on
the call's own arguments, check them, keep the fastest in the per-user cache: later processes
time nothing), or "error". FUSETUNE_NO_TUNE=1 turns "tune" into "default" everywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusetune import registry, runtime
from fusetune.spec import (
    TORCH_DTYPES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    check_fits,
)

ON_MISS = ("default", "tune", "error")
NO_TUNE_ENV = "FUSETUNE_NO_TUNE"
# Launch options a config may hold beside the kernel's constexprs.
LAUNCH_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# ‖out − ref‖ / ‖ref‖ allowed by default, by the dtype of the outputs' kernel (its first
# tensor): the built-ins' bounds for 16- and 32-bit floats; FP8 holds 3 mantissa bits; integer
# and boolean results must be exact.
DEFAULT_TOLERANCE: dict[str, float] = {
    "float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5, "float64": 1e-12,
    "float8_e4m3fn": 1.25e-1, "float8_e5m2": 2.5e-1, "float8_e4m3fnuz": 1.25e-1,
    "float8_e5m2fnuz": 2.5e-1}
TUNE_CONFIGS = 32  # configs a "tune now" of a product space times (a list is timed whole)
# Triton's autotune arguments that have no place here, and why.
_REFUSED = {
    "pre_hook": "a hook cannot be stored in a table; use reset_to_zero / restore_value",
    "post_hook": "a hook cannot be stored in a table; use reset_to_zero / restore_value",
    "warmup": "fusetune times configs with triton.testing.do_bench's own warm-up",
    "rep": "fusetune times configs with triton.testing.do_bench's own repetitions",
    "use_cuda_graph": "fusetune times short kernels as CUDA-graph replays by itself",
    "do_bench": "fusetune times with triton.testing.do_bench (L2 flushed)",
    "cache_results": "fusetune always keeps what it tuned (tables, the per-user cache)",
}


class NotTunedError(LookupError):
    """No table holds a config for a call of a kernel declared with on_miss="error"."""


@dataclasses.dataclass(frozen=True)
class _Options:
    configs: tuple[Config, ...] | None
    key: tuple[str, ...]
    prune_configs_by: Mapping[str, Any] | None
    reset_to_zero: tuple[str, ...]
    restore_value: tuple[str, ...]
    space: Mapping[str, Any] | str | Path | None
    make_inputs: Callable[..., Mapping[str, Any]] | None
    grid: Any
    reference: Callable[[dict[str, Any]], Mapping[str, Any]] | None
    name: str | None
    default: Any
    on_miss: str
    tables: tuple[str, ...]
    tolerance: float | Mapping[str, float] | None
    resources: Callable[[Config, Point], Resources] | None
    cost: Callable[[Point], Cost] | None
    source_objects: tuple[Any, ...]
    other_triton: str
    tune_configs: int


def autotune(configs: Sequence[Any] | None = None, key: Sequence[str] = (),
             prune_configs_by: Mapping[str, Any] | None = None,
             reset_to_zero: Sequence[str] | None = None,
             restore_value: Sequence[str] | None = None, *,
             space: Mapping[str, Any] | str | Path | None = None,
             make_inputs: Callable[..., Mapping[str, Any]] | None = None,
             grid: Any = None,
             reference: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
             name: str | None = None, default: Any = None, on_miss: str = "default",
             tables: Sequence[str | Path] = (),
             tolerance: float | Mapping[str, float] | None = None,
             resources: Callable[[Config, Point], Resources] | None = None,
             cost: Callable[[Point], Cost] | None = None,
             source_objects: Sequence[Any] = (), other_triton: str = "warn",
             tune_configs: int = TUNE_CONFIGS, **triton_only: Any
             ) -> Callable[[Any], TunedKernel]:
    """Declares a `@triton.jit` kernel for fusetune: a drop-in for `@triton.autotune`.

    Triton's arguments: `configs` (a list of `triton.Config`, or of dicts with num_warps and
    num_stages among their keys), `key` (the argument names whose values key the tables; they
    must be integers), `prune_configs_by` ({"early_config_prune": f(configs, named_args),
    "perf_model": f(**args), "top_k": n}: the early prune applies offline and at every call,
    the perf model to a "tune now" only), `reset_to_zero` and `restore_value` (arguments zeroed,
    or restored, before each launch a tuning makes).

    fusetune's own:
    - `space`: instead of `configs`, a search space (a mapping, or a YAML file's path relative
      to the kernel's module): `params` {name: {pow2: [lo, hi]} | {values: [...]} | {range:
      [lo, hi, step]}} and `constraints` (expressions over config keys and key arguments, e.g.
      "BLOCK_M * BLOCK_K <= 32768", or functions of (config, dims)). `configs` take
      constraints too: `space={"configs": [...], "constraints": [...]}`.
    - `make_inputs(**key_values, dtype, device)`: the kernel's arguments by name for an offline
      point (every argument the call passes, tensors and integers), and `grid`: the launch grid
      of those (a tuple, or a function of the arguments and the config as Triton's).
    - `reference(args)`: {output argument name: expected tensor}, the correctness gate (every
      candidate's outputs are compared with `tolerance`, ‖out − ref‖ / ‖ref‖; by default the
      dtype's, see DEFAULT_TOLERANCE). Without one, the first config's outputs are the
      reference, the outputs being the tensors its launch changed.
    - `name` (default: the function's), `default` (the config of a miss: a config, or a
      function of the key values; default: the first config, or the first of the space that
      its constraints and the GPU allow), `on_miss` ("default", "tune", "error"), `tables`
      (table files the kernel's package ships, relative to its module), `resources(config,
      point)` (a fusetune.Resources of one program: configs the GPU cannot hold are pruned
      before compiling; without it a config that does not fit fails to compile and is
      recorded so; `point.dim` holds the key values, `point.dtype` the first tensor's dtype),
      `cost(point)` (a fusetune.Cost: the roofline floor), `source_objects` (other code whose
      change invalidates the tuned entries; the `@triton.jit` functions the kernel calls by
      name are found by themselves), `other_triton` ("warn", "refuse", "ignore": entries tuned
      with another Triton version), `tune_configs` (configs a "tune now" of a space times).
    """
    if triton_only:
        reasons = "; ".join(f"{k}: {_REFUSED.get(k, 'not an argument of autotune')}"
                            for k in triton_only)
        raise TypeError(f"fusetune.autotune does not take {', '.join(triton_only)} ({reasons})")
    if on_miss not in ON_MISS:
        raise ValueError(f"on_miss={on_miss!r}; valid: {', '.join(ON_MISS)}")
    if other_triton not in ("warn", "refuse", "ignore"):
        raise ValueError(f"other_triton={other_triton!r}; valid: warn, refuse, ignore")
    if isinstance(key, str):
        raise TypeError(f"key={key!r}: a list of argument names, e.g. key=[{key!r}]")
    if configs is not None and space is not None:
        raise ValueError("give configs (a list) or space (a search space), not both; a space "
                         "may hold a list: space={'configs': [...], 'constraints': [...]}")
    if configs is None and space is None:
        raise ValueError("give configs=[triton.Config(...), ...] or space={'params': ...}")
    if make_inputs is not None and grid is None:
        raise ValueError("make_inputs needs grid: the launch grid of its arguments (a tuple, "
                         "or a function of the arguments and the config)")
    if not isinstance(tune_configs, int) or tune_configs < 1:
        raise ValueError(f"tune_configs={tune_configs!r} must be a positive integer")
    opts = _Options(
        configs=None if configs is None else tuple(_config_of(c, i) for i, c in enumerate(
            configs)),
        key=tuple(key), prune_configs_by=prune_configs_by,
        reset_to_zero=tuple(reset_to_zero or ()), restore_value=tuple(restore_value or ()),
        space=space, make_inputs=make_inputs, grid=grid, reference=reference, name=name,
        default=default, on_miss=on_miss, tables=tuple(str(t) for t in tables),
        tolerance=tolerance, resources=resources, cost=cost,
        source_objects=tuple(source_objects), other_triton=other_triton,
        tune_configs=tune_configs)

    def decorate(fn: Any) -> TunedKernel:
        return TunedKernel(fn, opts)

    return decorate


def _config_of(c: Any, i: int) -> Config:
    """A config as fusetune stores it (integers by name) from a triton.Config or a mapping."""
    if isinstance(c, Mapping):
        raw = dict(c)
    else:
        if getattr(c, "pre_hook", None) is not None:
            raise TypeError(f"configs[{i}] has a pre_hook: {_REFUSED['pre_hook']}")
        raw = dict(c.kwargs)
        for k in LAUNCH_KEYS:
            v = getattr(c, k, None)
            if v is not None and not (k == "num_ctas" and v == 1):
                raw[k] = v
    out: Config = {}
    for k, v in raw.items():
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, int):
            raise TypeError(f"configs[{i}]: {k}={v!r}: fusetune stores configs as integers "
                            "(a constexpr of another type belongs in the call's arguments)")
        out[str(k)] = v
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _is_tensor(v: Any) -> bool:
    return hasattr(v, "dtype") and hasattr(v, "data_ptr")


def signature(args: Mapping[str, Any], order: Sequence[str]) -> tuple[str, str, Any]:
    """(dtype, other dtypes, device) of a call's arguments: the first tensor's dtype, the
    distinct dtypes of the others that differ from it (comma-separated, in argument order;
    "" where all share it) and the first tensor's device."""
    tensors = [args[n] for n in order if n in args and _is_tensor(args[n])]
    if not tensors:
        raise TypeError("a kernel declared with fusetune.autotune takes at least one tensor: "
                        "its dtype is part of the key")
    first = _dtype_name(tensors[0].dtype)
    others: list[str] = []
    for t in tensors[1:]:
        name = _dtype_name(t.dtype)
        if name != first and name not in others:
            others.append(name)
    for name in (first, *others):
        if name not in TORCH_DTYPES:
            raise TypeError(f"tensor dtype {name}: fusetune keys on {', '.join(TORCH_DTYPES)}")
    weights = ",".join(others)
    if len(weights) > 32:
        raise TypeError(f"the tensors' dtypes {first},{weights} make too long a key (32 "
                        "characters for the others): convert some tensors beforehand")
    return first, weights, tensors[0].device


def _jit_dependencies(fn: Any) -> list[Any]:
    """The @triton.jit functions `fn` calls by a global name, and theirs: their source is the
    kernel's too."""
    out: list[Any] = []
    seen = {id(fn)}
    todo = [fn]
    while todo:
        f = todo.pop()
        py = getattr(f, "fn", f)
        try:
            names = inspect.getclosurevars(py).globals
        except TypeError:
            continue
        for v in names.values():
            if type(v).__name__ in ("JITFunction", "InterpretedFunction") and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
                todo.append(v)
    return out


class _Inputs(dict):  # type: ignore[type-arg]
    """A kernel's arguments by name for tuning, with what a launch restores (`restore`:
    name -> copy), zeroes (`zero`), the outputs checked (`outputs`) and the launch grid."""

    restore: dict[str, Any]
    zero: tuple[str, ...]
    outputs: tuple[str, ...]
    grid: Any


class TunedKernel:
    """A `@triton.jit` kernel declared with `fusetune.autotune`: launch it as `kernel[grid](
    *args, **kwargs)` (Triton's syntax); `spec` is its KernelSpec; `fn` the JIT function."""

    def __init__(self, fn: Any, opts: _Options) -> None:
        if not hasattr(fn, "arg_names") or not hasattr(fn, "run"):
            raise TypeError(f"fusetune.autotune decorates a @triton.jit function, got "
                            f"{type(fn).__name__} (put @fusetune.autotune above @triton.jit)")
        self.fn = fn
        self.opts = opts
        self.arg_names: list[str] = list(fn.arg_names)
        py = getattr(fn, "fn", fn)
        self.__name__ = py.__name__
        self.__doc__ = py.__doc__
        self.__module__ = py.__module__
        for what, names in (("key", opts.key), ("reset_to_zero", opts.reset_to_zero),
                            ("restore_value", opts.restore_value)):
            bad = [n for n in names if n not in self.arg_names]
            if bad:
                raise ValueError(f"{self.__name__}: {what} names {', '.join(bad)}, which "
                                 f"are not its arguments ({', '.join(self.arg_names)})")
        self._memo: dict[tuple[Any, ...], Config] = {}
        self._generation = -1  # runtime.generation() of the lookups in _memo
        self._lock = threading.Lock()
        self._kept: dict[Point, set[tuple[tuple[str, int], ...]]] = {}
        self.tuned_now = 0  # configs this process timed for this kernel at run time
        self.spec = self._build_spec()
        registry.declare(self.spec)
        # Hashed now, with the module's import: the first call of a shape only looks up.
        _ = self.spec.source_hash
        if opts.tables:  # read with the shipped tables, at the first lookup that needs them
            base = self._module_dir()
            runtime.add_package_tables(self.spec.name, tuple(
                str(p if Path(p).is_absolute() else base / p) for p in opts.tables))

    # -- the spec --------------------------------------------------------------------------

    def _module_dir(self) -> Path:
        import sys

        module = sys.modules.get(self.__module__)
        file = getattr(module, "__file__", None)
        return Path(file).parent if file else Path.cwd()

    def _space_data(self) -> Mapping[str, Any]:
        opts = self.opts
        if opts.configs is not None:
            return {"configs": [dict(c) for c in opts.configs]}
        if isinstance(opts.space, (str, Path)):
            import yaml

            p = Path(opts.space)
            p = p if p.is_absolute() else self._module_dir() / p
            try:
                data = yaml.safe_load(p.read_text())
            except (OSError, yaml.YAMLError) as e:
                raise ValueError(f"{self.__name__}: space {str(p)!r}: {e}") from None
            return data
        assert opts.space is not None
        return opts.space

    def _build_spec(self) -> KernelSpec:
        from fusetune.tuner.space import parse_space_data

        opts = self.opts
        name = opts.name or self.__name__
        registry.check_name(name)
        data = self._space_data()
        if not isinstance(data, Mapping):
            raise ValueError(f"{name}: a space is a mapping (params or configs), got {data!r}")
        keys, values, pow2 = self._config_keys(name, data)
        clash = [k for k in keys if k in opts.key or (k in self.arg_names and k in LAUNCH_KEYS)]
        if clash:
            raise ValueError(f"{name}: {', '.join(clash)} cannot be both a key argument and "
                             "a config key")
        flags = {k: 0 for k in keys if 0 in values[k] and set(values[k]) <= {0, 1}}
        tolerance = self._tolerance(name)
        spec = KernelSpec(
            name=name, description=f"{self.__name__} ({self.__module__}), declared with "
                                   "fusetune.autotune",
            dim_names=tuple(sorted(opts.key)), config_keys=keys, pow2_keys=pow2,
            make_inputs=self._make_inputs, make_outputs=self._make_outputs,
            reference=self._reference, launch=self._launch,
            default_config=self._default_config, resources=self._resources, cost=self._cost,
            canonical=lambda c, p: dict(c), dims_from_model=self._dims_from_model,
            tolerance=tolerance,
            source_objects=(self.fn, *_jit_dependencies(self.fn), *opts.source_objects),
            flags=flags, ref=f"{self.__module__}:{self.__name__}", space=data,
            dtypes=TORCH_DTYPES, rows=False, signature=self._signature_of,
            other_triton=opts.other_triton)
        self._space = parse_space_data(data, spec, f"{name} (its declared space)")
        return spec

    def _config_keys(self, name: str, data: Mapping[str, Any]
                     ) -> tuple[tuple[str, ...], dict[str, set[int]], tuple[str, ...]]:
        """(config keys, each key's values, the pow2 keys) of a declared space."""
        values: dict[str, set[int]] = {}
        pow2: list[str] = []
        if "configs" in data:
            configs = [_config_of(c, i) for i, c in enumerate(data["configs"] or [])]
            if not configs:
                raise ValueError(f"{name}: configs is empty")
            keys = tuple(configs[0])
            for i, c in enumerate(configs):
                if set(c) != set(keys):
                    raise ValueError(f"{name}: configs[{i}] has keys {', '.join(c)}, "
                                     f"configs[0] {', '.join(keys)}: every config sets the "
                                     "same keys")
                for k, v in c.items():
                    values.setdefault(k, set()).add(v)
            return keys, values, ()
        params = data.get("params")
        if not isinstance(params, Mapping) or not params:
            raise ValueError(f"{name}: a space needs params (name -> values) or configs")
        for k, body in params.items():
            got: set[int] = set()
            if isinstance(body, Mapping) and len(body) == 1:
                ((kind, arg),) = body.items()
                if kind == "values" and isinstance(arg, list):
                    got = {v for v in arg if isinstance(v, int)}
                if kind == "pow2":
                    pow2.append(str(k))
            values[str(k)] = got
        return tuple(str(k) for k in params), values, tuple(pow2)

    def _tolerance(self, name: str) -> dict[str, float]:
        tol = self.opts.tolerance
        base = {d: DEFAULT_TOLERANCE.get(d, 0.0) for d in TORCH_DTYPES}
        if tol is None:
            return base
        if isinstance(tol, Mapping):
            unknown = [d for d in tol if d not in TORCH_DTYPES]
            if unknown:
                raise ValueError(f"{name}: tolerance for {', '.join(unknown)}; dtypes: "
                                 f"{', '.join(TORCH_DTYPES)}")
            return {**base, **{d: float(v) for d, v in tol.items()}}
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
            raise ValueError(f"{name}: tolerance={tol!r} must be a number >= 0 or a mapping "
                             "of dtype to number")
        return dict.fromkeys(TORCH_DTYPES, float(tol))

    def _dims_from_model(self, model: Any) -> dict[str, int]:
        raise ValueError(f"{self.spec.name} is keyed by its arguments "
                         f"{', '.join(self.opts.key)}: give their values as --dims, not --model")

    def _call_make_inputs(self, point: Point, device: Any) -> dict[str, Any]:
        import torch

        if self.opts.make_inputs is None:
            raise ValueError(f"{self.spec.name}: no make_inputs: it can be tuned at run time "
                             "(on_miss='tune') but not offline; declare make_inputs and grid")
        args = self.opts.make_inputs(**point.dim, dtype=getattr(torch, point.dtype),
                                     device=device)
        if not isinstance(args, Mapping):
            raise TypeError(f"{self.spec.name}: make_inputs returned {type(args).__name__}, "
                            "expected a mapping of argument name to value")
        unknown = [k for k in args if k not in self.arg_names]
        if unknown:
            raise ValueError(f"{self.spec.name}: make_inputs gave {', '.join(unknown)}, which "
                             f"are not the kernel's arguments ({', '.join(self.arg_names)})")
        for k in self.opts.key:
            if k not in args:
                raise ValueError(f"{self.spec.name}: make_inputs gave no {k} (a key argument)")
            if _key_value(args, k, self.spec.name) != point.dim[k]:
                raise ValueError(f"{self.spec.name}: make_inputs(**{point.dim}) gave "
                                 f"{k}={args[k]!r}")
        return dict(args)

    def _signature_of(self, point: Point) -> str:
        """The other dtypes of `point`'s inputs (its Point.weights), from make_inputs on the
        meta device (no memory; on the CPU where make_inputs needs real tensors)."""
        try:
            args = self._call_make_inputs(point, "meta")
        except (RuntimeError, NotImplementedError):
            args = self._call_make_inputs(point, "cpu")
        dtype, weights, _ = signature(args, self.arg_names)
        if dtype != point.dtype:
            raise ValueError(f"{self.spec.name}: make_inputs(dtype={point.dtype}) made the "
                             f"first tensor {dtype}: the first tensor's dtype is the point's")
        return weights

    def _make_inputs(self, point: Point, device: Any) -> Tensors:
        args = self._call_make_inputs(point, device)
        dtype, weights, _ = signature(args, self.arg_names)
        if (dtype, weights) != (point.dtype, point.weights):
            raise ValueError(f"{self.spec.name}: make_inputs made tensors of {dtype} (others "
                             f"{weights or 'the same'}), the point is {point.dtype} (others "
                             f"{point.weights or 'the same'})")
        return self._inputs(args, self.opts.grid)

    def _inputs(self, args: Mapping[str, Any], grid: Any) -> _Inputs:
        inputs = _Inputs(args)
        inputs.restore = {n: args[n].clone() for n in self.opts.restore_value if n in args}
        inputs.zero = tuple(n for n in self.opts.reset_to_zero if n in args)
        inputs.outputs = ()
        inputs.grid = grid
        return inputs

    def _run(self, inputs: _Inputs, config: Mapping[str, int]) -> None:
        for n, saved in inputs.restore.items():
            inputs[n].copy_(saved)
        for n in inputs.zero:
            inputs[n].zero_()
        self.fn.run(grid=inputs.grid, warmup=False, **inputs, **config)

    def _launch(self, inputs: Tensors, outputs: Tensors, config: Config) -> None:
        assert isinstance(inputs, _Inputs)
        self._run(inputs, config)

    def _reference(self, inputs: Tensors) -> Tensors:
        import torch

        assert isinstance(inputs, _Inputs)
        name = self.spec.name
        if self.opts.reference is not None:
            ref = self.opts.reference(dict(inputs))
            if not isinstance(ref, Mapping) or not ref:
                raise TypeError(f"{name}: reference returned {ref!r}, expected a mapping of "
                                "output argument name to expected tensor")
            bad = [k for k in ref if k not in inputs or not _is_tensor(inputs[k])]
            if bad:
                raise ValueError(f"{name}: reference names {', '.join(map(str, bad))}, which "
                                 "are not tensor arguments: it returns the outputs by name")
            inputs.outputs = tuple(ref)
            return dict(ref)
        # The first config's outputs: the tensors its launch changes.
        tensors = {n: v for n, v in inputs.items() if _is_tensor(v)}
        before = {n: t.clone() for n, t in tensors.items()}
        config = self._first_config({k: inputs[k] for k in self.opts.key})
        try:
            self._run(inputs, config)
        except Exception as e:
            raise RuntimeError(f"{name}: the reference run (the first config, {config}) "
                               f"failed: {type(e).__name__}: {e}; give reference= or put a "
                               "config that runs first") from None
        changed = [n for n, t in tensors.items() if not _same_bits(before[n], t)]
        if not changed:
            raise ValueError(f"{name}: the first config's launch changed no tensor argument: "
                             "give reference= naming the outputs")
        ref = {n: tensors[n].clone() for n in changed}
        for n, t in tensors.items():
            t.copy_(before[n])
        inputs.outputs = tuple(changed)
        if tensors and next(iter(tensors.values())).device.type == "cuda":
            torch.cuda.synchronize()
        return ref

    def _make_outputs(self, inputs: Tensors) -> Tensors:
        assert isinstance(inputs, _Inputs)
        return {n: inputs[n] for n in inputs.outputs}

    def _first_config(self, dims: Mapping[str, int]) -> Config:
        if self.opts.default is not None:
            return self._given_default(dims)
        for c in self._space.configs():
            if self._space.violated(c, dims) is None:
                return c
        return next(self._space.configs())

    def _given_default(self, dims: Mapping[str, int]) -> Config:
        d = self.opts.default
        raw = d(dict(dims)) if callable(d) else d
        return self.spec.validate_config(_config_of(raw, 0), where=f"{self.spec.name}: default")

    def _default_config(self, point: Point, gpu: Any) -> Config:
        if self.opts.default is not None:
            return self._given_default(point.dim)
        for c in self._space.configs():
            if self._space.violated(c, point.dim) is None and check_fits(
                    self._resources(c, point), gpu) is None:
                return c
        return self._first_config(point.dim)

    def _resources(self, config: Config, point: Point) -> Resources:
        unfit = ""
        early = (self.opts.prune_configs_by or {}).get("early_config_prune")
        # Offline, at a point's made arguments (at a call, config_for and _candidates apply
        # it to the call's own).
        if early is not None and self.opts.make_inputs is not None \
                and _items(config) not in self._kept_at(point, early):
            unfit = "prune_configs_by: early_config_prune leaves it out at this point"
        if self.opts.resources is not None:
            res = self.opts.resources(dict(config), point)
            if not isinstance(res, Resources):
                raise TypeError(f"{self.spec.name}: resources returned "
                                f"{type(res).__name__}, expected fusetune.spec.Resources")
            return dataclasses.replace(res, unfit=unfit) if unfit else res
        return Resources(0, 0, 32 * config.get("num_warps", 4), unfit=unfit)

    def _kept_at(self, point: Point, early: Callable[..., Any]
                 ) -> set[tuple[tuple[str, int], ...]]:
        """The configs of the space the early prune keeps at `point` (its arguments made on
        the meta device)."""
        if point not in self._kept:
            try:
                args = self._call_make_inputs(point, "meta")
            except (RuntimeError, NotImplementedError):
                args = self._call_make_inputs(point, "cpu")
            self._kept[point] = {_items(c) for c in _kept(early, list(self._space.configs()),
                                                          args)}
        return self._kept[point]

    def _cost(self, point: Point) -> Cost:
        if self.opts.cost is None:
            return Cost(0, 0)
        return self.opts.cost(point)

    # -- a call ---------------------------------------------------------------------------

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> Any:
        return self.run(*args, grid=grid, warmup=True, **kwargs)

    def run(self, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> Any:
        """Launches the kernel with the config the tables hold for these arguments' key."""
        nargs = dict(zip(self.arg_names, args, strict=False))  # defaults may be left out
        nargs.update(kwargs)
        config = self.config_for(nargs, grid)
        clash = [k for k in config if k in kwargs]
        if clash:
            raise ValueError(f"{self.spec.name}: {', '.join(clash)} given by the call and by "
                             "the tuned config: leave the config's keys to the tables")
        return self.fn.run(*args, grid=grid, warmup=warmup, **kwargs, **config)

    def config_for(self, nargs: Mapping[str, Any], grid: Any = None) -> Config:
        """The config a call with these arguments (by name) launches with."""
        name = self.spec.name
        dims = tuple(sorted((k, _key_value(nargs, k, name)) for k in self.opts.key))
        dtype, weights, device = signature(nargs, self.arg_names)
        memo = (dims, dtype, weights, str(device))
        if self._generation != runtime.generation():  # other tables now: look up again
            self._memo.clear()
            self._generation = runtime.generation()
        config = self._memo.get(memo)
        if config is None:
            with self._lock:
                config = self._memo.get(memo)
                if config is None:
                    config = self._memo[memo] = self._resolve(nargs, grid, dims, dtype,
                                                              weights, device)
        early = (self.opts.prune_configs_by or {}).get("early_config_prune")
        if early is not None and not _kept(early, [config], nargs):
            raise ValueError(
                f"{name}: the config for {dict(dims)} ({config}) is one that "
                "prune_configs_by's early_config_prune leaves out for these arguments: what it "
                "prunes by is not in key, so one entry cannot serve them all; add those "
                "arguments to key")
        return config

    def _resolve(self, nargs: Mapping[str, Any], grid: Any, dims: tuple[tuple[str, int], ...],
                 dtype: str, weights: str, device: Any) -> Config:
        res = runtime.resolve(self.spec, dict(dims), dtype, rows=1, weights=weights,
                              device=device, warn=False)
        if res.source != "default":
            return dict(res.config)
        gpu = runtime.gpu_for_device(device)
        command = runtime._search_command(self.spec, dims, dtype, 1, weights, gpu)
        what = f"{self.spec.name} on {gpu.name} ({', '.join(f'{k}={v}' for k, v in dims)}, " \
               f"{dtype}{', others ' + weights if weights else ''})"
        policy = self.opts.on_miss
        if policy == "error":
            raise NotTunedError(f"fusetune: no tuned config for {what}. Tune it with "
                                f"`{command}` and load the exported table "
                                "(fusetune.load_tables or FUSETUNE_TABLES), or declare the "
                                "kernel with on_miss='default' or 'tune'")
        if policy == "tune" and os.environ.get(NO_TUNE_ENV, "") not in ("", "0"):
            policy = "default"
            why = f"{NO_TUNE_ENV} is set: no tuning at run time"
        else:
            why = "on_miss='default'"
        if policy == "tune":
            return self._tune_now(nargs, grid, dims, dtype, weights, device, gpu)
        warnings.warn(f"fusetune: no tuned config for {what}: using the default config "
                      f"{res.config} ({why}). Tune it with `{command}` and load the exported "
                      "table with fusetune.load_tables() or FUSETUNE_TABLES.",
                      runtime.FusetuneWarning, stacklevel=runtime._caller_stacklevel())
        return dict(res.config)

    def _candidates(self, point: Point, nargs: Mapping[str, Any], gpu: Any) -> list[Config]:
        """What a "tune now" times: every config of a list (the perf model's top_k, where
        given), or the default and a sample of a space; each allowed by the constraints, the
        GPU's limits and the early prune."""
        space = self._space
        early = (self.opts.prune_configs_by or {}).get("early_config_prune")

        def allowed(c: Config) -> bool:
            return space.violated(c, point.dim) is None and check_fits(
                self._resources(c, point), gpu) is None

        if space.choices is not None:
            configs = [c for c in space.configs() if allowed(c)]
        else:
            default = self._default_config(point, gpu)
            rng = random.Random(0)
            configs = [default]
            pool = [c for c in space.configs() if allowed(c) and c != default]
            configs += rng.sample(pool, min(len(pool), self.opts.tune_configs - 1))
        if early is not None:
            configs = _kept(early, configs, nargs)
        prune = self.opts.prune_configs_by or {}
        if prune.get("perf_model") is not None and prune.get("top_k"):
            top_k = prune["top_k"]
            n = int(len(configs) * top_k) if isinstance(top_k, float) and top_k <= 1 else top_k
            configs = sorted(configs, key=lambda c: prune["perf_model"](**nargs, **c))[:max(n, 1)]
        return configs

    def _tune_now(self, nargs: Mapping[str, Any], grid: Any, dims: tuple[tuple[str, int], ...],
                  dtype: str, weights: str, device: Any, gpu: Any) -> Config:
        """Times and checks the candidates on the call's own arguments, keeps the fastest in
        the per-user cache, restores the arguments as the call had them."""
        import torch
        import triton

        from fusetune import tuned_cache
        from fusetune.gpus import UnknownGpuError, resolve
        from fusetune.tuner.bench import Evaluator

        point = Point(self.spec.name, dims, 1, 1, dtype, weights)
        if grid is None:
            raise ValueError(f"{self.spec.name}: tuning now needs the call's grid "
                             "(kernel[grid](...))")
        inputs = self._inputs(nargs, grid)
        # Every tensor as the call passed it: the tuning launches write into them.
        saved = {n: v.clone() for n, v in nargs.items() if _is_tensor(v)}
        spec = dataclasses.replace(self.spec, make_inputs=lambda p, d: inputs)
        backend = "cuda" if torch.device(device).type == "cuda" else "interpreter"
        failures: dict[str, str] = {}
        best: tuple[float, Config] | None = None
        try:
            evaluator = Evaluator(spec, point, backend, device)
            for config in self._candidates(point, nargs, gpu):
                out = evaluator.evaluate(config)
                self.tuned_now += 1
                if out.ok and out.time_us is not None:
                    if best is None or out.time_us < best[0]:
                        best = (out.time_us, config)
                else:
                    failures[str(config)] = f"{out.status}: {out.reason}"
        finally:
            for n, t in saved.items():
                nargs[n].copy_(t)
        if best is None:
            detail = "; ".join(f"{c}: {why}" for c, why in list(failures.items())[:5])
            raise RuntimeError(f"{self.spec.name}: no config ran correctly for "
                               f"{dict(dims)} ({detail})")
        time_us, config = best
        entry: dict[str, Any] = {"dims": dict(dims), "dtype": dtype}
        if weights:
            entry["weights"] = weights
        entry.update(batch=1, seq=1, config=dict(config), time_us=round(time_us, 3),
                     triton=str(triton.__version__), torch=str(torch.__version__),
                     backend=backend, source=self.spec.source_hash)
        try:
            resolve(gpu.name)
            catalogued = True
        except UnknownGpuError:
            catalogued = False
        tuned_cache.add(gpu.name, self.spec.name, entry, catalogued)
        runtime.forget_tuned()
        return dict(config)


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bits (NaN equal to itself)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _items(config: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(config.items()))


def _key_value(args: Mapping[str, Any], k: str, name: str) -> int:
    if k not in args:
        raise TypeError(f"{name}: the key argument {k!r} was not passed")
    v = args[k]
    if isinstance(v, bool):
        return int(v)
    if not isinstance(v, int):
        raise TypeError(f"{name}: the key argument {k}={v!r} is a {type(v).__name__}: a key "
                        "names integer arguments (sizes, switches), whose values select the "
                        "table entry")
    if v < 0:
        raise ValueError(f"{name}: the key argument {k}={v} is negative")
    return v


def _kept(early: Callable[..., Any], configs: Sequence[Config], args: Mapping[str, Any]
          ) -> list[Config]:
    """The configs prune_configs_by's early_config_prune keeps for `args` (it takes and
    returns triton.Config objects: compared as Triton fills them in)."""
    triton_configs = _triton_configs(configs)
    kept = {_items(_config_of(c, i)) for i, c in enumerate(early(triton_configs, dict(args)))}
    return [c for c, t in zip(configs, triton_configs, strict=True)
            if _items(_config_of(t, 0)) in kept]


def _triton_configs(configs: Sequence[Mapping[str, int]]) -> list[Any]:
    """triton.Config objects of fusetune configs (for prune_configs_by's functions)."""
    import triton

    out = []
    for c in configs:
        kwargs = {k: v for k, v in c.items() if k not in LAUNCH_KEYS}
        launch = {k: v for k, v in c.items() if k in LAUNCH_KEYS}
        out.append(triton.Config(kwargs, **launch))
    return out
