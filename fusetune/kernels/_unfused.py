"""The unfused way to compute a matmul kernel's result, as one more candidate of its space.

A fused kernel is not always the fastest way to its result: at many rows cuBLAS's GEMM can beat
a Triton kernel that carries a norm in front and an epilogue behind. The config key UNFUSED
(0/1, a flag: configs and tables without it mean 0) makes that a tuning choice like a tile
size: UNFUSED = 1 computes the same result as separate launches, fusetune's own norm, SiLU·mul
and RoPE kernels (their configs from the tables) around torch.matmul, residuals and biases
added by cuBLAS's beta (torch.addmm). ffn, linear and qkv have it (their launchers'
_unfused_2d), moe its own (torch._grouped_mm, moe._launch_unfused, with _upcast for FP8
experts); lola not yet. The tuner checks and times it like any config, the tables keep
it where it wins, the launcher runs it where the table says so.

Projections that read the same input run as one GEMM where their weights are views of one
stacked matrix, as fusetune.patch holds them (ffn's W1 and W3, qkv's Wq, Wk and Wv: `stacked`).

FP8 weights (weight-only) are upcast to the activations' dtype with their per-channel scales,
in one pass (_upcast_kernel: FP8 read once, the 16-bit copy written once), into a workspace of
about WORKSPACE_BYTES at a time (chunks of output channels, _chunks), and multiplied by the
16-bit GEMM. FP8 activations have no unfused form here (cuBLAS would be handed the rounded
activations, which the fused kernels make in their norm pass): such points run fused only.

A launcher's call that takes this form is replayed like a fused one (_replay): the GEMMs go
through `torch_call`, the upcast workspace and the intermediate results are `scratch`, and a
stacked weight's parts are noted (`note_stacked`) so that a replay checks they are one stack
still. cuBLAS's calls still cost more host time than a kernel launch; the tuner times such
configs over CUDA-graph replays (tuner.bench.HOST_SHARE_OF_FLUSH), as the GPU runs them
wherever the host keeps ahead of it.

Numerics: the same formula, rounded at other places (the norm's output and the GEMM's in the
activations' dtype, FP8 weights with their scales folded in before the products): within the
kernels' tolerances, checked against the same float32 reference as every config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusetune.kernels._direct import direct
from fusetune.kernels._replay import note_stacked, scratch, torch_call
from fusetune.spec import Config, Point, Resources

# Every other key of an UNFUSED config means nothing: the canonical config sets them to these,
# so that the unfused candidate is one config of the space (the tuner times it once).
_CANONICAL: Config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 2,
                      "SPLIT_K": 1, "UNROLL_K": 0, "SPREAD": 0, "THREAD_SUM": 0, "TMA": 0,
                      "num_warps": 4, "num_stages": 2, "UNFUSED": 1}
WORKSPACE_BYTES = 256 << 20  # FP8 weights upcast about this many bytes at a time (_chunks)
# The upcast is a copy: every program streams UPCAST_BLOCK elements of one row, which keeps
# the copy at the GPU's copy bandwidth for any row of at least that many elements; it is not a
# tuning choice of the kernels whose unfused form uses it.
UPCAST_BLOCK = 2048


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


CHUNK_CHANNELS = 128  # a chunk's output channels are a multiple of this (aligned GEMMs)


def _chunks(w: torch.Tensor, dtype: torch.dtype) -> int:
    """Output channels upcast at a time: the whole matrix where it fits the workspace, else
    the fewest equal parts that do, each rounded up to a multiple of CHUNK_CHANNELS (a GEMM
    and its slice of the output at an odd channel count run cuBLAS's unaligned paths, several
    times slower)."""
    n = w.shape[0]
    row_bytes = max(1, w.shape[1]) * torch.finfo(dtype).bits // 8
    parts = -(-n * row_bytes // WORKSPACE_BYTES)
    if parts <= 1:
        return n
    step = -(-n // parts)
    return min(n, -(-step // CHUNK_CHANNELS) * CHUNK_CHANNELS)


@triton.jit
def _upcast_kernel(w_ptr, s_ptr, out_ptr, n_cols, stride_w, stride_out,
                   HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, j): elements [j·BLOCK, (j+1)·BLOCK) of weight row `row` (one output
    # channel); the mask cuts the last block of a row at n_cols. FP8 → float32 is exact; the
    # product with the channel's float32 scale is rounded once, to the output's dtype.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + row.to(tl.int64) * stride_w + cols, mask=mask).to(tl.float32)
    if HAS_SCALE:
        w = w * tl.load(s_ptr + row).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols,
             w.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _upcast(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weights [n, K] (unit column stride) with their per-channel scales as `dtype`: each
    weight times its channel's scale in float32, rounded once (what (w.float() · scale).to(dtype)
    computes, without its float32 intermediate in memory)."""
    if w.stride(1) != 1:
        w = w.contiguous()
    out = scratch(tuple(w.shape), dtype, w.device)
    if w.numel() == 0:
        return out
    grid = (w.shape[0], triton.cdiv(w.shape[1], UPCAST_BLOCK))
    # the short launch path: at prefill sizes four upcasts a layer through Triton's argument
    # binding kept the host behind the GPU
    direct(_upcast_kernel)[grid](w, w if scale is None else scale, out, w.shape[1], w.stride(0),
                         out.stride(0), HAS_SCALE=scale is not None, BLOCK=UPCAST_BLOCK,
                         num_warps=4)
    return out


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
           out: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """out = x [M, K] · (scale ⊙ w)ᵀ (+ add, [M, N] or [N], by cuBLAS's beta) for w [N, K] in
    x's dtype (scale None) or FP8; returns `out`."""
    # through torch_call: a replay of the launcher's call makes the same cuBLAS calls (_replay)
    if w.dtype == x.dtype and scale is None:
        if add is None:
            return torch_call(torch.mm, (x, w.t()), out)
        return torch_call(torch.addmm, (add, x, w.t()), out)
    step = _chunks(w, x.dtype)
    for n0 in range(0, w.shape[0], step):
        n1 = min(n0 + step, w.shape[0])
        wd = _upcast(w[n0:n1], None if scale is None else scale[n0:n1], x.dtype)
        part = None if add is None else add[..., n0:n1]  # a residual's columns, a bias's
        cols = out[:, n0:n1]  # cuBLAS writes the columns in place (their row stride as ldc)
        if part is None:
            torch_call(torch.mm, (x, wd.t()), cols)
        else:
            torch_call(torch.addmm, (part, x, wd.t()), cols)
    return out


def stacked(*parts: torch.Tensor) -> torch.Tensor | None:
    """[sum of their rows, ...]: `parts` ([n_i, ...] each: weights [n_i, K], their scales or
    biases [n_i]) as one tensor, where each follows the one before it in memory (the views
    `fusetune.patch` makes of one stacked weight); None where they do not."""
    first = parts[0]
    offset = first.storage_offset()
    for t in parts:
        if (t.shape[1:] != first.shape[1:] or t.dtype != first.dtype
                or t.device != first.device or t.ndim == 0 or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in parts)
    note_stacked(parts)  # a replay of the call checks that its inputs are one stack too
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride())


def stacked_operands(weights: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...] | None,
                     biases: tuple[torch.Tensor, ...] | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(weights, their scales, their biases) each as one stacked tensor (`stacked`), for one GEMM
    over all of them; None where any of the three given is not one stack."""
    w_all = stacked(*weights)
    s_all = None if scales is None else stacked(*scales)
    b_all = None if biases is None else stacked(*biases)
    if w_all is None or (scales is not None and s_all is None) or (
            biases is not None and b_all is None):
        return None
    return w_all, s_all, b_all


# in the kernels' source hashes
SOURCES = (canonical, resources, _chunks, _upcast_kernel, _upcast, matmul, stacked,
           stacked_operands)
