"""The attention input projection, fused: RMSNorm -> Q, K, V projections -> RoPE on Q and K.

    q, k, v = qkv(x, rms_weight, wq, wk, wv, start_pos, theta, eps, interleaved=True)

x [batch, seq, dim]; wq [n_heads·head_dim, dim], wk and wv [n_kv_heads·head_dim, dim]
(nn.Linear layout; n_kv_heads < n_heads is grouped-query attention); q [batch, seq, n_heads,
head_dim], k and v [batch, seq, n_kv_heads, head_dim].

One launch covers the three matrices. A program computes BLOCK_N rotation *pairs* of one
matrix for BLOCK_M rows: two accumulators hold the two columns of each pair (2i, 2i+1 when
interleaved, i and i + head_dim/2 otherwise), so RoPE is applied in the epilogue without any
exchange between programs. RMSNorm folds into the matmul as in ffn.py (x ⊙ g in the K loop,
rstd per row in the epilogue). V goes through the same code with a zero angle. The weights are
in x's dtype or in FP8 with per-output-channel scales (fp8.py), applied before RoPE.

Tunables (search_spaces/qkv.yaml): BLOCK_M, BLOCK_N (pairs per program), BLOCK_K, GROUP_M,
PASSES, SPLIT_K, ACT_FP8, UNROLL_K, SPREAD, THREAD_SUM, TMA, num_warps, num_stages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels import fp8
from fusetune.kernels._matmul import (
    TWO_PRODUCT_SOURCES,
    block_rows,
    default_tiles,
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
    matmul_resources,
    weight_bytes,
)
from fusetune.kernels._spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    cdiv,
    check_device,
    dtype_name,
    torch_dtype,
)
from fusetune.kernels._trig import sincos
from fusetune.kernels.rmsnorm import _rmsnorm_kernel, rmsnorm
from fusetune.models import ModelPreset


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
    M, K, S,  # tokens, model width, sequence length (token m sits at position start_pos + m % S)
    NQ_PAIRS, NKV_PAIRS,  # Nq / 2 and Nkv / 2
    HALF,  # head_dim / 2: pairs per head
    stride_xm, stride_wq, stride_wk, stride_wv,
    start_pos,
    neg_log2_theta_over_half,  # freq_i = 2 ** (i * this) = theta^(-2i/head_dim)
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # pairs per program
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PASSES: tl.constexpr,  # 1: RMSNorm folded into the K loop; 2: X already normalized
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a slice of K
    FINISH: tl.constexpr,  # the split-K finishing pass: add the partials up, then the epilogue
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.mma_weight)
    ACT_FP8: tl.constexpr,  # X is FP8 with row scales SX (PASSES == 2 only)
    W_SCALED: tl.constexpr,  # the weights have per-output-channel scales SQ, SK, SV
    UNROLL_K: tl.constexpr,  # BLOCK_M == 1: two K-steps per loop iteration (gemv_two_products)
    SPREAD: tl.constexpr,  # BLOCK_M == 1: the program's BLOCK_N pairs far apart (block_rows)
    THREAD_SUM: tl.constexpr,  # BLOCK_M == 1: each thread adds its weight run up first
    TMA: tl.constexpr,  # X and the weight rows are read through descriptors (tma_two_products)
):
    # Column-blocks of the three matrices side by side: [Q blocks | K blocks | V blocks].
    nb_q = tl.cdiv(NQ_PAIRS, BLOCK_N)
    nb_kv = tl.cdiv(NKV_PAIRS, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), nb_q + 2 * nb_kv, GROUP_M)

    # Which matrix this program works on; V is rotated by a zero angle (no RoPE). `first` is
    # the matrix's first pair in the workspace's columns [Q pairs | K pairs | V pairs].
    if pid_n < nb_q:
        W, Y, stride_w, n_pairs, blk, rope, first = (WQ, OQ, stride_wq, NQ_PAIRS, pid_n, 1.0,
                                                     0 * NQ_PAIRS)
        SW = SQ
    elif pid_n < nb_q + nb_kv:
        W, Y, stride_w, n_pairs, blk, rope, first = (WK, OK, stride_wk, NKV_PAIRS, pid_n - nb_q,
                                                     1.0, NQ_PAIRS)
        SW = SK
    else:
        W, Y, stride_w, n_pairs, blk, rope, first = (WV, OV, stride_wv, NKV_PAIRS,
                                                     pid_n - nb_q - nb_kv, 0.0,
                                                     NQ_PAIRS + NKV_PAIRS)
        SW = SV

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = block_rows(blk, n_pairs, BLOCK_N, SPREAD)  # pair index within the matrix
    m_ok = rm < M
    p_ok = p < n_pairs
    mp_ok = m_ok[:, None] & p_ok[None, :]
    all_pairs = NQ_PAIRS + 2 * NKV_PAIRS
    head = p // HALF
    i = p % HALF  # pair index within the head: sets the frequency
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
                                        SPLIT_K, IEEE)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # not read: PASSES == 2
    else:
        # Weight rows col_a and col_b, read transposed as [BLOCK_K, BLOCK_N] tiles.
        acc_a, acc_b, sumsq = two_products(X, G, W, col_a[None, :].to(tl.int64) * stride_w,
                                           W, col_b[None, :].to(tl.int64) * stride_w, rm, m_ok,
                                           p_ok, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                           PASSES, IEEE, W_FP8, UNROLL_K, THREAD_SUM)

    if SPLIT_K > 1 and not FINISH:
        store_two_partials(WS, WSQ, acc_a, acc_b, sumsq, rm, first + p, m_ok, mp_ok, M,
                           all_pairs, pid_n == 0, PASSES)
    else:
        # The scales of the FP8 operands (x's row scales, those of the weight rows col_a and
        # col_b) and rstd.
        a, b = rms_scaled_products(acc_a, acc_b, sumsq, K, eps, SX, rm, m_ok, SW, col_a, SW,
                                   col_b, p_ok, ACT_FP8, W_SCALED, PASSES)
        # RoPE: angle (start_pos + s) · theta^(-2i/head_dim), in float32.
        pos = (start_pos + rm % S).to(tl.float32)
        freq = tl.exp2(i.to(tl.float32) * neg_log2_theta_over_half)
        angle = pos[:, None] * (freq * rope)[None, :]
        sin, cos = sincos(angle)  # polynomial: libdevice's sin/cos spill here (_trig.py)
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


def tma_pairs(interleaved: bool, head_dim: int, block_n: int) -> bool:
    """Whether the TMA loop can read tiles of `block_n` pairs: interleaved pairs always (even
    and odd rows); half-split pairs where a tile's pairs lie in one head (see the kernel)."""
    return interleaved or (head_dim // 2) % block_n == 0


def _launch_2d(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
               wv: torch.Tensor, oq: torch.Tensor, ok: torch.Tensor, ov: torch.Tensor, seq: int,
               head_dim: int, start_pos: int, theta: float, eps: float, interleaved: bool,
               config: Config, scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """x [M, K]; weights [N, K] with unit column stride (x's dtype or FP8, one dtype for the
    three, with per-channel scales `scales` = (sq, sk, sv) or None); outputs contiguous [M, N].

    PASSES = 2: RMSNorm runs first as its own kernel (fusetune.rmsnorm, tuned config from the
    tables) and the matmul reads its output; with FP8 weights and ACT_FP8 = 1 that pass
    writes the rows in e4m3 with a scale each (fp8.norm_fp8_rows) and the K loop multiplies
    FP8 by FP8. SPLIT_K > 1: SPLIT_K programs per output tile write float32 partial sums, and
    a second launch of the same kernel (FINISH) adds them up and applies RoPE.
    """
    m, k = x.shape
    if m == 0:
        return
    x, sx, act = first_pass("qkv", x, g, eps, config, wq.dtype, lambda t: rmsnorm(t, g, eps))
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
        ws = torch.empty((2 * split, m, nq_pairs + 2 * nkv_pairs), dtype=torch.float32,
                         device=x.device)
        wsq = torch.empty((split, m), dtype=torch.float32, device=x.device)
    n_blocks = cdiv(nq_pairs, bn) + 2 * cdiv(nkv_pairs, bn)
    args = launch_args(config, act=act, w_fp8=w_fp8, ieee=x.dtype == torch.float32,
                       w_scaled=scales is not None, tma=descs is not None)

    def launch(grid: tuple[int, int], finish: bool) -> None:
        _qkv_kernel[grid](
            xa, g, wq, wk, wv, *row_descs, oq, ok, ov, ws, wsq, oq if sx is None else sx, sq,
            sk, sv, m, k, seq, nq_pairs, nkv_pairs, half,
            x.stride(0), wq.stride(0), wk.stride(0), wv.stride(0), start_pos,
            -math.log2(theta) / half, eps, INTERLEAVED=interleaved, FINISH=finish, **args,
        )

    launch_split(launch, cdiv(m, config["BLOCK_M"]) * n_blocks, split)


def qkv(
    x: torch.Tensor,
    rms_weight: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    start_pos: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    *,
    head_dim: int | None = None,
    interleaved: bool = True,
    wq_scale: torch.Tensor | None = None,
    wk_scale: torch.Tensor | None = None,
    wv_scale: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm(x) projected to q, k, v, with RoPE on q and k (see the module docstring).

    `head_dim` defaults to 128 when it divides both projections' widths, else 64; pass it for
    models with other head sizes (or where 64 divides but the heads are wider).

    wq, wk and wv are in x's dtype, or all three FP8 (torch.float8_e4m3fn or float8_e5m2, e.g.
    from fusetune.quantize_fp8) with optional float32 scales per output channel `wq_scale`
    [Nq], `wk_scale`, `wv_scale` [Nkv] (None: 1). The config (BLOCK_M, BLOCK_N, BLOCK_K,
    GROUP_M, PASSES, SPLIT_K, ACT_FP8, UNROLL_K, SPREAD, THREAD_SUM, TMA, num_warps,
    num_stages) comes from the lookup tables (for this weight format) unless `config` is
    given.
    """
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
    if head_dim is None:  # the weights' shapes alone cannot tell 32 x 128 from 64 x 64
        head_dim = next((h for h in (128, 64) if nq % h == 0 and nkv % h == 0), 0)
        if not head_dim:
            raise ValueError(f"qkv: cannot infer head_dim from wq's {nq} and wk's {nkv} output "
                             "features; pass head_dim=")
    if head_dim < 2 or head_dim % 2 or nq % head_dim or nkv % head_dim:
        raise ValueError(f"qkv: head_dim={head_dim} must be even and divide wq's {nq} and "
                         f"wk's {nkv} output features")
    if start_pos < 0:
        raise ValueError(f"qkv: start_pos={start_pos} must be >= 0")
    dtype = dtype_name(x.dtype)
    weights = fp8.check_weights("qkv", x, {"wq": wq, "wk": wk, "wv": wv},
                                {"wq_scale": wq_scale, "wk_scale": wk_scale,
                                 "wv_scale": wv_scale})
    given = (wq_scale, wk_scale, wv_scale)
    scales = None
    if any(s is not None for s in given):  # the kernel scales all three or none
        scales = tuple(torch.ones(w.shape[0], dtype=torch.float32, device=x.device)
                       if s is None else s.contiguous() for w, s in zip((wq, wk, wv), given,
                                                                        strict=True))
    check_device(x, "qkv")
    ws = [w if w.stride(-1) == 1 else w.contiguous() for w in (wq, wk, wv)]
    x2 = x.reshape(bsz * seq, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(bsz, seq, nq // head_dim, head_dim, dtype=x.dtype, device=x.device)
    k = torch.empty(bsz, seq, nkv // head_dim, head_dim, dtype=x.dtype, device=x.device)
    v = torch.empty_like(k)
    if config is None:
        from fusetune.runtime import cached_config

        dims = (("dim", d), ("head_dim", head_dim), ("interleaved", int(interleaved)),
                ("n_heads", nq // head_dim), ("n_kv_heads", nkv // head_dim))
        cfg = cached_config(SPEC, dims, dtype, bsz * seq, weights, x.device)
    else:
        cfg = SPEC.validate_config(config)
    _launch_2d(x2, rms_weight.contiguous(), *ws, q.view(bsz * seq, nq), k.view(bsz * seq, nkv),
               v.view(bsz * seq, nkv), seq, head_dim, int(start_pos), float(theta), float(eps),
               bool(interleaved), cfg, scales)
    return q, k, v


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    dm = point.dim
    d, hd = dm["dim"], dm["head_dim"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, d, device=device)
    g = 1.0 + 0.1 * torch.randn(d, device=device)

    def w(n_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        # FP8 points: quantized, with per-channel scales.
        return fp8.spec_weight(torch.randn(n_heads * hd, d, device=device) / d**0.5, point)

    (wq, sq), (wk, sk), (wv, sv) = w(dm["n_heads"]), w(dm["n_kv_heads"]), w(dm["n_kv_heads"])
    return {"x": x.to(dtype), "rms_weight": g.to(dtype), "wq": wq, "wk": wk, "wv": wv,
            "wq_scale": sq, "wk_scale": sk, "wv_scale": sv, "start_pos": 5,
            "theta": 10000.0, "eps": 1e-6, "head_dim": hd, "interleaved": bool(dm["interleaved"])}


def _make_outputs(inputs: Tensors) -> Tensors:
    x, hd = inputs["x"], inputs["head_dim"]
    b, s = x.shape[:2]

    def out(w: torch.Tensor) -> torch.Tensor:
        return torch.empty(b, s, w.shape[0] // hd, hd, dtype=x.dtype, device=x.device)

    return {"q": out(inputs["wq"]), "k": out(inputs["wk"]), "v": out(inputs["wv"])}


def _rope_reference(t: torch.Tensor, start_pos: int, theta: float, interleaved: bool
                    ) -> torch.Tensor:
    from fusetune.kernels.rope import _reference as rope_reference

    return rope_reference({"x": t, "start_pos": start_pos, "theta": theta,
                           "interleaved": interleaved})["y"]


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    hd = inputs["head_dim"]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    xn = xn * inputs["rms_weight"].float()
    b, s = x.shape[:2]
    q, k, v = (  # FP8 weights: the dequantized weights the kernel multiplies by
        (xn @ fp8.spec_dequantized(inputs, w).T).view(b, s, -1, hd) for w in ("wq", "wk", "wv")
    )
    rot = {"start_pos": inputs["start_pos"], "theta": inputs["theta"],
           "interleaved": inputs["interleaved"]}
    return {"q": _rope_reference(q, **rot), "k": _rope_reference(k, **rot), "v": v}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x = inputs["x"]
    b, s, d = x.shape
    q, k, v = outputs["q"], outputs["k"], outputs["v"]
    _launch_2d(x.view(b * s, d), inputs["rms_weight"], inputs["wq"], inputs["wk"], inputs["wv"],
               q.view(b * s, -1), k.view(b * s, -1), v.view(b * s, -1), s, inputs["head_dim"],
               inputs["start_pos"], inputs["theta"], inputs["eps"], inputs["interleaved"],
               config, None if inputs.get("wq_scale") is None else
               (inputs["wq_scale"], inputs["wk_scale"], inputs["wv_scale"]))


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
        return c
    # BLOCK_N counts pairs, two output columns each (tl.dot still needs 16 of them).
    c["BLOCK_N"] = max(16, c["BLOCK_N"] // 2)
    return c


def _canonical(config: Config, point: Point) -> Config:
    def has_tma(c: Config) -> bool:
        return tma_pairs(bool(point.dim["interleaved"]), point.dim["head_dim"], c["BLOCK_N"])

    return matmul_canonical(config, point, _pairs(point), point.dim["dim"], has_tma)


def _resources(config: Config, point: Point) -> Resources:
    # Columns a and b of each pair: two weight tiles per K-step, two accumulators staged for
    # the epilogue; more base registers than ffn's for the RoPE epilogue.
    return matmul_resources(config, point, n_weights=2, epilogue=True, base_regs=48)


def _cost(point: Point) -> Cost:
    m, d = point.rows, point.dim["dim"]
    n = 2 * _pairs(point)
    elt = DTYPE_BYTES[point.dtype]
    return Cost(bytes=(m * d + m * n + d) * elt + weight_bytes(point, n, d),
                flops=2 * m * d * n + 8 * m * n)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim, "head_dim": model.head_dim, "interleaved": 1,
            "n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads}


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
    dims_from_model=_dims_from_model,
    source_objects=(_qkv_kernel, sincos, *TWO_PRODUCT_SOURCES, _launch_2d, *MATMUL_HOST_SOURCES,
                    _rmsnorm_kernel, *fp8.FP8_SOURCES),
    **MATMUL_SPEC_FIELDS,
)
