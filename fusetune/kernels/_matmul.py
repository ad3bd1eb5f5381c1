"""What the matmul-based kernels (ffn, qkv, lola) share: the jit helpers of their K loops and
epilogues, tile heuristics, config collapsing, the shared-memory model of a software-pipelined
K loop. The spec fields, resources and launch arguments built on these: _matmul_spec.py."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusetune.gpus import GpuSpec
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Point,
    Resources,
    check_fits,
    interpreting,
    next_pow2,
)

# The largest TMA box: a descriptor's tile is at most 256 elements along each side.
TMA_MAX_BOX = 256
# The default heuristic's shortest K for TMA tiles (see default_tiles): below it the
# descriptors have not been shown to pay off, so shorter products keep pointer loads.
TMA_MIN_K = 768


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
def block_rows(blk, n, BLOCK_N: tl.constexpr, SPREAD: tl.constexpr):
    """The BLOCK_N indices (weight rows, output columns; qkv: rotation pairs) of column-block
    `blk` of n: adjacent, blk·BLOCK_N + j, or with SPREAD one in every P = cdiv(n, BLOCK_N),
    blk + j·P, so that the block's weight rows lie 1/BLOCK_N of the matrix apart (at decode the
    rows that the programs running at one time read then form BLOCK_N separate runs of memory
    instead of one). Either way the P blocks cover 0 .. n - 1 once each (indices >= n: masked
    by the caller)."""
    j = tl.arange(0, BLOCK_N)
    if SPREAD:  # noqa: SIM108  (a Triton constexpr branch)
        idx = blk + j * tl.cdiv(n, BLOCK_N)
    else:
        idx = blk * BLOCK_N + j
    return idx


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
def fp8_as_f16(w, W_FP8: tl.constexpr):
    """The FP8 weight tile w (W_FP8 = 1, 2, 3: the values are fp8.W_*) decoded exactly to
    float16, which holds every e4m3 and e5m2 value; w as loaded for W_FP8 = 0. 1: an FP8 type,
    upcast; 2: e4m3 read as bytes; 3: e5m2 read as bytes."""
    if W_FP8 == 1:
        w = w.to(tl.float16)
    elif W_FP8 == 2:
        # e4m3 byte s.eeee.mmm -> float16 bits s.0eeee.mmm0000000: float16 reads that exponent
        # with bias 15 instead of 7, hence the exact × 2^8. e4m3's subnormals (eeee = 0) land
        # on float16's subnormals and come out right too.
        # (The integer constants may widen the result: back to 16 bits before the bitcast.)
        b = w.to(tl.uint16)
        h = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.uint16)
        w = h.to(tl.float16, bitcast=True) * 256.0
    elif W_FP8 == 3:
        # An e5m2 byte is the high byte of the float16 of the same value.
        h = (w.to(tl.uint16) << 8).to(tl.uint16)
        w = h.to(tl.float16, bitcast=True)
    return w


@triton.jit
def mma_weight(w, x, W_FP8: tl.constexpr):
    """The weight tile w as loaded, made tl.dot's partner of the activation tile x: as loaded
    (W_FP8 = 0: x's type, or FP8 beside FP8 activations), or FP8 decoded (fp8_as_f16) and
    upcast to x's type. FP8 values are exact in float16 and in x's type, so the product sees
    exactly the stored weights."""
    if W_FP8 != 0:
        w = fp8_as_f16(w, W_FP8).to(x.dtype)
    return w


@triton.jit
def gemv_weight(w, W_FP8: tl.constexpr):
    """The weight tile w in float32 for the one-row loops' float32 products: FP8 decoded
    (fp8_as_f16) and widened straight from float16, without mma_weight's rounding to x's type
    on the way (exact either way; two conversions a weight fewer where the loop's arithmetic,
    not memory, is what limits FP8 weights)."""
    if W_FP8 != 0:
        w = fp8_as_f16(w, W_FP8)
    return w.to(tl.float32)


@triton.jit
def scale_product(acc, SX, rows, rows_ok, SW, cols, cols_ok, ACT_FP8: tl.constexpr,
                  W_SCALED: tl.constexpr):
    """acc [rows, cols] (float32, after the K loop and the split-K sums) times the activations'
    row scales SX[rows] (ACT_FP8: x was quantized per row) and the weights' per-output-channel
    scales SW[cols] (W_SCALED); before any nonlinearity, RoPE or bias."""
    if ACT_FP8:
        acc = acc * tl.load(SX + rows, mask=rows_ok, other=1.0)[:, None]
    if W_SCALED:
        acc = acc * tl.load(SW + cols, mask=cols_ok, other=1.0)[None, :]
    return acc


@triton.jit
def rms_scaled_products(acc_a, acc_b, sumsq, K, eps, SX, rows, rows_ok, SA, cols_a, SB, cols_b,
                        cols_ok, ACT_FP8: tl.constexpr, W_SCALED: tl.constexpr,
                        PASSES: tl.constexpr):
    """two_products' accumulators made final (after the split-K sums): the FP8 operands' scales
    (scale_product: x's row scales, the weight rows cols_a / cols_b of SA / SB) and, with the
    RMSNorm folded into the loop (PASSES == 1), the rows' rstd from their sums of x²."""
    a = scale_product(acc_a, SX, rows, rows_ok, SA, cols_a, cols_ok, ACT_FP8, W_SCALED)
    b = scale_product(acc_b, SX, rows, rows_ok, SB, cols_b, cols_ok, ACT_FP8, W_SCALED)
    if PASSES == 1:
        rstd = tl.rsqrt(sumsq / K + eps)[:, None]
        a = a * rstd
        b = b * rstd
    return a, b


@triton.jit
def row_norm_stats(x_row, K, eps, RMS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(mean, rstd) in float32 of the row of K elements at x_row (unit stride), for the norm
    passes: RMSNorm's (RMS: mean 0, rstd = rsqrt(mean(x²) + eps)) or LayerNorm's (two passes
    over the row, the second from cache)."""
    rk = tl.arange(0, BLOCK_K)
    mean = 0.0
    if not RMS:
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        d = tl.where(k0 + rk < K, x - mean, 0.0)  # masked lanes must not add mean²
        acc += d * d
    return mean, tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok, K, stride_xm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PASSES: tl.constexpr, IEEE: tl.constexpr,
                 W_FP8: tl.constexpr, UNROLL_K: tl.constexpr, THREAD_SUM: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """x·Waᵀ and x·Wbᵀ for the rows rm of X over this program's K-slice: the tensor-core loop
    (mma_two_products), or with BLOCK_M = 1 the one-row loop (gemv_two_products, which alone
    reads UNROLL_K and THREAD_SUM). Returns [BLOCK_M, BLOCK_N], [BLOCK_M, BLOCK_N] and the
    rows' sums of x² [BLOCK_M]. INTERPRETED: see dot."""
    if BLOCK_M == 1:
        acc_a, acc_b, sumsq = gemv_two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok,
                                                K, stride_xm, BLOCK_N, BLOCK_K, SPLIT_K, PASSES,
                                                W_FP8, UNROLL_K, THREAD_SUM)
    else:
        acc_a, acc_b, sumsq = mma_two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok,
                                               K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                               PASSES, IEEE, W_FP8, INTERPRETED)
    return acc_a, acc_b, sumsq


@triton.jit
def gemv_two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok, K, stride_xm,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      PASSES: tl.constexpr, W_FP8: tl.constexpr, UNROLL_K: tl.constexpr,
                      THREAD_SUM: tl.constexpr):
    """two_products for one row per program (BLOCK_M = 1), without tensor cores: at decode
    sizes a 16-row tl.dot pads the row with zero rows and moves every tile through shared
    memory; here the weight tiles go from memory straight to registers as wide vectors and
    are multiplied with the row in float32 (a GEMV).

    rm has one element. Weight tiles are read as [BLOCK_K, BLOCK_N] (a weight row is
    contiguous in K, the tile's first axis, so the loads vectorize along it); the products
    accumulate element-wise in float32 [BLOCK_K, BLOCK_N] tiles that are summed over K once,
    after the loop. THREAD_SUM = 1 first adds up each run of V = 16 bytes of a weight row (8
    16-bit or 16 FP8 weights, what one thread loads as one vector), so the accumulators are
    [BLOCK_K // V, BLOCK_N]: V times fewer registers (the reshape keeps a run in one thread:
    no data moves between threads; the sums come in another order than with 0). With
    PASSES == 1 the row is scaled by G in float32 (not rounded back to x's type as for the
    tensor cores) and its sum of squares comes back too.

    There is no software pipeline (no tl.dot for the compiler to stage): a warp waits for its
    loads before multiplying. UNROLL_K = 1 takes two K-steps per iteration, unrolled, so that
    the loads of both are in flight together (twice the bytes per wait, into the same
    accumulators)."""
    k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
    rk = tl.arange(0, BLOCK_K)
    # [1] + [BLOCK_K] broadcasts to the BLOCK_K addresses of the row.
    x_ptrs = X + rm.to(tl.int64) * stride_xm + (k_begin + rk)
    wa_ptrs = WA + (wa_rows + (k_begin + rk)[:, None])
    wb_ptrs = WB + (wb_rows + (k_begin + rk)[:, None])
    # THREAD_SUM: V = a 16-byte run of weight elements (one vector load a thread).
    V: tl.constexpr = 128 // WA.dtype.element_ty.primitive_bitwidth if THREAD_SUM else 1
    acc_a = tl.zeros([BLOCK_K // V, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_K // V, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K * (1 + UNROLL_K)):
        for u in tl.static_range(1 + UNROLL_K):
            step = u * BLOCK_K  # this K-step's offset within the iteration
            # The last K-step may be partial, an unrolled one past the slice's end empty:
            # masked lanes read 0 and add nothing.
            k_ok = rk < k_end - k0 - step
            x = tl.load(x_ptrs + step, mask=k_ok & m_ok, other=0.0)
            w_mask = k_ok[:, None] & w_ok[None, :]
            # FP8 weights are converted exactly (gemv_weight), then everything is float32.
            # Each weight byte is read once (by the programs of this tile's few rows at about
            # the same time): evict-first keeps it from displacing what L2 still serves.
            wa = gemv_weight(tl.load(wa_ptrs + step, mask=w_mask, other=0.0,
                                     eviction_policy="evict_first"), W_FP8)
            wb = gemv_weight(tl.load(wb_ptrs + step, mask=w_mask, other=0.0,
                                     eviction_policy="evict_first"), W_FP8)
            xf = x.to(tl.float32)
            if PASSES == 1:
                g = tl.load(G + k0 + step + rk, mask=k_ok, other=0.0).to(tl.float32)
                sq += xf * xf
                xf = xf * g
            if V == 1:
                acc_a += wa * xf[:, None]
                acc_b += wb * xf[:, None]
            else:
                acc_a += tl.sum(tl.reshape(wa * xf[:, None], [BLOCK_K // V, V, BLOCK_N]), axis=1)
                acc_b += tl.sum(tl.reshape(wb * xf[:, None], [BLOCK_K // V, V, BLOCK_N]), axis=1)
        x_ptrs += BLOCK_K * (1 + UNROLL_K)
        wa_ptrs += BLOCK_K * (1 + UNROLL_K)
        wb_ptrs += BLOCK_K * (1 + UNROLL_K)
    sumsq = tl.zeros([1], dtype=tl.float32) + tl.sum(sq, axis=0)
    return tl.sum(acc_a, axis=0)[None, :], tl.sum(acc_b, axis=0)[None, :], sumsq


@triton.jit
def gemv_one_product(X, W, w_rows, rm, m_ok, w_ok, K, stride_xm, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PASSES: tl.constexpr,
                     W_FP8: tl.constexpr, UNROLL_K: tl.constexpr, THREAD_SUM: tl.constexpr):
    """x·Wᵀ for one row rm [1] of X over this program's K-slice, as gemv_two_products does it
    (UNROLL_K and THREAD_SUM too), for a LayerNorm folded into the loop (PASSES == 1):
    returns the product [1, BLOCK_N], the row's Σx and Σx² [1] and the weight rows' Σw
    [BLOCK_N] (zeros with PASSES == 2)."""
    k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm.to(tl.int64) * stride_xm + (k_begin + rk)  # [1] + [BLOCK_K]
    w_ptrs = W + (w_rows + (k_begin + rk)[:, None])  # [BLOCK_K, BLOCK_N], K contiguous
    # THREAD_SUM: V = a 16-byte run of weight elements (one vector load a thread).
    V: tl.constexpr = 128 // W.dtype.element_ty.primitive_bitwidth if THREAD_SUM else 1
    acc = tl.zeros([BLOCK_K // V, BLOCK_N], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_K // V, BLOCK_N], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_K], dtype=tl.float32)
    x_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K * (1 + UNROLL_K)):
        for u in tl.static_range(1 + UNROLL_K):
            step = u * BLOCK_K
            k_ok = rk < k_end - k0 - step  # as in gemv_two_products
            x = tl.load(x_ptrs + step, mask=k_ok & m_ok, other=0.0)
            w = gemv_weight(tl.load(w_ptrs + step, mask=k_ok[:, None] & w_ok[None, :],
                                    other=0.0, eviction_policy="evict_first"), W_FP8)
            xf = x.to(tl.float32)
            if V == 1:
                if PASSES == 1:
                    w_sum += w
                acc += w * xf[:, None]
            else:
                if PASSES == 1:
                    w_sum += tl.sum(tl.reshape(w, [BLOCK_K // V, V, BLOCK_N]), axis=1)
                acc += tl.sum(tl.reshape(w * xf[:, None], [BLOCK_K // V, V, BLOCK_N]), axis=1)
            if PASSES == 1:
                x_sum += xf
                x_sq += xf * xf
        x_ptrs += BLOCK_K * (1 + UNROLL_K)
        w_ptrs += BLOCK_K * (1 + UNROLL_K)
    one = tl.zeros([1], dtype=tl.float32)
    return (tl.sum(acc, axis=0)[None, :], one + tl.sum(x_sum, axis=0),
            one + tl.sum(x_sq, axis=0), tl.sum(w_sum, axis=0))


@triton.jit
def mma_two_products(X, G, WA, wa_rows, WB, wb_rows, rm, m_ok, w_ok, K, stride_xm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, PASSES: tl.constexpr, IEEE: tl.constexpr,
                     W_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """two_products with the tensor cores: x·Waᵀ and x·Wbᵀ over this program's K-slice for the
    rows rm of X [M, K] (row stride stride_xm). wa_rows / wb_rows [1, BLOCK_N] are the element
    offsets (int64) of the weight rows in WA / WB, read transposed as [BLOCK_K, BLOCK_N] tiles
    (w_ok: which of the rows exist) and converted as W_FP8 says (mma_weight). With PASSES == 1
    x is scaled by the RMSNorm weight G on the way and the rows' sums of x² come back too
    (zeros otherwise). INTERPRETED: see dot."""
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
        wa = mma_weight(wa, x, W_FP8)  # FP8 weights: upcast to x's type, or kept as FP8
        wb = mma_weight(wb, x, W_FP8)
        if PASSES == 1:
            g = tl.load(G + k0 + rk, mask=k_ok, other=0.0)
            x, x_sumsq = rms_scaled(x, g)
            sumsq += x_sumsq
        # With PASSES == 2 the tiles go from memory to the tensor cores untouched (but for the
        # upcast of FP8 weights), which lets the compiler keep the asynchronous load/MMA
        # pipeline that large M needs.
        acc_a = dot(x, wa, acc_a, IEEE, INTERPRETED)
        acc_b = dot(x, wb, acc_b, IEEE, INTERPRETED)
        x_ptrs += BLOCK_K
        wa_ptrs += BLOCK_K
        wb_ptrs += BLOCK_K
    return acc_a, acc_b, sumsq


@triton.jit
def tma_two_products(XD, WAD, WBD, m0, na0, nb0, K, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """mma_two_products for operands that reach the tensor cores untouched (PASSES == 2,
    weights in x's dtype, or FP8 beside FP8 activations), read through TMA descriptors: XD
    over X [M, K] with [BLOCK_M, BLOCK_K] boxes, WAD and WBD over weight rows [N, K] with
    [BLOCK_N, BLOCK_K] boxes. The copy engine moves each tile into shared memory by itself (no
    address arithmetic or masks in the loop; boxes past an edge of a matrix, including a
    partial last K-step, arrive zero-filled), for the rows from m0, the rows of WAD from na0
    and those of WBD from nb0, over this program's K-slice. The weight tiles arrive as
    [BLOCK_N, BLOCK_K] and are multiplied transposed. INTERPRETED: see dot."""
    k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = XD.load([m0, k0])
        acc_a = dot(x, WAD.load([na0, k0]).T, acc_a, IEEE, INTERPRETED)
        acc_b = dot(x, WBD.load([nb0, k0]).T, acc_b, IEEE, INTERPRETED)
    return acc_a, acc_b


@triton.jit
def tma_one_product(XD, WD, m0, n0, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """tma_two_products for one weight (WD over W [N, K]): x·Wᵀ over this program's
    K-slice. INTERPRETED: see dot."""
    k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = dot(XD.load([m0, k0]), WD.load([n0, k0]).T, acc, IEEE, INTERPRETED)
    return acc


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
def dot(a, b, acc, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a·b; with IEEE, exact float32 products (float32 inputs) instead of tf32.
    INTERPRETED (the launcher's: Triton's CPU interpreter runs the kernel; False for every
    compiled kernel, whose code it leaves as it was): bfloat16 tiles are widened to float32
    and multiplied exactly, the products the tensor cores make of them."""
    if INTERPRETED and a.dtype == tl.bfloat16:
        # The interpreter's tl.dot multiplies bfloat16 bit patterns as integers: widen first.
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
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


def gemv_split_k(tiles: int, k: int, block_k: int, gpu: GpuSpec) -> int:
    """A GEMV's default SPLIT_K for `tiles` column-blocks: the GEMV streams the weights once,
    so K is split until there are about four programs per SM (every SM keeps loads in flight
    to the end), at most 8 ways and each part at least two K-steps long."""
    split = 1
    while split < 8 and tiles * split < 4 * gpu.sms and split * 2 * block_k <= k:
        split *= 2
    return split


def default_tiles(point: Point, gpu: GpuSpec, resources: Callable[[Config, Point], Resources],
                  n: int, k: int) -> Config:
    """Tutorial-style tiles for an [M = point.rows, k] x [k, n] product: tall-skinny with the
    norm folded in and K split for decode, 128x128 after a separate norm pass (PASSES = 2) for
    prefill; then fewer stages (and smaller tiles) until `gpu` can hold the config."""
    m = point.rows
    if m == 1:  # one row: the GEMV structure (gemv_two_products)
        c = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
             "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
    elif m <= 16:
        # The norm pass first (PASSES = 2), then a plain K loop without split-K: the pass is
        # cheap at a few rows, while a folded norm rescales x in every column-block's loop and
        # a split K adds the partial sums' round trip and a second launch.
        c = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "PASSES": 2,
             "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    elif m <= 128:
        c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 1,
             "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    else:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
             "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    if point.fp8_activations:  # the norm pass chooses each row's scale first
        c["PASSES"] = 2
    c["UNROLL_K"] = 0
    c["SPREAD"] = 0
    c["THREAD_SUM"] = 0
    c["UNFUSED"] = 0  # the fused kernel: the unfused form is the tuner's to choose
    # Tiles through TMA descriptors at thousands of rows, operands that reach the tensor cores
    # as loaded (16-bit weights, or FP8 beside FP8 activations): the copy engine fills the
    # pipeline's buffers with no address arithmetic or masks in the loop, which pays for long
    # products; at a few hundred rows TMA tiles were slower, so pointers stay there. Where the
    # structure has no TMA loop, canonical drops it.
    as_loaded = not point.weights or point.fp8_activations
    c["TMA"] = int(gpu.tma and m >= 2048 and k >= TMA_MIN_K and as_loaded)
    if m == 1:
        c["SPLIT_K"] = gemv_split_k(-(-n // c["BLOCK_N"]), k, c["BLOCK_K"], gpu)
        if point.weights:
            # FP8 weights in the GEMV loop: half the bytes per tile, so two K-steps per
            # iteration (twice the bytes in flight per wait) and wider, shorter tiles; K split
            # as for the 16-bit tiles.
            c.update(BLOCK_N=16, BLOCK_K=256, UNROLL_K=1)
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
    if c.get("SPREAD") and (c["BLOCK_M"] > 1 or c["BLOCK_N"] == 1 or c["BLOCK_N"] >= n):
        # Spread rows are for the GEMV structure (tensor-core tiles store whole rows of
        # adjacent columns, and TMA reads adjacent rows); one row, or one block, is the same
        # either way.
        c["SPREAD"] = 0
    if c["BLOCK_M"] == 1:
        # The GEMV loop has no software pipeline: num_stages changes nothing.
        c["num_stages"] = 1
    else:
        c["BLOCK_N"] = max(c["BLOCK_N"], 16)  # tl.dot needs 16 columns
        if "UNROLL_K" in c:  # the tensor-core loop is pipelined by num_stages instead
            c["UNROLL_K"] = 0
        if "THREAD_SUM" in c:  # a flag of the one-row loop only
            c["THREAD_SUM"] = 0
    c["BLOCK_N"] = min(c["BLOCK_N"], max(16, next_pow2(n)))
    c["BLOCK_K"] = min(c["BLOCK_K"], max(16, next_pow2(k)))
    if -(-rows // c["BLOCK_M"]) == 1:
        c["GROUP_M"] = 1
    steps = -(-k // c["BLOCK_K"])
    while c["SPLIT_K"] > 1 and c["SPLIT_K"] > steps:
        c["SPLIT_K"] //= 2
    if c.get("UNROLL_K") and -(-steps // c["SPLIT_K"]) < 2:  # one K-step: nothing to unroll
        c["UNROLL_K"] = 0
    return c


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device `index`."""
    return torch.cuda.get_device_capability(index)


def check_tma(kernel: str, device: torch.device) -> None:
    """ValueError unless kernels on `device` can read tiles through TMA descriptors (TMA = 1:
    compute capability 9.0+, or the interpreter)."""
    if device.type != "cuda":
        if interpreting():
            return
        raise ValueError(f"{kernel}: TMA=1 needs a CUDA GPU of compute capability 9.0+; use TMA=0")
    major, minor = cuda_capability(device.index if device.index is not None
                                   else torch.cuda.current_device())
    if (major, minor) < (9, 0):
        raise ValueError(f"{kernel}: TMA=1 needs TMA descriptors (compute capability 9.0+), "
                         f"{device} has compute capability {major}.{minor}; use TMA=0")


def tma_structure(config: Config) -> bool:
    """Whether the config's structure has the TMA loop: tensor-core tiles (BLOCK_M > 1) after a
    norm pass (PASSES = 2), boxes of at most TMA_MAX_BOX per side."""
    return (config["BLOCK_M"] > 1 and config["PASSES"] == 2
            and max(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) <= TMA_MAX_BOX)


def use_tma(config: Config, w_fp8: int, *tensors: torch.Tensor) -> bool:
    """Whether a launch reads its tiles through TMA descriptors: the config asks for it (TMA),
    its structure has the TMA loop (what collapse_tma keeps: tensor-core tiles after a norm
    pass, boxes of at most TMA_MAX_BOX, weights as the MMA takes them: W_FP8 0, x's dtype or
    FP8 beside FP8 activations) and the descriptors can cover these 2-D tensors (unit column
    stride, start and row stride on 16-byte boundaries). Otherwise the same tiles are read by
    pointers."""
    return (bool(config.get("TMA")) and tma_structure(config) and w_fp8 == 0
            and all(t.ndim == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
                    and t.stride(0) * t.element_size() % 16 == 0 for t in tensors))


def tma_descriptors(kernel: str, config: Config, w_fp8: int, x: torch.Tensor,
                    weights: Sequence[torch.Tensor]) -> list[TensorDescriptor] | None:
    """Where the launch reads its tiles through TMA (use_tma; the device checked by
    check_tma): descriptors over x with [BLOCK_M, BLOCK_K] boxes and over each of `weights`
    with [BLOCK_N, BLOCK_K] boxes, in that order. None: the same tiles by pointers."""
    if not use_tma(config, w_fp8, x, *weights):
        return None
    check_tma(kernel, x.device)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    return [TensorDescriptor.from_tensor(x, [bm, bk]),
            *(TensorDescriptor.from_tensor(w, [bn, bk]) for w in weights)]


def collapse_tma(config: Config, point: Point, k: int, kernel_has_tma: bool = True) -> Config:
    """TMA = 1 only where the K loop can take it: a kernel with the TMA loop
    (`kernel_has_tma`), tensor-core tiles (BLOCK_M > 1) that reach the MMA untouched
    (PASSES = 2; weights in x's dtype, or FP8 weights beside FP8 activations), boxes of at
    most TMA_MAX_BOX per side, and rows of k elements that start on 16-byte boundaries (what a
    descriptor needs)."""
    c = dict(config)
    fp8_operands = bool(point.weights) and point.fp8_activations
    elt = 1 if fp8_operands else DTYPE_BYTES[point.dtype]
    if c.get("TMA") and not (
            kernel_has_tma and tma_structure(c) and (not point.weights or fp8_operands)
            and k * elt % 16 == 0):
        c["TMA"] = 0
    return c


def tma_smem(config: Config, x_elt: int, w_elt: int, n_weights: int) -> int:
    """Shared memory of the TMA loop (tma_two_products, tma_one_product): the copy engine
    fills num_stages full sets of tiles (an x tile of x_elt-byte elements, `n_weights` weight
    tiles of w_elt-byte ones), each set with its barrier."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    return config["num_stages"] * (bm * bk * x_elt + n_weights * bk * bn * w_elt) + 1024


# BLOCK_M = 1 reads the weights once per row and multiplies them in float32 on the CUDA cores,
# where a 16-row tensor-core tile reads them once for all its rows: from two rows on the tile
# is the better structure, so the one-row structure serves one row.
GEMV_MAX_ROWS = 1


def gemv_flag(config: Config, name: str) -> int:
    """The value a launch passes for `name`, a flag of the one-row structure only (SPREAD,
    THREAD_SUM): the config's (absent: 0) where BLOCK_M == 1, else 0."""
    return int(bool(config.get(name)) and config["BLOCK_M"] == 1)


def gemv_resources(config: Config, rows: int, w_bytes: int, n_weights: int) -> Resources:
    """Resources of a BLOCK_M = 1 config (gemv_two_products): float32 accumulators of
    n_weights [BLOCK_K, BLOCK_N] tiles plus the loaded tiles (w_bytes per element; two K-steps'
    worth with UNROLL_K) in registers; shared memory only for the final cross-warp sums
    (<= 4·BLOCK_K bytes on sm_90)."""
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    threads = 32 * config["num_warps"]
    loaded = w_bytes * (1 + config.get("UNROLL_K", 0))
    # THREAD_SUM: one float32 accumulator per 16-byte run of a weight row instead of one per
    # element.
    acc = 4 * w_bytes / 16 if config.get("THREAD_SUM") else 4
    regs = int(n_weights * bk * bn * (acc + loaded) / 4 + bk) // threads + 32
    unfit = ""
    if rows > GEMV_MAX_ROWS:
        unfit = (f"structure: BLOCK_M=1 (one row per program) re-reads the weights for each of "
                 f"the {rows} rows; it is for at most {GEMV_MAX_ROWS} row(s)")
    return Resources(smem_bytes=4 * bk, regs_per_thread=regs, threads=threads, unfit=unfit)


def pipelined_smem(config: Config, elt: int, n_weights: int, epilogue: bool,
                   operands: tuple[int, int, bool] | None = None) -> int:
    """Shared memory of a K loop over an x tile and `n_weights` weight tiles.

    Software pipelining keeps (num_stages - 1) sets of tiles; with `epilogue` the compiler
    also stages the [BLOCK_M, BLOCK_N] output tile through shared memory (it does for ffn's
    two-accumulator epilogue, not for lola's). Checked against Triton's own allocation for
    sm_90 (tests/kernels/test_ffn.py, test_lola.py). float32 operands are laid out
    differently: num_stages sets, no epilogue term. With PASSES = 2 (operands not modified in
    registers) Hopper keeps num_stages sets.

    `operands` (fp8.operand_bytes): bytes per x and per weight element in the pipelined tiles
    (1 for FP8) and whether the weight tiles are converted in registers; then the weights count
    as modified operands and, where Hopper's wgmma would read them (BLOCK_M >= 64), the
    converted tiles (x's type) are staged in shared memory once more, since wgmma reads its
    second operand from there. Default: both in the activations' type (`elt`), untouched.
    """
    x_elt, w_elt, converted = operands or (elt, elt, False)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    stages = config["num_stages"]
    tile = bm * bk * x_elt + n_weights * bk * bn * w_elt
    wgmma = bm >= 64 and config["num_warps"] >= 4
    staged = n_weights * bk * bn * elt if converted and wgmma else 0
    if elt == 4:
        return stages * tile + staged
    out_tile = bm * bn * elt if epilogue else 0
    folded = (stages - 1) * tile + out_tile + 1024 + staged
    if config.get("PASSES", 1) == 2 and wgmma and not converted:
        # Untouched operands go to the tensor cores straight from shared memory: with wgmma
        # (Hopper, BLOCK_M >= 64) the compiler then keeps num_stages full sets of tiles.
        return max(folded, stages * tile)
    if config.get("PASSES", 1) == 2 and wgmma:
        # Weight tiles upcast in registers after a norm pass: Triton 3.6 on sm_90 keeps
        # num_stages sets of the loaded tiles plus BLOCK_K x BLOCK_N bytes per weight.
        return max(folded, stages * tile + n_weights * bk * bn * w_elt)
    return folded


# The jit helpers a kernel built on two_products compiles in: part of its source hash.
TWO_PRODUCT_SOURCES = (grouped_tile, block_rows, k_slice, partial_ptrs, two_products,
                       mma_two_products, gemv_two_products, tma_two_products, two_partials_added,
                       store_two_partials, dot,
                       rms_scaled, fp8_as_f16, mma_weight, gemv_weight, scale_product,
                       rms_scaled_products)
