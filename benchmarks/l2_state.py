"""What the L2 holds before a timed decode kernel changes its time: do_bench's flush against
one that leaves the L2 clean.

triton.testing.do_bench "flushes" the L2 before every timed launch by zeroing a 256 MB buffer,
so the launch starts with the L2 full of dirty lines (about its 50 MB on an H100): as the
kernel's loads miss, those lines are written back to DRAM while it reads. A real decode step
finds the L2 holding mostly clean lines (weights and caches read by the kernels before it).
This script times the same CUDA-graph replays (the shipped configs at one row, and the
read-only kernel of the same bytes, benchmarks/bench_read_bw.py) three ways, in interleaved
rounds:

- `do_bench`: triton.testing.do_bench as every benchmark here times (the record);
- `zeroed`: this script's own loop with do_bench's flush (zero 256 MB), to show the loop agrees;
- `clean`: the same loop, the zeroing followed by a read of another 256 MB buffer, so that the
  L2 holds clean lines that the kernel can drop without writing them back.

    python -m benchmarks.l2_state [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
import triton

from benchmarks.bench_decode import CASES, READ_SHAPES, shipped_case
from benchmarks.bench_read_bw import _read_kernel, read_us
from benchmarks.script_args import doc_summary
from benchmarks.timing import as_graph, cuda_gpu, interleaved_medians, median_us
from fusetune.kernels._spec import WEIGHT_FORMATS

Fn = Callable[[], object]
FLUSH_BYTES = 256 * 1024 * 1024  # do_bench's buffer


def flushed_median_us(fn: Fn, prelude: Fn, reps: int = 100, warmup: int = 10) -> float:
    """Median µs of `fn` over `reps` launches, each after `prelude` (not timed), timed with CUDA
    events around the launch only, as do_bench does around its own flush."""
    for _ in range(warmup):
        prelude()
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        prelude()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)
                             ) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="", choices=["", *WEIGHT_FORMATS],
                    help="weight format of the kernels (default: float16 weights)")
    args = ap.parse_args(argv)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    other = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def zeroed() -> None:
        cache.zero_()

    def clean() -> None:
        cache.zero_()
        torch.amax(other)  # reads 256 MB: the dirty lines leave, clean ones stay

    timers: dict[str, Callable[[Fn], float]] = {
        "do_bench": median_us,
        "zeroed": lambda fn: flushed_median_us(fn, zeroed),
        "clean": lambda fn: flushed_median_us(fn, clean),
    }

    print(f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, Triton "
          f"{triton.__version__}; CUDA-graph replays, one row, float16 activations, weights "
          f"{args.weights or 'float16'}; median µs, median of {args.rounds} interleaved "
          "rounds\n")
    print("| kernel | MB | do_bench | zeroed | clean | clean / do_bench | TB/s do_bench / clean "
          "| config |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for kernel, model, dims in CASES:
        spec, dims, point, config, ev = shipped_case(kernel, model, dims, "float16",
                                                     args.weights)
        check = ev.check(config)
        if not check.ok:
            print(f"| {kernel} {dims} | | {check.status}: {check.reason} | | | | | |")
            continue
        nbytes = spec.cost(point).bytes
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        block, steps, warps, unroll, evict = min(READ_SHAPES, key=lambda s, x=x: read_us(x, *s))
        grid = triton.cdiv(x.numel(), block * steps)
        part = torch.empty(grid, device="cuda", dtype=torch.float32)
        graphs = {
            f"{kernel} {'/'.join(str(v) for v in dims.values())}": as_graph(
                lambda ev=ev, spec=spec, config=config: spec.launch(ev.inputs, ev.outputs,
                                                                    config)),
            "read-only, same bytes": as_graph(
                lambda x=x, part=part, grid=grid, block=block, steps=steps, warps=warps,
                unroll=unroll, evict=evict: _read_kernel[(grid,)](
                    x, part, x.numel(), BLOCK=block, STEPS=steps, UNROLL=unroll,
                    EVICT="evict_first" if evict else "", num_warps=warps)),
        }
        # Each graph timed the three ways in turn, round after round.
        times = interleaved_medians({(name, how): fn for name, fn in graphs.items()
                                     for how in timers}, args.rounds,
                                    lambda key, fn: timers[key[1]](fn))
        cfg = "/".join(str(v) for v in config.values())
        for name in graphs:
            m = {how: times[(name, how)] for how in timers}
            print(f"| {name} | {nbytes / 1e6:.0f} | {m['do_bench']:.1f} | {m['zeroed']:.1f} | "
                  f"{m['clean']:.1f} | {m['clean'] / m['do_bench']:.2f} | "
                  f"{nbytes / m['do_bench'] / 1e6:.2f} / {nbytes / m['clean'] / 1e6:.2f} | "
                  f"{cfg if name != 'read-only, same bytes' else (block, steps, warps)} |",
                  flush=True)
        del ev, x, graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
