"""Does torch.compile in the same process change what the RMSNorm kernel and a copy take?

A diagnostic. bench_rmsnorm at 4096 x 4096 (67 MB moved) times the copy at about 25 µs when its
torch.compile case is in the process, and about 28 µs when it is not, while fusetune's kernel
takes 28 µs either way (BENCHMARKS.md). This script times, at 4096 x 4096 in float16 and
bfloat16, the copy `y.copy_(x)`, the tuned kernel and Liger Kernel's RMSNorm (CUDA-graph
replays, do_bench medians with the L2 flushed, 3 interleaved rounds), then runs a
torch.compile'd RMSNorm once (`--compile`: Inductor compiles and launches it), and times the
three again, plus the tuned kernel compiled afresh after that (`--fresh`: a new Triton cache
directory, so Triton compiles it again in this process).

    python -m benchmarks.rmsnorm_compile_effect [--compile] [--fresh]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import triton

from benchmarks import bench_rmsnorm
from benchmarks.script_args import doc_summary
from benchmarks.timing import Fn, as_graph, cuda_gpu, interleaved_medians
from fusetune.kernels.rmsnorm import _launch_2d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--compile", action="store_true", help="run a torch.compile'd RMSNorm once")
    ap.add_argument("--fresh", action="store_true",
                    help="after that, compile the tuned kernel again in a new Triton cache")
    args = ap.parse_args(argv)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    liger = bench_rmsnorm.liger_rmsnorm()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; 4096 x 4096, µs of CUDA-graph replays (do_bench medians, L2 "
          "flushed, median of 3 rounds)\n")
    print("| dtype | when | copy | tuned | Liger | tuned / copy BW |")
    print("|---|---|---:|---:|---:|---:|")
    cases = [bench_rmsnorm.make_case(4096, 4096, dt, gpu, lambda x, w: None, liger)
             for dt in ("float16", "bfloat16")]

    def fns(case: dict[str, object]) -> dict[str, Fn]:
        x, w, y, cfg = case["x"], case["w"], case["y"], case["tuned_cfg"]
        out = {"copy": lambda: y.copy_(x),  # type: ignore[union-attr]
               "tuned": lambda: _launch_2d(x, w, torch.empty_like(x), 1e-6, cfg)}
        if liger is not None:
            out["liger"] = lambda: liger(x, w)
        return out

    def report(when: str) -> None:
        for case in cases:
            t = interleaved_medians({k: as_graph(f) for k, f in fns(case).items()}, 3)
            print(f"| {case['dtype']} | {when} | {t['copy']:.1f} | {t['tuned']:.1f} | "
                  f"{t.get('liger', float('nan')):.1f} | {100 * t['copy'] / t['tuned']:.0f}% |",
                  flush=True)

    report("before")
    if args.compile:
        compiled = torch.compile(bench_rmsnorm.eager_rmsnorm)
        for case in cases:
            compiled(case["x"], case["w"])
        torch.cuda.synchronize()
        report("after torch.compile ran")
        if args.fresh:
            os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
            from fusetune.kernels.rmsnorm import _rmsnorm_kernel
            _rmsnorm_kernel.device_caches.clear()  # the compiled kernels held in memory
            report("after, tuned kernel compiled again")
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
