"""The one-row GEMV with each thread's run of a weight row added up first (THREAD_SUM): a
diagnostic, side by side with the shipped configs.

The decode kernels accumulate every product in its own float32 register ([BLOCK_K, BLOCK_N]
tiles) and run at 17-25% occupancy (120-168 registers a thread). With THREAD_SUM = 1 a thread
first adds up the products of its 16-byte run of a weight row (8 float16 or 16 FP8 weights,
one vector load), so the accumulators are 8-16 times smaller. For ffn, qkv and lola at one
row (Llama-2-7B dims; lola 4096 -> 16384), 16-bit and e4m3 weights, this launches the shipped
config as it is, the same with THREAD_SUM flipped (0 <-> 1), and with --tables the config of
that table (e.g. the winners of exhaustive grids of benchmarks/grid_spaces/
*_gemv_thread_sum.yaml, or the tables shipped before), each checked against
the reference first (its registers from the compiled kernel), timed as CUDA-graph replays
(do_bench medians, L2 flushed, median of interleaved rounds), beside the read-only kernel of
the same bytes.

    python -m benchmarks.gemv_thread_sum [--tables T.yaml] [--weights fp16,fp8-e4m3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton

import fusetune
from benchmarks.bench_decode import READ_SHAPES
from benchmarks.bench_read_bw import read_us
from benchmarks.script_args import doc_summary
from benchmarks.timing import as_graph, cuda_gpu, interleaved_medians
from fusetune import models
from fusetune.kernels import get_spec
from fusetune.kernels._spec import Config, Point
from fusetune.tables import lookup
from fusetune.tuner.bench import Evaluator

CASES: tuple[tuple[str, dict[str, int] | None], ...] = (
    ("ffn", None), ("qkv", None), ("lola", {"dim": 4096, "out": 16384}))


def short(config: Config) -> str:
    keys = ("BLOCK_N", "BLOCK_K", "UNROLL_K", "SPREAD", "THREAD_SUM", "num_warps")
    return " ".join(f"{k.replace('BLOCK_', '').replace('num_', '')}={config.get(k, 0)}"
                    for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--tables", help="a table whose M = 1 configs are timed too")
    ap.add_argument("--weights", default="fp16,fp8-e4m3",
                    help="weight formats: fp16 (the activations' type), fp8-e4m3, fp8-e5m2")
    ap.add_argument("--kernels", default="ffn,qkv,lola")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if cuda_gpu() is None:
        return 2
    llama = models.preset("llama-2-7b")
    cases = []
    for name, dims in CASES:
        if name not in args.kernels.split(","):
            continue
        spec = get_spec(name)
        dims = dims or spec.dims_from_model(llama)
        for w in args.weights.split(","):
            weights = "" if w == "fp16" else w
            point = Point.make(name, dims, 1, 1, "float16", weights)
            shipped = spec.canonical(lookup(name, dims, "float16", rows=1, weights=weights),
                                     point)
            flipped = {**shipped, "THREAD_SUM": 1 - shipped.get("THREAD_SUM", 0)}
            cases.append((spec, point, {"shipped": shipped, "THREAD_SUM flipped": flipped}))
    if args.tables:  # after the shipped configs were looked up
        fusetune.load_tables(args.tables)
        for spec, point, configs in cases:
            configs["table"] = spec.canonical(lookup(spec.name, point.dim, "float16", rows=1,
                                                     weights=point.weights), point)
    labels = ["shipped", "THREAD_SUM flipped", *(["table"] if args.tables else [])]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; M = 1, float16 activations; µs of CUDA-graph replays "
          f"(do_bench medians, L2 flushed, median of {args.rounds} interleaved rounds); "
          "registers a thread in brackets\n")
    print("| kernel | weights | " + " | ".join(labels) + " | read-only | configs |")
    print("|---|---|" + "---:|" * (len(labels) + 1) + "---|")
    for spec, point, configs in cases:
        ev = Evaluator(spec, point, "cuda", "cuda")
        fns: dict[str, Callable[[], object] | None] = {}
        regs: dict[str, Any] = {}
        for label, config in configs.items():
            check = ev.check(config)
            if not check.ok:
                print(f"{spec.name} {point.weights or 'fp16'} {label}: {check.status} "
                      f"{check.reason}", file=sys.stderr)
                fns[label] = None
                continue
            regs[label] = check.n_regs
            print(f"{spec.name} {point.weights or 'fp16'} {label}: {short(config)}, "
                  f"{check.n_regs} registers, {check.n_spills} spilled, rel. error "
                  f"{check.rel_err:.2e}", file=sys.stderr)
            fns[label] = as_graph(lambda ev=ev, spec=spec, config=config:
                                  spec.launch(ev.inputs, ev.outputs, config))
        times = interleaved_medians(fns, args.rounds)
        nbytes = spec.cost(point).bytes
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        read = min(read_us(x, *s) for s in READ_SHAPES)
        cells = [f"{times[k]:.1f} ({regs[k]})" if times.get(k) is not None else "-"
                 for k in labels]
        cfgs = "; ".join(f"{k}: {short(c)}" for k, c in configs.items() if k != labels[1])
        print(f"| {spec.name} | {point.weights or 'fp16'} | " + " | ".join(cells)
              + f" | {read:.1f} | {cfgs} |", flush=True)
        del ev, fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
