"""The host side that the matmul kernels (ffn, qkv, lola) share, for a new one to reuse.

A matmul kernel multiplies the activations x [M, K] by one or more weight matrices [N, K]
(nn.Linear's layout, in x's dtype or FP8) in a K loop built from _matmul's jit helpers, with the
tunables of MATMUL_CONFIG_KEYS. What it shares with the others is here: the KernelSpec fields
(MATMUL_SPEC_FIELDS), the canonical config (matmul_canonical), the resources of its structures
(matmul_resources), the bytes of its weights (weight_bytes), the activations' first pass
(first_pass) and the constexpr arguments and grids of a launch (launch_args, launch_split).
Its own module keeps the @triton.jit kernel, the launcher's tensors, dims, reference and cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusetune.kernels import _unfused, fp8
from fusetune.kernels._matmul import (
    collapse_tiles,
    collapse_tma,
    gemv_flag,
    gemv_resources,
    pipelined_smem,
    tma_smem,
)
from fusetune.spec import (
    ACTIVATION_MODES,
    DTYPE_BYTES,
    WEIGHT_FORMATS,
    Config,
    ConfigError,
    Point,
    Resources,
    cdiv,
    interpreting,
)

# The tunables every matmul kernel has (the YAML spaces and tables name exactly these), and
# the tolerance its output is checked with (float32 accumulation of fp16/bf16 products).
# UNROLL_K (0/1: the GEMV structure's K loop takes two K-steps per
# iteration, see _matmul.gemv_two_products), SPREAD (0/1: a GEMV program's output rows lie far
# apart, see _matmul.block_rows), THREAD_SUM (0/1: a GEMV thread adds the products of its
# 16-byte run of a weight row up before accumulating, see _matmul.gemv_two_products) and TMA
# (0/1: the tensor-core loop reads its tiles through TMA descriptors, see
# _matmul.tma_two_products) may be left out of a config: tables written before them mean 0.
# UNFUSED (0/1: the result computed as separate launches around cuBLAS, see _unfused) too.
MATMUL_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PASSES", "SPLIT_K",
                      "UNROLL_K", "SPREAD", "THREAD_SUM", "TMA", "UNFUSED", "num_warps",
                      "num_stages")
MATMUL_FLAGS = {"UNROLL_K": 0, "SPREAD": 0, "THREAD_SUM": 0, "TMA": 0, "UNFUSED": 0}
MATMUL_POW2_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")
MATMUL_TOLERANCE = {"float16": 5e-3, "bfloat16": 2.5e-2, "float32": 1e-4}
# How far down in rows a matmul table entry serves (KernelSpec.row_reach): one tuned for R rows
# serves r rows where R < 256·r. A config tuned for thousands of rows (chosen where the tensor
# cores bound the product) loses to the default heuristic at a few rows, where reading the
# weights bounds it, but serves a few dozen rows well: so a 4096-row entry serves 17 rows and
# more, and below that, where no entry nearer in rows serves, the default runs.
MATMUL_ROW_REACH = 256
# Whether the kernels run on Triton's CPU interpreter: a property of the backend, not a
# tunable (no search space or table names it). Triton chooses the backend when it decorates
# the kernels, at import like this module, so it is read once, here; every launch passes it as
# the INTERPRETED constexpr (_matmul.dot), False for every compiled kernel.
INTERPRETED = interpreting()

# The KernelSpec fields every matmul kernel has: KernelSpec(name=..., ..., **MATMUL_SPEC_FIELDS).
MATMUL_SPEC_FIELDS: dict[str, Any] = {
    "config_keys": MATMUL_CONFIG_KEYS,
    "pow2_keys": MATMUL_POW2_KEYS,
    "tolerance": MATMUL_TOLERANCE,
    "flags": MATMUL_FLAGS,
    "weight_formats": WEIGHT_FORMATS,
    "activation_modes": ACTIVATION_MODES,
    "activation_tolerance": fp8.ACT_FP8_TOLERANCE,
    "row_reach": MATMUL_ROW_REACH,
    "one_row_structure": True,
    "one_row_same": ("dim",),
}


def matmul_canonical(config: Config, point: Point, n: int, k: int,
                     has_tma: Callable[[Config], bool] | None = None) -> Config:
    """The canonical config of a matmul over [point.rows, k] x [k, n]: tiles collapsed to the
    matrix (_matmul.collapse_tiles), then the FP8 activations' needs
    (fp8.collapse_fp8_activations), then TMA
    (_matmul.collapse_tma), where `has_tma` says whether the kernel has the TMA loop for the
    config so far (None: for every config). Every UNFUSED config is one (_unfused.canonical)."""
    if _unfused.unfused(config):
        return _unfused.canonical(config)
    c = collapse_tiles(config, point.rows, n, k)
    c = fp8.collapse_fp8_activations(c, point, k)
    return collapse_tma(c, point, k, kernel_has_tma=has_tma is None or has_tma(c))


def matmul_padding(config: Config, point: Point, n: int, k: int) -> float:
    """The share of a launch's weight tiles over [k, n] that is masked off: the n outputs and
    the K loop (SPLIT_K slices of BLOCK_K steps) each rounded up to whole tiles. (The rows'
    padding is the row rules' business: row_reach, GEMV_MAX_ROWS.)"""
    def covered(size: int, block: int) -> float:
        return size / (cdiv(size, block) * block) if size else 1.0

    if _unfused.unfused(config):
        return 0.0

    c = collapse_tiles(config, point.rows, n, k)
    return 1.0 - covered(n, c["BLOCK_N"]) * covered(k, c["BLOCK_K"] * c["SPLIT_K"])


def matmul_resources(config: Config, point: Point, *, n_weights: int, epilogue: bool,
                     base_regs: int, gemv_weights: int | None = None, extra_regs: int = 0,
                     loop_smem: Callable[[Config, int, tuple[int, int, bool]], int] | None = None,
                     unfused: bool = False) -> Resources:
    """Resources of one program of a kernel whose K loop multiplies an x tile by `n_weights`
    weight tiles.

    BLOCK_M = 1: the one-row structure's (_matmul.gemv_resources, with `gemv_weights` float32
    accumulator tiles; default n_weights). Otherwise the pipelined loop's shared memory
    (_matmul.pipelined_smem; `epilogue`: the output tile is staged there too), at least
    `loop_smem(config, elt, operands)` where the kernel's own loop stages more, and the TMA
    loop's where it reads through descriptors; registers for the n_weights float32
    accumulators, one K-step's operand fragments (FP8 weight tiles upcast in registers: in x's
    type, as the MMA reads them) and `extra_regs` more elements, spread over the threads, plus
    `base_regs` per thread. UNFUSED = 1: the unfused form's (_unfused.resources), where the
    kernel has one (`unfused`), else unfit."""
    if _unfused.unfused(config):
        if not unfused:
            return Resources(0, 0, 128, unfit="unfused: this kernel has no unfused form")
        return _unfused.resources(point)
    elt = DTYPE_BYTES[point.dtype]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    threads = 32 * config["num_warps"]
    operands = fp8.operand_bytes(point)
    x_elt, w_elt, converted = operands
    if bm == 1:
        return gemv_resources(config, point.rows, w_elt,
                              n_weights=n_weights if gemv_weights is None else gemv_weights)
    smem = pipelined_smem(config, elt, n_weights=n_weights, epilogue=epilogue,
                          operands=operands)
    if loop_smem is not None:
        smem = max(smem, loop_smem(config, elt, operands))
    tma = bool(config.get("TMA"))
    if tma:
        smem = max(smem, tma_smem(config, x_elt, w_elt, n_weights=n_weights))
    w_bytes = elt if converted else w_elt
    regs = ((n_weights * bm * bn + (bm * bk * x_elt + n_weights * bk * bn * w_bytes) // 4
             + extra_regs) // threads + base_regs)
    return Resources(smem_bytes=smem, regs_per_thread=regs, threads=threads,
                     fp8_mma=point.fp8_activations, tma=tma)


def weight_bytes(point: Point, n: int, k: int) -> int:
    """Bytes of n weight rows of k elements at `point`: FP8 weights one byte each and a
    float32 scale per row (output channel), else in the activations' dtype."""
    if point.weights in WEIGHT_FORMATS:
        return n * (k + 4)
    return n * k * DTYPE_BYTES[point.dtype]


def first_pass(x: torch.Tensor, g: torch.Tensor | None, eps: float, config: Config,
               act: bool, norm: Callable[[torch.Tensor], torch.Tensor] | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the activations as the K loop reads them, their row scales) for a launch of `config`.
    With FP8 activations (`act`, the caller's mode) the pass always runs, whatever the config:
    it writes the normalized rows in e4m3 with a scale each (fp8.norm_fp8_rows: RMSNorm with
    the weight g, LayerNorm without affine where g is None) and the K loop multiplies FP8 by
    FP8. Else with PASSES = 2 the kernel's own norm pass `norm(x)` runs first; else the norm
    folds into the K loop and x is read as it is. A kernel without a norm (`norm` None) reads
    x as it is, or quantized without a norm. The scales are None unless `act`."""
    if act:
        if config["BLOCK_M"] > 1 and config["BLOCK_K"] < 32:
            raise ConfigError(f"BLOCK_K={config['BLOCK_K']} with FP8 activations: tensor-core "
                              "tiles of 8-bit operands need BLOCK_K >= 32")
        return fp8.norm_fp8_rows(x, g, eps, norm=norm is not None)
    return (norm(x) if norm is not None and config["PASSES"] == 2 else x), None


def launch_args(config: Config, *, act: bool, w_fp8: int, ieee: bool, w_scaled: bool,
                tma: bool, passes: bool = True) -> dict[str, Any]:
    """The constexpr and launch arguments every matmul kernel takes for a launch of `config`
    (all but FINISH, which differs between the launches of a split-K product): the tiles,
    the FP8 activations (ACT_FP8: `act`, the caller's mode; the norm then ran as its own pass,
    PASSES = 2), how the weight tiles are read (W_FP8, fp8.W_*), whether there are channel
    scales (W_SCALED), exact float32 products (IEEE), the one-row structure's flags, whether
    TMA descriptors are passed and whether the kernel runs on the interpreter (INTERPRETED);
    PASSES only where the kernel takes it (`passes`).

    The same dict (do not modify it) for the same config object and flags: at decode a
    launcher's every call asks for it."""
    if _unfused.unfused(config):  # the kernels with an unfused form took it before this
        raise ConfigError("UNFUSED=1: this kernel has no unfused form (ffn, linear and qkv have)")
    key = (id(config), act, w_fp8, ieee, w_scaled, tma, passes)
    kept = _launch_args.get(key)
    if kept is not None and kept[0] is config:
        return kept[1]
    args = {
        "BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"],
        "BLOCK_K": config["BLOCK_K"], "GROUP_M": config["GROUP_M"],
        "PASSES": 2 if act else config["PASSES"], "SPLIT_K": config["SPLIT_K"], "IEEE": ieee,
        "W_FP8": w_fp8, "ACT_FP8": act, "W_SCALED": w_scaled,
        "UNROLL_K": config.get("UNROLL_K", 0), "SPREAD": gemv_flag(config, "SPREAD"),
        "TMA": tma, "THREAD_SUM": gemv_flag(config, "THREAD_SUM"), "INTERPRETED": INTERPRETED,
        "num_warps": config["num_warps"], "num_stages": config["num_stages"],
    }
    if not passes:
        del args["PASSES"]
    if len(_launch_args) >= 4096:
        _launch_args.clear()
    # the config is kept beside its dict: its id is not reused while the entry lives
    _launch_args[key] = (config, args)
    return args


_launch_args: dict[tuple[Any, ...], tuple[Config, dict[str, Any]]] = {}


def launch_split(launch: Callable[[tuple[int, int], bool], None], tiles: int,
                 split: int) -> None:
    """`launch(grid, finish)` over `tiles` output tiles: SPLIT_K = `split` programs per tile;
    with split > 1 they write float32 partial sums, and a second launch of the same kernel
    (finish) adds them up and applies the epilogue."""
    launch((tiles, split), False)
    if split > 1:
        launch((tiles, 1), True)


# The host code a matmul kernel's launch runs through: part of its source hash.
MATMUL_HOST_SOURCES = (first_pass, launch_args, launch_split)
