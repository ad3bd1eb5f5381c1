"""What made fusetune's RMSNorm look 8-10% slower than Liger's and a copy at 67 MB in some runs.

A diagnostic. At 4096 x 4096, bench_rmsnorm timed the copy at about 25 µs and Liger's kernel
at 26, fusetune's at 28 as in every other process (where the copy and Liger's kernel took 28
too). The answer (BENCHMARKS.md, 2026-11-25): whatever is timed right after the compiled
RMSNorm on the same tensors reads part of x from the L2 (Inductor loads it with evict-last
priority, which outlasts do_bench's flush); `--compile-at` shows it. The other variants rule
out the kernel's code and the way it is called (with bfloat16 the tuned config is Liger's own
launch: one row per program, a 4096-wide block, 8 warps). This script times, in one process
and the same interleaved rounds as bench_rmsnorm (CUDA-graph replays, do_bench medians with
the L2 flushed), beside bench_rmsnorm's own implementations:

- `liger_direct`: Liger's kernel launched on preallocated outputs (no allocation in the call);
- `one_d`: a kernel written like Liger's (a 1-D block, the row offset from the program id in
  int64) with fusetune's arithmetic (float32 to the store), no rstd store;
- `one_d_rstd`: the same, storing each row's rstd as Liger's does;
- `one_d_cast`: the same with Liger's casts (the normalized row rounded to x's dtype, then
  multiplied by the weight in that dtype), no rstd store;
- `one_d_w4`: `one_d` with 4 warps; `one_d_rows2`: two rows a program, one after the other,
  each as `one_d` does it, 4 warps (the tuned float16 config's shape);
- `tuned_direct`: fusetune's kernel with the tuned config, launched on a preallocated output
  (no allocation, no lookup in the call); `tuned_alloc`: the same launch on an output
  allocated in the call (`torch.empty_like(x)`, as `fusetune.rmsnorm` does).

`--without-compile` leaves bench_rmsnorm's torch.compile case out of the rounds (the state
in which the copy and Liger take 28 µs). The compiled case is timed where bench_rmsnorm
times it (after every other implementation of a case, benchmarks.timing.TIMED_LAST), or with
`--compile-at N` at place N of each case's order (0: first; 3: where bench_rmsnorm timed it
before, after tuned, default and eager).

    python -m benchmarks.rmsnorm_liger_gap [--without-compile | --compile-at N] [--rounds 3]
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
from fusetune.kernels.rmsnorm import _launch_2d

M = D = 4096


@triton.jit
def _one_d_kernel(X, W, Y, RSTD, M, stride, D, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                  STORE_RSTD: tl.constexpr, CAST: tl.constexpr):
    # ROWS rows per program, one after the other; a row's start from the program id in int64
    # (as Liger does).
    cols = tl.arange(0, BLOCK)
    ok = cols < D  # BLOCK is a power of two >= D
    w = tl.load(W + cols, mask=ok, other=0.0)
    for r in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        row_ok = ok & (cols * 0 + row < M)  # (a vector: the interpreter masks by vectors)
        x = tl.load(X + row * stride + cols, mask=row_ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        if STORE_RSTD:
            tl.store(RSTD + row, rstd, mask=row < M)
        # CAST: Liger's "llama" casting, the normalized row rounded to x's dtype, then × w.
        if CAST:  # noqa: SIM108  (a Triton constexpr branch)
            y = (xf * rstd).to(x.dtype) * w
        else:
            y = xf * rstd * w.to(tl.float32)
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=row_ok)


def one_d(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor,
          store_rstd: bool = False, cast: bool = False, rows: int = 1, warps: int = 8
          ) -> Callable[[], object]:
    def launch() -> None:
        _one_d_kernel[(triton.cdiv(x.shape[0], rows),)](
            x, w, y, rstd, x.shape[0], x.stride(0), x.shape[1], 1e-6,
            BLOCK=triton.next_power_of_2(x.shape[1]), ROWS=rows, STORE_RSTD=store_rstd,
            CAST=cast, num_warps=warps)
    return launch


def liger_direct(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor
                 ) -> Callable[[], object] | None:
    try:
        from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel
        from liger_kernel.ops.utils import calculate_settings
    except Exception:
        return None
    block, warps = calculate_settings(x.shape[1])

    def launch() -> None:
        _rms_norm_forward_kernel[(x.shape[0],)](
            y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd, rstd.stride(0), x.shape[1],
            1e-6, 0.0, 0, elementwise_affine=True, BLOCK_SIZE=block, num_warps=warps)
    return launch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc_summary(__doc__))
    ap.add_argument("--without-compile", action="store_true",
                    help="leave bench_rmsnorm's torch.compile case out of the rounds")
    ap.add_argument("--compile-at", type=int,
                    help="time the compiled case at this place of each case's order")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    gpu = cuda_gpu()
    if gpu is None:
        return 2
    liger = bench_rmsnorm.liger_rmsnorm()
    compiled = torch.compile(bench_rmsnorm.eager_rmsnorm)
    cases = [bench_rmsnorm.make_case(M, D, dt, gpu, compiled, liger)
             for dt in ("float16", "bfloat16")]
    extra = ("liger_direct", "tuned_direct", "tuned_alloc", "one_d", "one_d_rstd", "one_d_cast",
             "one_d_w4", "one_d_rows2")
    for case in cases:
        x, w, cfg = case["x"], case["w"], case["tuned_cfg"]
        y, rstd = torch.empty_like(x), torch.empty(M, device="cuda", dtype=torch.float32)
        case["fns"].update(liger_direct=liger_direct(x, w, y, rstd),
                           tuned_direct=lambda x=x, w=w, y=y, cfg=cfg: _launch_2d(x, w, y, 1e-6,
                                                                                  cfg),
                           tuned_alloc=lambda x=x, w=w, cfg=cfg: _launch_2d(
                               x, w, torch.empty_like(x), 1e-6, cfg),
                           one_d=one_d(x, w, y, rstd),
                           one_d_rstd=one_d(x, w, y, rstd, store_rstd=True),
                           one_d_cast=one_d(x, w, y, rstd, cast=True),
                           one_d_w4=one_d(x, w, y, rstd, warps=4),
                           one_d_rows2=one_d(x, w, y, rstd, rows=2, warps=4))
        ref = bench_rmsnorm.eager_rmsnorm(x.float(), w.float())
        for k in extra[3:]:
            case["fns"][k]()
            err = float((y.float() - ref).norm() / ref.norm())
            assert err < 1e-2, f"{k} wrong: rel err {err}"
    impls = [k for k in bench_rmsnorm.IMPLS if k != "compile"] + list(extra)
    if not args.without_compile:
        impls.insert(len(impls) if args.compile_at is None else args.compile_at, "compile")
    for case in cases:  # the timing order: that of impls
        case["fns"] = {k: case["fns"][k] for k in impls}
    medians, _ = time_cases(cases, impls, args.rounds, last=())
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; {M} x {D}, µs of CUDA-graph replays (copy: plain calls), "
          f"do_bench medians, median of {args.rounds} interleaved rounds, in this order; "
          f"torch.compile case {'left out' if args.without_compile else 'in the rounds'}\n")
    print("| dtype | " + " | ".join(impls) + " |")
    print("|---|" + "---:|" * len(impls))
    for case, t in zip(cases, medians, strict=True):
        cells = [f"{t[k]:.1f}" if t.get(k) is not None else "-" for k in impls]
        print(f"| {case['dtype']} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
