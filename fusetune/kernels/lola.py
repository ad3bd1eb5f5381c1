"""LayerNorm (no affine) -> Linear -> exact GELU, fused: y = gelu(layernorm(x)·Wᵀ + b).

LayerNorm folds into the matmul: layernorm(x)·Wᵀ = rstd ⊙ (x·Wᵀ − mean ⊗ Σ_k W[:, k]), with
mean and rstd per row and the column sums of W per output. Each program accumulates x·Wᵀ for
one [BLOCK_M, BLOCK_N] tile together with Σx and Σx² of its rows and Σ_k W of its columns (all
float32, from the tiles it loads anyway), then applies the correction, the bias and
gelu(y) = y·(1 + erf(y/√2))/2 in the epilogue. Weights use nn.Linear's layout [out, in], in
x's dtype or in FP8 with per-output-channel scales (fp8.py): a channel's scale multiplies its
whole sum (Σ_k W[n, k] too), before the bias.

The variance is E[x²] − mean², in float32: exact enough for activations whose mean is not
orders of magnitude above their spread (normalized hidden states); the reference is torch's
two-pass LayerNorm.

Tunables (search_spaces/lola.yaml): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PASSES, SPLIT_K,
UNROLL_K, SPREAD, THREAD_SUM, TMA, num_warps, num_stages.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels import fp8
from fusetune.kernels._direct import direct
from fusetune.kernels._matmul import (
    block_rows,
    default_tiles,
    dot,
    fp8_as_f16,
    gemv_one_product,
    gemv_weight,
    grouped_tile,
    k_slice,
    mma_weight,
    partial_ptrs,
    row_norm_stats,
    scale_product,
    tma_descriptors,
    tma_one_product,
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
from fusetune.models import ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    as_rows,
    cdiv,
    check_device,
    check_eps,
    check_no_grad,
    dtype_name,
    next_pow2,
    torch_dtype,
)


@triton.jit
def _lola_kernel(
    X,  # *[M, K] activations (FP8 with ACT_FP8), row stride stride_xm, unit column stride
    W,  # *[N, K] weight (nn.Linear layout), row stride stride_wn (X, W: TMA descriptors with TMA)
    B,  # *[N] bias
    OUT,  # *[M, N] output, row stride stride_om
    WS,  # *[SPLIT_K, M, N] float32 partial products (split-K only)
    WST,  # *[SPLIT_K, 2·M + N] float32 partial Σx, Σx² per row, Σw per column (split-K, PASSES 1)
    SX,  # *[M] float32 scales of X's rows (ACT_FP8 only)
    SW,  # *[N] float32 per-output-channel scales of W (W_SCALED only)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PASSES: tl.constexpr,  # 1: LayerNorm folded into the K loop; 2: X already normalized
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a slice of K
    FINISH: tl.constexpr,  # the split-K finishing pass: add the partials up, then the epilogue
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (_matmul.dot)
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.mma_weight)
    ACT_FP8: tl.constexpr,  # X is FP8 with row scales SX (PASSES == 2 only)
    W_SCALED: tl.constexpr,  # W has per-output-channel scales SW
    UNROLL_K: tl.constexpr,  # BLOCK_M == 1: two K-steps per loop iteration (gemv_one_product)
    SPREAD: tl.constexpr,  # BLOCK_M == 1: the program's BLOCK_N columns far apart (block_rows)
    THREAD_SUM: tl.constexpr,  # BLOCK_M == 1: each thread adds its weight run up first
    TMA: tl.constexpr,  # X and W are TMA descriptors (PASSES == 2, see tma_one_product)
):
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = block_rows(pid_n, N, BLOCK_N, SPREAD)  # rows of W, columns of OUT
    m_ok = rm < M
    n_ok = rn < N
    mn_ok = m_ok[:, None] & n_ok[None, :]
    stats = 2 * M + N  # one slice's row of WST: Σx [M], Σx² [M], Σw [N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_x = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_x2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FINISH:
        for s in range(SPLIT_K):
            acc += tl.load(partial_ptrs(WS, s, rm, rn, M, N), mask=mn_ok, other=0.0)
            if PASSES == 1:
                sum_x += tl.load(WST + s * stats + rm, mask=m_ok, other=0.0)
                sum_x2 += tl.load(WST + s * stats + M + rm, mask=m_ok, other=0.0)
                sum_w += tl.load(WST + s * stats + 2 * M + rn, mask=n_ok, other=0.0)
    elif BLOCK_M == 1:  # one row per program, no tensor cores (the decode structure)
        acc, sum_x, sum_x2, sum_w = gemv_one_product(
            X, W, rn[None, :].to(tl.int64) * stride_wn, rm, m_ok, n_ok, K, stride_xm, BLOCK_N,
            BLOCK_K, SPLIT_K, PASSES, W_FP8, UNROLL_K, THREAD_SUM)
    elif TMA:  # PASSES == 2: the row and column sums are not needed
        acc = tma_one_product(X, W, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                              SPLIT_K, IEEE, INTERPRETED)
    else:
        k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
        rk = tl.arange(0, BLOCK_K)
        # x tile [BLOCK_M, BLOCK_K]; the weight tile read transposed as [BLOCK_K, BLOCK_N].
        x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_begin + rk)[None, :]
        w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + (k_begin + rk)[:, None]
        for k0 in range(k_begin, k_end, BLOCK_K):
            k_ok = rk < k_end - k0  # partial last step: masked lanes read 0 and add nothing
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w = mma_weight(w, x, W_FP8)  # FP8 weights: upcast to x's type, or kept as FP8
            if PASSES == 1:
                # The sums come from a second load of the same tiles (L2 hits), not from the
                # tiles tl.dot takes: with Triton 3.6 on sm_90, summing those very tiles gave
                # results that changed from launch to launch with 64-row tiles, and it was
                # slower with smaller tiles. ".cg" keeps the second load a load of its own.
                xf = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                ws = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0,
                             cache_modifier=".cg")
                sum_x += tl.sum(xf, axis=1)
                sum_x2 += tl.sum(xf * xf, axis=1)
                sum_w += tl.sum(gemv_weight(ws, W_FP8), axis=0)
            # With PASSES == 2 the tiles go from memory to the tensor cores untouched, which
            # lets the compiler keep the asynchronous load/MMA pipeline that large M needs.
            acc = dot(x, w, acc, IEEE, INTERPRETED)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

    if SPLIT_K > 1 and not FINISH:
        # Partial sums of this K-slice; row statistics once per row-block (by the first
        # column-block), column sums once per column-block (by the first row-block).
        split = tl.program_id(1)
        tl.store(partial_ptrs(WS, split, rm, rn, M, N), acc, mask=mn_ok)
        if PASSES == 1:
            if pid_n == 0:
                tl.store(WST + split * stats + rm, sum_x, mask=m_ok)
                tl.store(WST + split * stats + M + rm, sum_x2, mask=m_ok)
            if pid_m == 0:
                tl.store(WST + split * stats + 2 * M + rn, sum_w, mask=n_ok)
    else:
        bias = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
        if PASSES == 1:
            mean = sum_x / K
            rstd = tl.rsqrt(tl.maximum(sum_x2 / K - mean * mean, 0.0) + eps)
            acc = rstd[:, None] * (acc - mean[:, None] * sum_w[None, :])
        # The scales of the FP8 operands, on the whole sums: x's row scales, the channels' own.
        y = scale_product(acc, SX, rm, m_ok, SW, rn, n_ok, ACT_FP8, W_SCALED) + bias[None, :]
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))  # exact GELU
        out_ptrs = OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mn_ok)


@triton.jit
def _layernorm_kernel(
    X,  # *[M, K] input, row stride stride_xm, unit column stride
    Y,  # *[M, K] output (contiguous), x's dtype
    M,
    K,
    stride_xm,
    eps,
    BLOCK_K: tl.constexpr,  # columns per step: >= K in one pass (SINGLE_PASS), else a loop
    ROWS: tl.constexpr,  # rows per program (1 when looping)
    SINGLE_PASS: tl.constexpr,  # BLOCK_K >= K: the rows are read once and held in registers
):
    # Program `pid` owns rows [pid*ROWS, pid*ROWS + ROWS); rows past M are masked off. Mean and
    # variance in float32, then (x - mean) * rstd rounded to x's dtype, as torch's layer_norm.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]  # BLOCK_K is a power of two >= K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / K  # masked lanes read 0: they add nothing
        d = tl.where(mask, x - mean[:, None], 0.0)  # ... and must not add mean² here
        rstd = tl.rsqrt(tl.sum(d * d, axis=1) / K + eps)
        tl.store(Y + rows[:, None].to(tl.int64) * K + cols[None, :],
                 (d * rstd[:, None]).to(Y.dtype.element_ty), mask=mask)
    else:
        # Rows wider than a register tile: statistics over the row (two passes, the second
        # from cache), then a third pass writes; one row per program.
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_xm
        y_row = Y + row * K
        rk = tl.arange(0, BLOCK_K)
        mean, rstd = row_norm_stats(x_row, K, eps, 0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            tl.store(y_row + k0 + rk, ((x - mean) * rstd).to(Y.dtype.element_ty),
                     mask=k0 + rk < K)


# The first pass of PASSES = 2 reads x once and writes it once, like RMSNorm: whole rows in
# registers up to 16K columns (rmsnorm's default heuristic) rather than a loop that reads each
# row again for each statistic, several rows per program for narrow rows rather than more warps
# on one row, 16 elements a thread.
LAYERNORM_PASS_ELEMENTS = 2048  # elements a program holds at least (rows of narrow inputs)
LAYERNORM_THREAD_ELEMENTS = 16
LAYERNORM_SINGLE_PASS_MAX = 16384


def layernorm_pass_launch(k: int) -> tuple[int, int, int]:
    """(BLOCK_K, ROWS, num_warps) of the LayerNorm pass over rows of k elements."""
    block = next_pow2(k)
    if block > LAYERNORM_SINGLE_PASS_MAX:
        return 8192, 1, 16
    rows = max(1, min(16, LAYERNORM_PASS_ELEMENTS // block))
    warps = rows * block // (32 * LAYERNORM_THREAD_ELEMENTS)
    return block, rows, max(1, min(16, warps))


def layernorm_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine of x [M, K] (unit column stride), in x's dtype: the first of
    lola's two passes when PASSES = 2."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block, rows, warps = layernorm_pass_launch(k)
    direct(_layernorm_kernel)[(cdiv(m, rows),)](x, y, m, k, x.stride(0), eps, BLOCK_K=block,
                                        ROWS=rows, SINGLE_PASS=block >= k, num_warps=warps)
    return y


def _launch_2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor, eps: float,
               config: Config, sw: torch.Tensor | None = None, act: bool = False) -> None:
    """Launches on x [M, K], w [N, K] (unit column strides; x's dtype or FP8 with optional
    per-channel scales sw [N]), b [N], out [M, N]; `act`: FP8 activations.

    PASSES = 2: LayerNorm runs first as its own kernel and the matmul reads its output; with
    FP8 activations that pass always runs and writes the rows in e4m3 with a scale each
    (fp8.norm_fp8_rows), and the K loop multiplies FP8 by FP8. SPLIT_K > 1: SPLIT_K programs
    per output tile write float32 partial sums, and a second launch of the same kernel
    (FINISH) adds them up and applies the epilogue.
    """
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    x, sx = first_pass(x, None, eps, config, act, lambda t: layernorm_rows(t, eps))
    w, w_fp8 = fp8.weight_operand(w, act, config["BLOCK_M"] == 1)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    # TMA: the K loop reads x and W through descriptors, where the config asks for it and the
    # tensors allow it (else the same tiles by pointers).
    descs = tma_descriptors("lola", config, w_fp8, x, [w])
    xa, wa = descs or (x, w)
    split = config["SPLIT_K"]
    ws = wst = out  # not read unless split > 1
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        wst = torch.empty((split, 2 * m + n), dtype=torch.float32, device=x.device)
    args = launch_args(config, act=act, w_fp8=w_fp8, ieee=x.dtype == torch.float32,
                       w_scaled=sw is not None, tma=descs is not None)

    def launch(grid: tuple[int, int], finish: bool) -> None:
        direct(_lola_kernel)[grid](
            xa, wa, b, out, ws, wst, out if sx is None else sx, out if sw is None else sw,
            m, n, k, x.stride(0), w.stride(0), out.stride(0), eps, FINISH=finish, **args,
        )

    launch_split(launch, cdiv(m, bm) * cdiv(n, bn), split)


def lola(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    eps: float,
    weight_scale: torch.Tensor | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """gelu(layernorm(x)·Wᵀ + b), exact GELU, LayerNorm without affine, x [..., in_features],
    weight [out_features, in_features], bias [out_features]; returns [..., out] in x's dtype.

    `weight` is in x's dtype, or FP8 (torch.float8_e4m3fn or float8_e5m2, e.g. from
    fusetune.quantize_fp8) with optional float32 scales per output channel `weight_scale`
    [out_features] (None: 1), W = weight_scale[:, None] · weight: weight-only by default;
    `fp8_activations=True` rounds the normalized activations to e4m3 per row too (see
    fusetune.ffn). The config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PASSES, SPLIT_K, UNROLL_K,
    SPREAD, THREAD_SUM, TMA, num_warps, num_stages) comes from the lookup tables (for this
    weight format and activation mode) unless `config` is given; no config changes the
    numerics.
    """
    if x.ndim < 1:
        raise ValueError("lola: x must have at least one dimension")
    d = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(f"lola: weight must be [out_features, {d}] (nn.Linear layout), got "
                         f"{tuple(weight.shape)}")
    n = weight.shape[0]
    if bias.shape != (n,):
        raise ValueError(f"lola: bias has shape {tuple(bias.shape)}, expected ({n},)")
    dtype = dtype_name(x.dtype)
    weights = fp8.check_weights("lola", x, {"weight": weight}, {"weight_scale": weight_scale})
    dtype_name(bias.dtype)  # raises for a bias dtype the kernel cannot read
    for name, t in (("weight", weight), ("bias", bias)):
        if t.device != x.device:
            raise ValueError(f"lola: {name} is on {t.device}, x on {x.device}")
    check_device(x, "lola")
    check_eps("lola", eps)
    check_no_grad("lola", x, weight, bias)
    if fp8_activations:
        fp8.check_fp8_activations("lola", weights, x.device)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    x2 = as_rows(x, d)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if config is None:
        from fusetune.runtime import cached_config

        cfg = cached_config(SPEC, (("dim", d), ("out", n)), dtype, m, weights, x.device,
                            activations="fp8" if fp8_activations else "")
    else:
        cfg = SPEC.validate_config(config)
    _launch_2d(x2, w, bias.contiguous(), out.view(-1, n), float(eps), cfg,
               None if weight_scale is None else weight_scale.contiguous(),
               bool(fp8_activations))
    return out


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    d, n = point.dim["dim"], point.dim["out"]
    dtype = torch_dtype(point.dtype)
    # Hidden states with a per-row offset and scale, so that the mean and variance matter.
    x = torch.randn(point.batch, point.seq, d, device=device)
    x = x * (1 + torch.rand(point.batch, point.seq, 1, device=device)) \
        + 0.5 * torch.randn(point.batch, point.seq, 1, device=device)
    w, w_scale = fp8.spec_weight(torch.randn(n, d, device=device) / d**0.5, point)
    b = 0.1 * torch.randn(n, device=device)
    return {"x": x.to(dtype), "weight": w, "weight_scale": w_scale, "bias": b.to(dtype),
            "eps": 1e-5, "fp8_activations": point.fp8_activations}


def _make_outputs(inputs: Tensors) -> Tensors:
    x, w = inputs["x"], inputs["weight"]
    return {"y": torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)}


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    xn = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=inputs["eps"])
    # FP8 weights: the dequantized weights the kernel multiplies by.
    y = xn @ fp8.spec_dequantized(inputs, "weight").T + inputs["bias"].float()
    return {"y": torch.nn.functional.gelu(y)}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, y = inputs["x"], outputs["y"]
    _launch_2d(x.view(-1, x.shape[-1]), inputs["weight"], inputs["bias"],
               y.view(-1, y.shape[-1]), inputs["eps"], config, inputs.get("weight_scale"),
               inputs.get("fp8_activations", False))


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    return default_tiles(point, gpu, _resources, point.dim["out"], point.dim["dim"])


def _canonical(config: Config, point: Point) -> Config:
    return matmul_canonical(config, point, point.dim["out"], point.dim["dim"])


def _folded_smem(config: Config, elt: int, operands: tuple[int, int, bool]) -> int:
    """Shared memory of the folded loop (PASSES = 1) beyond pipelined_smem's model: its sums
    read their own copies of the tiles, so with wgmma tl.dot's operands go to the tensor cores
    as loaded (FP8 weights: upcast, then staged in shared memory once more in x's type) and the
    compiler keeps num_stages sets of tiles; and the float32 accumulator tile may be staged for
    the epilogue."""
    if config["PASSES"] != 1:
        return 0
    x_elt, w_elt, converted = operands
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    smem = bm * bn * 4
    if bm >= 64 and config["num_warps"] >= 4:
        tile = bm * bk * x_elt + bk * bn * w_elt
        staged = bk * bn * elt if converted else 0
        smem = max(smem, config["num_stages"] * tile + staged)
    return smem


def _resources(config: Config, point: Point) -> Resources:
    # One weight tile per K-step, the output tile not staged for the epilogue; with PASSES == 1
    # the one-row loop keeps the weights' sums in a second float32 tile, and the registers hold
    # one more [BLOCK_K, BLOCK_N] tile either way.
    return matmul_resources(config, point, n_weights=1, epilogue=False, base_regs=40,
                            gemv_weights=3 - config["PASSES"],
                            extra_regs=config["BLOCK_K"] * config["BLOCK_N"],
                            loop_smem=_folded_smem)


def _cost(point: Point) -> Cost:
    m, d, n = point.rows, point.dim["dim"], point.dim["out"]
    elt = DTYPE_BYTES[point.dtype]
    return Cost(bytes=(m * d + m * n + n) * elt + weight_bytes(point, n, d),
                flops=2 * m * d * n + 10 * m * n)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim, "out": model.hidden}



def _padding(config: Config, point: Point) -> float:
    return matmul_padding(config, point, point.dim["out"], point.dim["dim"])

SPEC = KernelSpec(
    name="lola",
    description="LayerNorm (no affine) -> x·Wᵀ + b -> exact GELU",
    dim_names=("dim", "out"),
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
    source_objects=(_lola_kernel, _layernorm_kernel, row_norm_stats, grouped_tile, block_rows,
                    k_slice, partial_ptrs, dot, gemv_one_product, tma_one_product, fp8_as_f16,
                    mma_weight, gemv_weight, scale_product, _launch_2d, *MATMUL_HOST_SOURCES,
                    layernorm_rows,
                    *fp8.FP8_SOURCES),
    **MATMUL_SPEC_FIELDS,
)
