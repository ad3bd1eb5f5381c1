"""Do PTX load hints make a read-only stream faster? The decode (M = 1) matmul kernels read
their weights once; Triton emits plain `ld.global.v4.b32` for their 16-byte loads.

A Triton kernel reads a buffer of int32 words (each program BLOCK words per step, STEPS steps)
and writes the wrapping int32 sum of its words, once with tl.load and once per hint with the
16-byte load written as inline PTX (`ld.global<hints>.v4.b32`): `L2::128B` / `L2::256B` ask L2
to fetch that much around each miss, `nc` reads through the non-coherent (read-only) path,
`L1::no_allocate` / `L1::evict_first` keep the bytes out of L1. Every variant's sum is checked
against torch's, then each is timed with do_bench (L2 flushed), best config per variant, in
interleaved rounds.

    python -m benchmarks.read_hints --mb 180,100,90,50
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu

# name -> the PTX load instruction (None: tl.load; "evict_first": tl.load with that eviction
# policy, what the GEMV loops use; ".cg": tl.load with that cache modifier)
HINTS: dict[str, str | None] = {
    "tl.load": None,
    "tl.load, evict_first": "evict_first",
    "tl.load, .cg": ".cg",
    "asm, none": "ld.global.v4.b32",
    "L2::128B": "ld.global.L2::128B.v4.b32",
    "L2::256B": "ld.global.L2::256B.v4.b32",
    "nc": "ld.global.nc.v4.b32",
    "nc, L1::no_allocate": "ld.global.nc.L1::no_allocate.v4.b32",
    "nc, L1::no_allocate, L2::256B": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32",
    "L1::evict_first, L2::256B": "ld.global.L1::evict_first.L2::256B.v4.b32",
}
# (BLOCK words a step, STEPS, warps, unrolled)
CONFIGS = [(b, s, w, u) for b in (512, 1024, 2048) for s in (1, 2, 4) for w in (4, 8)
           for u in ((False, True) if s > 1 else (False,))]
CHUNK = max(b * s for b, s, _, _ in CONFIGS)


@triton.jit
def _words16(p, OP: tl.constexpr):
    """The four int32 words at each 16-byte-aligned address of `p`, through the load `OP`."""
    return tl.inline_asm_elementwise(OP + " {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _step(p, OP: tl.constexpr, ASM: tl.constexpr):
    """The words at `p` (ASM: the four words at each address), added up per lane."""
    if ASM:
        a, b, d, e = _words16(p, OP)
        v = (a + b) + (d + e)
    elif OP == ".cg":
        v = tl.load(p, cache_modifier=OP)
    else:
        v = tl.load(p, eviction_policy=OP)
    return v


@triton.jit
def _read_kernel(X, OUT, BLOCK: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr,
                 OP: tl.constexpr, ASM: tl.constexpr):
    # Program p reads words [p·STEPS·BLOCK, (p+1)·STEPS·BLOCK) in STEPS contiguous blocks (the
    # buffer is a whole number of programs: no mask). With ASM, a block is BLOCK / 4 addresses
    # 16 bytes apart, each loaded as four words by `OP`; else BLOCK words by tl.load (16-byte
    # vectors too: the buffer is 16-byte aligned).
    base = tl.program_id(0).to(tl.int64) * (STEPS * BLOCK)
    if ASM:
        c = 4 * tl.arange(0, BLOCK // 4)
        acc = tl.zeros([BLOCK // 4], dtype=tl.int32)
    else:
        c = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
    if UNROLL:
        for s in tl.static_range(STEPS):
            acc += _step(X + base + s * BLOCK + c, OP, ASM)
    else:
        for s in range(STEPS):
            acc += _step(X + base + s * BLOCK + c, OP, ASM)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, axis=0))


def runner(x: torch.Tensor, op: str | None, block: int, steps: int, warps: int, unroll: bool):
    grid = x.numel() // (block * steps)
    out = torch.empty(grid, device=x.device, dtype=torch.int32)

    def run() -> None:
        asm = op is not None and op.startswith("ld.")
        _read_kernel[(grid,)](x, out, BLOCK=block, STEPS=steps, UNROLL=unroll, OP=op or "",
                              ASM=asm, num_warps=warps)

    return run, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--mb", default="180,100,90,50", help="buffer sizes in MB (1e6 bytes)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the best configs")
    args = ap.parse_args(argv)
    if cuda_gpu() is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; median µs (do_bench, L2 flushed); the best config per hint "
          f"over {len(CONFIGS)} (BLOCK words, STEPS, warps, unrolled), then the median of "
          f"{args.rounds} interleaved rounds of the best\n", flush=True)
    names = list(HINTS)
    print("| MB | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for mb in (float(v) for v in args.mb.split(",")):
        n = -(-int(mb * 1e6) // 4 // CHUNK) * CHUNK  # int32 words, a whole number of chunks
        x = torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", dtype=torch.int32)
        want = int(x.sum(dtype=torch.int64)) % 2**32
        best: dict[str, tuple[float, tuple]] = {}
        for name, op in HINTS.items():
            for cfg in CONFIGS:
                run, out = runner(x, op, *cfg)
                run()
                got = int(out.sum(dtype=torch.int64)) % 2**32
                if got != want:
                    print(f"{name} {cfg}: sum {got} != {want}", file=sys.stderr)
                    return 1
                t = do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3
                best[name] = min(best.get(name, (float("inf"), cfg)), (t, cfg))
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                run, _ = runner(x, HINTS[name], *best[name][1])
                times[name].append(do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3)
        cells = []
        for name in names:
            t = statistics.median(times[name])
            cells.append(f"{t:.1f} ({4 * n / t / 1e6:.2f} TB/s)")
        print(f"| {4 * n / 1e6:.0f} | " + " | ".join(cells) + " |", flush=True)
        for name in names:
            print(f"  {name}: best config {best[name][1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
