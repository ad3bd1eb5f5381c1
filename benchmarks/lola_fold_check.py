"""Why some lola configs with the LayerNorm folded into the K loop (PASSES = 1) give wrong
results on the H100 at many rows: a diagnostic, not a kernel of fusetune.

In the stored grids (768 -> 3072, 4096 rows) most PASSES = 1 configs agree with the reference
to a relative error of 2.1e-4, but some tensor-core tiles with num_stages 3-4 give 4e-3 to
1.7e-2, which varies by config (the interpreter is exact for all of them). This script runs
lola's folded K loop, copied here, with variants of how the loop reads the tiles it both sums
(Σx, Σx², Σw) and multiplies:

- `as-is`: the loop of fusetune/kernels/lola.py (sums, then tl.dot of the same tiles);
- `dot-first`: the same, the tl.dot before the sums;
- `reload`: the sums from a second load of each tile (cache modifier .cg, so that it stays
  a separate load), the tl.dot from the first; `reload x`, `reload w`: only that tile's;
- `fusetune`: fusetune.lola itself with the config;

for every config given (BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,num_warps,num_stages), three launches
each, relative errors against the float32 reference.

    python -m benchmarks.lola_fold_check [--rows 4096 --dim 768 --out 3072 --configs ...]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

import fusetune
from benchmarks.script_args import doc_summary
from benchmarks.timing import cuda_gpu, median_us
from fusetune.kernels._matmul import grouped_tile

CONFIGS = [  # wrong in the stored grid (rel err), then right ones of the same shapes
    (64, 128, 64, 1, 4, 3), (64, 128, 64, 1, 4, 4), (64, 128, 64, 8, 8, 4),
    (64, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4),
    (64, 128, 64, 1, 4, 2), (64, 128, 32, 1, 4, 4), (128, 128, 32, 8, 8, 3),
]
VARIANTS = ("as-is", "dot-first", "reload", "reload x", "reload w")


@triton.jit
def tile_pointers(X, W, M, N, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """lola's tensor-core tile set-up: this program's rows and columns, their masks, and the
    pointers of its first x tile [BLOCK_M, BLOCK_K] and weight tile read transposed
    [BLOCK_K, BLOCK_N]."""
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    return rm, rn, rm < M, rn < N, rk, x_ptrs, w_ptrs


@triton.jit
def _folded(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om, eps,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUP_M: tl.constexpr, VARIANT: tl.constexpr):
    rm, rn, m_ok, n_ok, rk, x_ptrs, w_ptrs = tile_pointers(X, W, M, N, stride_xm, stride_wn,
                                                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_x = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_x2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if VARIANT == 1:
            acc = tl.dot(x, w, acc)
        if VARIANT == 2 or VARIANT == 3:
            xs = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        else:
            xs = x.to(tl.float32)
        if VARIANT == 2 or VARIANT == 4:
            ws = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        else:
            ws = w.to(tl.float32)
        sum_x += tl.sum(xs, axis=1)
        sum_x2 += tl.sum(xs * xs, axis=1)
        sum_w += tl.sum(ws, axis=0)
        if VARIANT != 1:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mean = sum_x / K
    rstd = tl.rsqrt(tl.maximum(sum_x2 / K - mean * mean, 0.0) + eps)
    y = rstd[:, None] * (acc - mean[:, None] * sum_w[None, :])
    y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             y.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The lola diagnostics' command line: rows, dim -> out (GPT-2's MLP at 4096 rows)."""
    ap = argparse.ArgumentParser(description=doc_summary(doc))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--out", type=int, default=3072)
    return ap


def parse_on_gpu(ap: argparse.ArgumentParser) -> argparse.Namespace | None:
    """The parsed arguments with torch seeded, or None (said on stderr) without a CUDA GPU."""
    args = ap.parse_args()
    if cuda_gpu() is None:
        return None
    torch.manual_seed(0)
    return args


def main() -> int:
    ap = shape_parser(__doc__)
    ap.add_argument("--configs", default="",
                    help="BM,BN,BK,GM,warps,stages;... (default: the stored grid's cases)")
    args = parse_on_gpu(ap)
    if args is None:
        return 2
    m, k, n = args.rows, args.dim, args.out
    # lola's own search inputs: rows with an offset and a scale each.
    x = (torch.randn(m, k, device="cuda") * (1 + torch.rand(m, 1, device="cuda"))
         + 0.5 * torch.randn(m, 1, device="cuda")).half()
    w = (torch.randn(n, k, device="cuda") / k**0.5).half()
    b = (0.1 * torch.randn(n, device="cuda")).half()
    ref = torch.nn.functional.gelu(
        torch.nn.functional.layer_norm(x.float(), (k,), eps=1e-5) @ w.float().T + b.float())
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; lola {k} -> {n} at {m} rows, fp16; relative error of three "
          "launches each (tolerance 5e-3), median µs")
    print("| config BM,BN,BK,GM,warps,stages | " + " | ".join(VARIANTS) + " | fusetune.lola |")
    print("|---|" + "---|" * (len(VARIANTS) + 1))

    def err() -> str:
        torch.cuda.synchronize()
        return f"{float((out.float() - ref).norm() / ref.norm()):.1e}"

    configs = ([tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
               if args.configs else CONFIGS)
    for bm, bn, bk, gm, nw, st in configs:
        cells = []
        for v in range(len(VARIANTS)):
            def run(v: int = v, c: tuple[int, ...] = (bm, bn, bk, gm, nw, st)) -> None:
                grid = (triton.cdiv(m, c[0]) * triton.cdiv(n, c[1]),)
                _folded[grid](x, w, b, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                              1e-5, BLOCK_M=c[0], BLOCK_N=c[1], BLOCK_K=c[2], GROUP_M=c[3],
                              VARIANT=v, num_warps=c[4], num_stages=c[5])
            errs = []
            for _ in range(3):
                out.zero_()
                run()
                errs.append(err())
            cells.append(f"{'/'.join(errs)} ({median_us(run):.1f})")
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "PASSES": 1,
               "SPLIT_K": 1, "ACT_FP8": 0, "UNROLL_K": 0, "TMA": 0, "num_warps": nw,
               "num_stages": st}
        errs = []
        for _ in range(3):
            out.copy_(fusetune.lola(x, w, b, config=cfg))
            errs.append(err())
        cells.append("/".join(errs))
        print(f"| {bm},{bn},{bk},{gm},{nw},{st} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
