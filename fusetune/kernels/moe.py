"""The experts of a mixture-of-experts layer, fused into two launches:

    out = moe(x, gate_up, down, topk_ids, topk_weights)

x [tokens, dim]; gate_up [experts, 2·hidden, dim] (each expert's gate rows, then its up rows:
transformers' fused experts layout); down [experts, dim, hidden]; topk_ids and topk_weights
[tokens, top_k]: the router's choice and weights, the caller's (the model's own softmax,
top-k and normalization). out[t] = Σ_j w[t, j] · down[e] · (silu(gate[e]·x[t]) ⊙ up[e]·x[t])
with e = topk_ids[t, j].

The (token, expert) pairs are grouped by expert first (`group_pairs`: two small launches, no
synchronization, so the call can be captured in a CUDA graph): each expert's pairs padded
to a whole number of BLOCK_M rows, and every block of BLOCK_M rows tagged with its expert (or
none: the padding blocks past the last expert's). Launch 1, per (row block, BLOCK_N columns of
hidden): the gathered rows of x times the expert's gate and up rows, h = silu(a) · b in float32,
written to the pairs' rows of an intermediate [pairs, hidden]. Launch 2, per (row block,
BLOCK_N columns of dim): those rows times the expert's down rows, times the pair's routing
weight, written to the pair's row of [pairs, dim] in float32; the top_k rows of a token are then
added up (torch) and rounded once to x's dtype. An expert no token chose costs nothing; at
decode most experts are idle and the row blocks are mostly padding (BLOCK_M 16: the tensor
cores' smallest tile), at prefill the blocks are full.

BLOCK_M = 1 is the other structure, for decode: no grouping and no tensor cores. Launch 1 has a
program per (pair, BLOCK_N columns of hidden), launch 2 one per (token, BLOCK_N columns of
dim) that adds the token's top_k products up in order in float32 and writes out's row in x's
dtype: two launches in all, each weight tile read by the programs of the pairs that chose its
expert (at decode, one or two, at about the same time) as float32 GEMV loops
(_matmul.gemv_two_products, gemv_one_product). The roundings are the grouped structure's: the
intermediate in x's dtype, the output once.

UNFUSED = 1 is the same result computed another way, a candidate of the search like any config
(as for the dense matmul kernels, _unfused): the pairs sorted by expert (torch's stable sort, no
synchronization), torch._grouped_mm over the gathered rows of x and each expert's gate/up
rows, SiLU·mul in x's dtype, torch._grouped_mm with the down rows, then each token's top_k rows
times their routing weights added up in float32 (in order: no atomics) and rounded once. FP8
weights are upcast with their scales first (all the experts: a transient 16-bit copy).
Cheaper at prefill where cuBLAS's grouped GEMM beats the Triton tiles.

Tunables (search_spaces/moe.yaml): BLOCK_M (the grouping's rows per block; 1: the per-pair
structure), BLOCK_N, BLOCK_K, num_warps, num_stages, shared by the grouped structure's two
launches; in the per-pair structure DOWN_N, DOWN_K and DOWN_WARPS are launch 2's own column
tile, K-step and warps (0: launch 1's), since its programs differ in kind (one per token and
column block, top_k weight tiles each, against one per pair and column block: at a few tokens
top_k times fewer programs with top_k times the loads); PDL = 1 (per-pair, compute capability
9.0+) launches launch 2 as launch 1's programmatic dependent: its programs are scheduled while
launch 1's last ones run and load their first weight tile before waiting for launch 1's writes,
which at decode hides part of the gap between the two launches; UNFUSED.
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
    cuda_capability,
    dot,
    fp8_as_f16,
    gemv_resources,
    gemv_two_products,
    gemv_weight,
    k_slice,
)
from fusetune.kernels._replay import note_unrecordable, scratch, torch_call
from fusetune.models import ModelError, ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    WEIGHT_FORMATS,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    cdiv,
    check_device,
    check_fits,
    check_no_grad,
    dtype_name,
    interpreting,
    next_pow2,
    torch_dtype,
)

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "UNFUSED",
               "DOWN_N", "DOWN_K", "DOWN_WARPS", "PDL")
# The per-pair structure's launch 2 keys, each 0 where it takes launch 1's value.
DOWN_KEYS = {"DOWN_N": "BLOCK_N", "DOWN_K": "BLOCK_K", "DOWN_WARPS": "num_warps"}
# The tokens a server hands one layer (`search`'s rows where none are given): decode batches
# up to 256 and prefills from 512 to 8192.
SERVER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Every other key of an UNFUSED config means nothing: its one canonical config.
_UNFUSED_CONFIG: Config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4,
                           "num_stages": 2, "UNFUSED": 1, "DOWN_N": 0, "DOWN_K": 0,
                           "DOWN_WARPS": 0, "PDL": 0}


@triton.jit
def _experts_kernel(
    A,  # *[rows, K] the launch's input rows: x (launch 1: a row per token) or the intermediate
    # (launch 2: a row per pair), unit column stride
    W,  # *[E, N_W, K] the experts' weights (nn.Linear layout per expert), unit column stride
    OUT,  # *[pairs, N] output rows, one per pair, unit column stride
    PAIRS,  # *[blocks·BLOCK_M] int32: the pair in each grouped row (>= n_pairs: padding)
    BLOCK_EXPERT,  # *[blocks] int32: each row block's expert (>= E: no expert, skipped)
    RW,  # *[pairs] the pairs' routing weights (SCALE_ROWS)
    S,  # *[E, N_W] float32: FP8 weights' scale per expert and output channel (W_SCALED)
    n_pairs, N, K, E,
    stride_am, stride_we, stride_wn, stride_om, stride_se,
    TOP_K: tl.constexpr,  # launch 1: a pair's row of x is token = pair // TOP_K
    GATED: tl.constexpr,  # launch 1: two products (the gate's rows n, the up's rows N + n)
    SCALE_ROWS: tl.constexpr,  # launch 2: each row times its pair's routing weight
    W_SCALED: tl.constexpr,  # FP8 weights: each output column times its channel's scale
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (_matmul.dot)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < E:  # padding blocks past the last expert's do nothing
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(PAIRS + rm)
        row_ok = pair < n_pairs  # the padding rows of an expert's last block read 0
        if GATED:  # noqa: SIM108  (a Triton constexpr branch)
            a_row = pair // TOP_K  # the token: launch 1 reads x
        else:
            a_row = pair  # launch 2 reads the intermediate row of the pair
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        # The expert's weight rows rn (and N + rn), read transposed as [BLOCK_K, BLOCK_N].
        w_base = W + e.to(tl.int64) * stride_we
        a_ptrs = A + a_row[:, None].to(tl.int64) * stride_am + rk[None, :]
        w_ptrs = w_base + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0  # the last K-step may be partial: masked lanes read 0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            # FP8 weights are converted to the activations' dtype (exact: every FP8 value is
            # a bf16 and an fp16 value); 16-bit ones already are it
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = dot(a, w.to(a.dtype), acc, IEEE, INTERPRETED)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0)
                acc_up = dot(a, w_up.to(a.dtype), acc_up, IEEE, INTERPRETED)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if W_SCALED:  # x · (scale ⊙ W)ᵀ = (x · Wᵀ) ⊙ scale, per output column, in float32
            s_ptrs = S + e.to(tl.int64) * stride_se + rn
            acc = acc * tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(s_ptrs + N, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) · up, float32
        if SCALE_ROWS:
            acc = acc * tl.load(RW + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        o_ptrs = OUT + pair[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _pair_gemv_kernel(
    X,  # *[tokens, K] unit column stride
    W,  # *[E, 2·N, K] gate_up (FP8: as fp8.weight_operand gives it for W_FP8)
    INTER,  # *[pairs, N] the intermediate, a row per pair
    IDS,  # *[pairs] the pairs' experts (topk_ids, flat)
    S,  # *[E, 2·N] float32: FP8 weights' scale per expert and output channel (W_SCALED)
    N, K, E,
    stride_xm, stride_we, stride_wn, stride_im, stride_se,
    TOP_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.gemv_weight)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GDC: tl.constexpr,  # launch 2 is this launch's programmatic dependent (PDL)
):
    # Launch 1 of the per-pair structure: program (pair, 0, column block) computes
    # silu(x[token] · gate[e]ᵀ) ⊙ (x[token] · up[e]ᵀ) for BLOCK_N columns of hidden.
    if GDC:
        # Launch 2's programs may be scheduled once every program of this launch has started
        # (they wait for its writes themselves, _token_gemv_kernel's gdc_wait).
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    # (grid axis 1 is the GEMV loop's split-K slice, _matmul.k_slice: one slice here)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    # the expert as a [1] block (the masks it joins are blocks)
    e = tl.load(IDS + pair + tl.zeros([1], dtype=tl.int32)).to(tl.int32)
    e_ok = (e >= 0) & (e < E)  # an id outside the experts reads nothing and gives NaN
    e_safe = tl.where(e_ok, e, 0).to(tl.int64)
    w_base = W + e_safe * stride_we
    w_rows = rn[None, :].to(tl.int64) * stride_wn  # gate rows rn (up rows N + rn), [1, BLOCK_N]
    token = tl.zeros([1], dtype=tl.int32) + pair // TOP_K
    y, up, _ = gemv_two_products(X, X, w_base, w_rows, w_base + N * stride_wn, w_rows, token,
                                 token >= 0, n_ok & e_ok, K, stride_xm, BLOCK_N, BLOCK_K, 1, 2,
                                 W_FP8, 0, 0)
    if W_SCALED:  # per output column, in float32, before the activation
        s_ptrs = S + e_safe * stride_se + rn
        y = y * tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
        up = up * tl.load(s_ptrs + N, mask=n_ok, other=0.0)[None, :]
    h = tl.where(e_ok, y * tl.sigmoid(y) * up, float("nan"))  # silu(gate) · up, float32
    tl.store(INTER + pair.to(tl.int64) * stride_im + rn[None, :], h.to(INTER.dtype.element_ty),
             mask=n_ok[None, :])


@triton.jit
def _token_gemv_kernel(
    INTER,  # *[pairs, K] the intermediate, a row per pair, unit column stride
    W,  # *[E, N, K] down (FP8: as fp8.weight_operand gives it for W_FP8)
    OUT,  # *[tokens, N] x's dtype
    IDS,  # *[pairs] the pairs' experts (topk_ids, flat)
    RW,  # *[pairs] the pairs' routing weights
    S,  # *[E, N] float32 (W_SCALED)
    N, K, E,
    stride_im, stride_we, stride_wn, stride_om, stride_se,
    TOP_K: tl.constexpr,
    J: tl.constexpr,  # TOP_K rounded up to a power of two (the tiles' first axis)
    W_SCALED: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # the first K-step's weights are loaded before launch 1's writes are read
    GDC: tl.constexpr,  # launched as launch 1's programmatic dependent: wait for it (PDL)
):
    # Launch 2 of the per-pair structure: program (token, 0, column block) computes
    # Σ_j w[j] · inter[pair j] · down[e_j]ᵀ for BLOCK_N columns of dim, the token's TOP_K pairs
    # side by side in one K loop ([J, BLOCK_K, BLOCK_N] weight tiles: the loads of every pair
    # in flight together), in float32, rounded once.
    token = tl.program_id(0)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    j = tl.arange(0, J)
    j_ok = j < TOP_K  # lanes past TOP_K (J > TOP_K) read nothing and add 0
    pair = token * TOP_K + j
    e = tl.load(IDS + pair, mask=j_ok, other=0).to(tl.int32)
    e_ok = j_ok & (e >= 0) & (e < E)  # an id outside the experts reads nothing: NaN below
    e_safe = tl.where(e_ok, e, 0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    # [J, BLOCK_K]: pair j's intermediate row; [J, BLOCK_K, BLOCK_N]: its expert's down rows
    # rn (a row contiguous in K, the tile's middle axis, so the loads vectorize along it)
    a_ptrs = INTER + pair[:, None].to(tl.int64) * stride_im + rk[None, :]
    w_ptrs = (W + e_safe[:, None, None] * stride_we + rn[None, None, :].to(tl.int64) * stride_wn
              + rk[None, :, None])
    w_ok = e_ok[:, None, None] & n_ok[None, None, :]
    acc = tl.zeros([J, BLOCK_K, BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PDL:
        # The first K-step peeled: its weight tile (and the ids above), which launch 1 does not
        # write, load while launch 1 finishes; the intermediate only after gdc_wait, from which
        # on launch 1's writes are complete and visible. The same products in the same order
        # as the loop's: the result does not depend on PDL.
        k_ok = rk < K
        w = gemv_weight(tl.load(w_ptrs, mask=w_ok & k_ok[None, :, None], other=0.0,
                                eviction_policy="evict_first"), W_FP8)
        if GDC:  # (without it, as under the interpreter, launch 1 has finished already)
            tl.extra.cuda.gdc_wait()
        a = tl.load(a_ptrs, mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * a[:, :, None]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k_ok = rk < K - k0  # the last K-step may be partial: masked lanes read 0
        a = tl.load(a_ptrs, mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = gemv_weight(tl.load(w_ptrs, mask=w_ok & k_ok[None, :, None], other=0.0,
                                eviction_policy="evict_first"), W_FP8)
        acc += w * a[:, :, None]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)  # [J, BLOCK_N]
    if W_SCALED:  # per output column, in float32
        y = y * tl.load(S + e_safe[:, None] * stride_se + rn[None, :],
                        mask=e_ok[:, None] & n_ok[None, :], other=0.0)
    y = y * tl.load(RW + pair, mask=j_ok, other=0.0).to(tl.float32)[:, None]
    y = tl.where(e_ok[:, None] | (j >= TOP_K)[:, None], y, float("nan"))
    out = tl.sum(y, axis=0)
    tl.store(OUT + token.to(tl.int64) * stride_om + rn, out.to(OUT.dtype.element_ty), mask=n_ok)


@triton.jit
def _rank_kernel(IDS, COUNTS, RANK, n, E, BLOCK: tl.constexpr):
    # Each pair's place among its expert's pairs, in whatever order the atomics run: a row's
    # result does not depend on the other rows of its block, so the order changes no bit.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(IDS + offs, mask=offs < n, other=0).to(tl.int32)
    ok = (offs < n) & (e >= 0) & (e < E)  # an id outside the experts is placed nowhere
    rank = tl.atomic_add(COUNTS + e, 1, mask=ok)
    tl.store(RANK + offs, rank, mask=ok)


@triton.jit
def _place_kernel(IDS, COUNTS, RANK, PAIRS, BLOCK_EXPERT, PER_PAIR, n, E, n_blocks, D,
                  stride_pp, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_D: tl.constexpr, NAN_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    ex = tl.arange(0, E_P2)
    count = tl.load(COUNTS + ex, mask=ex < E, other=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # each expert's rows: whole blocks
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(IDS + offs, mask=offs < n, other=0).to(tl.int32)
    ok = (offs < n) & (e >= 0) & (e < E)
    rank = tl.load(RANK + offs, mask=ok, other=0)
    # the start of each pair's expert: pad_start[e], picked out of the registers by a compare
    start = tl.sum(tl.where(e[:, None] == ex[None, :], pad_start[None, :], 0), axis=1)
    tl.store(PAIRS + start + rank, offs.to(tl.int32), mask=ok)
    # A pair whose id names no expert: its row of the per-pair output is NaN (no launch writes
    # it), so the token's output is NaN rather than a sum that silently left an expert out.
    # Only a block that has such a pair walks its rows, NAN_ROWS at a time (a [BLOCK, BLOCK_D]
    # tile of addresses would not fit a thread's registers at BLOCK 1024).
    bad = (offs < n) & ((e < 0) | (e >= E))
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        for r0 in range(0, BLOCK, NAN_ROWS):
            ro = pid * BLOCK + r0 + tl.arange(0, NAN_ROWS)
            er = tl.load(IDS + ro, mask=ro < n, other=0).to(tl.int32)
            bad_r = (ro < n) & ((er < 0) | (er >= E))
            for d0 in range(0, D, BLOCK_D):
                rd = d0 + tl.arange(0, BLOCK_D)
                tl.store(PER_PAIR + ro[:, None].to(tl.int64) * stride_pp + rd[None, :],
                         tl.full([NAN_ROWS, BLOCK_D], float("nan"), tl.float32),
                         mask=bad_r[:, None] & (rd[None, :] < D))
    # Block b's expert: how many experts' padded rows end at or before its first row (E or
    # more: a block past the last expert's, skipped by the launches).
    b = pid * BLOCK + tl.arange(0, BLOCK)
    be = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(BLOCK_EXPERT + b, be, mask=b < n_blocks)


def group_pairs(topk_ids: torch.Tensor, experts: int, block_m: int,
                per_pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs (pair p = token · top_k + j, expert topk_ids.flat[p]) grouped
    by expert: (pairs [blocks · block_m] int32, each expert's pairs from a block boundary, in
    any order, the rest of its last block n_pairs; block_expert [blocks] int32, each block's
    expert, `experts` or more for the blocks past the last expert's). Two launches and no
    synchronization with the device (the call can be captured in a CUDA graph): the number
    of blocks is the most the pairs can need. A pair whose id is outside [0, experts) is in
    no block; its row of `per_pair` [n_pairs, D] float32 (launch 2's output) is set to NaN."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    # Σ over the experts with pairs of cdiv(count, block_m) <= n // block_m + such experts
    blocks = cdiv(n, block_m) + min(experts, n)
    # scratch, filled by torch calls a replay of the call repeats (_replay.torch_call)
    counts = torch_call(torch.zeros, ((experts,),), scratch((experts,), torch.int32, device))
    rank = scratch((n,), torch.int32, device)
    pairs = torch_call(torch.full, ((blocks * block_m,), n),
                       scratch((blocks * block_m,), torch.int32, device))
    block_expert = scratch((blocks,), torch.int32, device)
    e_p2 = triton.next_power_of_2(experts)
    block = max(16, min(1024, 8192 // e_p2))  # the [block, experts] compares stay small
    direct(_rank_kernel)[(cdiv(n, block),)](flat, counts, rank, n, experts, BLOCK=block,
                                            num_warps=4)
    direct(_place_kernel)[(cdiv(max(n, blocks), block),)](
        flat, counts, rank, pairs, block_expert, per_pair, n, experts, blocks,
        per_pair.shape[1], per_pair.stride(0),
        BLOCK_M=block_m, E_P2=e_p2, BLOCK=block, BLOCK_D=64, NAN_ROWS=min(16, block),
        num_warps=4)
    return pairs, block_expert


def _launch_2d(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
               config: Config, gate_up_scale: torch.Tensor | None = None,
               down_scale: torch.Tensor | None = None) -> None:
    """x [T, D], gate_up [E, 2H, D], down [E, D, H] (unit column strides; FP8 with their
    scales [E, 2H] and [E, D], contiguous, or None), topk_ids and topk_weights [T, k]
    (contiguous), out [T, D], with exactly `config`."""
    t, d = x.shape
    if t == 0:
        return
    e, h2, _ = gate_up.shape
    h, k = h2 // 2, topk_ids.shape[1]
    if config.get("UNFUSED"):
        _launch_unfused(x, gate_up, down, topk_ids, topk_weights, out, gate_up_scale,
                        down_scale)
        return
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    n_pairs = t * k
    inter = scratch((n_pairs, h), x.dtype, x.device)
    if bm == 1:
        _launch_per_pair(x, gate_up, down, topk_ids, topk_weights, inter, out, config,
                         gate_up_scale, down_scale)
        return
    per_pair = scratch((n_pairs, d), torch.float32, x.device)
    pairs, block_expert = group_pairs(topk_ids, e, bm, per_pair)
    blocks = block_expert.numel()
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
                INTERPRETED=interpreting(), num_warps=config["num_warps"],
                num_stages=config["num_stages"])
    s1 = topk_weights if gate_up_scale is None else gate_up_scale  # (not read unless scaled)
    s2 = topk_weights if down_scale is None else down_scale
    direct(_experts_kernel)[(blocks, cdiv(h, bn))](
        x, gate_up, inter, pairs, block_expert, topk_weights, s1, n_pairs, h, d, e,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        0 if gate_up_scale is None else gate_up_scale.stride(0),
        TOP_K=k, GATED=True, SCALE_ROWS=False, W_SCALED=gate_up_scale is not None, **meta)
    direct(_experts_kernel)[(blocks, cdiv(d, bn))](
        inter, down, per_pair, pairs, block_expert, topk_weights, s2, n_pairs, d, h, e,
        inter.stride(0), down.stride(0), down.stride(1), per_pair.stride(0),
        0 if down_scale is None else down_scale.stride(0),
        TOP_K=k, GATED=False, SCALE_ROWS=True, W_SCALED=down_scale is not None, **meta)
    # a token's top_k rows added in float32, then × 1 into out: rounded once (as copy_ would),
    # both torch calls a replay repeats
    sums = torch_call(torch.sum, (per_pair.view(t, k, d), 1), scratch((t, d), torch.float32,
                                                                      x.device))
    torch_call(torch.mul, (sums, 1.0), out)


def _launch_per_pair(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, inter: torch.Tensor,
                     out: torch.Tensor, config: Config, gate_up_scale: torch.Tensor | None,
                     down_scale: torch.Tensor | None) -> None:
    """_launch_2d's BLOCK_M = 1 structure (the module docstring): a program per pair, then
    one per token."""
    t, d = x.shape
    e, h2, _ = gate_up.shape
    h, k = h2 // 2, topk_ids.shape[1]
    w1, w_fp8 = fp8.weight_operand(gate_up, False, gemv=True)
    w2, _ = fp8.weight_operand(down, False, gemv=True)
    tile2 = _down_tile(config)
    pdl = bool(config.get("PDL"))
    gdc = pdl and has_gdc(x.device)
    meta = dict(TOP_K=k, W_FP8=w_fp8, num_stages=config["num_stages"], GDC=gdc)
    s1 = topk_weights if gate_up_scale is None else gate_up_scale  # (not read unless scaled)
    s2 = topk_weights if down_scale is None else down_scale
    direct(_pair_gemv_kernel)[(t * k, 1, cdiv(h, config["BLOCK_N"]))](
        x, w1, inter, topk_ids, s1, h, d, e,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        0 if gate_up_scale is None else gate_up_scale.stride(0),
        W_SCALED=gate_up_scale is not None, BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"], num_warps=config["num_warps"], **meta)
    direct(_token_gemv_kernel)[(t, 1, cdiv(d, tile2["BLOCK_N"]))](
        inter, w2, out, topk_ids, topk_weights, s2, d, h, e,
        inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        0 if down_scale is None else down_scale.stride(0),
        J=triton.next_power_of_2(k), W_SCALED=down_scale is not None, PDL=pdl, **tile2,
        **meta, **({"launch_pdl": True} if gdc else {}))


def has_gdc(device: torch.device) -> bool:
    """Whether launches on `device` can be programmatic dependents of the launch before them
    (griddepcontrol: compute capability 9.0+; not under Triton's interpreter, which runs the
    launches one after the other anyway)."""
    if interpreting() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_capability(index) >= (9, 0)


def _down_tile(config: Config) -> dict[str, int]:
    """The per-pair structure's launch 2 tile: DOWN_N, DOWN_K, DOWN_WARPS, or launch 1's."""
    return {key: config.get(down) or config[key] for down, key in DOWN_KEYS.items()}


def _experts_upcast(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                    ) -> torch.Tensor:
    """Experts' weights [E, N, K] in `dtype`: as they are, or FP8 (times their channels' scales
    [E, N] where given) rounded once (_unfused._upcast over the E·N channels)."""
    if w.dtype == dtype:
        return w
    e, n, kk = w.shape
    return _unfused._upcast(w.reshape(e * n, kk), None if scale is None else scale.reshape(e * n),
                            dtype).view(e, n, kk)


def _launch_unfused(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                    gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None
                    ) -> None:
    """_launch_2d's UNFUSED = 1 form (the module docstring): torch._grouped_mm twice."""
    # torch's launches do not go through `direct`: a call that makes them has no replay
    note_unrecordable()
    t, d = x.shape
    e = gate_up.shape[0]
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    ok = (flat >= 0) & (flat < e)
    # pairs sorted by expert, the ids outside the experts last (group e, multiplied by no one)
    key = torch.where(ok, flat, e)
    order = key.argsort(stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # (bincount would wait for the device)
    offs = counts[:e].cumsum(0).to(torch.int32)
    gu = _experts_upcast(gate_up, gate_up_scale, x.dtype)
    ab = torch._grouped_mm(x[order // k], gu.transpose(1, 2), offs=offs)
    a, b = ab.chunk(2, dim=-1)
    dn = _experts_upcast(down, down_scale, x.dtype)
    y = torch._grouped_mm(torch.nn.functional.silu(a) * b, dn.transpose(1, 2), offs=offs)
    per_pair = torch.empty_like(y)
    per_pair[order] = y  # back to pair order (each row written once: no atomics)
    w = torch.where(ok, topk_weights.reshape(-1).float(), float("nan"))
    out.copy_((per_pair.float() * w[:, None]).view(t, k, d).sum(dim=1))


def moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """The experts' part of a mixture-of-experts layer (see the module docstring): x [tokens,
    dim] (or [..., dim]); gate_up [experts, 2·hidden, dim] and down [experts, dim, hidden] in
    x's dtype, or both FP8 (e4m3 or e5m2) with float32 scales per expert and output channel,
    gate_up_scale [experts, 2·hidden] and down_scale [experts, dim] (fusetune.quantize_fp8 of
    the stacked experts; weight-only: converted to x's dtype in the kernels); topk_ids
    [tokens, top_k] (integers in [0, experts): a token with an id outside gets NaN, as no check
    can stop the call without waiting for the device) and topk_weights [tokens, top_k] from
    the caller's router. Returns [..., dim] in x's dtype. The config (BLOCK_M, BLOCK_N,
    BLOCK_K, num_warps, num_stages) comes from the lookup tables (keyed on the weights' format
    too) unless `config` is given; no config changes the numerics."""
    memo_key = None
    if _MEMO.active(config):
        memo_key = (tensor_key(x), tensor_key(gate_up), tensor_key(down), tensor_key(topk_ids),
                    tensor_key(topk_weights), tensor_key(gate_up_scale),
                    tensor_key(down_scale))
        inputs = (x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale)

        def run(cfg: Config) -> torch.Tensor:
            return _run(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale,
                        cfg)

        done = _MEMO.repeat(memo_key, inputs, run)
        if done is not None:
            return done
    if x.ndim < 1:
        raise ValueError("moe: x must have at least one dimension")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    t = x2.shape[0]
    if gate_up.ndim != 3 or gate_up.shape[2] != d or gate_up.shape[1] % 2:
        raise ValueError(f"moe: gate_up must be [experts, 2·hidden, {d}], got "
                         f"{tuple(gate_up.shape)}")
    e, h = gate_up.shape[0], gate_up.shape[1] // 2
    if down.shape != (e, d, h):
        raise ValueError(f"moe: down must be [{e}, {d}, {h}] (experts, dim, hidden), got "
                         f"{tuple(down.shape)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe: topk_ids and topk_weights must both be [{t}, top_k] (a row per "
                         f"token), got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"moe: topk_ids must be integers, got {topk_ids.dtype}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.device != x.device:
            raise ValueError(f"moe: {name} is on {w.device}, x on {x.device}")
    weights = fp8.check_weights("moe", x, {"gate_up": gate_up, "down": down},
                                {"gate_up_scale": gate_up_scale, "down_scale": down_scale})
    check_device(x, "moe")
    check_no_grad("moe", x, gate_up, down, topk_weights)
    dtype = dtype_name(x.dtype)
    top_k = topk_ids.shape[1]
    if config is None:
        since = _MEMO.generation()
        from fusetune.runtime import cached_config

        dims = (("dim", d), ("experts", e), ("hidden", h), ("top_k", top_k))
        cfg = cached_config(SPEC, dims, dtype, t, weights, x.device)
        if memo_key is not None:
            return _MEMO.first(memo_key, inputs, cfg, since, run)
    else:
        cfg = SPEC.validate_config(config)
    return _run(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale, cfg)


# What moe's checks and lookup decided per call signature, with the replay of its launches
# (_call_memo): a decode step's experts are two launches, their Python more than their time.
_MEMO = CallMemo()


def _run(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
         topk_weights: torch.Tensor, gate_up_scale: torch.Tensor | None,
         down_scale: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """moe's launches, once its inputs are checked and its config chosen."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    t = x2.shape[0]
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    w = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    w2 = down if down.stride(-1) == 1 else down.contiguous()
    _launch_2d(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, w2,
               topk_ids.to(torch.int64).contiguous(), topk_weights.contiguous(), out, cfg,
               None if gate_up_scale is None else gate_up_scale.contiguous(),
               None if down_scale is None else down_scale.contiguous())
    return out.view(x.shape)


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    dm = point.dim
    d, e, h, k = dm["dim"], dm["experts"], dm["hidden"], dm["top_k"]
    dtype = torch_dtype(point.dtype)
    t = point.rows
    x = torch.randn(t, d, device=device)
    # the router as Mixtral's: softmax over the experts, top-k, the k weights renormalized
    logits = torch.randn(t, e, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up, gate_up_scale = fp8.spec_weight(torch.randn(e, 2 * h, d, device=device) / d**0.5,
                                             point)
    down, down_scale = fp8.spec_weight(torch.randn(e, d, h, device=device) / h**0.5, point)
    return {"x": x.to(dtype), "gate_up": gate_up, "gate_up_scale": gate_up_scale,
            "down": down, "down_scale": down_scale, "topk_ids": ids,
            "topk_weights": weights.to(dtype)}


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"out": torch.empty_like(inputs["x"])}


def _reference(inputs: Tensors) -> Tensors:
    """A plain loop over the experts, in float32 (transformers' own experts loop); FP8 weights
    dequantized with their scales."""
    x = inputs["x"].float()
    gate_up = fp8.spec_dequantized(inputs, "gate_up")
    down = fp8.spec_dequantized(inputs, "down")
    ids, weights = inputs["topk_ids"], inputs["topk_weights"].float()
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, j = torch.where(ids == e)
        if token.numel() == 0:
            continue
        g, u = (x[token] @ gate_up[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ down[e].T
        out.index_add_(0, token, y * weights[token, j, None])
    return {"out": out}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    _launch_2d(inputs["x"], inputs["gate_up"], inputs["down"], inputs["topk_ids"],
               inputs["topk_weights"], outputs["out"], config, inputs.get("gate_up_scale"),
               inputs.get("down_scale"))


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    # Rows per expert block: few tokens reach an expert at decode (the smallest tensor-core
    # tile), many at prefill.
    dm = point.dim
    pairs_per_expert = point.rows * dm["top_k"] / max(1, dm["experts"])
    if pairs_per_expert <= 1:  # at most about one pair an expert: the per-pair structure
        # Long K-steps of 8 warps stream the weights best; launch 2 takes 4 columns a program
        # (it holds top_k weight tiles) and K-steps that keep its [top_k, DOWN_K, 4] tiles at
        # 8192 elements (registers); its programs start during launch 1's tail where the GPU
        # can (PDL).
        dk = max(32, min(512, 8192 // (4 * next_pow2(dm["top_k"]))))
        c = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 8, "num_stages": 1,
             "UNFUSED": 0, "DOWN_N": 4, "DOWN_K": dk, "DOWN_WARPS": 0, "PDL": int(gpu.pdl)}
        while c["BLOCK_K"] > 32 and check_fits(_resources(c, point), gpu) is not None:
            c["BLOCK_K"] //= 2
            c["DOWN_K"] = max(32, c["DOWN_K"] // 2)
        return c
    bm = 16 if pairs_per_expert <= 16 else 32 if pairs_per_expert <= 64 else 64
    c = {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3,
         "UNFUSED": 0, **dict.fromkeys(DOWN_KEYS, 0), "PDL": 0}
    # At decode only the routed experts' blocks work: narrower column tiles until the launch
    # with fewer columns has about two programs per SM, each streaming its rows of the
    # weights, with longer K-steps for the narrower tiles.
    active = min(dm["experts"], point.rows * dm["top_k"])
    while c["BLOCK_N"] > 16 and active * cdiv(min(dm["dim"], dm["hidden"]),
                                              c["BLOCK_N"]) < 2 * gpu.sms:
        c["BLOCK_N"] //= 2
        c["BLOCK_K"] = 128
    while c["num_stages"] > 1 and _resources(c, point).smem_bytes > gpu.smem_per_block:
        c["num_stages"] -= 1
    # FP8 weights converted in registers: shorter K-steps until the registers fit (a default
    # the search prunes would be a default it never times)
    while c["BLOCK_K"] > 32 and check_fits(_resources(c, point), gpu) is not None:
        c["BLOCK_K"] //= 2
    return c


# The per-pair structure reads an expert's weights once for each of its pairs (at the same time,
# so mostly from L2 when they are few): beyond this many pairs an expert on average the grouped
# tensor-core tiles are the structure.
PER_PAIR_MAX = 2


def _canonical(config: Config, point: Point) -> Config:
    if config.get("UNFUSED"):
        return {k: _UNFUSED_CONFIG[k] for k in config}
    c = dict(config)
    if c["BLOCK_M"] == 1:  # the GEMV loops have no software pipeline: num_stages changes nothing
        c["num_stages"] = 1
    for down, key in DOWN_KEYS.items():
        # launch 1's value written out is the same kernel as 0; the grouped structure's two
        # launches share their tile
        if c.get(down) == c[key] or c["BLOCK_M"] != 1:
            c[down] = 0
    if c["BLOCK_M"] != 1:  # the grouped structure's launches are no programmatic dependents
        c["PDL"] = 0
    return c


def _resources(config: Config, point: Point) -> Resources:
    if config.get("UNFUSED"):  # torch's launches: nothing a fused config is pruned for
        return Resources(smem_bytes=0, regs_per_thread=0, threads=128)
    a_elt, w_elt, converted = fp8.operand_bytes(point)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if bm == 1:
        dm = point.dim
        # launch 1: two [BLOCK_K, BLOCK_N] accumulators; launch 2 (its own tile): one per pair
        # of a token. A program of either launch must fit: the larger demand of each.
        one = gemv_resources(config, 1, w_elt, 2)
        two = gemv_resources(_down_tile(config), 1, w_elt, next_pow2(dm["top_k"]))
        res = Resources(smem_bytes=max(one.smem_bytes, two.smem_bytes),
                        regs_per_thread=max(one.regs_per_thread, two.regs_per_thread),
                        threads=max(one.threads, two.threads), pdl=bool(config.get("PDL")))
        if point.rows * dm["top_k"] > PER_PAIR_MAX * dm["experts"]:
            res = dataclasses.replace(res, unfit=(
                f"structure: BLOCK_M=1 (a program per pair) reads an expert's weights once for "
                f"each of its pairs; it is for at most {PER_PAIR_MAX} pairs an expert on average, "
                f"not {point.rows * dm['top_k'] / dm['experts']:.3g}"))
        return res
    threads = 32 * config["num_warps"]
    # launch 1's two weight tiles and two accumulators (the larger of the two launches); FP8
    # weight tiles staged as bytes, then converted in registers
    smem = max(1, config["num_stages"] - 1) * (bm * bk * a_elt + 2 * bk * bn * w_elt)
    regs = (2 * bm * bn // threads + (bm * bk + 2 * bk * bn * (2 if converted else 1)) // threads
            + 40)
    return Resources(smem_bytes=smem, regs_per_thread=regs, threads=threads)


def _cost(point: Point) -> Cost:
    dm = point.dim
    d, e, h, k = dm["dim"], dm["experts"], dm["hidden"], dm["top_k"]
    t = point.rows
    elt = DTYPE_BYTES[point.dtype]
    w_elt = fp8.operand_bytes(point)[1]
    used = min(e, t * k)  # the experts the pairs can reach: their weights are read
    bytes_ = used * 3 * h * d * w_elt + t * d * elt * 2 + t * k * (h * elt + d * 4)
    return Cost(bytes=bytes_, flops=2 * t * k * 3 * h * d)


def _runs_per_pair(config: Mapping[str, int]) -> bool:
    return config["BLOCK_M"] == 1 and not config.get("UNFUSED")


def _runs_grouped(config: Mapping[str, int]) -> bool:
    return config["BLOCK_M"] != 1 and not config.get("UNFUSED")


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    if not model.experts:
        raise ModelError(f"{model.name} is not a mixture-of-experts model: moe has no points in "
                         "it (mixtral-8x7b and qwen3-30b-a3b are)")
    return {"dim": model.dim, "experts": model.experts, "hidden": model.expert_hidden,
            "top_k": model.top_k}


def _top_k_problem(dims: Mapping[str, int]) -> str | None:
    if dims["top_k"] > dims["experts"]:
        return (f"top_k={dims['top_k']} must be at most experts={dims['experts']} (each token "
                "is routed to top_k distinct experts)")
    return None


SPEC = KernelSpec(
    name="moe",
    description="mixture-of-experts experts: grouped gate/up + SiLU·mul, then down, weighted",
    dim_names=("dim", "experts", "hidden", "top_k"),
    check_dims=_top_k_problem,
    config_keys=CONFIG_KEYS,
    pow2_keys=("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", *DOWN_KEYS),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    dims_from_model=_dims_from_model,
    weight_formats=WEIGHT_FORMATS,
    source_objects=(_experts_kernel, _pair_gemv_kernel, _token_gemv_kernel, _rank_kernel,
                    _place_kernel, group_pairs, _launch_2d, _launch_per_pair, _down_tile, has_gdc,
                    _launch_unfused, _experts_upcast, dot, gemv_two_products, k_slice,
                    gemv_weight, fp8_as_f16, fp8.weight_operand, _unfused._upcast,
                    _unfused._upcast_kernel),
    algorithm_sources=(_launch_unfused, _experts_upcast, _unfused._upcast,
                       _unfused._upcast_kernel),
    structure_sources=(
        (_runs_per_pair, (_pair_gemv_kernel, _token_gemv_kernel, _launch_per_pair, _down_tile,
                          has_gdc, gemv_two_products, k_slice, gemv_weight)),
        (_runs_grouped, (_experts_kernel, _rank_kernel, _place_kernel, group_pairs, dot)),
    ),
    flags={"UNFUSED": 0, "PDL": 0},
    same_as=DOWN_KEYS,
    algorithm_keys=("UNFUSED",),
    unfused_form="torch._grouped_mm, SiLU·mul, torch._grouped_mm, weighted sum",
    default_rows=SERVER_TOKENS,
)
