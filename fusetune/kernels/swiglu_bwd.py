"""SwiGLU's backward: from a, b and dy [..., H], da = dy·b·silu'(a) and db = dy·silu(a).

silu(a) = a·σ(a) and silu'(a) = σ(a)·(1 + a·(1 − σ(a))) are recomputed from a in the kernel
(float32), so the forward stores nothing beyond its inputs. One pass: a, b and dy read once,
da and db written once, in the inputs' dtype.

`fusetune.swiglu` launches it as its backward; `swiglu_bwd(a, b, dy)` runs it alone. Tunables
(search_spaces/swiglu_bwd.yaml): BLOCK (columns per program), ROWS (rows per program),
num_warps; the tiling is swiglu's (`_glu`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fusetune.kernels import _glu
from fusetune.kernels._direct import direct
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    check_no_grad,
)


@triton.jit
def _swiglu_bwd_kernel(
    A, B, DY,  # *[M, H] inputs (gate, up) and the output's gradient, unit column stride
    DA, DB,  # *[M, H] gradients of a and b, unit column stride
    M, H,
    stride_am, stride_bm, stride_dym, stride_dam, stride_dbm,  # row strides
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
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
    dy = tl.load(DY + r * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    db = dy * silu
    tl.store(DA + r * stride_dam + cols[None, :], da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + r * stride_dbm + cols[None, :], db.to(DB.dtype.element_ty), mask=mask)


def _launch_2d(a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, da: torch.Tensor,
               db: torch.Tensor, config: Config) -> None:
    """Launches on [M, H] views (unit column stride) with exactly `config`."""
    m, h = a.shape
    if m == 0:
        return
    direct(_swiglu_bwd_kernel)[_glu.grid(m, h, config)](
        a, b, dy, da, db, m, h,
        a.stride(0), b.stride(0), dy.stride(0), da.stride(0), db.stride(0),
        BLOCK=config["BLOCK"], ROWS=config["ROWS"], num_warps=config["num_warps"],
        num_stages=1,
    )


def swiglu_bwd(
    a: torch.Tensor,
    b: torch.Tensor,
    dy: torch.Tensor,
    *,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db), the gradients of y = silu(a)·b given dy, for a, b, dy of one shape [..., H]
    and dtype (rows may be strided); new tensors of that shape and dtype. The config (BLOCK,
    ROWS, num_warps) comes from swiglu_bwd's lookup entries unless `config` is given."""
    dtype, (a2, b2, dy2) = _glu.check_rows("swiglu_bwd", a=a, b=b, dy=dy)
    check_no_grad("swiglu_bwd", a, b, dy)
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    m, h = a2.shape
    if config is None:
        cfg = _glu.lookup(SPEC, dtype, m, h, a.device)
    else:
        cfg = SPEC.validate_config(config)
    _launch_2d(a2, b2, dy2, da.view(-1, h), db.view(-1, h), cfg)
    return da, db


def reference(a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) by the formulas, in float32."""
    a, b, dy = a.float(), b.float(), dy.float()
    sig = torch.sigmoid(a)
    return dy * b * sig * (1 + a * (1 - sig)), dy * F.silu(a)


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    return _glu.make_rows(point, device, ("a", "b", "dy"))


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"da": torch.empty_like(inputs["a"]), "db": torch.empty_like(inputs["a"])}


def _reference(inputs: Tensors) -> Tensors:
    da, db = reference(inputs["a"], inputs["b"], inputs["dy"])
    return {"da": da, "db": db}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    h = inputs["a"].shape[-1]
    a, b, dy = (inputs[k].view(-1, h) for k in ("a", "b", "dy"))
    _launch_2d(a, b, dy, outputs["da"].view(-1, h), outputs["db"].view(-1, h), config)


def _resources(config: Config, point: Point) -> Resources:
    # a, b, dy, σ(a) and the two results per element.
    return _glu.resources(config, point, floats_per_element=6)


def _cost(point: Point) -> Cost:
    n = point.rows * point.dim["hidden"]
    # a, b, dy read; da, db written. σ: an exp, an add, a division; then ~9 multiplies/adds.
    return Cost(bytes=5 * n * DTYPE_BYTES[point.dtype], flops=12 * n)


SPEC = KernelSpec(
    name="swiglu_bwd",
    description="SwiGLU backward: da = dy·b·silu'(a), db = dy·silu(a) (float32 math)",
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
    source_objects=(_swiglu_bwd_kernel, _launch_2d, _glu.grid),
)
