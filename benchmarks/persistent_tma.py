"""Persistent programs for the TMA tensor-core loop: a diagnostic, not a kernel of fusetune.

The ffn's product at prefill (x [4096, 4096] times W1 and W3 [11008, 4096], silu(a)·b, no norm
pass) through TMA descriptors, with one program per output tile (fusetune's structure) and with
one program per SM walking the tiles in a loop that Triton flattens (tl.range(..., flatten=True)),
so that a tile's loads could overlap the previous tile's epilogue; beside the cuBLAS GEMM of
[W1; W3] alone.

    python -m benchmarks.persistent_tma
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.timing import cuda_gpu

M, K, N = 4096, 4096, 11008


@triton.jit
def _tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # fusetune's grouped order (_matmul.grouped_tile) for tile number `tile`
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@triton.jit
def _ffn_tma(XD, W1D, W3D, OD, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, PERSISTENT: tl.constexpr):
    # Tiles [BM, BN] of the output in grouped order; PERSISTENT: program p takes tiles p,
    # p + NUM_PROGS, ... (else one tile, its program id). Boxes past the edges arrive
    # zero-filled and are not stored.
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    start = tl.program_id(0)
    if PERSISTENT:
        step = NUM_PROGS
        end = num_pid_m * num_pid_n
    else:
        step = 1
        end = start + 1
    for tile in tl.range(start, end, step, flatten=PERSISTENT):
        pid_m, pid_n = _tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc1 = tl.zeros([BM, BN], dtype=tl.float32)
        acc3 = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = XD.load([pid_m * BM, k0])
            acc1 = tl.dot(x, W1D.load([pid_n * BN, k0]).T, acc1)
            acc3 = tl.dot(x, W3D.load([pid_n * BN, k0]).T, acc3)
        h = acc1 * tl.sigmoid(acc1) * acc3
        OD.store([pid_m * BM, pid_n * BN], h.to(tl.float16))


def main() -> int:
    if cuda_gpu() is None:
        return 2
    from triton.tools.tensor_descriptor import TensorDescriptor

    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; x [{M}, {K}], W1 and W3 [{N}, {K}], fp16; median µs (do_bench, "
          "L2 flushed)")
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w1 = torch.randn(N, K, device="cuda", dtype=torch.float16) / 64
    w3 = torch.randn(N, K, device="cuda", dtype=torch.float16) / 64
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    ref = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)).float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w13 = torch.cat([w1, w3])
    gemm = do_bench(lambda: x @ w13.T, warmup=25, rep=200, return_mode="median") * 1e3
    print(f"cuBLAS [W1;W3] GEMM alone: {gemm:.1f}")
    bm, bn, bk, nw = 128, 128, 64, 8
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    d1, d3 = (TensorDescriptor.from_tensor(w, [bn, bk]) for w in (w1, w3))
    od = TensorDescriptor.from_tensor(out, [bm, bn])
    for gm, st, pers in itertools.product((8, 16), (3, 4), (0, 1)):
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        grid = (min(sms, tiles),) if pers else (tiles,)

        def run(gm: int = gm, st: int = st, pers: int = pers, grid: tuple[int] = grid) -> None:
            _ffn_tma[grid](xd, d1, d3, od, M, N, K, BM=bm, BN=bn, BK=bk, GROUP_M=gm,
                           NUM_PROGS=grid[0], PERSISTENT=pers, num_warps=nw, num_stages=st)

        run()
        torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm())
        t = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{bm}/{bn}/{bk} GROUP_M {gm} stages {st} "
              f"{'persistent' if pers else 'per tile  '}: {t:.1f} (rel err {err:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
