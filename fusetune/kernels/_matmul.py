"""What the matmul-based kernels (ffn, lola, ...) share: tile heuristics, config collapsing,
the shared-memory model of a software-pipelined K loop."""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._spec import Config, Point, Resources, check_fits, next_pow2


@triton.jit
def grouped_tile(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row-block, column-block) of this program in grouped launch order: GROUP_M consecutive
    row-blocks walk the same column-blocks, so the weight tiles they share are read from L2
    rather than from memory."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·b; with IEEE, exact float32 products (float32 inputs) instead of tf32."""
    if IEEE:  # noqa: SIM108  (a Triton constexpr branch: one tl.dot per precision)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def rms_scaled(x, g):
    """For an x tile [BLOCK_M, BLOCK_K] and the RMSNorm weight tile g [BLOCK_K]: x ⊙ g, computed
    in float32 and rounded back to x's type for the tensor cores, and the rows' sums of x²
    (float32) to accumulate for rstd."""
    xf = x.to(tl.float32)
    return (xf * g.to(tl.float32)[None, :]).to(x.dtype), tl.sum(xf * xf, axis=1)


def default_tiles(point: Point, gpu: GpuSpec, resources: Callable[[Config, Point], Resources]
                  ) -> Config:
    """Tutorial-style tiles: tall-skinny for decode, 128x128 for prefill; then fewer stages
    (and smaller tiles) until `gpu` can hold the config."""
    m = point.rows
    if m <= 16:
        c = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
             "num_stages": 4}
    elif m <= 128:
        c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
             "num_stages": 4}
    else:
        c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
             "num_stages": 3}
    while check_fits(resources(c, point), gpu) is not None:
        if c["num_stages"] > 2:
            c["num_stages"] -= 1
        elif c["BLOCK_N"] > 32:
            c["BLOCK_N"] //= 2
        elif c["BLOCK_K"] > 32:
            c["BLOCK_K"] //= 2
        else:
            break
    return c


def collapse_tiles(config: Config, rows: int, n: int, k: int) -> Config:
    """Tiles past the matrix only add masked lanes (tl.dot needs at least 16 per side), and
    with a single row of tiles every GROUP_M gives the same launch order."""
    c = dict(config)
    c["BLOCK_M"] = min(c["BLOCK_M"], max(16, next_pow2(rows)))
    c["BLOCK_N"] = min(c["BLOCK_N"], max(16, next_pow2(n)))
    c["BLOCK_K"] = min(c["BLOCK_K"], max(16, next_pow2(k)))
    if -(-rows // c["BLOCK_M"]) == 1:
        c["GROUP_M"] = 1
    return c


def pipelined_smem(config: Config, elt: int, n_weights: int, epilogue: bool) -> int:
    """Shared memory of a K loop over an x tile and `n_weights` weight tiles.

    Software pipelining keeps (num_stages - 1) sets of tiles; with `epilogue` the compiler
    also stages the [BLOCK_M, BLOCK_N] output tile through shared memory (it does for ffn's
    two-accumulator epilogue, not for lola's). Checked against Triton's own allocation for
    sm_90 (tests/kernels/test_ffn.py, test_lola.py). float32 operands are laid out
    differently: num_stages sets, no epilogue term.
    """
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tile = (bm * bk + n_weights * bk * bn) * elt
    if elt == 4:
        return config["num_stages"] * tile
    out_tile = bm * bn * elt if epilogue else 0
    return (config["num_stages"] - 1) * tile + out_tile + 1024
