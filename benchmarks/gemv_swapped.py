"""Decode (one row) with the weight as the tensor cores' first operand: a diagnostic, not a
kernel of fusetune.

fusetune's decode structures put the activation rows on the MMA's M side (BLOCK_M >= 16: the
row padded to 16, mma.sync from registers) or use no tensor cores (BLOCK_M = 1: the weight
tile converted and multiplied in registers). Here the product is computed transposed,
outᵀ = W · xᵀ: weight tiles [BLOCK_W, BLOCK_K] come through a TMA descriptor into shared
memory (num_stages buffers) and go from there to warpgroup MMAs (wgmma: M = BLOCK_W >= 64) as
the first operand, the row as the second ([BLOCK_K, 16]: TMA zero-fills the 15 rows past x).
No weight byte passes through registers; FP8 weights meet an FP8 row (e4m3). K is split over
SPLIT_K programs per tile, added with float32 atomics into a zeroed output.

The bare product (no norm, no epilogue) for the weight bytes of Llama-2-7B's ffn ([W1; W3]
22016 x 4096) and qkv (12288 x 4096), fp16 and e4m3, beside fusetune's shipped fused kernel
for that point and the read-only kernel of the same bytes. GPU µs: medians of do_bench (L2
flushed) over CUDA-graph replays (the zeroing of the output included).

    python -m benchmarks.gemv_swapped [ffn qkv] [--fp16-only]
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import fusetune
from benchmarks.bench_read_bw import read_us
from benchmarks.timing import as_graph, cuda_gpu, median_us

DIM = 4096
ROWS = {"ffn": 22016, "qkv": 12288}
XN = 16  # the row, padded to the MMA's smallest N


@triton.jit
def _swapped_gemv(XD, WD, OUT, N, K, M, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, XN_: tl.constexpr):
    # Program (p, s): weight rows [p·BLOCK_W, (p+1)·BLOCK_W), K-slice s of SPLIT_K.
    n0 = tl.program_id(0) * BLOCK_W
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_len
    k_end = tl.minimum(k_begin + k_len, K)
    acc = tl.zeros([BLOCK_W, XN_], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Boxes past W's or x's edges arrive zero-filled: no masks.
        acc = tl.dot(WD.load([n0, k0]), XD.load([0, k0]).T, acc)
    rn = n0 + tl.arange(0, BLOCK_W)
    cols = tl.arange(0, XN_)
    ptrs = OUT + cols[None, :] * N + rn[:, None]  # out [M, N], row-major: column c is row c
    mask = (rn[:, None] < N) & (cols[None, :] < M)
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def shipped_us(kind: str, fp8: bool) -> float:
    """fusetune's shipped fused kernel at this point (lookup table config), graph replays."""
    torch.manual_seed(0)
    x = torch.randn(1, DIM, device="cuda", dtype=torch.float16)
    g = torch.ones(DIM, device="cuda", dtype=torch.float16)
    n = ROWS[kind] // (2 if kind == "ffn" else 3)
    ws = [(torch.randn(n, DIM, device="cuda") * 0.02).to(torch.float16)
          for _ in range(2 if kind == "ffn" else 3)]
    kw: dict[str, torch.Tensor] = {}
    if fp8:
        pairs = [fusetune.quantize_fp8(w, fmt="e4m3") for w in ws]
        ws = [p[0] for p in pairs]
        names = ("w1", "w3") if kind == "ffn" else ("wq", "wk", "wv")
        kw = {f"{nm}_scale": p[1] for nm, p in zip(names, pairs, strict=True)}
    if kind == "ffn":
        fn = lambda: fusetune.ffn(x, g, *ws, **kw)
    else:
        x3 = x.view(1, 1, DIM)
        fn = lambda: fusetune.qkv(x3, g, *ws, **kw)
    return median_us(as_graph(fn))


def sweep(kind: str, fmt: str, t0: float) -> None:
    """Times shipped, read-only and every swapped config for (kind, fmt); prints the best."""
    n = ROWS[kind]
    torch.manual_seed(0)
    x16 = torch.randn(1, DIM, device="cuda", dtype=torch.float16)
    w16 = (torch.randn(n, DIM, device="cuda") * 0.02).to(torch.float16)
    if fmt == "e4m3":
        w = (w16.float() * 20).to(torch.float8_e4m3fn)
        x = x16.to(torch.float8_e4m3fn)
    else:
        w, x = w16, x16
    ref = (x.float() @ w.float().T).view(-1)
    del w16
    elt = w.element_size()
    read = min(read_us(w.view(torch.float16).view(-1), blk, 1, nw, evict=ev)
               for blk, nw, ev in itertools.product((1024, 2048), (4, 8), (True, False)))
    ship = shipped_us(kind, fmt == "e4m3")
    out = torch.zeros(n, device="cuda", dtype=torch.float32)
    res: list[tuple[float, str]] = []
    bks = (64, 128, 256) if elt == 2 else (128, 256)
    for bw, bk, sk, nw, st in itertools.product((64, 128), bks, (1, 2, 4), (4, 8),
                                                (3, 4, 6, 8)):
        smem = st * (bw + XN) * bk * elt
        if smem > 200 * 1024 or (nw == 8 and bw == 64):
            continue
        wd = TensorDescriptor.from_tensor(w, [bw, bk])
        xd = TensorDescriptor.from_tensor(x, [XN, bk])
        grid = (math.ceil(n / bw), sk)

        def run(bw: int = bw, bk: int = bk, sk: int = sk, nw: int = nw, st: int = st,
                wd: TensorDescriptor = wd, xd: TensorDescriptor = xd,
                grid: tuple[int, int] = grid) -> None:
            if sk > 1:
                out.zero_()
            _swapped_gemv[grid](xd, wd, out, n, DIM, 1, BLOCK_W=bw, BLOCK_K=bk,
                                SPLIT_K=sk, XN_=XN, num_warps=nw, num_stages=st)

        name = f"{bw},{bk},{sk},{nw},{st}"
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a config the GPU cannot hold: reported, not timed
            res.append((float("inf"), f"{name} {type(exc).__name__}"))
            continue
        err = float((out - ref).norm() / ref.norm())
        if err > 2e-2:
            res.append((float("inf"), f"{name} WRONG {err:.1e}"))
            continue
        res.append((median_us(as_graph(run)), name))
    res.sort()
    nbytes = w.numel() * elt
    print(f"\n{kind} {fmt}: {nbytes / 1e6:.0f} MB of weights; floor {nbytes / 3.0e6:.1f} µs; "
          f"read-only {read:.1f}; shipped fused fusetune {ship:.1f}; swapped bare product "
          f"best {res[0][0]:.1f} ({res[0][1]})  [{time.time() - t0:.0f} s, {len(res)} "
          "configs]")
    for t, name in res[:10]:
        print(f"  {t:7.1f}  {name}")
    bad = [name for t, name in res if math.isinf(t)]
    if bad:
        print(f"  not timed: {len(bad)} ({', '.join(bad[:4])} ...)")
    sys.stdout.flush()


def main() -> int:
    if cuda_gpu() is None:
        return 2
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kinds = args or list(ROWS)
    fmts = ("fp16",) if "--fp16-only" in sys.argv else ("fp16", "e4m3")
    # Device-side allocations of the runtime (none expected; required by some TMA paths).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, Triton "
          f"{triton.__version__}; median µs of CUDA-graph replays (do_bench, L2 flushed); "
          "configs as BLOCK_W,BLOCK_K,SPLIT_K,num_warps,num_stages", flush=True)
    t0 = time.time()
    for kind, fmt in itertools.product(kinds, fmts):
        sweep(kind, fmt, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
