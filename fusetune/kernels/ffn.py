"""Feed-forward gate of Llama-style MLPs, fused: h = silu(a) · b (or Gemma's GeGLU, gelu(a) · b
with the tanh approximation) with a = rmsnorm(x)·W1ᵀ and b = rmsnorm(x)·W3ᵀ, in one pass
over x.

RMSNorm folds into the matmul: rmsnorm(x)·Wᵀ = rstd ⊙ ((x ⊙ g)·Wᵀ), with rstd = rsqrt(mean(x²)+eps)
per row. Each program accumulates (x ⊙ g)·W1ᵀ and (x ⊙ g)·W3ᵀ for one [BLOCK_M, BLOCK_N] tile
and the row sums of x² on the way (x is read once for both products); the epilogue scales by
rstd and applies silu(a)·b in float32. Weights use nn.Linear's layout [hidden, dim], in x's
dtype or in FP8 with per-output-channel scales (fp8.py): the scales multiply a and b in the
epilogue, before silu.

Tunables (search_spaces/ffn.yaml): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M (programs that share
weight tiles are launched together for L2 reuse), PASSES, SPLIT_K, UNROLL_K, SPREAD,
THREAD_SUM, TMA, num_warps, num_stages. FP8 activations are no tunable but the caller's mode
(fp8.py).
"""

from __future__ import annotations

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
    as_rows,
    cdiv,
    check_device,
    check_eps,
    check_no_grad,
    dtype_name,
    torch_dtype,
)


@triton.jit
def _ffn_kernel(
    X,  # *[M, K] activations (FP8 with ACT_FP8), row stride stride_xm, unit column stride
    G,  # *[K] RMSNorm weight
    W1,  # *[N, K] gate projection (nn.Linear layout), row stride stride_wn
    W3,  # *[N, K] up projection, same layout and strides as W1
    # (with TMA, X, W1 and W3 are TMA descriptors over the same tensors)
    OUT,  # *[M, N] output, row stride stride_om
    WS,  # *[2·SPLIT_K, M, N] float32 partial products (split-K only)
    WSQ,  # *[SPLIT_K, M] float32 partial sums of x² (split-K with PASSES == 1 only)
    SX,  # *[M] float32 scales of X's rows (ACT_FP8 only)
    S1, S3,  # *[N] float32 per-output-channel scales of W1 and W3 (W_SCALED only)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PASSES: tl.constexpr,  # 1: RMSNorm folded into the K loop; 2: X already normalized
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a slice of K
    FINISH: tl.constexpr,  # the split-K finishing pass: add the partials up, then the epilogue
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (_matmul.dot)
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.mma_weight)
    ACT_FP8: tl.constexpr,  # X is FP8 with row scales SX (PASSES == 2 only)
    W_SCALED: tl.constexpr,  # the weights have per-output-channel scales S1, S3
    UNROLL_K: tl.constexpr,  # BLOCK_M == 1: two K-steps per loop iteration (gemv_two_products)
    SPREAD: tl.constexpr,  # BLOCK_M == 1: the program's BLOCK_N columns far apart (block_rows)
    THREAD_SUM: tl.constexpr,  # BLOCK_M == 1: each thread adds its weight run up first
    TMA: tl.constexpr,  # X, W1, W3 are TMA descriptors (PASSES == 2, see tma_two_products)
    ACT: tl.constexpr,  # the gate's activation: ACTIVATIONS[ACT] (0 silu, 1 gelu, tanh form)
):
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = block_rows(pid_n, N, BLOCK_N, SPREAD)  # the same rows of W1 and W3, columns of OUT
    m_ok = rm < M
    n_ok = rn < N
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if FINISH:
        acc1, acc3, sumsq = two_partials_added(WS, WSQ, rm, rn, m_ok, mn_ok, M, N, BLOCK_M,
                                               BLOCK_N, SPLIT_K, PASSES)
    elif TMA:
        acc1, acc3 = tma_two_products(X, W1, W3, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                      pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
                                      IEEE, INTERPRETED)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # not read: PASSES == 2
    else:
        # Weight tiles read transposed as [BLOCK_K, BLOCK_N] (W[n, k]): rows rn of W1 and W3.
        w_off = rn[None, :].to(tl.int64) * stride_wn
        acc1, acc3, sumsq = two_products(X, G, W1, w_off, W3, w_off, rm, m_ok, n_ok, K,
                                         stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PASSES,
                                         IEEE, W_FP8, UNROLL_K, THREAD_SUM, INTERPRETED)

    if SPLIT_K > 1 and not FINISH:
        store_two_partials(WS, WSQ, acc1, acc3, sumsq, rm, rn, m_ok, mn_ok, M, N, pid_n == 0,
                           PASSES)
    else:
        # The scales of the FP8 operands (x's row scales, the channels' own) and rstd.
        a, b = rms_scaled_products(acc1, acc3, sumsq, K, eps, SX, rm, m_ok, S1, rn, S3, rn, n_ok,
                                   ACT_FP8, W_SCALED, PASSES)
        if ACT == 0:
            h = a * tl.sigmoid(a) * b  # silu(a) · b, float32
        else:
            # gelu(a) · b, tanh form: 0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³))), float32,
            # with tanh(z) = 2·σ(2z) − 1
            z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            h = a * tl.sigmoid(2.0 * z) * b
        out_ptrs = OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, h.to(OUT.dtype.element_ty), mask=mn_ok)


def _launch_2d(x: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               out: torch.Tensor, eps: float, config: Config, s1: torch.Tensor | None = None,
               s3: torch.Tensor | None = None, act: bool = False, gate: int = 0) -> None:
    """Launches on x [M, K], weights [N, K] (unit column strides; x's dtype or FP8 with
    optional per-channel scales s1, s3 [N]), out [M, N]; `act`: FP8 activations; `gate`: the
    gate's activation, an index of ACTIVATIONS.

    PASSES = 2: RMSNorm runs first as its own kernel (tuned config from the tables) and the
    matmul reads its output; with FP8 activations that pass always runs and writes the rows in
    e4m3 with a scale each (fp8.norm_fp8_rows), and the K loop multiplies FP8 by FP8.
    SPLIT_K > 1: SPLIT_K programs per output tile write float32 partial sums, and
    a second launch of the same kernel (FINISH) adds them up and applies the epilogue.
    """
    m, k = x.shape
    n = w1.shape[0]
    if m == 0 or n == 0:
        return
    if _unfused.unfused(config):
        _unfused_2d(x, g, w1, w3, out, eps, s1, s3, act, gate)
        return
    x, sx = first_pass(x, g, eps, config, act, lambda t: norm_rows(t, g, eps))
    gemv = config["BLOCK_M"] == 1
    w1, w_fp8 = fp8.weight_operand(w1, act, gemv)
    w3, _ = fp8.weight_operand(w3, act, gemv)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    # TMA: the K loop reads x, W1 and W3 through descriptors (boxes of one tile each), where
    # the config asks for it and these tensors allow it (else the same tiles by pointers).
    descs = tma_descriptors("ffn", config, w_fp8, x, [w1, w3])
    xa, w1a, w3a = descs or (x, w1, w3)
    split = config["SPLIT_K"]
    ws = wsq = out  # not read unless split > 1
    if split > 1:
        ws = scratch((2 * split, m, n), torch.float32, x.device)
        wsq = scratch((split, m), torch.float32, x.device)
    args = launch_args(config, act=act, w_fp8=w_fp8, ieee=x.dtype == torch.float32,
                       w_scaled=s1 is not None, tma=descs is not None)

    def launch(grid: tuple[int, int], finish: bool) -> None:
        direct(_ffn_kernel)[grid](
            xa, g, w1a, w3a, out, ws, wsq, out if sx is None else sx,
            out if s1 is None else s1, out if s3 is None else s3, m, n, k, x.stride(0),
            w1.stride(0), out.stride(0), eps, FINISH=finish, ACT=gate, **args,
        )

    launch_split(launch, cdiv(m, bm) * cdiv(n, bn), split)


def _unfused_2d(x: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                out: torch.Tensor, eps: float, s1: torch.Tensor | None, s3: torch.Tensor | None,
                act: bool, gate: int = 0) -> None:
    """UNFUSED = 1 (_unfused): RMSNorm (its tuned config), then cuBLAS: one GEMM over W1 and
    W3 where they are one stacked matrix (fusetune.patch makes them views of one), else one
    each (FP8 weights upcast with their scales); then the gate's activation · b in one pass,
    float32 (swiglu's kernel and tuned config: silu, or GeGLU's gelu in its tanh form)."""
    from fusetune.kernels.swiglu import SPEC as SWIGLU
    from fusetune.kernels.swiglu import _launch_2d as swiglu_2d
    from fusetune.runtime import cached_config

    if act:
        raise ConfigError("ffn: UNFUSED=1 with FP8 activations: that mode runs fused only")
    m, hidden = x.shape[0], w1.shape[0]
    xn = norm_rows(x, g, eps)
    one_gemm = None if (s1 is None) != (s3 is None) else _unfused.stacked_operands(
        (w1, w3), None if s1 is None else (s1, s3), None)
    if one_gemm is not None:
        both, scales, _ = one_gemm
        ab = _unfused.matmul(xn, both, scales, scratch((m, 2 * hidden), x.dtype, x.device))
        a, b = ab[:, :hidden], ab[:, hidden:]
    else:
        a = _unfused.matmul(xn, w1, s1, scratch((m, hidden), x.dtype, x.device))
        b = _unfused.matmul(xn, w3, s3, scratch((m, hidden), x.dtype, x.device))
    cfg = cached_config(SWIGLU, (("hidden", hidden),), dtype_name(x.dtype), m, "", x.device,
                        warn=False)
    swiglu_2d(a, b, out, cfg, gate=gate)


# The gate's activations (the point's optional dim `act` is an index of this): Llama's SiLU
# (SwiGLU) and Gemma's GELU in its tanh form (GeGLU, transformers' gelu_pytorch_tanh).
ACTIVATIONS = ("silu", "gelu_tanh")


def ffn(
    x: torch.Tensor,
    rms_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    *,
    eps: float,
    w1_scale: torch.Tensor | None = None,
    w3_scale: torch.Tensor | None = None,
    activation: str = "silu",
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """silu(rmsnorm(x)·W1ᵀ) · (rmsnorm(x)·W3ᵀ) for x [..., dim], W1 and W3 [hidden, dim], with
    the model's norm epsilon `eps`; `activation="gelu_tanh"`: gelu (tanh form, Gemma's
    gelu_pytorch_tanh) instead of silu.

    W1 and W3 are in x's dtype, or both FP8 (torch.float8_e4m3fn or float8_e5m2, e.g. from
    fusetune.quantize_fp8) with optional float32 scales per output channel `w1_scale`,
    `w3_scale` [hidden] (None: 1), W1 = w1_scale[:, None] · w1. FP8 weights are weight-only
    by default: the activations stay in x's dtype and the results match the dequantized
    weights within the 16-bit tolerance. `fp8_activations=True` (FP8 weights, FP8 tensor
    cores) rounds the normalized activations to e4m3 too, per row: faster products, a few
    percent of error (fp8.ACT_FP8_TOLERANCE). Returns [..., hidden] in x's dtype. The config
    (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PASSES, SPLIT_K, UNROLL_K, SPREAD, THREAD_SUM, TMA,
    num_warps, num_stages) comes from the lookup tables (for this weight format and activation
    mode) unless `config` is given; no config changes the numerics.
    """
    memo_key = None
    if _MEMO.active(config):
        memo_key = (tensor_key(x), tensor_key(rms_weight), tensor_key(w1), tensor_key(w3),
                    tensor_key(w1_scale), tensor_key(w3_scale), eps, activation,
                    fp8_activations)
        inputs = (x, rms_weight, w1, w3, w1_scale, w3_scale)

        def run(cfg: Config) -> torch.Tensor:
            return _run(x, rms_weight, w1, w3, eps, w1_scale, w3_scale, fp8_activations, cfg,
                        ACTIVATIONS.index(activation))

        out = _MEMO.repeat(memo_key, inputs, run)
        if out is not None:
            return out
    if activation not in ACTIVATIONS:
        raise ValueError(f"ffn: activation={activation!r}; valid: "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}")
    gate = ACTIVATIONS.index(activation)
    if x.ndim < 1:
        raise ValueError("ffn: x must have at least one dimension")
    d = x.shape[-1]
    if rms_weight.shape != (d,):
        raise ValueError(f"ffn: rms_weight has shape {tuple(rms_weight.shape)}, expected ({d},)")
    if w1.ndim != 2 or w1.shape[1] != d or w3.shape != w1.shape:
        raise ValueError(f"ffn: w1 and w3 must both be [hidden, {d}] (nn.Linear layout), got "
                         f"{tuple(w1.shape)} and {tuple(w3.shape)}")
    dtype = dtype_name(x.dtype)
    for name, t in (("rms_weight", rms_weight), ("w1", w1), ("w3", w3)):
        if t.device != x.device:
            raise ValueError(f"ffn: {name} is on {t.device}, x on {x.device}")
    weights = fp8.check_weights("ffn", x, {"w1": w1, "w3": w3},
                                {"w1_scale": w1_scale, "w3_scale": w3_scale})
    check_device(x, "ffn")
    check_eps("ffn", eps)
    check_no_grad("ffn", x, rms_weight, w1, w3)
    if fp8_activations:
        fp8.check_fp8_activations("ffn", weights, x.device)
    if config is None:
        since = _MEMO.generation()
        from fusetune.runtime import cached_config

        m = x.numel() // d if d else 0
        dims = (*((("act", gate),) if gate else ()), ("dim", d), ("hidden", w1.shape[0]))
        cfg = cached_config(SPEC, dims, dtype, m, weights, x.device,
                            activations="fp8" if fp8_activations else "")
        if memo_key is not None:
            return _MEMO.first(memo_key, inputs, cfg, since, run)
    else:
        cfg = SPEC.validate_config(config)
    return _run(x, rms_weight, w1, w3, eps, w1_scale, w3_scale, fp8_activations, cfg, gate)


_MEMO = CallMemo()


def _run(x: torch.Tensor, rms_weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
         eps: float, w1_scale: torch.Tensor | None, w3_scale: torch.Tensor | None,
         fp8_activations: bool, cfg: Config, gate: int = 0) -> torch.Tensor:
    """ffn's launch, once its inputs are checked and its config chosen."""
    if (w1_scale is None) != (w3_scale is None):  # the kernel scales both or neither
        ones = torch.ones(w1.shape[0], dtype=torch.float32, device=x.device)
        w1_scale, w3_scale = (ones if w1_scale is None else w1_scale,
                              ones if w3_scale is None else w3_scale)
    if w1.stride(-1) != 1 or w3.stride() != w1.stride():  # the kernel reads both with one stride
        w1, w3 = w1.contiguous(), w3.contiguous()
    d, hidden = x.shape[-1], w1.shape[0]
    out = torch.empty((*x.shape[:-1], hidden), dtype=x.dtype, device=x.device)
    _launch_2d(as_rows(x, d), rms_weight.contiguous(), w1, w3, out.view(-1, hidden), float(eps),
               cfg, None if w1_scale is None else w1_scale.contiguous(),
               None if w3_scale is None else w3_scale.contiguous(), bool(fp8_activations),
               gate)
    return out


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    d, hdim = point.dim["dim"], point.dim["hidden"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, d, device=device)
    g = 1.0 + 0.1 * torch.randn(d, device=device)
    # nn.Linear's default init scale, so that a and b are O(1) like in a trained model. W1 and
    # W3 are the halves of one stacked matrix, as fusetune.patch holds them (the unfused form
    # multiplies by both in one GEMM there).
    w13, s13 = fp8.spec_weight(torch.randn(2 * hdim, d, device=device) / d**0.5, point)
    w1, w3 = w13[:hdim], w13[hdim:]
    w1_scale, w3_scale = (None, None) if s13 is None else (s13[:hdim], s13[hdim:])
    return {"x": x.to(dtype), "rms_weight": g.to(dtype), "w1": w1, "w3": w3,
            "w1_scale": w1_scale, "w3_scale": w3_scale, "eps": 1e-6,
            "fp8_activations": point.fp8_activations,
            "activation": ACTIVATIONS[SPEC.dim_value(point, "act")]}


def _make_outputs(inputs: Tensors) -> Tensors:
    x, w1 = inputs["x"], inputs["w1"]
    return {"h": torch.empty((*x.shape[:-1], w1.shape[0]), dtype=x.dtype, device=x.device)}


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    xn = xn * inputs["rms_weight"].float()
    # FP8 weights: the dequantized weights the kernel multiplies by.
    a = xn @ fp8.spec_dequantized(inputs, "w1").T
    b = xn @ fp8.spec_dequantized(inputs, "w3").T
    if inputs.get("activation", "silu") == "gelu_tanh":
        return {"h": torch.nn.functional.gelu(a, approximate="tanh") * b}
    return {"h": torch.nn.functional.silu(a) * b}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, h = inputs["x"], outputs["h"]
    _launch_2d(x.view(-1, x.shape[-1]), inputs["rms_weight"], inputs["w1"], inputs["w3"],
               h.view(-1, h.shape[-1]), inputs["eps"], config, inputs.get("w1_scale"),
               inputs.get("w3_scale"), inputs.get("fp8_activations", False),
               ACTIVATIONS.index(inputs.get("activation", "silu")))


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    return default_tiles(point, gpu, _resources, point.dim["hidden"], point.dim["dim"])


def _canonical(config: Config, point: Point) -> Config:
    return matmul_canonical(config, point, point.dim["hidden"], point.dim["dim"])


def _resources(config: Config, point: Point) -> Resources:
    # W1 and W3: two weight tiles per K-step, two accumulators staged for the epilogue.
    return matmul_resources(config, point, n_weights=2, epilogue=True, base_regs=40,
                            unfused=True)


def _cost(point: Point) -> Cost:
    m, d, hdim = point.rows, point.dim["dim"], point.dim["hidden"]
    elt = DTYPE_BYTES[point.dtype]
    w_bytes = weight_bytes(point, 2 * hdim, d)
    return Cost(bytes=(m * d + m * hdim + d) * elt + w_bytes,
                flops=2 * m * d * 2 * hdim + 6 * m * hdim)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    gate = ACTIVATIONS.index(model.mlp_act)
    return {"dim": model.dim, "hidden": model.hidden, **({"act": gate} if gate else {})}



def _padding(config: Config, point: Point) -> float:
    return matmul_padding(config, point, point.dim["hidden"], point.dim["dim"])

SPEC = KernelSpec(
    name="ffn",
    description="RMSNorm -> x·W1ᵀ, x·W3ᵀ in one pass over x -> silu(a)·b",
    dim_names=("dim", "hidden"),
    optional_dims={"act": 0},  # the gate's activation: an index of ACTIVATIONS
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
    source_objects=(_ffn_kernel, *TWO_PRODUCT_SOURCES, _launch_2d, *MATMUL_HOST_SOURCES,
                    _rmsnorm_kernel, *fp8.FP8_SOURCES, _unfused_2d, *_unfused.SOURCES),
    algorithm_sources=(_unfused_2d, *_unfused.SOURCES),
    algorithm_keys=("UNFUSED",),
    dim_choices={"act": dict(enumerate(ACTIVATIONS))},
    **MATMUL_SPEC_FIELDS,
)
