"""Shared memory of lola's tensor-core kernel with the LayerNorm folded into the K loop
(PASSES = 1): what the compiler allocates beside what lola's resource model predicts.

The search skips, before compiling, every config whose predicted shared memory exceeds the
GPU's; a prediction below what the compiler allocates lets an OutOfResources through, one far
above it hides configs that fit. This script compiles (without running) every config of a grid
(BLOCK_M 16-128, BLOCK_N 64-256, BLOCK_K 32-128, 2-8 warps, 2 and 4 stages) for 16-bit and e4m3
weights, in parallel processes, and prints both figures per config, then the configs the model
under-predicts (there should be none) and how far it over-predicts.

    python -m benchmarks.lola_smem_check [--dim 4096 --out 16384 --rows 256 --jobs 14]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu
from fusetune.kernels._spec import Point
from fusetune.kernels.lola import SPEC
from fusetune.tuner.launches import compile_only, kernel_stats, launched_kernels

WEIGHTS = ("", "fp8-e4m3")
GRID = list(itertools.product((16, 32, 64, 128), (64, 128, 256), (32, 64, 128), (2, 4, 8),
                              (2, 4)))

_inputs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}


def _point(weights: str, dim: int, out: int, rows: int) -> Point:
    return Point.make("lola", {"dim": dim, "out": out}, 1, rows, "float16", weights)


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PASSES": 1,
            "SPLIT_K": 1, "ACT_FP8": 0, "UNROLL_K": 0, "TMA": 0, "num_warps": warps,
            "num_stages": stages}


def _compiled_smem(job: tuple[str, tuple[int, ...], int, int, int]) -> tuple[int | None, str]:
    """Compiles one config in this worker process; its shared memory, or why there is none."""
    weights, tile, dim, out, rows = job
    if weights not in _inputs:
        inputs = SPEC.make_inputs(_point(weights, dim, out, rows), "cuda")
        _inputs[weights] = (inputs, SPEC.make_outputs(inputs))
    inputs, outputs = _inputs[weights]
    try:
        with launched_kernels() as kernels, compile_only():
            SPEC.launch(inputs, outputs, _config(*tile))
    except Exception as e:  # a config the compiler rejects is a row of the report
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return kernel_stats(kernels).smem_bytes, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--out", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--jobs", type=int, default=14, help="compiling processes")
    args = ap.parse_args()
    if cuda_gpu() is None:
        return 2
    import triton

    jobs = [(w, tile, args.dim, args.out, args.rows) for w in WEIGHTS for tile in GRID]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; lola {args.dim} -> {args.out}, fp16 activations, PASSES 1, "
          f"{args.rows} rows; shared memory per program, bytes")
    print("| weights | BM,BN,BK,warps,stages | predicted | compiled | predicted/compiled |")
    print("|---|---|---|---|---|", flush=True)
    under, ratios = [], []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        # rows in the grid's order, each printed as soon as it and those before it are done
        for (weights, tile, *_), (smem, why) in zip(
                jobs, pool.map(_compiled_smem, jobs, chunksize=2), strict=True):
            predicted = SPEC.resources(_config(*tile), _point(weights, args.dim, args.out,
                                                              args.rows)).smem_bytes
            name = weights or "fp16"
            cfg = ",".join(map(str, tile))
            if smem is None:
                print(f"| {name} | {cfg} | {predicted} | {why} | |", flush=True)
                continue
            ratio = predicted / smem if smem else float("inf")
            ratios.append(ratio)
            if predicted < smem:
                under.append(f"{name} {cfg}: predicted {predicted}, compiled {smem}")
            print(f"| {name} | {cfg} | {predicted} | {smem} | {ratio:.2f} |", flush=True)
    finite = sorted(r for r in ratios if r != float("inf"))
    print(f"\n{len(ratios)} configs compiled; under-predicted: {len(under)}")
    for line in under:
        print("  " + line)
    if finite:
        print(f"predicted/compiled: median {finite[len(finite) // 2]:.2f}, "
              f"max {finite[-1]:.2f}")
    return 1 if under else 0


if __name__ == "__main__":
    sys.exit(main())
