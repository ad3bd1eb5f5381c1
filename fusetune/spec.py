"""What the tuner, the tables and the runtime need from any kernel: `KernelSpec`.

A kernel module builds one `KernelSpec`; the registry in `fusetune.kernels` maps names to them.
Nothing here imports the tuner, the database or the tables: the arrows point from them to here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fusetune.gpus import GpuSpec
    from fusetune.models import ModelPreset

Config = dict[str, int]
Tensors = dict[str, Any]

DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
# The torch dtypes a kernel declared with fusetune.autotune may take or key on, by name.
TORCH_DTYPES: tuple[str, ...] = (
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8", "int16", "int32", "int64", "bool")

# Weight formats a point can have besides "" (weights in the activations' dtype): FP8 with one
# float32 scale per output channel (fusetune.quantize_fp8).
WEIGHT_FORMATS: tuple[str, ...] = ("fp8-e4m3", "fp8-e5m2")
# What `fusetune search --weights` accepts: the FP8 formats, or the 16-bit type of the
# activations (the kernels read other weights in x's dtype), which means Point.weights "".
WEIGHT_CHOICES: tuple[str, ...] = (*WEIGHT_FORMATS, "fp16", "bf16")
_SIXTEEN_BIT = {"fp16": "float16", "bf16": "bfloat16"}
# How the activations enter a matmul with FP8 weights besides "" (in their own 16-bit dtype:
# weight-only FP8, what FP8 weights mean unless the caller asks for more): "fp8", rounded to
# e4m3 with one scale per row and multiplied by the weights on the FP8 tensor cores. A mode
# changes the results, so it is the caller's choice and part of every key, never a tunable.
ACTIVATION_MODES: tuple[str, ...] = ("fp8",)


_DEF = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]", re.MULTILINE)


class ConfigError(ValueError):
    """A launch configuration that does not fit the kernel (unknown key, bad value)."""


@dataclass(frozen=True)
class Point:
    """One tuning point: a kernel at fixed model dims, batch, sequence length and dtype.

    `weights` is the weight storage format for kernels that have weights ("" means "same as the
    activations"); it is part of every key so that FP8 weights never share entries with fp16.
    `activations` is how FP8 weights meet the activations ("": in their dtype; "fp8": rounded
    to FP8, see ACTIVATION_MODES), part of every key too: the two modes give other results.
    """

    kernel: str
    dims: tuple[tuple[str, int], ...]
    batch: int
    seq: int
    dtype: str
    weights: str = ""
    activations: str = ""

    @staticmethod
    def make(
        kernel: str, dims: Mapping[str, int], batch: int, seq: int, dtype: str, weights: str = "",
        activations: str = "",
    ) -> Point:
        return Point(kernel, tuple(sorted(dims.items())), batch, seq, dtype, weights, activations)

    @property
    def fp8_activations(self) -> bool:
        return self.activations == "fp8"

    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def rows(self) -> int:
        """Number of token rows the kernel processes (batch × seq)."""
        return self.batch * self.seq

    @property
    def dims_label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.dims)

    @property
    def label(self) -> str:
        w = f" w={self.weights}" if self.weights else ""
        a = f" a={self.activations}" if self.activations else ""
        return f"{self.kernel} {self.dims_label} b={self.batch} s={self.seq} {self.dtype}{w}{a}"


def point_weights(fmt: str, dtype: str) -> str:
    """`Point.weights` for the weight format `fmt` (one of WEIGHT_CHOICES) at activation dtype
    `dtype`: the FP8 formats as they are; "fp16"/"bf16" only with float16/bfloat16 activations,
    as "" (weights in the activations' dtype: one key for both spellings)."""
    if fmt in WEIGHT_FORMATS:
        return fmt
    if fmt not in _SIXTEEN_BIT:
        raise ValueError(f"unknown weight format {fmt!r}; valid: {', '.join(WEIGHT_CHOICES)}")
    if _SIXTEEN_BIT[fmt] != dtype:
        raise ValueError(f"weights {fmt} with {dtype} activations: weights other than FP8 are "
                         f"read in the activations' dtype; use {fmt} with "
                         f"{_SIXTEEN_BIT[fmt]} only, or one of {', '.join(WEIGHT_FORMATS)}")
    return ""


def point_activations(mode: str | None, weights: str) -> str:
    """`Point.activations` for the activation mode `mode` ("fp8", or None / "" / "16bit" for the
    activations' own dtype) with weights `weights` (Point.weights); FP8 activations only beside
    FP8 weights."""
    if mode in (None, "", "16bit"):
        return ""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"unknown activation mode {mode!r}; valid: 16bit (the activations' "
                         f"dtype), {', '.join(ACTIVATION_MODES)}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"activations {mode!r} need FP8 weights ({', '.join(WEIGHT_FORMATS)}); "
                         f"the weights are {weights or 'in the activations dtype'}")
    return mode


@dataclass(frozen=True)
class Resources:
    """Predicted per-program resources of a compiled config (for pruning before compiling)."""

    smem_bytes: int
    regs_per_thread: int
    threads: int
    fp8_mma: bool = False  # FP8 activations: need Triton's FP8 types and FP8 tensor cores
    tma: bool = False  # tiles read through TMA descriptors: needs compute capability 9.0+
    pdl: bool = False  # a programmatic dependent launch (griddepcontrol): compute capability 9.0+
    unfit: str = ""  # why the config's structure cannot serve the point at all ("name: ...")
    # Of regs_per_thread, values used once a step that the compiler may keep in local memory
    # (served by the L1) where the registers run out: they count only up to what a block's
    # register file leaves the others.
    spill_regs: int = 0


@dataclass(frozen=True)
class Cost:
    """What any implementation must do: bytes through device memory and floating-point ops."""

    bytes: int
    flops: int

    def floor_us(self, bandwidth_gbs: float | None, peak_tflops: float | None) -> float | None:
        """Roofline floor in µs: the larger of bytes/bandwidth and flops/peak."""
        times = []
        if bandwidth_gbs:
            times.append(self.bytes / (bandwidth_gbs * 1e9) * 1e6)
        if peak_tflops and self.flops:
            times.append(self.flops / (peak_tflops * 1e12) * 1e6)
        return max(times) if times else None


def _source_hash(objects: tuple[Any, ...]) -> str:
    h = hashlib.sha256()
    for obj in objects:
        fn = getattr(obj, "fn", obj)  # a triton JITFunction keeps the Python function in .fn
        src = inspect.getsource(fn)
        # From its `def` on: the decorators (@fusetune.autotune's arguments: its space, its
        # tables) choose among configs, they do not change what a config computes.
        start = _DEF.search(src)
        h.update((src[start.start():] if start else src).encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class KernelSpec:
    """Everything the rest of fusetune knows about one kernel.

    - `make_inputs(point, device)`: realistic random inputs (never zeros), plus scalars.
    - `make_outputs(inputs)`: freshly allocated output tensors.
    - `reference(inputs)`: the torch formula in float32; returns outputs by name.
    - `launch(inputs, outputs, config)`: the Triton launch with exactly this config.
    - `default_config(point, gpu)`: a heuristic that works everywhere.
    - `resources(config, point)`: predicted smem / registers / threads of one program.
    - `cost(point)`: bytes and flops of the roofline floor.
    - `canonical(config, point)`: maps configs that compile to the same kernel onto one.
    - `dims_from_model(preset)`: this kernel's dims for a model preset.
    - `flags`: config keys whose value is 0 or 1, with the value a config that leaves them out
      means (tables and configs written before the key existed stay valid).
    - `same_as`: config keys whose value 0 (or leaving them out) means the value of the key
      they name (moe's DOWN_N: its second launch's column tile, 0: BLOCK_N's); any other value
      is a positive integer as for the other keys.
    - `weight_formats`: the Point.weights values besides "" that `make_inputs` can build.
    - `activation_modes`: the Point.activations values besides "" the kernel can run, with
      `activation_tolerance`, the tolerance of those modes per activation dtype (FP8
      activations round the inputs of every product: one looser bound for every config).
    - `row_reach`: a table entry tuned for R rows serves a lookup of r rows only where
      R < row_reach · r (None: any r <= R); see `runtime._covering`.
    - `padding(config, point)`: the share of the config's tile work that is masked off at the
      point (tiles rounded up past the matrix); the lookup carries a config to other dims only
      where it does not grow (None: no such check).
    - `one_row_structure`: one row has a structure of its own (the matmul kernels' BLOCK_M = 1,
      which serves one row only): a one-row lookup carries a config over from other dims only
      from their one-row entries, and only from those that share `one_row_same` (the matmuls'
      K width: the one-row loop's BLOCK_K, SPLIT_K and UNROLL_K split that width).
    - `carry_same`: dims a tuned entry must share with a point to lend it its config (qkv's
      head_dim and pairing: its tiles map onto the heads' rotation pairs; rmsnorm_bwd's only
      dim, so that it lends to no other dims).
    - `structure(config, point)`: what of the kernel's structure a config takes at a point
      that depends on the point (rmsnorm: whether a row fits one block, or is walked in
      passes); the lookup carries a config to other dims only where its structure there is
      the one it was tuned with (None: no such check).
    - `algorithm_keys`: flags of config_keys that choose another way to compute the result
      rather than tune one (the matmul kernels' UNFUSED): every search tries each of them,
      from the default config, right after the default.
    - `algorithm_sources`: those of source_objects that only configs of another algorithm
      (an algorithm key set) run: a config of the kernel's own code is served with the hash of
      the other sources (config_source_hash), so a change to these alone leaves its entries.
    - `structure_sources`: (runs, sources) pairs within the kernel's own code: the sources only
      configs for which runs(config) holds run (moe's per-pair GEMV launches, its grouped
      tiles); a config's hash leaves out those of the structures it does not run, so a change
      to one structure leaves the entries of the others.
    - `unfused_form`: what an UNFUSED = 1 config runs, in words (for `show` and the search's
      tables).
    - `dim_choices`: the dims that take one of a few values rather than size something (the
      switches, such as qkv's interleaved and qk_norm; ffn's activation), each value with what
      it means; every other dim of a built-in kernel is a size, at least 1 (`dims_problem`).
    - `check_dims(dims)`: what is wrong with a point's dims taken together (all of them, an
      optional one at its default where left out), in words, or None: qkv's head_dim must be
      even, moe's top_k at most its experts.
    - `optional_dims`: dims beside dim_names with a default (qkv's qk_norm: 0), which points,
      tables and lookups leave out at that value (`short_dims`): tables from before the kernel
      gained the argument keep their keys.
    - `default_rows`: the row counts `search` tunes the kernel at where no rows are given (no
      --batch, --seq, --rows, --max-batch or --prefill), each a point of that batch and seq 1;
      empty: those of the search's grid (`search --kernel K`) or of the model's path
      (`--kernel all`). moe's: the token counts a server hands one layer, decode (a few
      pairs an expert, most experts idle) to prefill (thousands), whose best structures differ.

    What a kernel declared with `fusetune.autotune` (or any kernel outside fusetune) sets
    besides, where the built-ins keep the defaults:
    - `ref`: how `fusetune.kernels.get_spec` finds the kernel in another process (a worker):
      "package.module:attribute", or the name of an entry point of the group
      `fusetune.kernels` ("": the kernel's name, for the built-ins).
    - `space`: the search space as data (`fusetune.tuner.space.parse_space_data`), used where
      no `--space` file is given (None: the shipped `search_spaces/NAME.yaml`).
    - `dtypes`: the values a point's dtype may take (the dtype of the kernel's first tensor).
    - `rows`: whether points have rows (batch × seq) that the lookup carries configs across;
      False: every point has batch 1 and seq 1 and the lookup answers only the exact dims
      (a kernel keyed by its own arguments, whose configs may not serve other values).
    - `signature(point)`: the point's Point.weights as the kernel's inputs make it (a user
      kernel: the dtypes of its other tensors where they differ from the first one's), None
      where Point.weights is a weight format.
    - `other_triton`: what the lookup does with an entry tuned with another Triton version:
      "warn" (serve it, warn once), "refuse" (not served, warn once) or "ignore". The
      environment variable FUSETUNE_OTHER_TRITON overrides it for every kernel.
    """

    name: str
    description: str
    dim_names: tuple[str, ...]
    config_keys: tuple[str, ...]
    pow2_keys: tuple[str, ...]
    make_inputs: Callable[[Point, torch.device | str], Tensors]
    make_outputs: Callable[[Tensors], Tensors]
    reference: Callable[[Tensors], Tensors]
    launch: Callable[[Tensors, Tensors, Config], None]
    default_config: Callable[[Point, GpuSpec], Config]
    resources: Callable[[Config, Point], Resources]
    cost: Callable[[Point], Cost]
    canonical: Callable[[Config, Point], Config]
    dims_from_model: Callable[[ModelPreset], dict[str, int]]
    # ‖out − ref‖ / ‖ref‖ allowed per activation dtype.
    tolerance: Mapping[str, float] = field(
        default_factory=lambda: {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
    )
    source_objects: tuple[Any, ...] = ()
    algorithm_sources: tuple[Any, ...] = ()
    flags: Mapping[str, int] = field(default_factory=dict)
    same_as: Mapping[str, str] = field(default_factory=dict)
    structure_sources: tuple[tuple[Callable[[Mapping[str, Any]], bool], tuple[Any, ...]],
                             ...] = ()
    weight_formats: tuple[str, ...] = ()
    activation_modes: tuple[str, ...] = ()
    activation_tolerance: Mapping[str, float] = field(default_factory=dict)
    row_reach: int | None = None
    padding: Callable[[Config, Point], float] | None = None
    one_row_structure: bool = False
    one_row_same: tuple[str, ...] = ()
    carry_same: tuple[str, ...] = ()
    structure: Callable[[Config, Point], Hashable] | None = None
    ref: str = ""
    space: Mapping[str, Any] | None = None
    dtypes: tuple[str, ...] = DTYPES
    rows: bool = True
    signature: Callable[[Point], str] | None = None
    unfused_form: str = "norm, cuBLAS GEMM, epilogue as separate launches"
    other_triton: str = "ignore"
    algorithm_keys: tuple[str, ...] = ()
    optional_dims: Mapping[str, int] = field(default_factory=dict)
    default_rows: tuple[int, ...] = ()
    dim_choices: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    check_dims: Callable[[Mapping[str, int]], str | None] | None = None

    @property
    def all_dim_names(self) -> tuple[str, ...]:
        return (*self.dim_names, *self.optional_dims)

    @property
    def dims_text(self) -> str:
        """The dims' names for messages: dim_names, then each optional one as such."""
        return ", ".join(self.dim_names) + "".join(f", optionally {k}" for k in self.optional_dims)

    def dims_named(self, names: Iterable[str]) -> bool:
        """Whether `names` are a valid set of this kernel's dims: every one of dim_names, and
        of optional_dims those given."""
        names = set(names)
        return set(self.dim_names) <= names <= set(self.all_dim_names)

    def short_dims(self, dims: Mapping[str, int]) -> dict[str, int]:
        """`dims` as points, tables and lookups key them: an optional dim at its default left
        out (so that a kernel which gained an argument keeps its older tables' keys)."""
        return {k: v for k, v in dims.items()
                if k not in self.optional_dims or v != self.optional_dims[k]}

    def dims_problem(self, dims: Mapping[str, Any]) -> str | None:
        """What is wrong with `dims` (named as dims_named allows) as a point's dims, in words
        naming the bad value and the valid ones, or None. A switch or choice takes one of its
        `dim_choices`; any other dim is a size, at least 1 for a built-in kernel (a kernel of
        one's own keys on its arguments as they are: at least 0); then `check_dims`."""
        for k, v in dims.items():
            if not isinstance(v, int) or isinstance(v, bool):
                return f"{k}={v!r} must be an integer"
            if k not in self.dim_choices and v < (0 if self.ref else 1):
                if self.ref:
                    return f"{k}={v} must be a non-negative integer"
                switches = (f"; of {self.name}'s dims only {', '.join(self.dim_choices)} take 0"
                            if self.dim_choices else "")
                return f"{k}={v} must be a positive integer (a size{switches})"
        return self.choices_problem(dims)

    def choices_problem(self, dims: Mapping[str, int]) -> str | None:
        """What is wrong with `dims` (integers) beyond their being sizes, or None: a switch or
        choice outside its `dim_choices` (the message names the valid ones), then what
        `check_dims` finds. The lookup and the tables judge their dims by this too, where a
        size may be 0."""
        for k, v in dims.items():
            choices = self.dim_choices.get(k)
            if choices is not None and v not in choices:
                valid = ", ".join(f"{c} ({meaning})" for c, meaning in choices.items())
                return f"{k}={v} is none of {self.name}'s choices: {valid}"
        if self.check_dims is not None:
            return self.check_dims({**self.optional_dims, **dims})
        return None

    def dim_value(self, point: Point, name: str) -> int:
        """A dim of `point`, an optional one at its default where the point leaves it out."""
        return point.dim.get(name, self.optional_dims.get(name, 0))

    @property
    def search_ref(self) -> str:
        """What `fusetune search --kernel` (and get_spec) takes for this kernel."""
        return self.ref or self.name

    def accepts_weights(self, weights: str) -> bool:
        """Whether `weights` may be a point's Point.weights (besides "")."""
        if self.signature is not None:
            return all(part in TORCH_DTYPES for part in weights.split(","))
        return weights in self.weight_formats

    def point_weights(self, fmt: str, dtype: str) -> str:
        """Point.weights for weights in format `fmt` (one of WEIGHT_CHOICES) with `dtype`
        activations (see `point_weights`); ValueError where this kernel cannot take them."""
        if not self.weight_formats:
            raise ValueError(f"weights {fmt!r}: {self.name} has no weights (a weight format "
                             "applies to the matmul kernels ffn, qkv, linear and lola)")
        key = point_weights(fmt, dtype)
        if key and key not in self.weight_formats:
            raise ValueError(f"weights {fmt!r}: {self.name} takes "
                             f"{', '.join(self.weight_formats)} or the activations' dtype")
        return key

    def point_activations(self, mode: str | None, weights: str) -> str:
        """Point.activations for activation mode `mode` beside weights `weights` (see
        `point_activations`); ValueError where this kernel cannot run the mode."""
        key = point_activations(mode, weights)
        if key and key not in self.activation_modes:
            raise ValueError(f"activations {mode!r}: {self.name} runs its activations in their "
                             "own dtype only")
        return key

    def tolerance_for(self, point: Point) -> float:
        """‖out − ref‖ / ‖ref‖ allowed at `point`: one bound for every config of the point (its
        activation mode's), so that no config passes with numerics another would fail."""
        if point.activations:
            return self.activation_tolerance[point.dtype]
        return self.tolerance[point.dtype]

    @functools.cached_property
    def source_hash(self) -> str:
        """Hash of the kernel's source: results from another version of the kernel never mix.
        Read once, as the process imported it (the code it runs)."""
        return _source_hash(self.source_objects)

    @functools.cached_property
    def _source_hashes(self) -> dict[tuple[bool, ...], str]:
        """_config_sources_hash's, by its argument (read once, as source_hash)."""
        return {}

    def _config_sources_hash(self, runs: tuple[bool, ...]) -> str:
        """Hash of the sources a config runs: all but `algorithm_sources` where it is of the
        kernel's own code (runs[0] False), and but the sources of each of `structure_sources`
        it does not run (runs[1:])."""
        if runs not in self._source_hashes:
            skip = set() if runs[0] else {id(o) for o in self.algorithm_sources}
            for ran, (_, sources) in zip(runs[1:], self.structure_sources, strict=True):
                if not ran:
                    skip |= {id(o) for o in sources}
            self._source_hashes[runs] = _source_hash(
                tuple(o for o in self.source_objects if id(o) not in skip))
        return self._source_hashes[runs]

    @property
    def omitted_values(self) -> dict[str, int]:
        """What a config that leaves out a key of `flags` or `same_as` means for it."""
        return {**self.flags, **dict.fromkeys(self.same_as, 0)}

    def config_source_hash(self, config: Mapping[str, Any]) -> str:
        """The source hash a table entry of `config` records and is served with: that of the
        sources the config runs (the whole source's for a config of another algorithm, an
        algorithm key set, but for the `structure_sources` it does not run; without
        `algorithm_sources` for a config of the kernel's own code, which never runs them), so
        that a change to the unfused form alone leaves the fused entries served, and one to
        a structure the entries of the others."""
        other = any(config.get(k) for k in self.algorithm_keys)
        return self._config_sources_hash(
            (other, *(bool(runs(config)) for runs, _ in self.structure_sources)))

    def runs_source(self, source: str, config: Mapping[str, Any]) -> bool:
        """Whether a table entry of `config` that records source hash `source` was tuned on
        the code this process runs for it: the kernel's whole source's hash (older tables'),
        or that of what the config runs (config_source_hash)."""
        return source in (self.source_hash, self.config_source_hash(config))

    def validate_config(self, config: Mapping[str, Any], where: str = "config") -> Config:
        """Checks a user- or table-supplied config; returns it as a plain dict of ints."""
        if not isinstance(config, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping of {', '.join(self.config_keys)}, "
                f"got {type(config).__name__}"
            )
        missing = [k for k in self.config_keys
                   if k not in config and k not in self.flags and k not in self.same_as]
        unknown = [k for k in config if k not in self.config_keys]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown {', '.join(map(str, unknown))}")
            left_out = [f"{k} (default {v})" for k, v in self.flags.items()] + [
                f"{k} (default 0: {same})" for k, same in self.same_as.items()]
            optional = f"; {', '.join(left_out)} may be left out" if left_out else ""
            if "ACT_FP8" in unknown:  # a key of older tables and configs
                optional += ("; ACT_FP8 is no config key: FP8 activations change the results, "
                             "so they are the caller's mode (fp8_activations=True; in a table "
                             "an entry's `activations: fp8`), never a tuning value")
            raise ConfigError(
                f"{where}: {'; '.join(parts)} (a {self.name} config has exactly "
                f"{', '.join(self.config_keys)}{optional})"
            )
        out: Config = {}
        omitted = self.omitted_values
        for k in self.config_keys:
            v = config.get(k, omitted.get(k))
            if k in self.same_as and v == 0 and not isinstance(v, bool):
                out[k] = 0
                continue
            if k in self.flags:
                if isinstance(v, bool) or v not in (0, 1):
                    raise ConfigError(f"{where}: {k}={v!r} must be 0 or 1")
                out[k] = v
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}: {k}={v!r} must be a positive integer")
            if k in self.pow2_keys and v & (v - 1):
                raise ConfigError(f"{where}: {k}={v} must be a power of two")
            out[k] = v
        return out


def check_fits(res: Resources, gpu: GpuSpec) -> str | None:
    """Why a config cannot run well on `gpu` (None if it fits), from the predicted resources.

    The reason starts with the limit's name (fp8-tensor-cores, tma, pdl, threads, shared-memory,
    registers) for counting.
    """
    if res.unfit:
        return res.unfit
    if res.fp8_mma and not gpu.fp8_tensor_cores:
        major, minor = gpu.compute_capability
        return (f"fp8-tensor-cores: FP8 activations need FP8 tensor cores (compute capability "
                f"8.9+), {gpu.name} has {major}.{minor}")
    if res.tma and not gpu.tma:
        major, minor = gpu.compute_capability
        return (f"tma: TMA=1 needs TMA descriptors (compute capability 9.0+), {gpu.name} has "
                f"{major}.{minor}")
    if res.pdl and not gpu.pdl:
        major, minor = gpu.compute_capability
        return (f"pdl: PDL=1 needs programmatic dependent launch (compute capability 9.0+), "
                f"{gpu.name} has {major}.{minor}")
    if res.threads > gpu.max_threads_per_block:
        return f"threads: {res.threads} > {gpu.max_threads_per_block} per block"
    if res.smem_bytes > gpu.smem_per_block:
        return f"shared-memory: {res.smem_bytes} B > {gpu.smem_per_block} B per block"
    regs = res.regs_per_thread
    if res.spill_regs:
        regs = max(regs - res.spill_regs, min(regs, gpu.regs_per_block // res.threads))
    if regs > gpu.regs_per_thread:
        return (f"registers: ~{regs} per thread > {gpu.regs_per_thread} "
                "(would spill to local memory)")
    if regs * res.threads > gpu.regs_per_block:
        return f"registers: ~{regs}×{res.threads} > {gpu.regs_per_block} per block"
    return None


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(t: torch.Tensor, kernel: str) -> None:
    """CUDA tensors, or CPU tensors under the interpreter; a clear error otherwise."""
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{kernel}: tensors are on {t.device}; fusetune's kernels run on CUDA tensors (or on "
            "CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 before importing "
            "fusetune)")


def check_eps(kernel: str, eps: float) -> None:
    """ValueError unless eps is a positive finite number (a norm's epsilon: 0 or less divides
    zero rows by zero, and a negative one can take the root of a negative number)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"{kernel}: eps={eps!r} must be a positive finite number (the "
                         "model's norm epsilon, e.g. its config's rms_norm_eps)")


def check_no_grad(kernel: str, *tensors: torch.Tensor | None) -> None:
    """RuntimeError where autograd would record the call: the kernels have no backward pass,
    so their outputs would be silently detached from the graph."""
    import torch

    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{kernel}: an input requires grad, but fusetune's {kernel} has no backward pass: "
            "its output would be detached from the graph. Run it under torch.no_grad() or "
            "torch.inference_mode(), or pass detached tensors.")


def as_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """[..., d] -> [M, d] with unit column stride, without copying when the strides allow it."""
    try:
        t2 = t.view(-1, d)
    except RuntimeError:  # leading dims not collapsible into one stride
        t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' grids: plain integer arithmetic (triton.cdiv, a
    constexpr function, is slow to call from Python, and a launch makes up to three of
    them)."""
    return -(-a // b)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"unsupported dtype {dtype}; valid: {', '.join(DTYPES)}")
        _dtype_names[dtype] = name
    return name


_dtype_names: dict[torch.dtype, str] = {}  # dtype_name's answers (a launcher asks every call)
