"""How fast can this GPU stream bytes it only reads? The ceiling for the decode (M = 1) matmul
kernels, which read their weights once and write almost nothing.

A Triton kernel reads a buffer (each program BLOCK elements per step, STEPS steps, 16-byte
vector loads) and writes one float32 partial sum per program; timed beside a device-to-device
copy of the same bytes (which reads and writes them), with do_bench (L2 flushed).

    python -m benchmarks.bench_read_bw --mb 180,100,134
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu


@triton.jit
def _read_kernel(X, OUT, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr,
                 EVICT: tl.constexpr):
    # Program p reads elements [p·STEPS·BLOCK, (p+1)·STEPS·BLOCK) in STEPS contiguous blocks
    # (the mask covers the buffer's end) and writes their float32 sum: one value per program.
    # UNROLL: the STEPS loads are unrolled (all of them in flight at once) instead of looped;
    # EVICT: the loads' eviction policy ("evict_first": each byte is read once; "": none).
    base = tl.program_id(0).to(tl.int64) * (STEPS * BLOCK)
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if UNROLL:
        for s in tl.static_range(STEPS):
            offs = base + s * BLOCK + r
            acc += tl.load(X + offs, mask=offs < n, other=0.0,
                           eviction_policy=EVICT).to(tl.float32)
    else:
        for s in range(STEPS):
            offs = base + s * BLOCK + r
            acc += tl.load(X + offs, mask=offs < n, other=0.0,
                           eviction_policy=EVICT).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, axis=0))


def read_us(x: torch.Tensor, block: int, steps: int, warps: int, unroll: bool = False,
            evict: bool = False) -> float:
    n = x.numel()
    grid = triton.cdiv(n, block * steps)
    out = torch.empty(grid, device=x.device, dtype=torch.float32)

    def run() -> None:
        _read_kernel[(grid,)](x, out, n, BLOCK=block, STEPS=steps, UNROLL=unroll,
                              EVICT="evict_first" if evict else "", num_warps=warps)

    run()
    torch.cuda.synchronize()
    ref = x.float().sum()
    assert torch.allclose(out.sum(), ref, rtol=1e-3, atol=1e-1), (float(out.sum()), float(ref))
    return do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--mb", default="180,100,134", help="buffer sizes in MB (1e6 bytes)")
    args = ap.parse_args(argv)
    if cuda_gpu() is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; median µs (do_bench, L2 flushed)\n")
    print("| MB | best read | TB/s | config (BLOCK, STEPS, warps, unrolled, evict_first) | "
          "copy (read+write) | TB/s |")
    print("|---:|---:|---:|---|---:|---:|")
    for mb in (float(v) for v in args.mb.split(",")):
        n = int(mb * 1e6) // 2
        x = torch.randn(n, device="cuda").half()
        best = (float("inf"), None)
        for block in (1024, 2048, 4096, 8192):
            for steps in (1, 4, 8, 16):
                for warps in (4, 8):
                    for unroll in (False, True) if steps > 1 else (False,):
                        for evict in (False, True):
                            t = read_us(x, block, steps, warps, unroll, evict)
                            best = min(best, (t, (block, steps, warps, unroll, evict)))
        y = torch.empty_like(x)
        copy = do_bench(lambda x=x, y=y: y.copy_(x), warmup=25, rep=100, return_mode="median") * 1e3
        nbytes = 2 * n
        print(f"| {mb:g} | {best[0]:.1f} | {nbytes / best[0] / 1e6:.2f} | {best[1]} | "
              f"{copy:.1f} | {2 * nbytes / copy / 1e6:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
