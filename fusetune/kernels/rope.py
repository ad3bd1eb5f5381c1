"""Rotary position embedding: rotates each pair of x by angle (start_pos + s)·theta^(−2i/head_dim).

interleaved=True pairs (2i, 2i+1) as in the original Llama code; interleaved=False pairs
(i, i + head_dim/2) as in Hugging Face's rotate_half. Angles are computed in the kernel (no
cos/sin tables), in float32; the output has x's dtype.

Tunables (search_spaces/rope.yaml): BLOCK_T (tokens per program), BLOCK_H (heads per program),
num_warps. There is no loop, so no num_stages. The layout is a dim of the point (`interleaved`
1 or 0): the two layouts are different kernels and are tuned separately.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
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
    next_pow2,
    torch_dtype,
)
from fusetune.models import ModelPreset


@triton.jit
def _rope_kernel(
    X,  # *[B, S, H, D] input, unit stride along D
    Y,  # *[B, S, H, D] output, unit stride along D
    T,  # tokens = B * S
    S,  # sequence length (position of token t is start_pos + t % S)
    H,  # heads
    HALF,  # D // 2 pairs per head
    start_pos,
    neg_log2_theta_over_half,  # -log2(theta) / HALF: freq_i = 2 ** (i * this) = theta^(-2i/D)
    stride_xb, stride_xs, stride_xh,
    stride_yb, stride_ys, stride_yh,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF (tail pairs masked)
    INTERLEAVED: tl.constexpr,
):
    # Program (pid_t, pid_h) owns BLOCK_T tokens from pid_t*BLOCK_T and BLOCK_H heads from
    # pid_h*BLOCK_H; lanes past T, H or HALF are masked off.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    b = t // S
    s = t % S

    # Angles per (token, pair), shared by all heads of the program: [BLOCK_T, BLOCK_HALF].
    freq = tl.exp2(i.to(tl.float32) * neg_log2_theta_over_half)
    angle = (start_pos + s).to(tl.float32)[:, None] * freq[None, :]
    cos = tl.cos(angle)[:, None, :]  # [BLOCK_T, 1, BLOCK_HALF], broadcast over heads
    sin = tl.sin(angle)[:, None, :]

    # Element offsets of (token, head) row starts, in int64 (B*S*H*D can pass 2**31).
    x_row = (b.to(tl.int64) * stride_xb + s.to(tl.int64) * stride_xs)[:, None, None] \
        + (h.to(tl.int64) * stride_xh)[None, :, None]  # [BLOCK_T, BLOCK_H, 1]
    y_row = (b.to(tl.int64) * stride_yb + s.to(tl.int64) * stride_ys)[:, None, None] \
        + (h.to(tl.int64) * stride_yh)[None, :, None]
    mask = (t < T)[:, None, None] & (h < H)[None, :, None] & (i < HALF)[None, None, :]

    if INTERLEAVED:
        # Pair i is elements (2i, 2i+1): load whole rows [.., 2*BLOCK_HALF] (contiguous, so
        # each thread reads 16-byte vectors), view them as [.., BLOCK_HALF, 2] and split the
        # last axis into the pairs' two halves; the rotated halves are joined back the same way.
        d = tl.arange(0, 2 * BLOCK_HALF)
        m2 = (t < T)[:, None, None] & (h < H)[None, :, None] & (d < 2 * HALF)[None, None, :]
        x = tl.load(X + x_row + d[None, None, :], mask=m2, other=0.0).to(tl.float32)
        x0, x1 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
        y = tl.join(x0 * cos - x1 * sin, x0 * sin + x1 * cos)
        y = tl.reshape(y, [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        tl.store(Y + y_row + d[None, None, :], y.to(Y.dtype.element_ty), mask=m2)
    else:
        # Pair i is elements (i, i + HALF): two contiguous half-rows.
        x0 = tl.load(X + x_row + i[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(X + x_row + HALF + i[None, None, :], mask=mask, other=0.0).to(tl.float32)
        y0 = x0 * cos - x1 * sin
        y1 = x0 * sin + x1 * cos
        tl.store(Y + y_row + i[None, None, :], y0.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + y_row + HALF + i[None, None, :], y1.to(Y.dtype.element_ty), mask=mask)


def _launch_4d(x: torch.Tensor, y: torch.Tensor, start_pos: int, theta: float, interleaved: bool,
               config: Config) -> None:
    """Launches on [B, S, H, D] tensors (unit stride along D) with exactly `config`."""
    bsz, seq, heads, d = x.shape
    tokens = bsz * seq
    if tokens == 0 or heads == 0:
        return
    half = d // 2
    grid = (cdiv(tokens, config["BLOCK_T"]), cdiv(heads, config["BLOCK_H"]))
    _rope_kernel[grid](
        x, y, tokens, seq, heads, half, start_pos, -math.log2(theta) / half,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        BLOCK_T=config["BLOCK_T"], BLOCK_H=config["BLOCK_H"], BLOCK_HALF=next_pow2(half),
        INTERLEAVED=interleaved, num_warps=config["num_warps"], num_stages=1,
    )


def rope(
    x: torch.Tensor,
    start_pos: int = 0,
    theta: float = 10000.0,
    *,
    interleaved: bool = True,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Rotary embedding of x [batch, seq, heads, head_dim]; returns a new tensor of x's dtype.

    Position of x[:, s] is start_pos + s. The config (BLOCK_T, BLOCK_H, num_warps) comes from
    the lookup tables for this GPU and shape unless `config` is given.
    """
    if x.ndim != 4:
        raise ValueError(f"rope: x must be [batch, seq, heads, head_dim], got shape "
                         f"{tuple(x.shape)}")
    bsz, seq, heads, d = x.shape
    if d % 2:
        raise ValueError(f"rope: head_dim={d} must be even")
    if start_pos < 0:
        raise ValueError(f"rope: start_pos={start_pos} must be >= 0")
    if not theta > 0:
        raise ValueError(f"rope: theta={theta} must be > 0")
    dtype = dtype_name(x.dtype)
    check_device(x, "rope")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if config is None:
        from fusetune.runtime import cached_config

        dims = (("head_dim", d), ("heads", heads), ("interleaved", int(interleaved)))
        cfg = cached_config(SPEC, dims, dtype, bsz * seq, "", x.device)
    else:
        cfg = SPEC.validate_config(config)
    _launch_4d(x, y, int(start_pos), float(theta), bool(interleaved), cfg)
    return y


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    dims = point.dim
    x = torch.randn(point.batch, point.seq, dims["heads"], dims["head_dim"], device=device)
    # A non-zero start position exercises the position offset (decode appends after a prompt).
    return {"x": x.to(torch_dtype(point.dtype)), "start_pos": 7, "theta": 10000.0,
            "interleaved": bool(dims["interleaved"])}


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"y": torch.empty_like(inputs["x"])}


def _reference(inputs: Tensors) -> Tensors:
    x = inputs["x"].double()
    seq, d = x.shape[1], x.shape[3]
    pos = inputs["start_pos"] + torch.arange(seq, dtype=torch.float64, device=x.device)
    freq = inputs["theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angle = (pos[:, None] * freq[None, :])[None, :, None, :]  # [1, S, 1, D/2]
    cos, sin = angle.cos(), angle.sin()
    if inputs["interleaved"]:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    else:
        x0, x1 = x[..., : d // 2], x[..., d // 2 :]
        y = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return {"y": y.float()}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    _launch_4d(inputs["x"], outputs["y"], inputs["start_pos"], inputs["theta"],
               inputs["interleaved"], config)


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    # All heads of one token per program, 4 warps: about 4K elements per program at
    # head_dim 128 (and more tokens per program for narrow rows).
    dims = point.dim
    block_h = min(next_pow2(dims["heads"]), 32)
    row = block_h * next_pow2(dims["head_dim"])
    block_t = max(1, min(4096 // row, 16))
    return {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": 4}


def _canonical(config: Config, point: Point) -> Config:
    # Blocks past the token or head count only add masked lanes.
    c = dict(config)
    c["BLOCK_T"] = min(c["BLOCK_T"], next_pow2(point.rows))
    c["BLOCK_H"] = min(c["BLOCK_H"], next_pow2(point.dim["heads"]))
    return c


def _resources(config: Config, point: Point) -> Resources:
    threads = 32 * config["num_warps"]
    tile = config["BLOCK_T"] * config["BLOCK_H"] * next_pow2(point.dim["head_dim"])
    per_thread = -(-tile // threads)
    # float32 x and y per element, cos/sin per pair, addresses.
    regs = 2 * per_thread + 40
    return Resources(smem_bytes=0, regs_per_thread=regs, threads=threads)


def _cost(point: Point) -> Cost:
    dims = point.dim
    n = point.rows * dims["heads"] * dims["head_dim"]
    return Cost(bytes=2 * n * DTYPE_BYTES[point.dtype], flops=3 * n)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"heads": model.n_heads, "head_dim": model.head_dim, "interleaved": 1}


SPEC = KernelSpec(
    name="rope",
    description="rotary position embedding on [batch, seq, heads, head_dim], angles in-kernel",
    dim_names=("head_dim", "heads", "interleaved"),
    config_keys=("BLOCK_T", "BLOCK_H", "num_warps"),
    pow2_keys=("BLOCK_T", "BLOCK_H", "num_warps"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    dims_from_model=_dims_from_model,
    source_objects=(_rope_kernel, _launch_4d),
)
