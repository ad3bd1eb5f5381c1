"""What the matmul-based kernels (ffn, lola, ...) share: tile heuristics, config collapsing,
the shared-memory model of a software-pipelined K loop."""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._spec import Config, Point, Resources, check_fits, next_pow2

# The tunables every matmul kernel has (the YAML spaces and tables name exactly these), and
# the tolerance its output is checked with (float32 accumulation of fp16/bf16 products).
MATMUL_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PASSES", "SPLIT_K",
                      "num_warps", "num_stages")
MATMUL_POW2_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")
MATMUL_TOLERANCE = {"float16": 5e-3, "bfloat16": 2.5e-2, "float32": 1e-4}


@triton.jit
def grouped_tile(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row-block, column-block) of this program in grouped launch order: GROUP_M consecutive
    row-blocks walk the same column-blocks, so the weight tiles they share are read from L2
    rather than from memory."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.jit
def k_slice(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[k_begin, k_end) of this program's share of K under split-K (the slice is
    tl.program_id(1) of SPLIT_K): whole BLOCK_K steps each, the last slice takes what remains
    (possibly nothing)."""
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = tl.program_id(1) * steps * BLOCK_K
    return k_begin, tl.minimum(k_begin + steps * BLOCK_K, K)


@triton.jit
def partial_ptrs(WS, slot, rows, cols, n_rows, n_cols):
    """Pointers to [rows, cols] of the float32 partial-sum workspace WS [slots, n_rows, n_cols]
    at `slot`: split-K programs store their partial accumulators there and the finishing pass
    adds the slots up."""
    return WS + (slot * n_rows + rows[:, None]).to(tl.int64) * n_cols + cols[None, :]


@triton.jit
def two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok, K, stride_xm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PASSES: tl.constexpr, IEEE: tl.constexpr):
    """x·Waᵀ and x·Wbᵀ over this program's K-slice for the rows rm of X [M, K] (row stride
    stride_xm). wa_rows / wb_rows [1, BLOCK_N] are the element offsets (int64) of the weight
    rows in WA / WB, read transposed as [BLOCK_K, BLOCK_N] tiles (w_ok: which of the rows
    exist). With PASSES == 1 x is scaled by the RMSNorm weight G on the way and the rows' sums
    of x² come back too (zeros otherwise)."""
    k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_begin + rk)[None, :]
    wa_ptrs = WA + (wa_rows + (k_begin + rk)[:, None])
    wb_ptrs = WB + (wb_rows + (k_begin + rk)[:, None])
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = rk < k_end - k0  # the last K-step may be partial: masked lanes read 0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wa = tl.load(wa_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        wb = tl.load(wb_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if PASSES == 1:
            g = tl.load(G + k0 + rk, mask=k_ok, other=0.0)
            x, x_sumsq = rms_scaled(x, g)
            sumsq += x_sumsq
        # With PASSES == 2 the tiles go from memory to the tensor cores untouched, which lets
        # the compiler keep the asynchronous load/MMA pipeline that large M needs.
        acc_a = dot(x, wa, acc_a, IEEE)
        acc_b = dot(x, wb, acc_b, IEEE)
        x_ptrs += BLOCK_K
        wa_ptrs += BLOCK_K
        wb_ptrs += BLOCK_K
    return acc_a, acc_b, sumsq


@triton.jit
def two_partials_added(WS, WSQ, rm, cols, m_ok, mc_ok, M, n_cols,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                       PASSES: tl.constexpr):
    """The split-K finishing pass of two_products: its two accumulators (slots 2s and 2s + 1 of
    WS [2·SPLIT_K, M, n_cols]) and, with PASSES == 1, the x² sums (WSQ [SPLIT_K, M]) added up
    over the slices."""
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc_a += tl.load(partial_ptrs(WS, 2 * s, rm, cols, M, n_cols), mask=mc_ok, other=0.0)
        acc_b += tl.load(partial_ptrs(WS, 2 * s + 1, rm, cols, M, n_cols), mask=mc_ok,
                         other=0.0)
        if PASSES == 1:
            sumsq += tl.load(WSQ + s * M + rm, mask=m_ok, other=0.0)
    return acc_a, acc_b, sumsq


@triton.jit
def store_two_partials(WS, WSQ, acc_a, acc_b, sumsq, rm, cols, m_ok, mc_ok, M, n_cols,
                       first_col_block, PASSES: tl.constexpr):
    """This K-slice's (tl.program_id(1)) share for two_partials_added; the x² sums are stored
    once per row-block, by the program of the first column-block."""
    split = tl.program_id(1)
    tl.store(partial_ptrs(WS, 2 * split, rm, cols, M, n_cols), acc_a, mask=mc_ok)
    tl.store(partial_ptrs(WS, 2 * split + 1, rm, cols, M, n_cols), acc_b, mask=mc_ok)
    if PASSES == 1 and first_col_block:
        tl.store(WSQ + split * M + rm, sumsq, mask=m_ok)


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·b; with IEEE, exact float32 products (float32 inputs) instead of tf32."""
    if IEEE:  # noqa: SIM108  (a Triton constexpr branch: one tl.dot per precision)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def rms_scaled(x, g):
    """For an x tile [BLOCK_M, BLOCK_K] and the RMSNorm weight tile g [BLOCK_K]: x ⊙ g, computed
    in float32 and rounded back to x's type for the tensor cores, and the rows' sums of x²
    (float32) to accumulate for rstd."""
    xf = x.to(tl.float32)
    return (xf * g.to(tl.float32)[None, :]).to(x.dtype), tl.sum(xf * xf, axis=1)


def default_tiles(point: Point, gpu: GpuSpec, resources: Callable[[Config, Point], Resources],
                  n: int, k: int) -> Config:
    """Tutorial-style tiles for an [M = point.rows, k] x [k, n] product: tall-skinny with the
    norm folded in and K split for decode, 128x128 after a separate norm pass (PASSES = 2) for
    prefill; then fewer stages (and smaller tiles) until `gpu` can hold the config."""
    m = point.rows
    if m <= 16:
        c = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "PASSES": 1,
             "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    elif m <= 128:
        c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 1,
             "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    else:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
             "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    if m <= 16:
        # Decode streams the weights once: split K until there are about four programs per SM,
        # so that every SM keeps loads in flight to the end.
        tiles = -(-n // c["BLOCK_N"])
        while (c["SPLIT_K"] < 8 and tiles * c["SPLIT_K"] < 4 * gpu.sms
               and c["SPLIT_K"] * 2 * c["BLOCK_K"] <= k):
            c["SPLIT_K"] *= 2
    while check_fits(resources(c, point), gpu) is not None:
        if c["num_stages"] > 2:
            c["num_stages"] -= 1
        elif c["BLOCK_N"] > 32:
            c["BLOCK_N"] //= 2
        elif c["BLOCK_K"] > 32:
            c["BLOCK_K"] //= 2
        else:
            break
    return c


def collapse_tiles(config: Config, rows: int, n: int, k: int) -> Config:
    """Tiles past the matrix only add masked lanes (tl.dot needs at least 16 per side), with
    a single row of tiles every GROUP_M gives the same launch order, and K-slices beyond the
    number of BLOCK_K steps would be empty."""
    c = dict(config)
    c["BLOCK_M"] = min(c["BLOCK_M"], max(16, next_pow2(rows)))
    c["BLOCK_N"] = min(c["BLOCK_N"], max(16, next_pow2(n)))
    c["BLOCK_K"] = min(c["BLOCK_K"], max(16, next_pow2(k)))
    if -(-rows // c["BLOCK_M"]) == 1:
        c["GROUP_M"] = 1
    steps = -(-k // c["BLOCK_K"])
    while c["SPLIT_K"] > 1 and c["SPLIT_K"] > steps:
        c["SPLIT_K"] //= 2
    return c


def pipelined_smem(config: Config, elt: int, n_weights: int, epilogue: bool) -> int:
    """Shared memory of a K loop over an x tile and `n_weights` weight tiles.

    Software pipelining keeps (num_stages - 1) sets of tiles; with `epilogue` the compiler
    also stages the [BLOCK_M, BLOCK_N] output tile through shared memory (it does for ffn's
    two-accumulator epilogue, not for lola's). Checked against Triton's own allocation for
    sm_90 (tests/kernels/test_ffn.py, test_lola.py). float32 operands are laid out
    differently: num_stages sets, no epilogue term. With PASSES = 2 (operands not modified in
    registers) Hopper keeps num_stages sets.
    """
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    stages = config["num_stages"]
    tile = (bm * bk + n_weights * bk * bn) * elt
    if elt == 4:
        return stages * tile
    out_tile = bm * bn * elt if epilogue else 0
    folded = (stages - 1) * tile + out_tile + 1024
    if config.get("PASSES", 1) == 2 and bm >= 64 and config["num_warps"] >= 4:
        # Untouched operands go to the tensor cores straight from shared memory: with wgmma
        # (Hopper, BLOCK_M >= 64) the compiler then keeps num_stages full sets of tiles.
        return max(folded, stages * tile)
    return folded


# The jit helpers a kernel built on two_products compiles in: part of its source hash.
TWO_PRODUCT_SOURCES = (grouped_tile, k_slice, partial_ptrs, two_products, two_partials_added,
                       store_two_partials, dot, rms_scaled)
