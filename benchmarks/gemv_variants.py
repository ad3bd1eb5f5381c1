"""How the one-row GEMV loop should read its weights: a diagnostic, not a kernel of fusetune.

One weight matrix of the Llama-2-7B ffn's size ([W1; W3], 22016 x 4096) times one fp16 row, in
float32, with the loop of fusetune's GEMV structure (weight tiles [BLOCK_K, BLOCK_N] straight
to registers, evict-first) and variants of it:

- `x1d`: the row loaded as a [BLOCK_K] vector (fusetune's loop);
- `U1`, `U2`, `U4`: the row through a broadcast pointer tile, 1, 2 or 4 K-steps per iteration
  (unrolled: their loads in flight together; fusetune's UNROLL_K = 1 is U2);
- `P`: register double-buffering (the next K-step's weights loaded before this one's
  products);
- `T`: the weight tiles through a TMA descriptor, num_stages buffers in shared memory filled
  by the copy engine ahead of the products;

each for fp16 weights, e4m3 and e5m2 (through Triton's conversion: on sm_90 the hardware's,
two bytes an instruction), over BLOCK_N x BLOCK_K x num_warps; the best four per variant, beside
the read-only kernel of the same bytes (benchmarks/bench_read_bw.py).

    python -m benchmarks.gemv_variants [VARIANT ...]   # e.g. T x1d (default: all)
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.bench_read_bw import read_us
from benchmarks.timing import cuda_gpu
from fusetune.kernels._matmul import mma_weight

N, K = 22016, 4096


@triton.jit
def _weight_tile(W, N, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output rows rn (BLOCK_N of them; w_ok: which exist), the K offsets rk of
    one step and the pointers of its first [BLOCK_K, BLOCK_N] weight tile: W[n, k] read
    transposed, k contiguous (16-byte vector loads)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    return rn, rn < N, rk, W + (rn[None, :].to(tl.int64) * stride_wn + rk[:, None])


@triton.jit
def _gemv_x1d(X, W, OUT, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              W_FP8: tl.constexpr):
    # Program p: output rows [p·BLOCK_N, (p+1)·BLOCK_N) from [BLOCK_K, BLOCK_N] weight tiles;
    # the row x as a [BLOCK_K] vector broadcast over the tile's columns.
    rn, w_ok, rk, w_ptrs = _weight_tile(W, N, stride_wn, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0  # masked lanes of a partial last step read 0
        x = tl.load(X + k0 + rk, mask=k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += mma_weight(w, x, W_FP8).to(tl.float32) * x.to(tl.float32)[:, None]
        w_ptrs += BLOCK_K
    tl.store(OUT + rn, tl.sum(acc, axis=0), mask=w_ok)


@triton.jit
def _gemv_unrolled(X, W, OUT, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   W_FP8: tl.constexpr, U: tl.constexpr):
    # As _gemv_x1d, with x loaded through a [BLOCK_K, BLOCK_N] pointer tile that repeats each
    # row address over the columns (the load then has the weight tile's layout: no exchange
    # through shared memory), and U K-steps per iteration, unrolled.
    rn, w_ok, rk, w_ptrs = _weight_tile(W, N, stride_wn, BLOCK_N, BLOCK_K)
    x_ptrs = tl.broadcast_to((X + rk)[:, None], (BLOCK_K, BLOCK_N))
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * U):
        for u in tl.static_range(U):
            k_ok = rk < K - k0 - u * BLOCK_K  # an unrolled step past K reads nothing
            x = tl.load(x_ptrs + u * BLOCK_K, mask=k_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + u * BLOCK_K, mask=k_ok[:, None] & w_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += mma_weight(w, x, W_FP8).to(tl.float32) * x.to(tl.float32)
        w_ptrs += BLOCK_K * U
        x_ptrs += BLOCK_K * U
    tl.store(OUT + rn, tl.sum(acc, axis=0), mask=w_ok)


@triton.jit
def _gemv_prefetch(X, W, OUT, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   W_FP8: tl.constexpr):
    # As _gemv_unrolled with U = 1, the next K-step's weight tile loaded before this one's
    # products (carried in registers from one iteration to the next).
    rn, w_ok, rk, w_ptrs = _weight_tile(W, N, stride_wn, BLOCK_N, BLOCK_K)
    x_ptrs = tl.broadcast_to((X + rk)[:, None], (BLOCK_K, BLOCK_N))
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    w = tl.load(w_ptrs, mask=(rk < K)[:, None] & w_ok[None, :], other=0.0,
                eviction_policy="evict_first")
    for k0 in range(0, K, BLOCK_K):
        nxt = rk < K - k0 - BLOCK_K
        w_next = tl.load(w_ptrs + BLOCK_K, mask=nxt[:, None] & w_ok[None, :], other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=(rk < K - k0)[:, None], other=0.0)
        acc += mma_weight(w, x, W_FP8).to(tl.float32) * x.to(tl.float32)
        w = w_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tl.store(OUT + rn, tl.sum(acc, axis=0), mask=w_ok)


@triton.jit
def _gemv_tma(X, WD, OUT, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              W_FP8: tl.constexpr):
    # Weight tiles [BLOCK_N, BLOCK_K] through a TMA descriptor WD over W [N, K]: the copy
    # engine fills num_stages shared-memory buffers ahead of the products (boxes past W's
    # edges arrive zero-filled), the tile then goes from shared memory to registers.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + rk, mask=rk < K - k0, other=0.0)
        w = WD.load([tl.program_id(0) * BLOCK_N, k0])
        acc += mma_weight(w, x, W_FP8).to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(OUT + rn, tl.sum(acc, axis=1), mask=rn < N)


def best_tma_configs(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor
                     ) -> list[tuple[float, str]]:
    """best_configs for _gemv_tma: BLOCK_N x BLOCK_K boxes (at most 256 per side) x num_warps
    x num_stages, as 'BLOCK_N,BLOCK_K,num_warps,num_stages'."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty(N, device="cuda", dtype=torch.float32)
    res: list[tuple[float, str]] = []
    for bn, bk, nw, st in itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4)):
        if not 4 <= bk * bn // (32 * nw) <= 64:
            continue
        wd = TensorDescriptor.from_tensor(w, [bn, bk])

        def run(bn: int = bn, bk: int = bk, nw: int = nw, st: int = st,
                wd: TensorDescriptor = wd) -> None:
            _gemv_tma[(triton.cdiv(N, bn),)](x, wd, out, N, K, BLOCK_N=bn, BLOCK_K=bk,
                                             W_FP8=0 if w.dtype == torch.float16 else 1,
                                             num_warps=nw, num_stages=st)

        name = f"{bn},{bk},{nw},{st}"
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a config the GPU cannot hold: reported, not timed
            res.append((float("inf"), f"{name} {type(exc).__name__}"))
            continue
        res.append(checked_time(run, out, ref, name))
    return sorted(res)


def checked_time(run: Callable[[], None], out: torch.Tensor, ref: torch.Tensor, name: str
                 ) -> tuple[float, str]:
    """(median µs, name) of `run`, which has been launched once to write `out`; (inf, 'name
    WRONG') where `out` is not `ref`."""
    torch.cuda.synchronize()
    err = float((out - ref).norm() / ref.norm())
    if err > 1e-3:
        return float("inf"), f"{name} WRONG ({err:.1e})"
    return do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3, name


VARIANTS = {
    "x1d": (_gemv_x1d, {}),
    "U1": (_gemv_unrolled, {"U": 1}),
    "U2": (_gemv_unrolled, {"U": 2}),
    "U4": (_gemv_unrolled, {"U": 4}),
    "P": (_gemv_prefetch, {}),
}


def best_configs(kernel: triton.JITFunction, extra: dict[str, int], x: torch.Tensor,
                 w: torch.Tensor, ref: torch.Tensor) -> list[tuple[float, str]]:
    """(µs, 'BLOCK_N,BLOCK_K,num_warps') of every config that fits in registers, best first;
    a config whose result is wrong is reported as such."""
    out = torch.empty(N, device="cuda", dtype=torch.float32)
    bks = (256, 512, 1024) if w.dtype == torch.float16 else (512, 1024, 2048)
    res: list[tuple[float, str]] = []
    for bn, bk, nw in itertools.product((4, 8, 16), bks, (2, 4, 8)):
        if not 4 <= bk * bn // (32 * nw) <= 64:  # float32 accumulators per thread
            continue

        def run(bn: int = bn, bk: int = bk, nw: int = nw) -> None:
            kernel[(triton.cdiv(N, bn),)](x, w, out, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                          W_FP8=0 if w.dtype == torch.float16 else 1,
                                          num_warps=nw, num_stages=1, **extra)

        run()
        res.append(checked_time(run, out, ref, f"{bn},{bk},{nw}"))
    return sorted(res)


def main() -> int:
    if cuda_gpu() is None:
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; W [{N}, {K}] times one fp16 row; median µs (do_bench, L2 "
          "flushed); best configs as BLOCK_N,BLOCK_K,num_warps")
    torch.manual_seed(0)
    x = torch.randn(K, device="cuda", dtype=torch.float16)
    w16 = (torch.randn(N, K, device="cuda") * 0.02).to(torch.float16)
    weights = {"fp16": w16, "e4m3": (w16.float() * 20).to(torch.float8_e4m3fn),
               "e5m2": (w16.float() * 20).to(torch.float8_e5m2)}
    for mb, buf in ((N * K * 2 // 10**6, w16), (N * K // 10**6, weights["e4m3"])):
        best = min(read_us(buf.view(torch.uint8).view(-1), b, s, nw, evict=True)
                   for b, s, nw in itertools.product((2048, 4096), (4, 8), (4, 8)))
        print(f"read-only kernel, {mb} MB: {best:.1f} µs")
    t0 = time.time()
    only = sys.argv[1:]  # variant names to run (default: all), "T" for _gemv_tma
    for wname, w in weights.items():
        if "T" in only or not only:
            top = best_tma_configs(x, w, w.float() @ x.float())[:4]
            print(f"{wname} T    " + "  ".join(f"{t:.1f} ({c})" for t, c in top)
                  + f"  [{time.time() - t0:.0f} s]", flush=True)
    for (wname, w), (vname, (kernel, extra)) in itertools.product(weights.items(),
                                                                  VARIANTS.items()):
        if only and vname not in only:
            continue
        ref = w.float() @ x.float()
        top = best_configs(kernel, extra, x, w, ref)[:4]
        print(f"{wname} {vname:4s} " + "  ".join(f"{t:.1f} ({c})" for t, c in top)
              + f"  [{time.time() - t0:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
