"""Decode (one row) of the matmul kernels against the read-only ceiling of their bytes.

For ffn, qkv, lola and linear at one token row, the kernel launches alone (no Python-side lookup or
allocation, which at these sizes costs more than the GPU work) with the config of the lookup
table, timed with do_bench (L2 flushed) in the same process as a Triton kernel that only reads
the same number of bytes (the fastest of a few shapes) and a device-to-device copy. The kernel
is timed twice: as CUDA-graph replays (the figure compared with the ceiling: no Python in the
timed region; the tuner times graph replays too) and as plain launches, which is higher where
one launch's Python-side cost exceeds do_bench's L2 flush.

    python -m benchmarks.bench_decode [--weights fp8-e4m3]

With --weights fp8-e4m3 (or fp8-e5m2) the weights are FP8 with per-channel scales, the tables'
rows for that format give the config, and the read-only kernel reads the FP8 bytes.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.script_args import add_cases_option, chosen_cases, doc_summary
from benchmarks.timing import as_graph, cuda_gpu, median_us
from fusetune import models
from fusetune.kernels import get_spec
from fusetune.spec import WEIGHT_FORMATS, Config, KernelSpec, Point
from fusetune.tables import lookup
from fusetune.tuner.bench import Evaluator

# (kernel, model preset, dims) by name; DEFAULT_CASES are timed unless --cases names others.
NAMED_CASES: dict[str, tuple[str, str | None, dict[str, int] | None]] = {
    "ffn": ("ffn", "llama-2-7b", None),
    "qkv": ("qkv", "llama-2-7b", None),
    "lola": ("lola", None, {"dim": 4096, "out": 16384}),
    "lola_11008": ("lola", None, {"dim": 4096, "out": 11008}),
    "qkv_half": ("qkv", None, {"dim": 4096, "head_dim": 128, "interleaved": 0, "n_heads": 32,
                               "n_kv_heads": 32}),
    "lola_768": ("lola", None, {"dim": 768, "out": 3072}),
    # Llama-3-8B's down_proj and o_proj with the residual add (what fusetune.patch runs)
    "linear": ("linear", None, {"dim": 14336, "out": 4096, "bias": 0, "residual": 1}),
    "linear_o": ("linear", None, {"dim": 4096, "out": 4096, "bias": 0, "residual": 1}),
}
DEFAULT_CASES = ("ffn", "qkv", "lola", "lola_11008")
# Shapes of the read-only kernel tried for each size: (BLOCK, warps, evict-first loads).
READ_SHAPES = [(b, w, e) for e in (True, False) for b in (1024, 2048, 4096) for w in (4, 8)]


@triton.jit
def _read_kernel(X, OUT, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    # Program p reads elements [p·BLOCK, (p+1)·BLOCK) (the mask covers the buffer's end) with
    # 16-byte vector loads and writes their float32 sum: it reads every byte once and writes
    # almost nothing, as a one-row matmul reads its weights. EVICT: the loads' eviction policy
    # ("evict_first": each byte is read once, as the kernels' weight loads are marked; "": none).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy=EVICT)
    tl.store(OUT + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


def read_us(x: torch.Tensor, block: int, warps: int, evict: bool) -> float:
    """do_bench median µs of the read-only kernel over `x` (its sum checked first)."""
    n = x.numel()
    grid = triton.cdiv(n, block)
    out = torch.empty(grid, device=x.device, dtype=torch.float32)

    def run() -> None:
        _read_kernel[(grid,)](x, out, n, BLOCK=block, EVICT="evict_first" if evict else "",
                              num_warps=warps)

    run()
    torch.cuda.synchronize()
    ref = x.float().sum()
    assert torch.allclose(out.sum(), ref, rtol=1e-3, atol=1e-1), (float(out.sum()), float(ref))
    return median_us(run)


def shipped_case(kernel: str, model: str | None, dims: dict[str, int] | None, dtype: str,
                 weights: str) -> tuple[KernelSpec, dict[str, int], Point, Config, Evaluator]:
    """A named case at one row: its spec, dims, point, the config the lookup gives it (the
    loaded and shipped tables) and an Evaluator with its inputs on the GPU."""
    spec = get_spec(kernel)
    dims = dims or spec.dims_from_model(models.preset(model))
    point = Point.make(kernel, dims, 1, 1, dtype, weights)
    config = spec.canonical(lookup(kernel, dims, dtype, rows=1, weights=weights), point)
    return spec, dims, point, config, Evaluator(spec, point, "cuda", "cuda")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--weights", default="", choices=["", *WEIGHT_FORMATS],
                    help="weight format (default: the activations' dtype)")
    add_cases_option(ap, NAMED_CASES, DEFAULT_CASES)
    args = ap.parse_args(argv)
    names = chosen_cases(ap, args.cases, NAMED_CASES, DEFAULT_CASES)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, triton "
          f"{triton.__version__}; median µs (do_bench, L2 flushed), kernel launches only\n")
    print("| kernel | dims | MB read | kernel µs (graph) | plain launches µs | read-only µs | "
          "kernel / read-only | copy of the bytes µs | kernel TB/s | config |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for kernel, model, dims in (NAMED_CASES[n] for n in names):
        spec, dims, point, config, ev = shipped_case(kernel, model, dims, args.dtype,
                                                     args.weights)
        check = ev.check(config)
        if not check.ok:
            print(f"| {kernel} | {dims} | - | {check.status}: {check.reason} | | | | | | |")
            continue

        def launch(ev: Evaluator = ev, spec: KernelSpec = spec, config: Config = config) -> None:
            spec.launch(ev.inputs, ev.outputs, config)

        plain = median_us(launch)
        t = median_us(as_graph(launch))
        nbytes = spec.cost(point).bytes
        x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
        read = min(read_us(x, *s) for s in READ_SHAPES)
        y = torch.empty_like(x)
        copy = do_bench(lambda x=x, y=y: y.copy_(x), warmup=25, rep=100,
                        return_mode="median") * 1e3
        cfg = "/".join(str(v) for v in config.values())
        print(f"| {kernel} | {dims} | {nbytes / 1e6:.0f} | {t:.1f} | {plain:.1f} | {read:.1f} | "
              f"{t / read:.2f} | {copy:.1f} | {nbytes / t / 1e6:.2f} | {cfg} |", flush=True)
        del ev, x, y
    return 0


if __name__ == "__main__":
    sys.exit(main())
