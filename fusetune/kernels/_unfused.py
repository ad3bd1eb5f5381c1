"""The unfused way to compute a matmul kernel's result, as one more candidate of its space.

A fused kernel is not always the fastest way to its result: at many rows cuBLAS's GEMM can beat
a Triton kernel that carries a norm in front and an epilogue behind. The config key UNFUSED
(0/1, a flag: configs and tables without it mean 0) makes that a tuning choice like a tile
size: UNFUSED = 1 computes the same result as separate launches, fusetune's own norm, SiLU·mul
and RoPE kernels (their configs from the tables) around torch.matmul, residuals and biases
added by cuBLAS's beta (torch.addmm). ffn, linear and qkv have it (their launchers'
_unfused_2d); lola not yet. The tuner checks and times it like any config, the tables keep
it where it wins, the launcher runs it where the table says so.

FP8 weights (weight-only) are upcast to the activations' dtype with their per-channel scales,
into a workspace of at most WORKSPACE_BYTES at a time (chunks of output channels), and
multiplied by the 16-bit GEMM. FP8 activations have no unfused form here (cuBLAS would be
handed the rounded activations, which the fused kernels make in their norm pass): such points
run fused only.

Numerics: the same formula, rounded at other places (the norm's output and the GEMM's in the
activations' dtype, FP8 weights with their scales folded in before the products): within the
kernels' tolerances, checked against the same float32 reference as every config.
"""

from __future__ import annotations

import torch

from fusetune.spec import Config, Point, Resources

# Every other key of an UNFUSED config means nothing: the canonical config sets them to these,
# so that the unfused candidate is one config of the space (the tuner times it once).
_CANONICAL: Config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 2,
                      "SPLIT_K": 1, "UNROLL_K": 0, "SPREAD": 0, "THREAD_SUM": 0, "TMA": 0,
                      "num_warps": 4, "num_stages": 2, "UNFUSED": 1}
WORKSPACE_BYTES = 256 << 20  # FP8 weights upcast at most this many bytes at a time


def unfused(config: Config) -> bool:
    return bool(config.get("UNFUSED"))


def canonical(config: Config) -> Config:
    """The one config that stands for every UNFUSED = 1 config (the keys `config` has)."""
    return {k: _CANONICAL[k] for k in config}


def resources(point: Point) -> Resources:
    """What the unfused candidate needs of a GPU: nothing a fused config is pruned for; unfit
    at points of FP8 activations (see the module's doc)."""
    unfit = ("unfused: FP8 activations run fused only (their rounding is the fused norm "
             "pass's)" if point.fp8_activations else "")
    return Resources(smem_bytes=0, regs_per_thread=0, threads=128, unfit=unfit)


def _chunks(w: torch.Tensor, dtype: torch.dtype) -> int:
    """Output channels upcast at a time: the whole matrix where it fits the workspace."""
    row_bytes = max(1, w.shape[1]) * torch.finfo(dtype).bits // 8
    return max(1, min(w.shape[0], WORKSPACE_BYTES // row_bytes))


def _upcast(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weights [n, K] with their per-channel scales as `dtype` (the scale folded in, in
    float32, then rounded once)."""
    if scale is None:
        return w.to(dtype)
    return (w.float() * scale.float()[:, None]).to(dtype)


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
           out: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """out = x [M, K] · (scale ⊙ w)ᵀ (+ add, [M, N] or [N], by cuBLAS's beta) for w [N, K] in
    x's dtype (scale None) or FP8; returns `out`."""
    if w.dtype == x.dtype and scale is None:
        if add is None:
            return torch.mm(x, w.t(), out=out)
        return torch.addmm(add, x, w.t(), out=out)
    step = _chunks(w, x.dtype)
    if step >= w.shape[0]:
        wd = _upcast(w, scale, x.dtype)
        return torch.mm(x, wd.t(), out=out) if add is None else torch.addmm(add, x, wd.t(),
                                                                            out=out)
    for n0 in range(0, w.shape[0], step):
        n1 = min(n0 + step, w.shape[0])
        wd = _upcast(w[n0:n1], None if scale is None else scale[n0:n1], x.dtype)
        part = None if add is None else add[..., n0:n1]  # a residual's columns, a bias's
        out[:, n0:n1] = torch.mm(x, wd.t()) if part is None else torch.addmm(part, x, wd.t())
    return out


def stacked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """[2N, ...]: `a` and `b` [N, ...] (weights [N, K], or their scales [N]) as one tensor,
    where b follows a in memory (the views `fusetune.patch` makes of one stacked weight); None
    where they do not."""
    if (a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.ndim == 0
            or not a.is_contiguous() or not b.is_contiguous()
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.numel()):
        return None
    return torch.as_strided(a, (2 * a.shape[0], *a.shape[1:]), a.stride())


SOURCES = (canonical, resources, _upcast, matmul, stacked)  # in the kernels' source hashes
