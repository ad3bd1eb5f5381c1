"""SwiGLU's gate: y = silu(a) · b for a, b [..., H] (the gate and up projections' outputs),
computed in float32, y in a's dtype.

Differentiable in a and b: where autograd records the call, the backward is `swiglu_bwd` (a
kernel tuned of its own), which recomputes silu(a) and σ(a) from a, so autograd saves a and b
only (the inputs, alive anyway), no activation of its own.

Tunables (search_spaces/swiglu.yaml): BLOCK (columns per program), ROWS (rows per program),
num_warps; the tiling is in `_glu`, shared with swiglu_bwd.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from fusetune.kernels import _glu
from fusetune.kernels._direct import direct
from fusetune.kernels.swiglu_bwd import swiglu_bwd
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
)


@triton.jit
def _swiglu_kernel(
    A, B,  # *[M, H] gate and up values, unit column stride
    Y,  # *[M, H] output, unit column stride
    M, H,
    stride_am, stride_bm, stride_ym,  # row strides
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    GATE: tl.constexpr = 0,  # the gate's activation: 0 silu (SwiGLU), 1 gelu, tanh form (GeGLU)
):
    # Program p owns rows [rb*ROWS, rb*ROWS + ROWS) x columns [cb*BLOCK, cb*BLOCK + BLOCK):
    # the column blocks of one row block are neighbours (_glu.grid); lanes past M or H masked.
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(H, BLOCK)
    rows = (pid // col_blocks) * ROWS + tl.arange(0, ROWS)
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    r = rows.to(tl.int64)[:, None]  # row offsets in int64: M*H can pass 2**31
    a = tl.load(A + r * stride_am + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + r * stride_bm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE == 0:
        y = a * tl.sigmoid(a) * b
    else:
        # gelu(a) = 0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³))) = a·σ(2·√(2/π)·(…)), as ffn's
        # epilogue computes it
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        y = a * tl.sigmoid(2.0 * z) * b
    tl.store(Y + r * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _launch_2d(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, config: Config,
               gate: int = 0) -> None:
    """Launches on [M, H] views (unit column stride) with exactly `config`; `gate` 1: gelu
    (tanh form) instead of silu, Gemma's GeGLU for ffn's unfused form (the same streaming of
    a, b and y, so silu's tuned config serves it)."""
    m, h = a.shape
    if m == 0:
        return
    direct(_swiglu_kernel)[_glu.grid(m, h, config)](
        a, b, y, m, h, a.stride(0), b.stride(0), y.stride(0),
        BLOCK=config["BLOCK"], ROWS=config["ROWS"], GATE=gate, num_warps=config["num_warps"],
        num_stages=1,
    )


def _forward(a: torch.Tensor, b: torch.Tensor, config: Config | None) -> torch.Tensor:
    dtype, (a2, b2) = _glu.check_rows("swiglu", a=a, b=b)
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    m, h = a2.shape
    cfg = _glu.lookup(SPEC, dtype, m, h, a.device) if config is None else config
    _launch_2d(a2, b2, y.view(-1, h), cfg)
    return y


class _SwiGLU(torch.autograd.Function):
    """y = silu(a)·b with (da, db) = swiglu_bwd(a, b, dy)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, config: Config | None
                ) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _forward(a, b, config)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        da, db = swiglu_bwd(a, b, dy)
        need_a, need_b, _ = ctx.needs_input_grad
        return (da if need_a else None), (db if need_b else None), None


def swiglu(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """silu(a) · b for a, b of one shape [..., H] and dtype (rows may be strided, e.g. the two
    halves of a fused gate/up output), in float32; a new tensor of a's shape and dtype.

    The config (BLOCK, ROWS, num_warps) comes from the lookup tables for this GPU and shape
    unless `config` is given (it sets the forward's; the backward's comes from swiglu_bwd's
    entries). Where a or b requires grad (and grad mode is on) the call is recorded for
    autograd, with `swiglu_bwd` as its backward.
    """
    cfg = None if config is None else SPEC.validate_config(config)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _SwiGLU.apply(a, b, cfg)
    return _forward(a, b, cfg)


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    return _glu.make_rows(point, device, ("a", "b"))


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"y": torch.empty_like(inputs["a"])}


def _reference(inputs: Tensors) -> Tensors:
    return {"y": F.silu(inputs["a"].float()) * inputs["b"].float()}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    h = inputs["a"].shape[-1]
    _launch_2d(inputs["a"].view(-1, h), inputs["b"].view(-1, h), outputs["y"].view(-1, h),
               config)


def _resources(config: Config, point: Point) -> Resources:
    # a, b and the product per element.
    return _glu.resources(config, point, floats_per_element=3)


def _cost(point: Point) -> Cost:
    n = point.rows * point.dim["hidden"]
    # a, b read, y written; σ (an exp, an add, a division) and two multiplies.
    return Cost(bytes=3 * n * DTYPE_BYTES[point.dtype], flops=5 * n)


SPEC = KernelSpec(
    name="swiglu",
    description="SwiGLU gate silu(a)·b over the last dimension (float32 math), any leading shape",
    dim_names=_glu.DIM_NAMES,
    config_keys=_glu.CONFIG_KEYS,
    pow2_keys=_glu.CONFIG_KEYS,
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_glu.default_config,
    resources=_resources,
    cost=_cost,
    canonical=_glu.canonical,
    dims_from_model=_glu.dims_from_model,
    source_objects=(_swiglu_kernel, _launch_2d, _glu.grid),
)
