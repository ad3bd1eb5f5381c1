"""Kernels of a package outside fusetune, declared with @fusetune.autotune: `axpy_kernel`
(registered by the entry point `ext_axpy`), `axpy_tune_kernel` (tuned at run time on a miss)
and `faulty_kernel`, whose space holds configs that fail each in its own way."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fusetune
from fusetune.spec import Resources


def make_inputs(N: int, dtype: torch.dtype, device: str) -> dict:
    x = torch.randn(N, dtype=dtype, device=device)
    y = torch.randn(N, dtype=dtype, device=device)
    return {"x_ptr": x, "y_ptr": y, "out_ptr": torch.empty_like(x), "N": N, "alpha": 0.5}


def grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["N"], meta["BLOCK"]),)


def reference(args: dict) -> dict:
    return {"out_ptr": args["alpha"] * args["x_ptr"].float() + args["y_ptr"].float()}


SPACE = {"params": {"BLOCK": {"pow2": [16, 128]}, "num_warps": {"values": [1, 2]}},
         "constraints": ["BLOCK <= max(16, N)"]}


@triton.jit
def _axpy_block(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK: tl.constexpr):
    # One program's block of alpha·x + y (a helper: its source is its callers' too).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


@fusetune.autotune(space=SPACE, key=["N"], make_inputs=make_inputs, grid=grid,
                   reference=reference, name="ext_axpy")
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK: tl.constexpr):
    _axpy_block(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK)


@fusetune.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=1),
                            triton.Config({"BLOCK": 64}, num_warps=2),
                            triton.Config({"BLOCK": 128}, num_warps=4)],
                   key=["N"], name="ext_axpy_tune", on_miss="tune")
@triton.jit
def axpy_tune_kernel(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK: tl.constexpr):
    _axpy_block(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK)


def faulty_resources(config: dict, point: fusetune.Point) -> Resources:
    # BLOCK 128 claims more shared memory than any GPU has: pruned before compiling.
    smem = 1 << 30 if config["BLOCK"] == 128 else 0
    return Resources(smem_bytes=smem, regs_per_thread=32, threads=32 * config["num_warps"])


@fusetune.autotune(configs=[{"BLOCK": 16, "num_warps": 1}, {"BLOCK": 32, "num_warps": 1},
                            {"BLOCK": 64, "num_warps": 1}, {"BLOCK": 128, "num_warps": 1}],
                   key=["N"], make_inputs=make_inputs, grid=grid, reference=reference,
                   name="ext_faulty", resources=faulty_resources)
@triton.jit
def faulty_kernel(x_ptr, y_ptr, out_ptr, N, alpha, BLOCK: tl.constexpr):
    # BLOCK 64 does not compile; BLOCK 32 computes the wrong result; 16 is right.
    tl.static_assert(BLOCK != 64, "BLOCK 64 is refused")
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    if BLOCK == 32:
        y = y + 1.0
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)
