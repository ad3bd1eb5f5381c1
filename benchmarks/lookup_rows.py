"""What the lookup gives the matmul kernels at row counts between their tuned ones.

Between tuned row counts the lookup took the nearest one in log2. Where the tables held a
one-row (GEMV, BLOCK_M = 1) entry and prefill tiles at 4096 rows only, the nearest entry of
2-64 rows was the one-row config, which multiplies every weight row once per token row. The
lookup now takes the next tuned row count up whose config's structure can serve the asked
rows. For each case and row count this times, in one process: the log-nearest tuned entry
regardless of its structure ("nearest, any structure": the rule before), the config the
lookup gives now, and the default heuristic; each checked against the reference first,
timed as CUDA-graph replays (do_bench medians, L2 flushed, median of interleaved rounds).

With `--entry-rows R` the tuned entry of exactly R rows is timed beside them (e.g. 4096: what
the lookup rounded 65-4095 rows up to where no entry lay between).

    python -m benchmarks.lookup_rows [--tables T.yaml] [--rows 2,4,8,16,64] [--rounds 3]
                                     [--entry-rows 4096] [--cases ffn_e5m2,qkv_e5m2]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
import triton

import fusetune
from benchmarks.script_args import add_cases_option, chosen_cases, doc_summary
from benchmarks.timing import as_graph, cuda_gpu, interleaved_medians
from fusetune.kernels import get_spec
from fusetune.kernels._spec import Config, Point
from fusetune.tables import gpu_for_device, lookup, tuned_entries
from fusetune.tuner.bench import Evaluator

LLAMA_FFN = {"dim": 4096, "hidden": 11008}
LLAMA_QKV = {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32, "n_kv_heads": 32}
LOLA_16384 = {"dim": 4096, "out": 16384}
# (kernel, dims, activations, weights) by name: the groups of the H100 tables tuned at several
# row counts (first those that held a one-row entry and prefill entries only); DEFAULT_CASES are
# timed unless --cases names others. The *_e5m2 / lola_*_fp8 groups had a one-row and a
# 4096-row entry only when the row reach came in.
NAMED_CASES: dict[str, tuple[str, dict[str, int], str, str]] = {
    "ffn_e4m3": ("ffn", LLAMA_FFN, "float16", "fp8-e4m3"),
    "ffn_bf16": ("ffn", LLAMA_FFN, "bfloat16", ""),
    "ffn_fp16": ("ffn", LLAMA_FFN, "float16", ""),
    "qkv_e4m3": ("qkv", LLAMA_QKV, "float16", "fp8-e4m3"),
    "qkv_bf16": ("qkv", LLAMA_QKV, "bfloat16", ""),
    "qkv_fp16": ("qkv", LLAMA_QKV, "float16", ""),
    "lola_fp16": ("lola", LOLA_16384, "float16", ""),
    "lola_bf16": ("lola", LOLA_16384, "bfloat16", ""),
    "lola_768": ("lola", {"dim": 768, "out": 3072}, "float16", ""),
    "ffn_e5m2": ("ffn", LLAMA_FFN, "float16", "fp8-e5m2"),
    "qkv_e5m2": ("qkv", LLAMA_QKV, "float16", "fp8-e5m2"),
    "lola_e4m3": ("lola", LOLA_16384, "float16", "fp8-e4m3"),
    "lola_e5m2": ("lola", LOLA_16384, "float16", "fp8-e5m2"),
}
DEFAULT_CASES = ("ffn_e4m3", "ffn_bf16", "ffn_fp16", "qkv_e4m3", "qkv_bf16", "qkv_fp16",
                 "lola_fp16", "lola_bf16", "lola_768")


def group_entries(kernel: str, dims: dict[str, int], dtype: str, weights: str
                  ) -> list[tuple[int, Config]]:
    """(rows, config) of the tuned entries of this GPU for the group, sorted by rows."""
    gpu = gpu_for_device(torch.device("cuda")).name
    key = tuple(sorted(dims.items()))
    return sorted(((r, c) for d, t, r, c in tuned_entries(gpu, kernel, weights)
                   if d == key and t == dtype), key=lambda e: e[0])


def nearest_any_structure(entries: list[tuple[int, Config]], rows: int) -> Config | None:
    """The tuned config of the row count nearest to `rows` in log2, within the tuned range,
    whatever its structure (the lookup's rule before it checked the structure)."""
    if not entries or not entries[0][0] <= rows <= entries[-1][0]:
        return None
    return min(entries, key=lambda e: abs(math.log2(e[0]) - math.log2(rows)))[1]


def entry_of(entries: list[tuple[int, Config]], rows: int) -> Config | None:
    """The tuned config of exactly `rows` rows, or None."""
    return next((c for r, c in entries if r == rows), None)


def short(config: Config) -> str:
    return "/".join(str(config.get(k, 0)) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PASSES"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--tables", help="a table loaded before the shipped ones")
    ap.add_argument("--rows", default="2,4,8,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--entry-rows", type=int, help="also time the tuned entry of this many rows")
    add_cases_option(ap, NAMED_CASES, DEFAULT_CASES, what="groups")
    args = ap.parse_args(argv)
    names = chosen_cases(ap, args.cases, NAMED_CASES, DEFAULT_CASES)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    if args.tables:
        fusetune.load_tables(args.tables)
    labels: tuple[str, ...] = ("nearest, any structure", "lookup now", "default")
    if args.entry_rows:
        labels += (f"{args.entry_rows}-row entry",)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; µs of CUDA-graph replays (do_bench medians, L2 flushed, "
          f"median of {args.rounds} interleaved rounds); configs as BLOCK_M/BLOCK_N/BLOCK_K/"
          "PASSES\n")
    print("| kernel | dims | x | weights | rows | " + " | ".join(labels) + " | configs |")
    print("|---|---|---|---|---:|" + "---:|" * len(labels) + "---|")
    for kernel, dims, dtype, weights in (NAMED_CASES[n] for n in names):
        spec = get_spec(kernel)
        entries = group_entries(kernel, dims, dtype, weights)
        for rows in (int(r) for r in args.rows.split(",")):
            point = Point.make(kernel, dims, rows, 1, dtype, weights)
            nearest = nearest_any_structure(entries, rows)
            configs = {
                labels[0]: nearest,
                labels[1]: lookup(kernel, dims, dtype, rows=rows, weights=weights),
                labels[2]: spec.canonical(spec.default_config(point, gpu), point),
            }
            if args.entry_rows:
                configs[labels[3]] = entry_of(entries, args.entry_rows)
            ev = Evaluator(spec, point, "cuda", "cuda")
            fns: dict[str, Callable[[], object] | None] = {}
            for label, config in configs.items():
                fns[label] = None
                if config is None:
                    continue
                check = ev.check(config)
                if not check.ok:
                    print(f"{kernel} {dims} {dtype} {weights} rows {rows} {label}: "
                          f"{check.status} {check.reason}", file=sys.stderr)
                    continue
                fns[label] = as_graph(lambda ev=ev, spec=spec, config=config:
                                      spec.launch(ev.inputs, ev.outputs, config))
            times = interleaved_medians(fns, args.rounds)
            cells = [f"{times[k]:.1f}" if times.get(k) is not None else "-" for k in labels]
            what = ",".join(f"{k}={v}" for k, v in dims.items())
            cfgs = "; ".join(f"{k}: {short(c)}" for k, c in configs.items() if c is not None)
            print(f"| {kernel} | {what} | {dtype} | {weights or '-'} | {rows} | "
                  + " | ".join(cells) + f" | {cfgs} |", flush=True)
            del ev, fns
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
