"""The docs' matmul (examples/tuned_matmul) with fusetune's tables beside `@triton.autotune`.

Two parts, on one GPU:
- GPU time per shape, side by side in one process: cuBLAS (torch.matmul), the kernel with the
  config fusetune's tables give (--tables, from `fusetune export`), and Triton's tutorial
  kernel under `@triton.autotune` with the tutorial's 8 configs (timed after its tuning);
  beside them the roofline floor: bytes / the copy bandwidth measured in this run, flops /
  the catalogue's fp16 peak.
- The first call of each shape in a new process (wall clock to the result, compile cache
  warm: each case runs once before): `@triton.autotune` without and with
  TRITON_CACHE_AUTOTUNING=1 (the second process of the pair), and fusetune with the table
  loaded. `--first-call-only` / `--timing-only` run one part.

    PYTHONPATH=examples/tuned_matmul python benchmarks/bench_autotune.py --tables T.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

SHAPES = ((16, 4096, 4096), (4096, 4096, 4096))

# A new process: the first call of each shape, wall clock to the result.
FIRST_CALL = textwrap.dedent('''
    import json, sys, time
    t_start = time.perf_counter()
    import torch
    which, shapes = sys.argv[1], json.loads(sys.argv[2])
    if which == "fusetune":
        import fusetune
        from tuned_matmul import matmul
    else:
        from benchmarks.triton_tutorial_matmul import tutorial_matmul as matmul
    # The process's first Triton launch pays Triton's own start (its launcher and driver
    # modules), whatever the kernel: an unrelated one takes it first, timed apart.
    from benchmarks.triton_tutorial_matmul import first_launch
    t0 = time.perf_counter()
    first_launch()
    torch.cuda.synchronize()
    out = {"first Triton launch": (time.perf_counter() - t0) * 1e3}
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        matmul(a, b)
        torch.cuda.synchronize()
        out[f"{m}x{n}x{k}"] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(out))
''')


def _first_call(which: str, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL, which, json.dumps(SHAPES)], env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_calls(tables: str, cache_dir: str) -> list[str]:
    base = dict(os.environ)
    base.pop("TRITON_CACHE_AUTOTUNING", None)
    cached = {**base, "TRITON_CACHE_AUTOTUNING": "1",
              "TRITON_CACHE_DIR": cache_dir}  # its own cache: the first process fills it
    with_table = {**base, "FUSETUNE_TABLES": tables, "FUSETUNE_NO_TUNE": "1"}
    rows = []
    for label, which, env in (("@triton.autotune", "tutorial", base),
                              ("@triton.autotune, TRITON_CACHE_AUTOTUNING=1", "tutorial",
                               cached),
                              ("fusetune, exported table loaded", "fusetune", with_table)):
        cold = _first_call(which, env)  # fills the compile (and autotuning) cache
        warm = _first_call(which, env)
        rows.append(f"| {label} | " + " | ".join(
            f"{cold[s]:.0f} / {warm[s]:.1f}" for s in cold) + " |")
    head = ("| ms to the result, first process / next process | the process's first Triton "
            "launch (another kernel) | " + " | ".join(
                f"first call of {m}x{n}x{k}" for m, n, k in SHAPES) + " |")
    return [head, "|---|---|" + "---|" * len(SHAPES), *rows]


def timings(rounds: int) -> list[str]:
    import triton
    from triton.testing import do_bench
    from tuned_matmul import matmul, matmul_kernel

    from benchmarks.timing import as_graph, host_us_per_call
    from benchmarks.triton_tutorial_matmul import tutorial_matmul as tutorial
    from fusetune.runtime import gpu_for_device
    gpu = gpu_for_device(torch.device("cuda"))
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = do_bench(lambda: dst.copy_(src), return_mode="median") * 1e3
    bandwidth = 2 * src.numel() / copy_us / 1e6  # TB/s, bytes read + written
    lines = [f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, "
             f"Triton {triton.__version__}; do_bench medians (L2 flushed) of CUDA-graph "
             f"replays, median of {rounds} interleaved rounds; copy bandwidth this run "
             f"{bandwidth:.2f} TB/s, fp16 peak {gpu.peak_fp16_tflops} TFLOP/s", "",
             "| shape (M, N, K) fp16 | floor µs | cuBLAS µs | fusetune µs | "
             "@triton.autotune (8 configs) µs | fusetune / cuBLAS | fusetune config | "
             "CPU µs per call: cuBLAS / fusetune / autotune |",
             "|---|---|---|---|---|---|---|---|"]
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k**0.5
        fns = {"cublas": lambda a=a, b=b: torch.matmul(a, b),
               "fusetune": lambda a=a, b=b: matmul(a, b),
               "tutorial": lambda a=a, b=b: tutorial(a, b)}
        ref = a.float() @ b.float()
        for name, fn in fns.items():
            err = float((fn().float() - ref).norm() / ref.norm())
            if err > 2e-3:
                raise RuntimeError(f"{name} at {m}x{n}x{k}: relative error {err:.2e}")
        host = {name: host_us_per_call(fn) for name, fn in fns.items()}
        graphs = {name: as_graph(fn) for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in graphs.items():
                times[name].append(do_bench(fn, return_mode="median") * 1e3)
        med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
        floor = max((m * k + k * n + m * n) * 2 / (bandwidth * 1e6),
                    2 * m * n * k / (gpu.peak_fp16_tflops * 1e6))
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        config = matmul_kernel.config_for({"a_ptr": a, "b_ptr": b, "c_ptr": c, "M": m, "N": n,
                                           "K": k})
        lines.append(f"| {m}, {n}, {k} | {floor:.1f} | {med['cublas']:.1f} | "
                     f"{med['fusetune']:.1f} | {med['tutorial']:.1f} | "
                     f"{med['fusetune'] / med['cublas']:.2f} | "
                     + " ".join(f"{key}={v}" for key, v in config.items()) + " | "
                     + " / ".join(f"{host[k]:.1f}" for k in ("cublas", "fusetune", "tutorial"))
                     + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", required=True, help="the exported table of tuned_matmul")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--first-call-only", action="store_true")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--cache-dir", default=str(Path.cwd() / ".bench-autotune-cache"),
                    help="Triton cache of the TRITON_CACHE_AUTOTUNING processes")
    ap.add_argument("--markdown", help="write the tables here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    lines: list[str] = []
    if not args.first_call_only:
        import fusetune

        os.environ["FUSETUNE_NO_TUNE"] = "1"
        fusetune.load_tables(args.tables)
        lines += [*timings(args.rounds), ""]
    if not args.timing_only:
        lines += first_calls(args.tables, args.cache_dir)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
