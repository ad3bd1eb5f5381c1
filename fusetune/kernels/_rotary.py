"""The rotation that RoPE's forward (`rope`) and backward (`rope_bwd`) share.

One @triton.jit kernel rotates pair i of every head of token (b, s) by the angle in the
caller's cos/sin tables [batch or 1, seq, head_dim or head_dim/2] (column i < head_dim/2 for
pair i): forward by +angle, backward (INVERSE) by −angle. A rotation's transpose is its inverse,
so the gradient dx of y = R(θ)·x is R(−θ)·dy: the same kernel with sin negated, reading the
same tables. Here too: the launcher, the tables' checks, the float32 reference, the plain
rotary embedding's tables (`rotary_tables`) and the spec pieces both kernels have in common
(same tiling, same tunables, same bytes).

interleaved=True pairs (2i, 2i+1) as in the original Llama code; interleaved=False pairs
(i, i + head_dim/2) as in Hugging Face's rotate_half. The rotation is computed in float32; the
output has the input's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._direct import direct
from fusetune.models import ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    cdiv,
    check_device,
    dtype_name,
    next_pow2,
    torch_dtype,
)

DIM_NAMES = ("head_dim", "heads", "interleaved")
CONFIG_KEYS = ("BLOCK_T", "BLOCK_H", "num_warps")
# How the rotated columns pair up (the dim `interleaved`), for messages.
PAIRING = {0: "half-split pairs (i, i + head_dim/2)", 1: "interleaved pairs (2i, 2i + 1)"}


def head_dim_problem(dims: Mapping[str, int]) -> str | None:
    """KernelSpec.check_dims of the kernels that rotate a head's columns in pairs."""
    hd = dims["head_dim"]
    return None if hd % 2 == 0 else f"head_dim={hd} must be even (RoPE rotates column pairs)"


@triton.jit
def _rope_kernel(
    X,  # *[B, S, H, D] input, unit stride along D
    Y,  # *[B, S, H, D] output, unit stride along D
    COS, SIN,  # *[B or 1, S, >= D/2] tables, unit column stride: column i is pair i's
    T,  # tokens = B * S
    S,  # sequence length: token t is (t // S, t % S)
    H,  # heads
    HALF,  # D // 2 pairs per head
    stride_xb, stride_xs, stride_xh,
    stride_yb, stride_ys, stride_yh,
    stride_cb, stride_cs,  # the tables' batch stride (0: one row of positions for the batch)
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF (tail pairs masked)
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,  # rotate by -angle (the backward: dx = R(-angle) dy)
):
    # Program (pid_t, pid_h) owns BLOCK_T tokens from pid_t*BLOCK_T and BLOCK_H heads from
    # pid_h*BLOCK_H; lanes past T, H or HALF are masked off.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    b = t // S
    s = t % S

    # cos and sin per (token, pair), shared by all heads of the program: [BLOCK_T, BLOCK_HALF],
    # broadcast over the heads as [BLOCK_T, 1, BLOCK_HALF].
    c_off = (b.to(tl.int64) * stride_cb + s.to(tl.int64) * stride_cs)[:, None] + i[None, :]
    c_ok = (t < T)[:, None] & (i < HALF)[None, :]
    cos = tl.load(COS + c_off, mask=c_ok, other=1.0).to(tl.float32)[:, None, :]
    sin = tl.load(SIN + c_off, mask=c_ok, other=0.0).to(tl.float32)[:, None, :]
    if INVERSE:
        sin = -sin  # cos(-a) = cos(a), sin(-a) = -sin(a)

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


def launch_rotation(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool, inverse: bool, config: Config) -> None:
    """Rotates x into y, [B, S, H, D] tensors (unit stride along D), by the tables [B or 1, S,
    >= D/2] (unit column stride), by -angle where `inverse`, with exactly `config`."""
    bsz, seq, heads, d = x.shape
    tokens = bsz * seq
    if tokens == 0 or heads == 0:
        return
    half = d // 2
    grid = (cdiv(tokens, config["BLOCK_T"]), cdiv(heads, config["BLOCK_H"]))
    direct(_rope_kernel)[grid](
        x, y, cos, sin, tokens, seq, heads, half,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        BLOCK_T=config["BLOCK_T"], BLOCK_H=config["BLOCK_H"], BLOCK_HALF=next_pow2(half),
        INTERLEAVED=interleaved, INVERSE=inverse, num_warps=config["num_warps"], num_stages=1,
    )


SOURCES = (_rope_kernel, launch_rotation)


def rotary_tables(positions: torch.Tensor, head_dim: int, *, theta: float,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., head_dim] of the plain rotary embedding at integer `positions` [...]:
    pair i turns by position · theta^(−2i/head_dim), both halves equal, as Hugging Face's
    default rotary embedding builds them (computed in float32, returned in `dtype`). Models
    with rope scaling build their own tables; pass those instead."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rotary_tables: head_dim={head_dim} must be even and >= 2")
    if not theta > 0:
        raise ValueError(f"rotary_tables: theta={theta} must be > 0")
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (steps / head_dim)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
            ) -> torch.Tensor:
    """The reference rotation, in float32: t [B, S, H, D] by tables [B or 1, S, >= D/2] (or
    [S, >= D/2]), column i for pair i (`-sin` rotates back)."""
    t = t.float()
    half = t.shape[-1] // 2
    c = cos[..., :half].float().unsqueeze(-2)  # [.., S, 1, D/2]: one angle for all heads
    s = sin[..., :half].float().unsqueeze(-2)
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    a, b = t[..., :half], t[..., half:]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


def check_x(x: torch.Tensor, interleaved: bool, kernel: str, what: str = "x") -> str:
    """The dtype name of `x`, checked as [batch, seq, heads, head_dim] with an even head_dim,
    on a device the kernels run on, beside an explicit bool `interleaved`."""
    if x.ndim != 4:
        raise ValueError(f"{kernel}: {what} must be [batch, seq, heads, head_dim], got shape "
                         f"{tuple(x.shape)}")
    if x.shape[3] % 2:
        raise ValueError(f"{kernel}: head_dim={x.shape[3]} must be even")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{kernel}: interleaved={interleaved!r} must be True (pairs 2i, 2i+1) "
                        "or False (pairs i, i + head_dim/2, Hugging Face's rotate_half)")
    dtype = dtype_name(x.dtype)
    check_device(x, kernel)
    return dtype


def check_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int, head_dim: int,
                 device: torch.device, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin checked as [batch or 1, seq, head_dim or head_dim/2] (a [seq, ...] table
    serves the whole batch) and returned 3-D with unit column stride."""
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        t = t.unsqueeze(0) if t.ndim == 2 else t
        if (t.ndim != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq
                or t.shape[2] not in (head_dim, head_dim // 2)):
            raise ValueError(f"{kernel}: {name} has shape {tuple(t.shape)}; expected [{batch} or "
                             f"1, {seq}, {head_dim} or {head_dim // 2}] (cos and sin of each "
                             "token's angles, as a rotary embedding returns them)")
        if t.device != device:
            raise ValueError(f"{kernel}: {name} is on {t.device}, x on {device}")
        dtype_name(t.dtype)  # raises for a dtype the kernel cannot read
        tables.append(t)
    if tables[0].shape != tables[1].shape:
        raise ValueError(f"{kernel}: cos has shape {tuple(cos.shape)} and sin "
                         f"{tuple(sin.shape)}; they must match")
    return as_tables(tables[0], tables[1])


def as_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked cos and sin as the kernels read them: 3-D (a [seq, ...] table gains the batch
    dim), unit column stride. What check_tables returns; alone, for a caller that checked these
    tables' metadata before (a launcher's memo)."""
    out = []
    for t in (cos, sin):
        t = t.unsqueeze(0) if t.ndim == 2 else t
        out.append(t if t.stride(-1) == 1 else t.contiguous())
    return out[0], out[1]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           inverse: bool, config: Config | None, spec: KernelSpec) -> torch.Tensor:
    """x [B, S, H, D] rotated into a new tensor of its dtype, with `config` or, where None,
    the config the tables hold for `spec` (rope's or rope_bwd's) at this point;
    the caller checked x (check_x) and the tables (check_tables)."""
    bsz, seq, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if config is None:
        from fusetune.runtime import cached_config

        dims = (("head_dim", d), ("heads", heads), ("interleaved", int(interleaved)))
        config = cached_config(spec, dims, dtype_name(x.dtype), bsz * seq, "", x.device)
    launch_rotation(x, y, cos, sin, interleaved, inverse, config)
    return y


# ---- what the tuner needs, the same for both directions --------------------------------------


def make_tensor_and_tables(point: Point, device: torch.device | str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random [batch, seq, heads, head_dim] tensor of the point's dtype and the tables of
    positions that differ per row of the batch (as in a left-padded batch)."""
    dims = point.dim
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, dims["heads"], dims["head_dim"], device=device)
    positions = (torch.arange(point.seq, device=device)[None, :] + 7
                 + 3 * torch.arange(point.batch, device=device)[:, None])
    cos, sin = rotary_tables(positions, dims["head_dim"], theta=10000.0, dtype=dtype)
    return x.to(dtype), cos, sin


def default_config(point: Point, gpu: GpuSpec) -> Config:
    # All heads of one token per program, 4 warps: about 4K elements per program at
    # head_dim 128 (and more tokens per program for narrow rows).
    dims = point.dim
    block_h = min(next_pow2(dims["heads"]), 32)
    row = block_h * next_pow2(dims["head_dim"])
    block_t = max(1, min(4096 // row, 16))
    return {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": 4}


def canonical(config: Config, point: Point) -> Config:
    # Blocks past the token or head count only add masked lanes.
    c = dict(config)
    c["BLOCK_T"] = min(c["BLOCK_T"], next_pow2(point.rows))
    c["BLOCK_H"] = min(c["BLOCK_H"], next_pow2(point.dim["heads"]))
    return c


def resources(config: Config, point: Point) -> Resources:
    threads = 32 * config["num_warps"]
    tile = config["BLOCK_T"] * config["BLOCK_H"] * next_pow2(point.dim["head_dim"])
    per_thread = -(-tile // threads)
    # float32 x and y per element, cos/sin per pair, addresses.
    regs = 2 * per_thread + 40
    return Resources(smem_bytes=0, regs_per_thread=regs, threads=threads)


def cost(point: Point) -> Cost:
    dims = point.dim
    n = point.rows * dims["heads"] * dims["head_dim"]
    tables = 2 * point.rows * dims["head_dim"] // 2  # cos and sin, half a row each
    return Cost(bytes=(2 * n + tables) * DTYPE_BYTES[point.dtype], flops=3 * n)


def dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"heads": model.n_heads, "head_dim": model.head_dim, "interleaved": 1}
