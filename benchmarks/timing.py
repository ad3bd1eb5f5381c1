"""Side-by-side GPU timing shared by the benchmark scripts.

Every implementation is warmed at every shape first, its Python-side cost per call is measured
once, then it is captured in a CUDA graph and timed with triton.testing.do_bench (L2 flushed)
in interleaved rounds; each figure is the median over rounds of do_bench's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from triton.testing import do_bench

from benchmarks.script_args import doc_summary
from fusetune.gpus import GpuSpec
from fusetune.tuner.bench import captured_launch

Fn = Callable[[], object]
K = TypeVar("K")
# A copy is timed as a plain call: its launch path is short enough not to leave the GPU idle.
PLAIN = frozenset({"copy"})
# Timed after every other implementation of a case: torch.compile's reductions load their
# input with evict-last priority, and lines so marked outlast do_bench's L2 flush, so that
# whatever was timed after the compiled case on the same tensors read part of them from the
# L2 (at 4096 x 4096 RMSNorm the copy and every kernel timed after it ran 8-10% faster).
TIMED_LAST = frozenset({"compile"})
STATIC_SHAPES = 4096  # compile_static: more shapes than a benchmark run times


def parser(doc: str, impls: Sequence[str]) -> argparse.ArgumentParser:
    """The options every benchmark has; each script adds its shapes."""
    ap = argparse.ArgumentParser(description=doc_summary(doc))
    ap.add_argument("--tables", help="lookup table (fusetune export); default: shipped tables")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--impls", default=",".join(impls), help="implementations to time")
    ap.add_argument("--no-graph", action="store_true",
                    help="time plain Python calls instead of CUDA-graph replays")
    ap.add_argument("--markdown", help="write the table here too")
    ap.add_argument("--json", help="write raw numbers here")
    return ap


def cuda_gpu() -> GpuSpec | None:
    """The GpuSpec of the current CUDA device; None, after saying why, where there is no CUDA
    GPU (the check every GPU benchmark starts with)."""
    from fusetune.tables import gpu_for_device

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    return gpu_for_device(torch.device("cuda"))


def start(args: argparse.Namespace) -> Any:
    """cuda_gpu, after loading --tables where there is a CUDA GPU."""
    import fusetune

    gpu = cuda_gpu()
    if gpu is not None and args.tables:
        fusetune.load_tables(args.tables)
    return gpu


def heading(gpu: Any, what: str, graphs: bool = True, plain: Collection[str] = PLAIN) -> str:
    """The line above a benchmark's table; `plain`: the implementations timed as plain calls
    (as passed to `run`)."""
    import triton

    how = ("plain calls (--no-graph: Python-side launch cost can add to small sizes)"
           if not graphs else "CUDA-graph replays" if not plain else
           f"CUDA-graph replays ({', '.join(sorted(plain))}: plain calls)")
    return (f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, "
            f"Triton {triton.__version__}, {what}; GPU µs: medians of do_bench (L2 flushed) over "
            f"{how}, median of interleaved rounds")


def run(args: argparse.Namespace, cases: Sequence[dict[str, Any]],
        plain: Collection[str] = PLAIN) -> tuple[list[dict[str, float | None]], dict[str, float]]:
    """time_cases with the command line's --impls, --rounds and --no-graph."""
    return time_cases(cases, args.impls.split(","), args.rounds, graphs=not args.no_graph,
                      plain=plain)


def compile_static(fn: Callable[..., Any], backend: Any = "inductor") -> Callable[..., Any]:
    """torch.compile of a benchmark's torch code, compiled for each input shape on its own
    (static shapes), as a model compiled at one shape runs it. Left to its defaults, dynamo
    recompiles a function met at a second shape for any size (dynamic shapes: other kernels
    than a static compile's), and past its recompile limit (8 versions of one function) runs
    it uncompiled with only a warning: the compile column of every later shape would time
    eager code. The limits are raised past any run's number of shapes."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, STATIC_SHAPES)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, STATIC_SHAPES)
    return torch.compile(fn, dynamic=False, backend=backend)


def median_us(fn: Fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def interleaved_medians(fns: Mapping[K, Fn | None], rounds: int,
                        measure: Callable[[K, Fn], float] | None = None
                        ) -> dict[K, float | None]:
    """median_us of each of `fns` (None: left out, its result None) in `rounds` rounds that
    take them in turn, then the median over the rounds: what the diagnostics compare side by
    side (time_cases does the same over several cases). `measure(key, fn)`: another way to
    time a key's fn (default: median_us)."""
    times: dict[K, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if fn is not None:
                times[k].append(measure(k, fn) if measure is not None else median_us(fn))
    return {k: statistics.median(v) if v else None for k, v in times.items()}


def as_graph(fn: Fn) -> Fn:
    """`fn` captured in a CUDA graph: replays cost the GPU time of its kernels only, so a slow
    Python launch path cannot leave the GPU idle inside the timed region (inference servers
    launch these kernels from graphs too). The replay holds `fn`, and with it the tensors its
    closure holds (fusetune.tuner.bench.captured_launch): when a benchmark's only reference to
    its inputs was the closure, replacing it by its graph freed them, and replays faulted.
    RuntimeError where `fn` cannot be captured."""
    fn()
    torch.cuda.synchronize()
    replay = captured_launch(fn)
    if replay is fn:
        raise RuntimeError("the call cannot be captured in a CUDA graph")
    return replay


def host_us_per_call(fn: Fn, n: int = 2000) -> float:
    """Python-side cost of one call (launch path, lookup included), without waiting for the GPU
    (where there is one: the work is done before and after the timed calls)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / n * 1e6


def time_cases(cases: Sequence[dict[str, Any]], impls: Sequence[str], rounds: int = 3,
               graphs: bool = True, last: Collection[str] = TIMED_LAST,
               plain: Collection[str] = PLAIN
               ) -> tuple[list[dict[str, float | None]], dict[str, float]]:
    """Times `case["fns"][impl]` for every case; returns per-case medians (None where an impl
    is missing) and the Python-side µs per call of each impl at the first case. In each round
    a case's implementations run in the order of its dict, those named in `last` after the
    others; those named in `plain` are timed as plain calls, never captured in a graph."""
    for case in cases:
        for k in list(case["fns"]):
            if k not in impls:
                case["fns"][k] = None
        fns = case["fns"]
        case["fns"] = {k: fns[k] for k in sorted(fns, key=lambda k: k in last)}
        for fn in case["fns"].values():
            if fn is not None:
                fn()
                fn()
    torch.cuda.synchronize()
    host = {k: host_us_per_call(fn) for k, fn in cases[0]["fns"].items() if fn is not None}
    if graphs:
        for case in cases:
            for k, fn in case["fns"].items():
                if fn is None or k in plain:
                    continue
                try:
                    case["fns"][k] = as_graph(fn)
                except Exception as e:  # time the plain call instead, and say so
                    print(f"note: {k} could not be captured in a graph ({e}); timed as a plain "
                          "call", file=sys.stderr)
    samples: list[dict[str, list[float]]] = [{k: [] for k in case["fns"]} for case in cases]
    for _ in range(rounds):
        for case, acc in zip(cases, samples, strict=True):
            for k, fn in case["fns"].items():
                if fn is not None:
                    acc[k].append(median_us(fn))
    medians = [{k: (statistics.median(v) if v else None) for k, v in acc.items()}
               for acc in samples]
    return medians, host


def report(lines: list[str], raw: list[dict[str, Any]], host: dict[str, float],
           markdown: str | None, json_path: str | None) -> None:
    """Prints the table (with the Python-side costs under it) and writes it where asked."""
    lines = [*lines, "", "Python-side cost of one call at the first row (µs of CPU, not in "
             "the GPU times): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    text = "\n".join(lines)
    print("\n" + text)
    if markdown:
        Path(markdown).write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": raw, "host_us": host}, indent=1))


BW_TBS = 3.0  # measured device-to-device copy ceiling of the H100 (bytes read + written)
PEAK_TFLOPS = 727.0  # measured cuBLAS fp16 4096^3 on the H100


def gemm_report(head: str, cases: Sequence[dict[str, Any]],
                medians: Sequence[dict[str, float | None]], impls: Sequence[str],
                config_keys: Sequence[str], host: dict[str, float], markdown: str | None,
                json_path: str | None) -> None:
    """The table of the matmul kernels' benchmarks: each case has "label", "dtype", "bytes",
    "flops", "tuned_cfg", "default_cfg", "rel_err" and optionally "weight_bytes" (then the
    tuned kernel's rate over the weights is shown); "gemm_alone" is the cuBLAS reference."""
    weights = all("weight_bytes" in c for c in cases)
    cols = ["dtype", "shape", "floor µs", *impls, "tuned/gemm",
            *(["weights TB/s"] if weights else []), "tuned config " + "/".join(config_keys)]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    raw = []
    for case, t in zip(cases, medians, strict=True):
        floor = max(case["bytes"] / (BW_TBS * 1e6), case["flops"] / (PEAK_TFLOPS * 1e6))
        tuned, gemm = t.get("tuned"), t.get("gemm_alone")
        cells = ["-" if t.get(k) is None else f"{t[k]:.1f}" for k in impls]
        cells.append(f"{tuned / gemm:.2f}" if tuned and gemm else "-")
        if weights:
            cells.append(f"{case['weight_bytes'] / tuned / 1e6:.2f}" if tuned else "-")
        cells.append("/".join(str(case["tuned_cfg"][k]) for k in config_keys))
        lines.append(f"| {case['dtype']} | {case['label']} | {floor:.1f} | "
                     + " | ".join(cells) + " |")
        raw.append({"dtype": case["dtype"], "shape": case["label"], "us": t, "floor_us": floor,
                    "tuned_config": case["tuned_cfg"], "default_config": case["default_cfg"],
                    "rel_err": case["rel_err"]})
    report(lines, raw, host, markdown, json_path)


def keep_saved_tensors() -> None:
    """torch.compile's backward frees what it saved from the forward ("donated buffers") and
    then refuses retain_graph=True; the training benchmarks rerun one backward, so keep them."""
    try:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    except (ImportError, AttributeError):  # a torch without donated buffers
        pass
