"""The attention input projection, fused: RMSNorm -> Q, K, V projections (+ bias) -> RoPE.

    q, k, v = qkv(x, rms_weight, wq, wk, wv, cos, sin, eps=1e-5, head_dim=128,
                  interleaved=False)

x [batch, seq, dim]; wq [n_heads·head_dim, dim], wk and wv [n_kv_heads·head_dim, dim]
(nn.Linear layout; n_kv_heads < n_heads is grouped-query attention); q [batch, seq, n_heads,
head_dim], k and v [batch, seq, n_kv_heads, head_dim].

RoPE takes its angles from the caller's tables, as Hugging Face's rotary embeddings return
them: cos and sin [batch or 1, seq, head_dim] (or head_dim/2), column i < head_dim/2 holding
the cosine and sine of pair i's angle for that token. So the model's own positions (a row per
token: left-padded batches differ per row), inverse frequencies, rope scaling and attention
scaling are exactly what the kernel applies, and nothing about them is a Python number baked
into the launch (a replayed CUDA graph reads the tables anew).

One launch covers the three matrices. A program computes BLOCK_N rotation *pairs* of one
matrix for BLOCK_M rows: two accumulators hold the two columns of each pair (2i, 2i+1 when
interleaved, i and i + head_dim/2 otherwise: Hugging Face's rotate_half), so RoPE is applied in
the epilogue without any exchange between programs. RMSNorm folds into the matmul as in ffn.py
(x ⊙ g in the K loop, rstd per row in the epilogue). V goes through the same code without the
rotation. The weights are in x's dtype or in FP8 with per-output-channel scales (fp8.py),
applied before the bias and RoPE.

Tunables (search_spaces/qkv.yaml): BLOCK_M, BLOCK_N (pairs per program), BLOCK_K, GROUP_M,
PASSES, SPLIT_K, UNROLL_K, SPREAD, THREAD_SUM, TMA, num_warps, num_stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels import _unfused, fp8
from fusetune.kernels._call_memo import CallMemo, tensor_key
from fusetune.kernels._direct import direct
from fusetune.kernels._matmul import (
    TWO_PRODUCT_SOURCES,
    block_rows,
    default_tiles,
    gemv_split_k,
    grouped_tile,
    rms_scaled_products,
    store_two_partials,
    tma_descriptors,
    tma_two_products,
    two_partials_added,
    two_products,
)
from fusetune.kernels._matmul_spec import (
    MATMUL_HOST_SOURCES,
    MATMUL_SPEC_FIELDS,
    first_pass,
    launch_args,
    launch_split,
    matmul_canonical,
    matmul_padding,
    matmul_resources,
    weight_bytes,
)
from fusetune.kernels._replay import scratch
from fusetune.kernels._rotary import (
    PAIRING,
    as_tables,
    check_tables,
    head_dim_problem,
    rotary_tables,
    rotated,
)
from fusetune.kernels.rmsnorm import _rmsnorm_kernel, norm_rows
from fusetune.models import ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    ConfigError,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    cdiv,
    check_device,
    check_eps,
    check_no_grad,
    dtype_name,
    next_pow2,
    torch_dtype,
)


@triton.jit
def _qkv_kernel(
    X,  # *[M, K] activations (M = batch·seq tokens; FP8 with ACT_FP8), row stride stride_xm
    # (with TMA a descriptor over the same tensor)
    G,  # *[K] RMSNorm weight
    WQ, WK, WV,  # *[Nq, K], *[Nkv, K], *[Nkv, K] weights (nn.Linear layout, unit column stride)
    # With TMA: descriptors over the rows of each pair's column a and of its column b, for
    # WQ, WK and WV (INTERLEAVED: the even rows W[0::2] and the odd rows W[1::2]; otherwise
    # W itself twice). None without TMA (the launcher's Python cost grows with each tensor).
    QA, QB, KA, KB, VA, VB,
    OQ, OK, OV,  # *[M, Nq], *[M, Nkv], *[M, Nkv] outputs, contiguous
    WS,  # *[2·SPLIT_K, M, NQ_PAIRS + 2·NKV_PAIRS] float32 partial products (split-K only)
    WSQ,  # *[SPLIT_K, M] float32 partial sums of x² (split-K with PASSES == 1 only)
    SX,  # *[M] float32 scales of X's rows (ACT_FP8 only)
    SQ, SK, SV,  # *[Nq], *[Nkv], *[Nkv] float32 per-output-channel weight scales (W_SCALED)
    BQ, BK, BV,  # *[Nq], *[Nkv], *[Nkv] biases (HAS_BIAS)
    QN, KN,  # *[head_dim] RMSNorm weights of each q head and each k head (QK_NORM)
    COS, SIN,  # *[B or 1, S, >= HALF] RoPE tables, unit column stride: column i is pair i's
    M, K, S,  # tokens (batch·seq), model width, sequence length: token m is (m // S, m % S)
    NQ_PAIRS, NKV_PAIRS,  # Nq / 2 and Nkv / 2
    HALF,  # head_dim / 2: pairs per head
    stride_xm, stride_wq, stride_wk, stride_wv,
    stride_cb, stride_cs,  # the tables' batch stride (0: one row of positions for the batch)
    eps,
    qk_eps,  # the q/k norms' epsilon (QK_NORM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # pairs per program
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PASSES: tl.constexpr,  # 1: RMSNorm folded into the K loop; 2: X already normalized
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a slice of K
    FINISH: tl.constexpr,  # the split-K finishing pass: add the partials up, then the epilogue
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (_matmul.dot)
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.mma_weight)
    ACT_FP8: tl.constexpr,  # X is FP8 with row scales SX (PASSES == 2 only)
    W_SCALED: tl.constexpr,  # the weights have per-output-channel scales SQ, SK, SV
    UNROLL_K: tl.constexpr,  # BLOCK_M == 1: two K-steps per loop iteration (gemv_two_products)
    SPREAD: tl.constexpr,  # BLOCK_M == 1: the program's BLOCK_N pairs far apart (block_rows)
    THREAD_SUM: tl.constexpr,  # BLOCK_M == 1: each thread adds its weight run up first
    TMA: tl.constexpr,  # X and the weight rows are read through descriptors (tma_two_products)
    HAS_BIAS: tl.constexpr,  # BQ, BK, BV are added before the rotation
    QK_NORM: tl.constexpr,  # each q and k head is RMS-normalized (QN, KN) before the rotation
    HEAD_PAIRS: tl.constexpr,  # QK_NORM: HALF, which then divides BLOCK_N (whole heads a tile)
):
    # Column-blocks of the three matrices side by side: [Q blocks | K blocks | V blocks].
    nb_q = tl.cdiv(NQ_PAIRS, BLOCK_N)
    nb_kv = tl.cdiv(NKV_PAIRS, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), nb_q + 2 * nb_kv, GROUP_M)

    # Which matrix this program works on; V is not rotated. `first` is the matrix's first pair
    # in the workspace's columns [Q pairs | K pairs | V pairs].
    # (as a [BLOCK_N] mask: a scalar condition in a load's mask is not a mask everywhere)
    rotate = (tl.zeros([BLOCK_N], dtype=tl.int32) + pid_n) < nb_q + nb_kv
    if pid_n < nb_q:
        W, Y, stride_w, n_pairs, blk, first = WQ, OQ, stride_wq, NQ_PAIRS, pid_n, 0 * NQ_PAIRS
        SW = SQ
        BW = BQ
        NW = QN
    elif pid_n < nb_q + nb_kv:
        W, Y, stride_w, n_pairs, blk, first = WK, OK, stride_wk, NKV_PAIRS, pid_n - nb_q, NQ_PAIRS
        SW = SK
        BW = BK
        NW = KN
    else:
        W, Y, stride_w, n_pairs, blk, first = (WV, OV, stride_wv, NKV_PAIRS, pid_n - nb_q - nb_kv,
                                               NQ_PAIRS + NKV_PAIRS)
        SW = SV
        BW = BV
        NW = QN  # not read: V is not normalized

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = block_rows(blk, n_pairs, BLOCK_N, SPREAD)  # pair index within the matrix
    m_ok = rm < M
    p_ok = p < n_pairs
    mp_ok = m_ok[:, None] & p_ok[None, :]
    all_pairs = NQ_PAIRS + 2 * NKV_PAIRS
    head = p // HALF
    i = p % HALF  # pair index within the head: its column in the RoPE tables
    if INTERLEAVED:
        col_a = head * (2 * HALF) + 2 * i
        col_b = col_a + 1
    else:
        col_a = head * (2 * HALF) + i
        col_b = col_a + HALF

    if FINISH:
        acc_a, acc_b, sumsq = two_partials_added(WS, WSQ, rm, first + p, m_ok, mp_ok, M,
                                                 all_pairs, BLOCK_M, BLOCK_N, SPLIT_K, PASSES)
    elif TMA:
        # The tile's pairs p0 .. p0 + BLOCK_N - 1 as rows of the descriptors: row p of the even
        # and odd rows when interleaved; otherwise the pairs lie in one head (the launcher
        # checks HALF % BLOCK_N == 0), their columns a are the contiguous rows from
        # head·2·HALF + i0 of W, their columns b HALF rows further on.
        p0 = blk * BLOCK_N
        m0 = pid_m * BLOCK_M
        if INTERLEAVED:
            ra = p0
            rb = p0
        else:
            ra = (p0 // HALF) * (2 * HALF) + p0 % HALF
            rb = ra + HALF
        # The matrix's descriptors are picked first and one loop reads through them: a loop
        # per matrix has pipeline buffers of its own (twice the shared memory).
        if pid_n < nb_q:
            DA = QA
            DB = QB
        elif pid_n < nb_q + nb_kv:
            DA = KA
            DB = KB
        else:
            DA = VA
            DB = VB
        acc_a, acc_b = tma_two_products(X, DA, DB, m0, ra, rb, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                        SPLIT_K, IEEE, INTERPRETED)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # not read: PASSES == 2
    else:
        # Weight rows col_a and col_b, read transposed as [BLOCK_K, BLOCK_N] tiles.
        acc_a, acc_b, sumsq = two_products(X, G, W, col_a[None, :].to(tl.int64) * stride_w,
                                           W, col_b[None, :].to(tl.int64) * stride_w, rm, m_ok,
                                           p_ok, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                           PASSES, IEEE, W_FP8, UNROLL_K, THREAD_SUM,
                                           INTERPRETED)

    if SPLIT_K > 1 and not FINISH:
        store_two_partials(WS, WSQ, acc_a, acc_b, sumsq, rm, first + p, m_ok, mp_ok, M,
                           all_pairs, pid_n == 0, PASSES)
    else:
        # The scales of the FP8 operands (x's row scales, those of the weight rows col_a and
        # col_b) and rstd.
        a, b = rms_scaled_products(acc_a, acc_b, sumsq, K, eps, SX, rm, m_ok, SW, col_a, SW,
                                   col_b, p_ok, ACT_FP8, W_SCALED, PASSES)
        if HAS_BIAS:  # q = x·Wᵀ + b first, then the rotation
            a += tl.load(BW + col_a, mask=p_ok, other=0.0).to(tl.float32)[None, :]
            b += tl.load(BW + col_b, mask=p_ok, other=0.0).to(tl.float32)[None, :]
        if QK_NORM:
            # The tile holds whole heads (HEAD_PAIRS divides BLOCK_N, SPREAD 0: the launcher's
            # configs), HEAD_PAIRS consecutive pairs each: the mean of a head's squares over
            # its 2·HEAD_PAIRS columns, then the norm's weight of each column within the head
            # (pair i's columns a and b). Masked pairs are 0 and add nothing; V's lanes keep
            # their values (rotate is False there).
            heads: tl.constexpr = BLOCK_N // HEAD_PAIRS
            sq = tl.reshape(a * a + b * b, [BLOCK_M, heads, HEAD_PAIRS])
            rstd = tl.rsqrt(tl.sum(sq, axis=2) / (2 * HEAD_PAIRS) + qk_eps)
            r = tl.reshape(tl.broadcast_to(rstd[:, :, None], [BLOCK_M, heads, HEAD_PAIRS]),
                           [BLOCK_M, BLOCK_N])
            in_head_a = col_a - head * (2 * HALF)
            nw_ok = p_ok & rotate
            wa = tl.load(NW + in_head_a, mask=nw_ok, other=1.0).to(tl.float32)
            wb = tl.load(NW + in_head_a + (col_b - col_a), mask=nw_ok, other=1.0).to(tl.float32)
            norm = rotate[None, :]
            a = tl.where(norm, a * r * wa[None, :], a)
            b = tl.where(norm, b * r * wb[None, :], b)
        # RoPE in float32 with the tables' cos and sin of token m's row, column i. V's lanes
        # read nothing: cos 1 and sin 0 leave them as they are.
        t_off = (rm // S).to(tl.int64) * stride_cb + (rm % S).to(tl.int64) * stride_cs
        cs_off = t_off[:, None] + i[None, :]
        cs_ok = mp_ok & rotate[None, :]
        cos = tl.load(COS + cs_off, mask=cs_ok, other=1.0).to(tl.float32)
        sin = tl.load(SIN + cs_off, mask=cs_ok, other=0.0).to(tl.float32)
        ya = a * cos - b * sin
        yb = a * sin + b * cos
        # Outputs are contiguous [M, N]: row stride 2 · n_pairs.
        o_row = Y + rm[:, None].to(tl.int64) * (2 * n_pairs)
        if INTERLEAVED and not SPREAD:
            # Pair p is columns 2p and 2p + 1: the tile's pairs are 2·BLOCK_N contiguous
            # columns from 2·blk·BLOCK_N. Interleaving ya and yb in registers makes that one
            # row of wide stores instead of two scattered 2-byte ones.
            y = tl.join(ya, yb).reshape(BLOCK_M, 2 * BLOCK_N)
            c = blk * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            tl.store(o_row + c[None, :], y.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & (c < 2 * n_pairs)[None, :])
        else:  # the pairs' columns a and b, wherever they lie
            tl.store(o_row + col_a[None, :], ya.to(Y.dtype.element_ty), mask=mp_ok)
            tl.store(o_row + col_b[None, :], yb.to(Y.dtype.element_ty), mask=mp_ok)


# q's and k's per-head RMSNorm weights [head_dim] and their epsilon (Qwen3's q_norm, k_norm)
QkNorm = tuple[torch.Tensor, torch.Tensor, float]


def tma_pairs(interleaved: bool, head_dim: int, block_n: int) -> bool:
    """Whether the TMA loop can read tiles of `block_n` pairs: interleaved pairs always (even
    and odd rows); half-split pairs where a tile's pairs lie in one head (see the kernel)."""
    return interleaved or (head_dim // 2) % block_n == 0


def _launch_2d(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
               wv: torch.Tensor, oq: torch.Tensor, ok: torch.Tensor, ov: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, seq: int, head_dim: int, eps: float,
               interleaved: bool, config: Config,
               scales: tuple[torch.Tensor, ...] | None = None,
               biases: tuple[torch.Tensor, ...] | None = None, act: bool = False,
               qk_norm: QkNorm | None = None) -> None:
    """x [M, K] (M = batch·seq rows); weights [N, K] with unit column stride (x's dtype or FP8,
    one dtype for the three, with per-channel scales `scales` = (sq, sk, sv) or None); biases
    (bq, bk, bv) or None; cos and sin [B or 1, seq, >= head_dim/2] with unit column stride;
    outputs contiguous [M, N]; `act`: FP8 activations; `qk_norm`: (q's and k's norm weights
    [head_dim], their epsilon), whose configs keep whole heads in a tile or split K (a
    finishing pass over whole heads: `_resources`).

    PASSES = 2: RMSNorm runs first as its own kernel (tuned config from the tables) and the
    matmul reads its output; with FP8 activations that pass always runs and writes the rows in
    e4m3 with a scale each (fp8.norm_fp8_rows), and the K loop multiplies FP8 by FP8.
    SPLIT_K > 1: SPLIT_K programs per output tile write float32 partial sums, and a second
    launch of the same kernel (FINISH) adds them up and applies RoPE.
    """
    m, k = x.shape
    if m == 0:
        return
    if _unfused.unfused(config):
        _unfused_2d(x, g, (wq, wk, wv), (oq, ok, ov), cos, sin, seq, head_dim, eps,
                    interleaved, scales, biases, act, qk_norm)
        return
    x, sx = first_pass(x, g, eps, config, act, lambda t: norm_rows(t, g, eps))
    gemv = config["BLOCK_M"] == 1
    wq, w_fp8 = fp8.weight_operand(wq, act, gemv)
    wk, _ = fp8.weight_operand(wk, act, gemv)
    wv, _ = fp8.weight_operand(wv, act, gemv)
    sq, sk, sv = scales if scales is not None else (oq, oq, oq)
    half = head_dim // 2
    bn = config["BLOCK_N"]
    # TMA: x and the rows of each pair's two columns through descriptors (see the kernel),
    # where the config asks for it and the tensors allow it; half-split pairs only where a
    # tile's pairs lie in one head. Else the same tiles by pointers.
    # The strided views are made only then: at decode this launch path costs more CPU time
    # than the kernel takes on the GPU, and six views are a fifth of it.
    descs = None
    if config.get("TMA") and tma_pairs(interleaved, head_dim, bn):
        rows = [r for w in (wq, wk, wv)
                for r in ((w[0::2], w[1::2]) if interleaved else (w, w))]
        descs = tma_descriptors("qkv", config, w_fp8, x, rows)
    xa, *row_descs = descs or (x, *[None] * 6)
    nq_pairs, nkv_pairs = wq.shape[0] // 2, wk.shape[0] // 2
    split = config["SPLIT_K"]
    ws = wsq = oq  # not read unless split > 1
    if split > 1:
        ws = scratch((2 * split, m, nq_pairs + 2 * nkv_pairs), torch.float32, x.device)
        wsq = scratch((split, m), torch.float32, x.device)
    n_blocks = cdiv(nq_pairs, bn) + 2 * cdiv(nkv_pairs, bn)
    args = launch_args(config, act=act, w_fp8=w_fp8, ieee=x.dtype == torch.float32,
                       w_scaled=scales is not None, tma=descs is not None)
    bq, bk, bv = biases if biases is not None else (oq, oq, oq)
    qn, kn, qk_eps = qk_norm if qk_norm is not None else (oq, oq, 0.0)
    stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0  # one row of positions: broadcast

    # Split-K with the q/k norms: only the finishing pass normalizes, so only its tiles must
    # hold whole heads. Where the products' tiles do not, it runs over tiles of whole heads
    # (BLOCK_N rounded up to them, SPREAD 0): the partials lie in the workspace by pair index,
    # whichever tile wrote them.
    finish_args, finish_tiles = args, 0
    if qk_norm is not None and split > 1 and (bn % half or args["SPREAD"]):
        fbn = half * cdiv(bn, half)
        finish_args = {**args, "BLOCK_N": fbn, "SPREAD": 0}
        finish_tiles = cdiv(m, config["BLOCK_M"]) * (cdiv(nq_pairs, fbn)
                                                     + 2 * cdiv(nkv_pairs, fbn))

    def launch(grid: tuple[int, int], finish: bool) -> None:
        a = args
        if finish and finish_tiles:
            a, grid = finish_args, (finish_tiles, 1)
        direct(_qkv_kernel)[grid](
            xa, g, wq, wk, wv, *row_descs, oq, ok, ov, ws, wsq, oq if sx is None else sx, sq,
            sk, sv, bq, bk, bv, qn, kn, cos, sin, m, k, seq, nq_pairs, nkv_pairs, half,
            x.stride(0), wq.stride(0), wk.stride(0), wv.stride(0), stride_cb, cos.stride(1),
            eps, qk_eps, INTERLEAVED=interleaved, FINISH=finish, HAS_BIAS=biases is not None,
            QK_NORM=qk_norm is not None, HEAD_PAIRS=half if qk_norm is not None else 1, **a,
        )

    launch_split(launch, cdiv(m, config["BLOCK_M"]) * n_blocks, split)


@triton.jit
def _unfused_finish_kernel(
    WS,  # *[T, (HQ + 2·HK)·D] the stacked GEMM's output: each row's q, k, then v heads
    Q, K, V,  # *[T, HQ·D], [T, HK·D], [T, HK·D] outputs, contiguous
    COS, SIN,  # *[B or 1, S, >= D/2] tables, unit column stride: column i is pair i's
    QN, KN,  # *[D] q's and k's per-head norm weights (QK_NORM only)
    T, S,  # tokens = B * S; token t is (t // S, t % S)
    HQ, HK,  # q heads, k (and v) heads
    HALF,  # D // 2 pairs per head
    stride_ws,  # WS's row stride
    stride_cb, stride_cs,  # the tables' batch stride (0: one row of positions) and seq stride
    qk_eps,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF (tail pairs masked)
    INTERLEAVED: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    # The unfused form's work after its GEMM, in one launch (what the rmsnorm, rope and copy
    # kernels would do in five): program (pid_t, pid_h) owns BLOCK_T tokens and BLOCK_H of the
    # HQ + 2·HK heads of the workspace's rows. A head h < HQ is q's (normalized by QN where
    # QK_NORM, rotated, written to Q), HQ <= h < HQ + HK k's (KN, rotated, K), the rest v's
    # (copied to V as they are). Lanes past T, the heads or HALF are masked off.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    b = t // S
    s = t % S
    D = 2 * HALF
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HK)
    turn = (is_q | is_k)[None, :, None]  # [1, BLOCK_H, 1]: heads that are normed and rotated

    c_off = (b.to(tl.int64) * stride_cb + s.to(tl.int64) * stride_cs)[:, None] + i[None, :]
    c_ok = (t < T)[:, None] & (i < HALF)[None, :]
    cos = tl.load(COS + c_off, mask=c_ok, other=1.0).to(tl.float32)[:, None, :]
    sin = tl.load(SIN + c_off, mask=c_ok, other=0.0).to(tl.float32)[:, None, :]

    # Row starts: the head's D columns in WS; in its output, the head's index within its part
    # (q, k or v) times D, in rows of that part's width.
    t64 = t.to(tl.int64)[:, None, None]
    src = WS + t64 * stride_ws + (h.to(tl.int64) * D)[None, :, None]
    hq = h.to(tl.int64)[None, :, None]
    dst = tl.where(is_q[None, :, None], Q + t64 * HQ * D + hq * D,
                   tl.where(is_k[None, :, None], K + t64 * HK * D + (hq - HQ) * D,
                            V + t64 * HK * D + (hq - HQ - HK) * D))
    row_ok = (t < T)[:, None, None] & (h < HQ + 2 * HK)[None, :, None]

    if INTERLEAVED:
        # Pair i is elements (2i, 2i+1): whole rows [.., 2·BLOCK_HALF], split into the pairs.
        d = tl.arange(0, 2 * BLOCK_HALF)
        m2 = row_ok & (d < D)[None, None, :]
        x = tl.load(src + d[None, None, :], mask=m2, other=0.0).to(tl.float32)
        if QK_NORM:
            # the head's RMSNorm as the rmsnorm kernel computes it, stored in the outputs'
            # dtype (its output) before the rotation reads it back
            rstd = tl.rsqrt(tl.sum(x * x, axis=2) / D + qk_eps)[:, :, None]
            wq = tl.load(QN + d, mask=d < D, other=0.0).to(tl.float32)[None, None, :]
            wk = tl.load(KN + d, mask=d < D, other=0.0).to(tl.float32)[None, None, :]
            wn = tl.where(is_q[None, :, None], wq, wk)
            xn = (x * rstd * wn).to(Q.dtype.element_ty).to(tl.float32)
            x = tl.where(turn, xn, x)
        x0, x1 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
        y = tl.join(x0 * cos - x1 * sin, x0 * sin + x1 * cos)
        y = tl.reshape(y, [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        y = tl.where(turn, y, x)  # v: as loaded (a product by cos 1 would turn inf to NaN)
        tl.store(dst + d[None, None, :], y.to(Q.dtype.element_ty), mask=m2)
    else:
        # Pair i is elements (i, i + HALF): two half-rows.
        mask = row_ok & (i < HALF)[None, None, :]
        x0 = tl.load(src + i[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(src + HALF + i[None, None, :], mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            rstd = tl.rsqrt((tl.sum(x0 * x0, axis=2) + tl.sum(x1 * x1, axis=2)) / D
                            + qk_eps)[:, :, None]
            i_ok = i < HALF
            w0 = tl.where(is_q[None, :, None],
                          tl.load(QN + i, mask=i_ok, other=0.0).to(tl.float32)[None, None, :],
                          tl.load(KN + i, mask=i_ok, other=0.0).to(tl.float32)[None, None, :])
            w1 = tl.where(is_q[None, :, None],
                          tl.load(QN + HALF + i, mask=i_ok,
                                  other=0.0).to(tl.float32)[None, None, :],
                          tl.load(KN + HALF + i, mask=i_ok,
                                  other=0.0).to(tl.float32)[None, None, :])
            x0 = tl.where(turn, (x0 * rstd * w0).to(Q.dtype.element_ty).to(tl.float32), x0)
            x1 = tl.where(turn, (x1 * rstd * w1).to(Q.dtype.element_ty).to(tl.float32), x1)
        y0 = tl.where(turn, x0 * cos - x1 * sin, x0)
        y1 = tl.where(turn, x0 * sin + x1 * cos, x1)
        tl.store(dst + i[None, None, :], y0.to(Q.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i[None, None, :], y1.to(Q.dtype.element_ty), mask=mask)


def _unfused_2d(x: torch.Tensor, g: torch.Tensor, weights: tuple[torch.Tensor, ...],
                outs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, seq: int,
                head_dim: int, eps: float, interleaved: bool,
                scales: tuple[torch.Tensor, ...] | None,
                biases: tuple[torch.Tensor, ...] | None, act: bool,
                qk_norm: QkNorm | None = None) -> None:
    """UNFUSED = 1 (_unfused): RMSNorm (its tuned config), cuBLAS (biases by its beta; FP8
    weights upcast with their scales), then RoPE on q and k. Where Wq, Wk and Wv are one
    stacked matrix (fusetune.patch makes them views of one; their scales and biases likewise,
    or none), one GEMM over all three into a workspace, then one launch
    (_unfused_finish_kernel, rope's tuned config for all the heads) that normalizes q's and
    k's heads where `qk_norm` is given, rotates them into q and k and copies v; else a GEMM
    straight into each output, its heads normalized by the rmsnorm kernel (`qk_norm`) and
    rotated in place by rope's."""
    from fusetune.kernels._rotary import launch_rotation
    from fusetune.kernels.rope import SPEC as ROPE
    from fusetune.runtime import cached_config

    if act:
        raise ConfigError("qkv: UNFUSED=1 with FP8 activations: that mode runs fused only")
    m = x.shape[0]
    xn = norm_rows(x, g, eps)
    one_gemm = _unfused.stacked_operands(weights, scales, biases)
    if one_gemm is not None:
        w_all, s_all, b_all = one_gemm
        ws = scratch((m, w_all.shape[0]), x.dtype, x.device)
        _unfused.matmul(xn, w_all, s_all, ws, b_all)
        hq, hk = weights[0].shape[0] // head_dim, weights[1].shape[0] // head_dim
        dims = (("head_dim", head_dim), ("heads", hq + 2 * hk),
                ("interleaved", int(interleaved)))
        cfg = cached_config(ROPE, dims, dtype_name(x.dtype), m, "", x.device, warn=False)
        half = head_dim // 2
        qn, kn, qk_eps = (ws, ws, 0.0) if qk_norm is None else qk_norm
        grid = (cdiv(m, cfg["BLOCK_T"]), cdiv(hq + 2 * hk, cfg["BLOCK_H"]))
        direct(_unfused_finish_kernel)[grid](
            ws, outs[0], outs[1], outs[2], cos, sin, qn, kn, m, seq, hq, hk, half, ws.stride(0),
            cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), float(qk_eps),
            BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], BLOCK_HALF=next_pow2(half),
            INTERLEAVED=interleaved, QK_NORM=qk_norm is not None,
            num_warps=cfg["num_warps"], num_stages=1)
        return
    for i, (w, out) in enumerate(zip(weights, outs, strict=True)):
        _unfused.matmul(xn, w, None if scales is None else scales[i], out.view(m, -1),
                        None if biases is None else biases[i])
    parts = [out.view(m, -1) for out in outs]
    for j, (w, part, out) in enumerate(zip(weights[:2], parts[:2], outs[:2], strict=False)):
        heads = w.shape[0] // head_dim
        if qk_norm is not None:  # the heads as rows of head_dim, normalized into a new tensor
            part = norm_rows(part.contiguous().view(-1, head_dim), qk_norm[j], qk_norm[2])
        src = part.view(m // seq, seq, heads, head_dim)
        dst = out.view(m // seq, seq, heads, head_dim)
        dims = (("head_dim", head_dim), ("heads", heads), ("interleaved", int(interleaved)))
        cfg = cached_config(ROPE, dims, dtype_name(x.dtype), m, "", x.device, warn=False)
        launch_rotation(src, dst, cos, sin, interleaved, False, cfg)  # in place where src is
        # dst: each program reads its pairs before it writes them


def qkv(
    x: torch.Tensor,
    rms_weight: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    head_dim: int,
    interleaved: bool,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    bv: torch.Tensor | None = None,
    wq_scale: torch.Tensor | None = None,
    wk_scale: torch.Tensor | None = None,
    wv_scale: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qk_eps: float | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm(x) projected to q, k, v (+ bq, bk, bv), with RoPE on q and k (see the module
    docstring). With `q_norm` and `k_norm` ([head_dim] weights, both or neither) and their
    epsilon `qk_eps`, each head of q and of k is RMS-normalized before RoPE (Qwen3's q_norm,
    k_norm), in the same launch (its configs keep whole heads in a tile). Returns q [batch,
    seq, n_heads, head_dim], k and v [batch, seq, n_kv_heads, head_dim], contiguous, in x's
    dtype.

    The layout is the caller's, never guessed: `head_dim` (which must divide the projections'
    widths), `interleaved` (True: pairs (2i, 2i+1) as Meta's Llama code; False: (i, i +
    head_dim/2) as Hugging Face's rotate_half) and `eps`. cos and sin: [batch or 1, seq,
    head_dim or head_dim/2], column i < head_dim/2 for pair i (Hugging Face's
    position_embeddings qualify as they are).

    wq, wk and wv are in x's dtype, or all three FP8 (torch.float8_e4m3fn or float8_e5m2, e.g.
    from fusetune.quantize_fp8) with optional float32 scales per output channel `wq_scale`
    [Nq], `wk_scale`, `wv_scale` [Nkv] (None: 1): weight-only by default (the 16-bit
    tolerance against the dequantized weights); `fp8_activations=True` rounds the normalized
    activations to e4m3 per row too (FP8 tensor cores; see fusetune.ffn). The config
    (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PASSES, SPLIT_K, UNROLL_K, SPREAD, THREAD_SUM, TMA,
    num_warps, num_stages) comes from the lookup tables (for this weight format and
    activation mode) unless `config` is given; no config changes the numerics.
    """
    qk = None if q_norm is None or k_norm is None or qk_eps is None else (q_norm, k_norm,
                                                                          float(qk_eps))
    memo_key = None
    if _MEMO.active(config):
        memo_key = (tensor_key(x), tensor_key(rms_weight), tensor_key(wq), tensor_key(wk),
                    tensor_key(wv), tensor_key(cos), tensor_key(sin), eps, head_dim,
                    interleaved, type(interleaved), tensor_key(bq), tensor_key(bk), tensor_key(bv),
                    tensor_key(wq_scale), tensor_key(wk_scale), tensor_key(wv_scale),
                    tensor_key(q_norm), tensor_key(k_norm), qk_eps, fp8_activations)
        inputs = (x, rms_weight, wq, wk, wv, cos, sin, bq, bk, bv, wq_scale, wk_scale, wv_scale,
                  q_norm, k_norm)

        def run(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _run(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, interleaved,
                        (bq, bk, bv), (wq_scale, wk_scale, wv_scale), fp8_activations, cfg,
                        qk)

        out = _MEMO.repeat(memo_key, inputs, run)
        if out is not None:
            return out
    if x.ndim != 3:
        raise ValueError(f"qkv: x must be [batch, seq, dim], got shape {tuple(x.shape)}")
    bsz, seq, d = x.shape
    if rms_weight.shape != (d,):
        raise ValueError(f"qkv: rms_weight has shape {tuple(rms_weight.shape)}, expected ({d},)")
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.ndim != 2 or w.shape[1] != d:
            raise ValueError(f"qkv: {name} must be [out_features, {d}] (nn.Linear layout), got "
                             f"{tuple(w.shape)}")
        if w.device != x.device:
            raise ValueError(f"qkv: {name} is on {w.device}, x on {x.device}")
    if wv.shape != wk.shape:
        raise ValueError(f"qkv: wk and wv must have the same shape, got {tuple(wk.shape)} and "
                         f"{tuple(wv.shape)}")
    nq, nkv = wq.shape[0], wk.shape[0]
    if (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2
            or head_dim % 2 or nq % head_dim or nkv % head_dim):
        raise ValueError(f"qkv: head_dim={head_dim!r} must be an even integer that divides wq's "
                         f"{nq} and wk's {nkv} output features (wq {tuple(wq.shape)}, wk "
                         f"{tuple(wk.shape)})")
    if not isinstance(interleaved, bool):
        raise TypeError(f"qkv: interleaved={interleaved!r} must be True (pairs 2i, 2i+1) or "
                        "False (pairs i, i + head_dim/2, Hugging Face's rotate_half)")
    check_eps("qkv", eps)
    dtype = dtype_name(x.dtype)
    weights = fp8.check_weights("qkv", x, {"wq": wq, "wk": wk, "wv": wv},
                                {"wq_scale": wq_scale, "wk_scale": wk_scale,
                                 "wv_scale": wv_scale})
    for name, b, w in (("bq", bq, wq), ("bk", bk, wk), ("bv", bv, wv)):
        if b is not None:
            if b.shape != (w.shape[0],) or b.device != x.device:
                raise ValueError(f"qkv: {name} must be [{w.shape[0]}] on {x.device}, got "
                                 f"{tuple(b.shape)} on {b.device}")
            dtype_name(b.dtype)  # raises for a bias dtype the kernel cannot read
    if (q_norm is None) != (k_norm is None) or (q_norm is None) != (qk_eps is None):
        raise ValueError("qkv: q_norm, k_norm and qk_eps come together (Qwen3's per-head norms "
                         f"and their epsilon) or not at all; got q_norm "
                         f"{'set' if q_norm is not None else 'None'}, k_norm "
                         f"{'set' if k_norm is not None else 'None'}, qk_eps={qk_eps!r}")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None:
            if t.shape != (head_dim,) or t.device != x.device:
                raise ValueError(f"qkv: {name} must be [{head_dim}] (head_dim) on {x.device}, "
                                 f"got {tuple(t.shape)} on {t.device}")
            dtype_name(t.dtype)  # raises for a dtype the kernel cannot read
    if qk_eps is not None:
        check_eps("qkv", qk_eps)
    check_tables(cos, sin, bsz, seq, head_dim, x.device, "qkv")
    check_device(x, "qkv")
    check_no_grad("qkv", x, rms_weight, wq, wk, wv, bq, bk, bv, q_norm, k_norm)
    if fp8_activations:
        fp8.check_fp8_activations("qkv", weights, x.device)
    if config is None:
        since = _MEMO.generation()
        from fusetune.runtime import cached_config

        dims = (("dim", d), ("head_dim", head_dim), ("interleaved", int(interleaved)),
                ("n_heads", nq // head_dim), ("n_kv_heads", nkv // head_dim),
                *((("qk_norm", 1),) if qk is not None else ()))
        cfg = cached_config(SPEC, dims, dtype, bsz * seq, weights, x.device,
                            activations="fp8" if fp8_activations else "")
        if memo_key is not None:
            return _MEMO.first(memo_key, inputs, cfg, since, run)
    else:
        cfg = SPEC.validate_config(config)
        if qk is not None and _cuts_heads(cfg, head_dim // 2):
            raise ConfigError(
                f"qkv: with q_norm and k_norm a tile must hold whole heads: BLOCK_N="
                f"{cfg['BLOCK_N']} pairs must be a multiple of head_dim/2 = {head_dim // 2}, "
                f"and SPREAD={cfg['SPREAD']} must be 0 (or the K loop split, SPLIT_K > 1: "
                "its finishing pass normalizes over whole heads)")
    return _run(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, interleaved, (bq, bk, bv),
                (wq_scale, wk_scale, wv_scale), fp8_activations, cfg, qk)


_MEMO = CallMemo()


def _run(x: torch.Tensor, rms_weight: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
         wv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, head_dim: int,
         interleaved: bool, given_biases: tuple[torch.Tensor | None, ...],
         given_scales: tuple[torch.Tensor | None, ...], fp8_activations: bool, cfg: Config,
         qk: QkNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv's launch, once its inputs are checked and its config chosen."""
    bsz, seq, d = x.shape
    nq, nkv = wq.shape[0], wk.shape[0]
    scales = None
    if any(s is not None for s in given_scales):  # the kernel scales all three or none
        scales = tuple(torch.ones(w.shape[0], dtype=torch.float32, device=x.device)
                       if s is None else s.contiguous()
                       for w, s in zip((wq, wk, wv), given_scales, strict=True))
    biases = None
    if any(b is not None for b in given_biases):  # the kernel adds all three or none
        biases = tuple(torch.zeros(w.shape[0], dtype=x.dtype, device=x.device) if b is None
                       else b.contiguous() for w, b in zip((wq, wk, wv), given_biases,
                                                           strict=True))
    cos, sin = as_tables(cos, sin)
    ws = [w if w.stride(-1) == 1 else w.contiguous() for w in (wq, wk, wv)]
    x2 = x.reshape(bsz * seq, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(bsz, seq, nq // head_dim, head_dim, dtype=x.dtype, device=x.device)
    k = torch.empty(bsz, seq, nkv // head_dim, head_dim, dtype=x.dtype, device=x.device)
    v = torch.empty_like(k)
    _launch_2d(x2, rms_weight.contiguous(), *ws, q.view(bsz * seq, nq), k.view(bsz * seq, nkv),
               v.view(bsz * seq, nkv), cos, sin, seq, head_dim, float(eps), interleaved, cfg,
               scales, biases, bool(fp8_activations),
               None if qk is None else (qk[0].contiguous(), qk[1].contiguous(), qk[2]))
    return q, k, v


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    dm = point.dim
    d, hd = dm["dim"], dm["head_dim"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, d, device=device)
    g = 1.0 + 0.1 * torch.randn(d, device=device)

    # One stacked matrix, Wq, Wk and Wv views of it, as fusetune.patch holds them (the
    # unfused form multiplies by all three in one GEMM there); per-channel scales alike.
    nq, nkv = dm["n_heads"] * hd, dm["n_kv_heads"] * hd
    w_all, s_all = fp8.spec_weight(torch.randn(nq + 2 * nkv, d, device=device) / d**0.5, point)
    wq, wk, wv = w_all[:nq], w_all[nq:nq + nkv], w_all[nq + nkv:]
    sq, sk, sv = (None,) * 3 if s_all is None else (s_all[:nq], s_all[nq:nq + nkv],
                                                     s_all[nq + nkv:])
    # Each row of the batch at other positions (as in a left-padded batch), tables in x's
    # dtype as a rotary embedding returns them.
    positions = (torch.arange(point.seq, device=device)[None, :] + 5
                 + 3 * torch.arange(point.batch, device=device)[:, None])
    cos, sin = rotary_tables(positions, hd, theta=10000.0, dtype=dtype)
    inputs = {"x": x.to(dtype), "rms_weight": g.to(dtype), "wq": wq, "wk": wk, "wv": wv,
              "wq_scale": sq, "wk_scale": sk, "wv_scale": sv, "cos": cos, "sin": sin,
              "eps": 1e-6, "head_dim": hd, "interleaved": bool(dm["interleaved"]),
              "fp8_activations": point.fp8_activations}
    if SPEC.dim_value(point, "qk_norm"):  # Qwen3's per-head norms of q and k
        inputs.update(q_norm=(1.0 + 0.1 * torch.randn(hd, device=device)).to(dtype),
                      k_norm=(1.0 + 0.1 * torch.randn(hd, device=device)).to(dtype),
                      qk_eps=1e-6)
    return inputs


def _make_outputs(inputs: Tensors) -> Tensors:
    x, hd = inputs["x"], inputs["head_dim"]
    b, s = x.shape[:2]

    def out(w: torch.Tensor) -> torch.Tensor:
        return torch.empty(b, s, w.shape[0] // hd, hd, dtype=x.dtype, device=x.device)

    return {"q": out(inputs["wq"]), "k": out(inputs["wk"]), "v": out(inputs["wv"])}


def _bias(inputs: Tensors, w: str) -> torch.Tensor | float:
    bias = inputs.get("b" + w[1:])
    return 0.0 if bias is None else bias.float()


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    hd = inputs["head_dim"]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    xn = xn * inputs["rms_weight"].float()
    b, s = x.shape[:2]
    q, k, v = (  # FP8 weights: the dequantized weights the kernel multiplies by
        (xn @ fp8.spec_dequantized(inputs, w).T + _bias(inputs, w)).view(b, s, -1, hd)
        for w in ("wq", "wk", "wv")
    )
    if inputs.get("q_norm") is not None:  # Qwen3: each head RMS-normalized, then rotated
        def head_norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            r = torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + inputs["qk_eps"])
            return t * r * w.float()

        q, k = head_norm(q, inputs["q_norm"]), head_norm(k, inputs["k_norm"])
    rot = (inputs["cos"], inputs["sin"], inputs["interleaved"])
    return {"q": rotated(q, *rot), "k": rotated(k, *rot), "v": v}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x = inputs["x"]
    b, s, d = x.shape
    q, k, v = outputs["q"], outputs["k"], outputs["v"]
    _launch_2d(x.view(b * s, d), inputs["rms_weight"], inputs["wq"], inputs["wk"], inputs["wv"],
               q.view(b * s, -1), k.view(b * s, -1), v.view(b * s, -1), inputs["cos"],
               inputs["sin"], s, inputs["head_dim"], inputs["eps"], inputs["interleaved"],
               config, None if inputs.get("wq_scale") is None else
               (inputs["wq_scale"], inputs["wk_scale"], inputs["wv_scale"]),
               None if inputs.get("bq") is None else (inputs["bq"], inputs["bk"], inputs["bv"]),
               inputs.get("fp8_activations", False),
               None if inputs.get("q_norm") is None else
               (inputs["q_norm"], inputs["k_norm"], inputs["qk_eps"]))


def _pairs(point: Point) -> int:
    dm = point.dim
    return (dm["n_heads"] + 2 * dm["n_kv_heads"]) * dm["head_dim"] // 2


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    c = default_tiles(point, gpu, _resources, _pairs(point), point.dim["dim"])
    if c["BLOCK_M"] == 1:
        # The GEMV reads even and odd weight rows as two tiles, a poor fit for the ffn's 4
        # pairs x 512; 16 pairs x 256 lies among neighbours that are all fast, so a GPU or
        # dims a little different keep it fast too.
        c["BLOCK_N"], c["BLOCK_K"] = 16, 256
    else:
        # BLOCK_N counts pairs, two output columns each (tl.dot still needs 16 of them).
        c["BLOCK_N"] = max(16, c["BLOCK_N"] // 2)
    if SPEC.dim_value(point, "qk_norm"):
        # Whole heads per tile (the per-head norm): the pairs of one head at least, and the
        # GEMV's K steps shorter for its four times wider tiles.
        half = point.dim["head_dim"] // 2
        c["BLOCK_N"] = -(-max(c["BLOCK_N"], half) // half) * half
        c["SPREAD"] = 0
        if c["BLOCK_M"] == 1:
            # the wider tiles leave a few column-blocks (48 at Qwen3-8B's): K split again
            c["BLOCK_K"] = 64
            c["SPLIT_K"] = gemv_split_k(-(-_pairs(point) // c["BLOCK_N"]), point.dim["dim"],
                                        c["BLOCK_K"], gpu)
    return c


def _canonical(config: Config, point: Point) -> Config:
    def has_tma(c: Config) -> bool:
        return tma_pairs(bool(point.dim["interleaved"]), point.dim["head_dim"], c["BLOCK_N"])

    return matmul_canonical(config, point, _pairs(point), point.dim["dim"], has_tma)


def _cuts_heads(config: Config, half: int) -> bool:
    """Whether `config` finishes its products in tiles of part of a head (or of pairs spread
    over the matrix), which the q/k norms cannot take: the per-head norm needs a head's every
    column in one program. A split-K config's finishing pass has tiles of whole heads
    (_launch_2d); the unfused form normalizes with the rmsnorm kernel."""
    return (not _unfused.unfused(config) and config["SPLIT_K"] == 1
            and bool(config["BLOCK_N"] % half or config.get("SPREAD")))


def _resources(config: Config, point: Point) -> Resources:
    # Columns a and b of each pair: two weight tiles per K-step, two accumulators staged for
    # the epilogue; more base registers than ffn's for the RoPE epilogue.
    res = matmul_resources(config, point, n_weights=2, epilogue=True, base_regs=48,
                           unfused=True)
    half = point.dim["head_dim"] // 2
    if SPEC.dim_value(point, "qk_norm") and not res.unfit and _cuts_heads(config, half):
        return dataclasses.replace(res, unfit=f"qk_norm: a tile must hold whole heads "
                                              f"(BLOCK_N a multiple of {half} pairs, SPREAD 0) "
                                              f"or the K loop be split (SPLIT_K > 1)")
    return res


def _cost(point: Point) -> Cost:
    m, d = point.rows, point.dim["dim"]
    n = 2 * _pairs(point)
    elt = DTYPE_BYTES[point.dtype]
    return Cost(bytes=(m * d + m * n + d) * elt + weight_bytes(point, n, d),
                flops=2 * m * d * n + 8 * m * n)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim, "head_dim": model.head_dim, "interleaved": 1,
            "n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads,
            **({"qk_norm": 1} if model.qk_norm else {})}



def _padding(config: Config, point: Point) -> float:
    return matmul_padding(config, point, _pairs(point), point.dim["dim"])

SPEC = KernelSpec(
    name="qkv",
    description="RMSNorm -> Q, K, V projections -> RoPE on q and k, one launch",
    dim_names=("dim", "head_dim", "interleaved", "n_heads", "n_kv_heads"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    padding=_padding,
    dims_from_model=_dims_from_model,
    source_objects=(_qkv_kernel, *TWO_PRODUCT_SOURCES, _launch_2d, *MATMUL_HOST_SOURCES,
                    _rmsnorm_kernel, *fp8.FP8_SOURCES, _unfused_2d, _unfused_finish_kernel,
                    *_unfused.SOURCES),
    algorithm_sources=(_unfused_2d, _unfused_finish_kernel, *_unfused.SOURCES),
    # A config's N tiles are laid over the heads' rotation pairs (and its TMA pair loads need
    # head_dim/2 to be a multiple of BLOCK_N): tuned for one head width, it is no guess for
    # another.
    carry_same=("head_dim", "interleaved"),
    optional_dims={"qk_norm": 0},
    dim_choices={"interleaved": PAIRING,
                 "qk_norm": {0: "no q/k norms", 1: "each q and k head RMS-normalized"}},
    check_dims=head_dim_problem,
    algorithm_keys=("UNFUSED",),
    **MATMUL_SPEC_FIELDS,
)
