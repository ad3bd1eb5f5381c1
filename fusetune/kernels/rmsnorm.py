"""RMSNorm: y = x · rsqrt(mean(x²) + eps) · weight, computed in float32.

Differentiable: with gradients enabled and x or weight requiring grad, `rmsnorm` runs through
an autograd Function whose backward is the rmsnorm_bwd kernel (fusetune/kernels/rmsnorm_bwd.py).

Tunables (all data, see search_spaces/rmsnorm.yaml): BLOCK_D (columns a program holds at once;
when it is smaller than D the kernel loops over the row twice), ROWS (rows per program),
num_warps, num_stages (software pipelining depth of the loads in the looping variant).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._call_memo import CallMemo, tensor_key
from fusetune.kernels._direct import direct
from fusetune.kernels._replay import scratch
from fusetune.kernels.rmsnorm_bwd import rmsnorm_bwd
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
    dtype_name,
    next_pow2,
    torch_dtype,
)


@triton.jit
def _rmsnorm_kernel(
    X,  # *[M, D] input, row stride stride_xm, unit column stride
    W,  # *[D] weight
    Y,  # *[M, D] output, row stride stride_ym, unit column stride
    R,  # *[M, D] residual added to the normalized rows (HAS_RESIDUAL), row stride stride_rm
    M,  # rows
    D,  # columns (the normalized width)
    stride_xm,
    stride_ym,
    stride_rm,
    eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_D >= D: the whole row fits, no loop
    HAS_RESIDUAL: tl.constexpr,  # y = r + norm(x)·w (Gemma's norm of a block's output)
):
    # Program `pid` owns rows [pid*ROWS, pid*ROWS + ROWS); rows past M are masked off.
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    # Row offsets in int64: M * stride can pass 2**31 elements for long prefills.
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm  # [ROWS, 1] pointers to row starts
    y_rows = Y + rows[:, None].to(tl.int64) * stride_ym
    r_rows = R + rows[:, None].to(tl.int64) * stride_rm

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D  # BLOCK_D is a power of two >= D: mask the tail columns
        mask = row_ok[:, None] & col_ok[None, :]
        # Masked lanes read 0, so they add nothing to the sum of squares. (No L2 eviction
        # hints on these loads: they slowed the kernel down rather than sped it up.)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [ROWS], float32
        y = x * rstd[:, None] * w[None, :]
        if HAS_RESIDUAL:  # added in float32: one rounding, at the store
            y += tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # Cast back to the output's element type only at the store.
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: accumulate x² elementwise in float32, reduce once after the loop.
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for off in range(0, D, BLOCK_D):
            cols = off + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (cols[None, :] < D)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / D + eps)
        # Pass 2: re-read the row (mostly from L2), scale, store.
        for off in range(0, D, BLOCK_D):
            cols = off + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            if HAS_RESIDUAL:
                y += tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _launch_2d(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, eps: float, config: Config,
               residual: torch.Tensor | None = None) -> None:
    """Launches on 2-D views x, y (and residual) of shape [M, D] (unit column stride) with
    exactly `config`."""
    m, d = x.shape
    if m == 0:
        return
    block_d, rows = config["BLOCK_D"], config["ROWS"]
    grid = (cdiv(m, rows),)
    r = y if residual is None else residual  # not read without a residual
    direct(_rmsnorm_kernel)[grid](
        x, weight, y, r, m, d, x.stride(0), y.stride(0), r.stride(0), eps,
        BLOCK_D=block_d, ROWS=rows, SINGLE_PASS=block_d >= d,
        HAS_RESIDUAL=residual is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    residual: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape), in float32, output in x.dtype:
    x · rsqrt(mean(x²) + eps) · weight, with the model's own `eps` (no default: models differ);
    with `residual` (x's shape and dtype), residual + that, added in float32 and rounded once
    (Gemma's norms of the attention's and the MLP's outputs, before their residual adds).

    The launch configuration comes from the lookup tables for this GPU and shape, unless
    `config` (BLOCK_D, ROWS, num_warps, num_stages) is given.

    With gradients enabled and x or weight requiring grad, the call is differentiable: the
    backward pass launches the rmsnorm_bwd kernel with the config the tables give for it
    (`config` applies to the forward only) and computes only the gradients asked for.
    """
    memo_key = None
    if _MEMO.active(config):
        memo_key = (tensor_key(x), tensor_key(weight), eps, tensor_key(residual))
        inputs = (x, weight, residual)

        def run(cfg: Config) -> torch.Tensor:
            return _run(x, weight, eps, cfg, residual)

        out = _MEMO.repeat(memo_key, inputs, run)
        if out is not None:
            return out
    if x.ndim < 1:
        raise ValueError("rmsnorm: x must have at least one dimension")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if weight.device != x.device:
        raise ValueError(f"rmsnorm: weight is on {weight.device}, x on {x.device}")
    check_device(x, "rmsnorm")
    check_eps("rmsnorm", eps)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"rmsnorm: residual must be x's shape {tuple(x.shape)}, dtype "
                         f"{x.dtype} and device {x.device}; got {tuple(residual.shape)}, "
                         f"{residual.dtype}, {residual.device}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        # Autograd records the call; its forward comes back here with gradients off (the
        # residual's gradient is the output's: its add is autograd's own).
        out = _RMSNormFunction.apply(x, weight, eps, config)
        return out if residual is None else residual + out
    dtype = dtype_name(x.dtype)
    dtype_name(weight.dtype)  # raises for weight dtypes the kernel cannot read
    if config is None:
        since = _MEMO.generation()
        from fusetune.runtime import cached_config

        m = x.numel() // d if d else 0
        dims = (("dim", d), *((("residual", 1),) if residual is not None else ()))
        cfg = cached_config(SPEC, dims, dtype, m, "", x.device)
        if memo_key is not None:
            return _MEMO.first(memo_key, inputs, cfg, since, run)
    else:
        cfg = SPEC.validate_config(config)
    return _run(x, weight, eps, cfg, residual)


_MEMO = CallMemo()


def _run(x: torch.Tensor, weight: torch.Tensor, eps: float, cfg: Config,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """rmsnorm's launch, once its inputs are checked and its config chosen."""
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_2d(as_rows(x, d), weight.contiguous(), y.view(-1, d), float(eps), cfg,
               None if residual is None else as_rows(residual, d))
    return y


class _RMSNormFunction(torch.autograd.Function):
    """fusetune.rmsnorm under autograd: saves x and weight (rstd is recomputed from x in the
    backward, which is cheaper than storing it) and launches rmsnorm_bwd for the gradients."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                weight: torch.Tensor, eps: float, config: Mapping[str, int] | None
                ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rmsnorm(x, weight, eps=eps, config=config)  # gradients are off in here

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        if torch.is_grad_enabled():  # create_graph=True: autograd would record this backward
            raise RuntimeError(
                "rmsnorm: no double backward: a gradient was asked for with create_graph=True, "
                "but the rmsnorm_bwd kernel has no backward pass of its own")
        x, weight = ctx.saved_tensors
        dx, dw = rmsnorm_bwd(x, weight, dy, eps=ctx.eps, grad_x=ctx.needs_input_grad[0],
                             grad_weight=ctx.needs_input_grad[1])
        return dx, dw, None, None


def norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, K] (unit column stride) into a new tensor: the matmul kernels' first
    pass (PASSES = 2), whose callers checked the inputs. The config comes from the tables as
    fusetune.rmsnorm's does, without a warning where none is tuned: the caller asked for the
    matmul kernel, whose own lookup says what is missing."""
    from fusetune.runtime import cached_config

    m, d = x.shape
    y = scratch((m, d), x.dtype, x.device)
    if m:
        cfg = cached_config(SPEC, (("dim", d),), dtype_name(x.dtype), m, "", x.device,
                            warn=False)
        _launch_2d(x, weight, y, float(eps), cfg)
    return y


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    d = point.dim["dim"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, d, device=device, dtype=torch.float32)
    weight = 1.0 + 0.1 * torch.randn(d, device=device, dtype=torch.float32)
    inputs = {"x": x.to(dtype), "weight": weight.to(dtype), "eps": 1e-6}
    if SPEC.dim_value(point, "residual"):
        inputs["residual"] = torch.randn(point.batch, point.seq, d, device=device).to(dtype)
    return inputs


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"y": torch.empty_like(inputs["x"])}


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"]) * inputs["weight"].float()
    if inputs.get("residual") is not None:
        y = y + inputs["residual"].float()
    return {"y": y}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, y, r = inputs["x"], outputs["y"], inputs.get("residual")
    d = x.shape[-1]
    _launch_2d(x.view(-1, d), inputs["weight"], y.view(-1, d), inputs["eps"], config,
               None if r is None else r.view(-1, d))


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    # One row per program, the whole row in registers up to 16K columns (looping beyond),
    # more warps for wider rows: the widely used heuristic of hand-written norm kernels.
    block_d = min(next_pow2(point.dim["dim"]), 16384)
    num_warps = 4 if block_d < 2048 else 8 if block_d < 8192 else 16
    return {"BLOCK_D": block_d, "ROWS": 1, "num_warps": num_warps, "num_stages": 1}


def _canonical(config: Config, point: Point) -> Config:
    # Configs that compile to the same kernel for this point collapse onto one:
    # BLOCK_D past the padded row width and ROWS past the row count only add masked lanes,
    # and num_stages means nothing without a loop to pipeline.
    d = point.dim["dim"]
    c = dict(config)
    c["BLOCK_D"] = min(c["BLOCK_D"], next_pow2(d))
    c["ROWS"] = min(c["ROWS"], next_pow2(point.rows))
    if c["BLOCK_D"] >= d:
        c["num_stages"] = 1
    return c


def _structure(config: Config, point: Point) -> bool:
    # one block holds the whole row (SINGLE_PASS), or the kernel walks it twice in blocks
    return config["BLOCK_D"] >= point.dim["dim"]


def _resources(config: Config, point: Point) -> Resources:
    elt = DTYPE_BYTES[point.dtype]
    threads = 32 * config["num_warps"]
    block_d, rows, stages = config["BLOCK_D"], config["ROWS"], config["num_stages"]
    tile = rows * block_d
    per_thread = -(-tile // threads)
    # float32 tile (x, or acc + x in the loop) plus addresses and bookkeeping.
    regs = 2 * per_thread + 32
    # Cross-warp reduction scratch, plus the pipelined x and weight tiles when looping.
    smem = rows * config["num_warps"] * 4
    if block_d < point.dim["dim"] and stages > 1:
        smem += (stages - 1) * (rows + 1) * block_d * elt
    return Resources(smem_bytes=smem, regs_per_thread=regs, threads=threads)


def _cost(point: Point) -> Cost:
    m, d = point.rows, point.dim["dim"]
    elt = DTYPE_BYTES[point.dtype]
    tensors = 3 if SPEC.dim_value(point, "residual") else 2  # x, y (and the residual)
    return Cost(bytes=tensors * m * d * elt + d * elt, flops=4 * m * d)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim}


SPEC = KernelSpec(
    name="rmsnorm",
    description="RMSNorm over the last dimension (float32 math), any leading shape",
    dim_names=("dim",),
    optional_dims={"residual": 0},  # 1: a residual added to the normalized rows
    config_keys=("BLOCK_D", "ROWS", "num_warps", "num_stages"),
    pow2_keys=("BLOCK_D", "ROWS", "num_warps"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    dims_from_model=_dims_from_model,
    source_objects=(_rmsnorm_kernel, _launch_2d),
    structure=_structure,
    dim_choices={"residual": {0: "no residual", 1: "a residual added to the normalized rows"}},
)
