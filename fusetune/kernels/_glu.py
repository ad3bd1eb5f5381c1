"""What swiglu (y = silu(a)·b) and its backward swiglu_bwd share: the tiling, the input checks,
the launch grid and the spec pieces of an elementwise kernel over rows [M, H].

Both kernels take ROWS rows × BLOCK columns a program, the programs of one row block side by
side along the row (a 1-D grid: program p is row block p // cdiv(H, BLOCK), column block
p % cdiv(H, BLOCK)), so a row wider than BLOCK is spread over several programs and no grid axis
limit applies. There is no loop, so no num_stages. The math is float32; the outputs have the
inputs' dtype.
"""

from __future__ import annotations

import torch

from fusetune.gpus import GpuSpec
from fusetune.models import ModelPreset
from fusetune.spec import (
    Config,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    as_rows,
    cdiv,
    check_device,
    dtype_name,
    next_pow2,
    torch_dtype,
)

DIM_NAMES = ("hidden",)
CONFIG_KEYS = ("BLOCK", "ROWS", "num_warps")


def check_rows(kernel: str, **tensors: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """The common dtype name of `tensors` (by argument name), checked as one shape [..., H]
    with H >= 1, one dtype and one device; returns them as [M, H] views with unit column
    stride (a copy only where the strides do not allow a view)."""
    (first, t0), *rest = tensors.items()
    if t0.ndim < 1 or t0.shape[-1] < 1:
        raise ValueError(f"{kernel}: {first} must be [..., hidden] with hidden >= 1, got shape "
                         f"{tuple(t0.shape)}")
    for name, t in rest:
        if t.shape != t0.shape:
            raise ValueError(f"{kernel}: {first} has shape {tuple(t0.shape)} and {name} "
                             f"{tuple(t.shape)}; they must match")
        if t.dtype != t0.dtype:
            raise TypeError(f"{kernel}: {first} is {t0.dtype} and {name} {t.dtype}; they must "
                            "match")
        if t.device != t0.device:
            raise ValueError(f"{kernel}: {first} is on {t0.device} and {name} on {t.device}")
    dtype = dtype_name(t0.dtype)
    check_device(t0, kernel)
    h = t0.shape[-1]
    return dtype, [as_rows(t, h) for t in tensors.values()]


def grid(m: int, h: int, config: Config) -> tuple[int]:
    """One program per ROWS × BLOCK tile of [m, h]."""
    return (cdiv(m, config["ROWS"]) * cdiv(h, config["BLOCK"]),)


def lookup(spec: KernelSpec, dtype: str, m: int, h: int, device: torch.device) -> Config:
    """The config the tables hold for `spec` (swiglu's or swiglu_bwd's) at m rows of width h."""
    from fusetune.runtime import cached_config

    return cached_config(spec, (("hidden", h),), dtype, m, "", device)


# ---- what the tuner needs, the same for both directions --------------------------------------


def make_rows(point: Point, device: torch.device | str, names: tuple[str, ...]) -> Tensors:
    """Random [batch, seq, hidden] tensors of the point's dtype, one per name: the gate's
    values spread over silu's curved part and tails (σ = 2), the others standard normal."""
    dtype = torch_dtype(point.dtype)
    shape = (point.batch, point.seq, point.dim["hidden"])
    out: Tensors = {}
    for name in names:
        t = torch.randn(shape, device=device)
        out[name] = (2 * t if name == "a" else t).to(dtype)
    return out


def default_config(point: Point, gpu: GpuSpec) -> Config:
    # 1024 elements a program with 4 warps (8 a thread: one 16-byte load of each 16-bit
    # tensor); rows narrower than that share a program.
    block = min(next_pow2(point.dim["hidden"]), 1024)
    rows = max(1, min(1024 // block, 16))
    return {"BLOCK": block, "ROWS": rows, "num_warps": 4}


def canonical(config: Config, point: Point) -> Config:
    # Blocks past the row width or the row count only add masked lanes.
    c = dict(config)
    c["BLOCK"] = min(c["BLOCK"], next_pow2(point.dim["hidden"]))
    c["ROWS"] = min(c["ROWS"], next_pow2(point.rows))
    return c


def resources(config: Config, point: Point, floats_per_element: int) -> Resources:
    """No shared memory; `floats_per_element` float32 registers per element of the tile (the
    loaded inputs and what is computed from them), plus addresses and masks."""
    threads = 32 * config["num_warps"]
    per_thread = -(-config["ROWS"] * config["BLOCK"] // threads)
    return Resources(smem_bytes=0, regs_per_thread=floats_per_element * per_thread + 32,
                     threads=threads)


def dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"hidden": model.hidden}
