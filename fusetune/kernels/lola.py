"""LayerNorm (no affine) -> Linear -> exact GELU, fused: y = gelu(layernorm(x)·Wᵀ + b).

LayerNorm folds into the matmul: layernorm(x)·Wᵀ = rstd ⊙ (x·Wᵀ − mean ⊗ Σ_k W[:, k]), with
mean and rstd per row and the column sums of W per output. Each program accumulates x·Wᵀ for
one [BLOCK_M, BLOCK_N] tile together with Σx and Σx² of its rows and Σ_k W of its columns (all
float32, from the tiles it loads anyway), then applies the correction, the bias and
gelu(y) = y·(1 + erf(y/√2))/2 in the epilogue. Weights use nn.Linear's layout [out, in].

The variance is E[x²] − mean², in float32: exact enough for activations whose mean is not
orders of magnitude above their spread (normalized hidden states); the reference is torch's
two-pass LayerNorm.

Tunables (search_spaces/lola.yaml): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._matmul import (
    collapse_tiles,
    default_tiles,
    dot,
    grouped_tile,
    pipelined_smem,
)
from fusetune.kernels._spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    as_rows,
    check_device,
    dtype_name,
    torch_dtype,
)
from fusetune.models import ModelPreset


@triton.jit
def _lola_kernel(
    X,  # *[M, K] activations, row stride stride_xm, unit column stride
    W,  # *[N, K] weight (nn.Linear layout), row stride stride_wn
    B,  # *[N] bias
    OUT,  # *[M, N] output, row stride stride_om
    M, N, K,
    stride_xm, stride_wn, stride_om,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
):
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] = Wᵀ

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_x = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_x2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0  # partial last step: masked lanes read 0 and add nothing
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sum_x += tl.sum(xf, axis=1)
        sum_x2 += tl.sum(xf * xf, axis=1)
        sum_w += tl.sum(w.to(tl.float32), axis=0)
        acc = dot(x, w, acc, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mean = sum_x / K
    rstd = tl.rsqrt(tl.maximum(sum_x2 / K - mean * mean, 0.0) + eps)
    bias = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = rstd[:, None] * (acc - mean[:, None] * sum_w[None, :]) + bias[None, :]
    y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))  # exact GELU
    out_ptrs = OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor, eps: float,
               config: Config) -> None:
    """Launches on x [M, K], w [N, K] (unit column strides), b [N], out [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _lola_kernel[grid](
        x, w, b, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), eps,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        IEEE=x.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def lola(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    *,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """gelu(layernorm(x)·Wᵀ + b), exact GELU, LayerNorm without affine, x [..., in_features],
    weight [out_features, in_features], bias [out_features]; returns [..., out] in x's dtype.

    The config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) comes from the
    lookup tables unless `config` is given.
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
    if weight.dtype != x.dtype:
        raise TypeError(f"lola: weight is {weight.dtype}, expected x's dtype {x.dtype}")
    dtype_name(bias.dtype)  # raises for a bias dtype the kernel cannot read
    for name, t in (("weight", weight), ("bias", bias)):
        if t.device != x.device:
            raise ValueError(f"lola: {name} is on {t.device}, x on {x.device}")
    check_device(x, "lola")
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    x2 = as_rows(x, d)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if config is None:
        from fusetune.tables import cached_config

        cfg = cached_config("lola", (("dim", d), ("out", n)), dtype, m, "", x.device)
    else:
        cfg = SPEC.validate_config(config)
    _launch_2d(x2, w, bias.contiguous(), out.view(-1, n), float(eps), cfg)
    return out


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    d, n = point.dim["dim"], point.dim["out"]
    dtype = torch_dtype(point.dtype)
    # Hidden states with a per-row offset and scale, so that the mean and variance matter.
    x = torch.randn(point.batch, point.seq, d, device=device)
    x = x * (1 + torch.rand(point.batch, point.seq, 1, device=device)) \
        + 0.5 * torch.randn(point.batch, point.seq, 1, device=device)
    w = torch.randn(n, d, device=device) / d**0.5
    b = 0.1 * torch.randn(n, device=device)
    return {"x": x.to(dtype), "weight": w.to(dtype), "bias": b.to(dtype), "eps": 1e-5}


def _make_outputs(inputs: Tensors) -> Tensors:
    x, w = inputs["x"], inputs["weight"]
    return {"y": torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)}


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    xn = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=inputs["eps"])
    y = xn @ inputs["weight"].float().T + inputs["bias"].float()
    return {"y": torch.nn.functional.gelu(y)}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, y = inputs["x"], outputs["y"]
    _launch_2d(x.view(-1, x.shape[-1]), inputs["weight"], inputs["bias"],
               y.view(-1, y.shape[-1]), inputs["eps"], config)


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    return default_tiles(point, gpu, _resources)


def _canonical(config: Config, point: Point) -> Config:
    return collapse_tiles(config, point.rows, point.dim["out"], point.dim["dim"])


def _resources(config: Config, point: Point) -> Resources:
    elt = DTYPE_BYTES[point.dtype]
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    threads = 32 * config["num_warps"]
    smem = pipelined_smem(config, elt, n_weights=1, epilogue=False)
    regs = (bm * bn + (bm * bk + bk * bn) * elt // 4 + bk * bn) // threads + 40
    return Resources(smem_bytes=smem, regs_per_thread=regs, threads=threads)


def _cost(point: Point) -> Cost:
    m, d, n = point.rows, point.dim["dim"], point.dim["out"]
    elt = DTYPE_BYTES[point.dtype]
    return Cost(bytes=(m * d + n * d + m * n + n) * elt, flops=2 * m * d * n + 10 * m * n)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim, "out": model.hidden}


SPEC = KernelSpec(
    name="lola",
    description="LayerNorm (no affine) -> x·Wᵀ + b -> exact GELU",
    dim_names=("dim", "out"),
    config_keys=("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"),
    pow2_keys=("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    dims_from_model=_dims_from_model,
    tolerance={"float16": 5e-3, "bfloat16": 2.5e-2, "float32": 1e-4},
    source_objects=(_lola_kernel, grouped_tile, dot, _launch_2d),
)
