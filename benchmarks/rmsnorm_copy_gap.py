"""RMSNorm beside a copy at 4096 x 4096 (67 MB moved): the kernel, or where the bytes lie?

A diagnostic, not part of fusetune. In bench_rmsnorm's own setting (its `make_case`, plain
calls, interleaved rounds of do_bench with the L2 flushed) it times, beside the tuned call and
the copy `y.copy_(x)`:

- the kernel with the tuned config writing into the copy's own output, and into another buffer;
- a copy into a freshly allocated output (`x.clone()`), as the tuned call allocates its own;
- a one-row-per-program variant of the kernel with each combination of a load eviction hint
  (none, evict_first) and a store cache modifier (none, .cs, .wt, .cg);
- persistent variants: 1-8 programs per SM walking the rows, the next row's load pipelined
  (2 stages) or not.

    python -m benchmarks.rmsnorm_copy_gap [--rows 4096] [--rounds 3] [--graph] [--liger]
    python -m benchmarks.rmsnorm_copy_gap --placement [--rows 4096]

--placement instead sweeps where the output lies: for outputs at 0-64 MB (2 MB steps, and a
few offsets off the 2 MB grid) into one large buffer, the copy `y.copy_(x)` and the kernel
(tuned config) writing into that very `y`, side by side (graph replays, both), to tell whether
the copy's speed in a given process comes from where its output lies.

With several --rows (e.g. 1,4096,16384, as bench_rmsnorm allocates them) every case is timed,
with --graph the kernels as CUDA-graph replays (the copy stays a plain call, as in
bench_rmsnorm), with --liger Liger Kernel's RMSNorm beside them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from benchmarks import bench_rmsnorm
from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu, time_cases
from fusetune.gpus import GpuSpec
from fusetune.kernels.rmsnorm import _launch_2d


@triton.jit
def _hinted_rmsnorm(X, W, Y, D, stride_xm, stride_ym, eps, BLOCK_D: tl.constexpr,
                    LOAD: tl.constexpr, STORE: tl.constexpr):
    # One row per program (BLOCK_D >= D, masked tail); x read with eviction policy LOAD, y
    # written with cache modifier STORE ("" for none); float32 math as in fusetune's kernel.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(X + row * stride_xm + cols, mask=ok, other=0.0,
                eviction_policy=LOAD).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(Y + row * stride_ym + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok,
             cache_modifier=STORE)


@triton.jit
def _persistent_rmsnorm(X, W, Y, M, D, stride_xm, stride_ym, eps, BLOCK_D: tl.constexpr,
                        PROGS: tl.constexpr, STAGES: tl.constexpr):
    # PROGS programs walk the rows p, p + PROGS, ... (BLOCK_D >= D); the weight is read once
    # per program; STAGES > 1 lets the compiler load the next row while this one is reduced.
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    first = tl.program_id(0).to(tl.int64)
    for i in tl.range(0, tl.cdiv(M - first, PROGS), num_stages=STAGES):
        r = first + i * PROGS
        x = tl.load(X + r * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(Y + r * stride_ym + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok)


def add_variants(case: dict[str, object]) -> None:
    """Adds the diagnostic's callables to a bench_rmsnorm case (same x, w and copy output)."""
    fns: dict[str, Callable[[], object] | None] = case["fns"]  # type: ignore[assignment]
    x, w, y = case["x"], case["w"], case["y"]  # type: ignore[misc]
    m, d = x.shape
    cfg = case["tuned_cfg"]
    other = torch.empty_like(x)
    fns["kernel into the copy's y"] = lambda: _launch_2d(x, w, y, 1e-6, cfg)
    fns["kernel into another buffer"] = lambda: _launch_2d(x, w, other, 1e-6, cfg)
    fns["copy into a new tensor"] = lambda: x.clone()
    block_d = triton.next_power_of_2(d)
    for load in ("", "evict_first"):
        for store in ("", ".cs", ".wt", ".cg"):
            def run(load: str = load, store: str = store) -> None:
                _hinted_rmsnorm[(m,)](x, w, other, d, x.stride(0), other.stride(0), 1e-6,
                                      BLOCK_D=block_d, LOAD=load, STORE=store, num_warps=8)
            fns[f"one row, load {load or '-'}, store {store or '-'}"] = run
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for per_sm, warps, stages in ((1, 8, 1), (2, 8, 1), (4, 8, 1), (8, 4, 1), (2, 8, 2),
                                  (4, 8, 2), (8, 4, 2)):
        def persistent(p: int = min(m, per_sm * sms), nw: int = warps, st: int = stages
                       ) -> None:
            _persistent_rmsnorm[(p,)](x, w, other, m, d, x.stride(0), other.stride(0), 1e-6,
                                      BLOCK_D=block_d, PROGS=p, STAGES=st, num_warps=nw)
        fns[f"persistent, {per_sm}/SM, {warps} warps, {stages} stages"] = persistent


def placement_sweep(rows: int, dim: int, gpu: GpuSpec, rounds: int) -> None:
    """The copy and the tuned kernel writing into the same output, for outputs at many offsets
    of one buffer (x fixed), each timed as a graph replay; a table per dtype."""
    from benchmarks.timing import as_graph, interleaved_medians

    offsets = [i * 2**21 for i in range(33)] + [2**16, 2**20 + 2**16, 3 * 2**19]
    for dtype in ("float16", "bfloat16"):
        case = bench_rmsnorm.make_case(rows, dim, dtype, gpu, lambda x, w: None, None)
        x, w, cfg = case["x"], case["w"], case["tuned_cfg"]  # type: ignore[misc]
        n = x.numel()
        buf = torch.empty(n + offsets[-4] // x.element_size() + 2**22, dtype=x.dtype,
                          device=x.device)
        print(f"\n{dtype} {rows} x {dim}: x at 0x{x.data_ptr():x}, buffer at "
              f"0x{buf.data_ptr():x}\n")
        print("| output offset in the buffer (bytes) | copy µs | kernel µs | kernel / copy |")
        print("|---:|---:|---:|---:|")
        ratios, copies, kernels = [], [], []
        for off in offsets:
            y = buf[off // x.element_size():][:n].view(rows, dim)
            t = interleaved_medians({
                "copy": as_graph(lambda y=y, x=x: y.copy_(x)),
                "kernel": as_graph(lambda y=y, x=x, w=w, cfg=cfg: _launch_2d(x, w, y, 1e-6, cfg)),
            }, rounds)
            c, k = t["copy"], t["kernel"]
            copies.append(c)
            kernels.append(k)
            ratios.append(k / c)
            print(f"| {off} | {c:.1f} | {k:.1f} | {k / c:.2f} |", flush=True)
        print(f"\ncopy {min(copies):.1f}-{max(copies):.1f} µs, kernel {min(kernels):.1f}-"
              f"{max(kernels):.1f} µs, kernel / copy {min(ratios):.2f}-{max(ratios):.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--rows", default="4096", help="row counts, comma-separated")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true", help="kernels as CUDA-graph replays")
    ap.add_argument("--liger", action="store_true", help="Liger Kernel's RMSNorm too")
    ap.add_argument("--placement", action="store_true",
                    help="sweep the output's place instead (copy and kernel into the same y)")
    args = ap.parse_args(argv)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    if args.placement:
        print(f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, "
              f"Triton {triton.__version__}; median µs of do_bench (L2 flushed), CUDA-graph "
              f"replays, median of {args.rounds} interleaved rounds")
        for rows in (int(r) for r in args.rows.split(",")):
            placement_sweep(rows, args.dim, gpu, args.rounds)
        return 0
    print(f"GPU {torch.cuda.get_device_name()} ({gpu.name}), torch {torch.__version__}, Triton "
          f"{triton.__version__}; median µs of do_bench (L2 flushed), "
          f"{'CUDA-graph replays (the copy: plain calls)' if args.graph else 'plain calls'}, "
          f"median of {args.rounds} interleaved rounds")
    liger = bench_rmsnorm.liger_rmsnorm() if args.liger else None
    cases = []
    for dtype in ("float16", "bfloat16"):
        for rows in (int(r) for r in args.rows.split(",")):
            case = bench_rmsnorm.make_case(rows, args.dim, dtype, gpu, lambda x, w: None,
                                           liger)
            add_variants(case)
            cases.append(case)
    skip = ("eager", "compile") + (() if liger else ("liger",))
    impls = [k for k in cases[0]["fns"] if k not in skip]
    medians, _ = time_cases(cases, impls, rounds=args.rounds, graphs=args.graph)
    for case, t in zip(cases, medians, strict=True):
        copy = t["copy"]
        print(f"\n{case['dtype']} {case['m']} x {args.dim} ({case['copy_bytes'] / 1e6:.0f} MB "
              f"read + written): copy {copy:.1f} µs\n")
        print("| implementation | µs | bandwidth / copy's |\n|---|---:|---:|")
        for k, v in t.items():
            if v is not None:
                print(f"| {k} | {v:.1f} | {100 * copy / v:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
