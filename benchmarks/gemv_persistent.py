"""Decode (one row) with persistent programs: a diagnostic, not a kernel of fusetune.

fusetune's decode structure launches one program per BLOCK_N weight rows (thousands of
programs); each program reads the activation row again from L2 and redoes its norm statistics.
Here a fixed number of programs (PROGS_PER_SM per streaming multiprocessor) each normalize the
row once, keep it in registers (whole rows: BLOCK_K >= K) or re-read it per K-step (BLOCK_K < K),
and then loop over the weight-row tiles t = pid, pid + P, pid + 2P, ... (all programs stream
neighbouring rows at the same time). Three shapes of Llama-2-7B / GPT-style decode:

- ffn: RMSNorm -> [W1; W3] (2 x 11008 x 4096) -> silu(a)·b;
- qkv: RMSNorm -> [Wq; Wk; Wv] (12288 x 4096), no rotation (its cost is the epilogue's);
- lola: LayerNorm -> W (16384 x 4096) + bias -> exact GELU;

each beside fusetune's shipped kernel for that point (the lookup table's config) and the
read-only kernel of the same weight bytes. GPU µs: medians of do_bench (L2 flushed) over
CUDA-graph replays.

    python -m benchmarks.gemv_persistent [ffn qkv lola]
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import fusetune
from benchmarks.bench_read_bw import read_us
from benchmarks.timing import as_graph, cuda_gpu, median_us

DIM = 4096
SHAPES = {"ffn": 11008, "qkv": 12288, "lola": 16384}  # weight rows per product


@triton.jit
def _row_stats(X, K, eps, LAYER: tl.constexpr, BLOCK_K: tl.constexpr):
    # mean and 1/std of the row for LayerNorm (LAYER), or 0 and 1/rms for RMSNorm, float32.
    rk = tl.arange(0, BLOCK_K)
    s1 = tl.zeros([BLOCK_K], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + rk, mask=rk < K - k0, other=0.0).to(tl.float32)
        s1 += x
        s2 += x * x
    if LAYER:
        mean = tl.sum(s1, axis=0) / K
        rstd = tl.rsqrt(tl.maximum(tl.sum(s2, axis=0) / K - mean * mean, 0.0) + eps)
    else:
        mean = tl.sum(s1, axis=0) * 0.0
        rstd = tl.rsqrt(tl.sum(s2, axis=0) / K + eps)
    return mean, rstd


@triton.jit
def _normed(X, G, k0, rk, K, mean, rstd, LAYER: tl.constexpr):
    # The normalized row's K-step [k0, k0 + BLOCK_K) in float32 (0 past K).
    k_ok = rk < K - k0
    x = tl.load(X + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
    if LAYER:
        return tl.where(k_ok, (x - mean) * rstd, 0.0)
    g = tl.load(G + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
    return x * rstd * g


@triton.jit
def _persistent_gemv(X, G, WA, WB, B, OUT, N, K, eps, n_progs,
                     KIND: tl.constexpr,  # 0 ffn (two products, silu·gate), 1 qkv, 2 lola
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    LAYER: tl.constexpr = KIND == 2
    mean, rstd = _row_stats(X, K, eps, LAYER, BLOCK_K)
    rk = tl.arange(0, BLOCK_K)
    WHOLE: tl.constexpr = BLOCK_K >= 4096  # one K-step covers the row (K = 4096 here)
    if WHOLE:
        xn_whole = _normed(X, G, 0, rk, K, mean, rstd, LAYER)  # in registers for every tile
    n_tiles = tl.cdiv(N, BLOCK_N)
    for t in range(pid, n_tiles, n_progs):
        rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        # Weight rows rn, K contiguous: [BLOCK_N, BLOCK_K] tiles, 16-byte vector loads.
        w_off = rn[:, None].to(tl.int64) * K + rk[None, :]
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xn = xn_whole if WHOLE else _normed(X, G, k0, rk, K, mean, rstd, LAYER)
            m = n_ok[:, None] & (rk < K - k0)[None, :]
            wa = tl.load(WA + w_off + k0, mask=m, other=0.0, eviction_policy="evict_first")
            acc_a += wa.to(tl.float32) * xn[None, :]
            if KIND == 0:
                wb = tl.load(WB + w_off + k0, mask=m, other=0.0, eviction_policy="evict_first")
                acc_b += wb.to(tl.float32) * xn[None, :]
        a = tl.sum(acc_a, axis=1)
        if KIND == 0:
            b = tl.sum(acc_b, axis=1)
            y = a / (1.0 + tl.exp(-a)) * b
        elif KIND == 1:
            y = a
        else:
            y = a + tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        tl.store(OUT + rn, y.to(OUT.dtype.element_ty), mask=n_ok)


def reference(kind: str, x: torch.Tensor, g: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor,
              b: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    if kind == "lola":
        y = torch.nn.functional.layer_norm(xf, (DIM,), eps=1e-5) @ wa.float().T + b.float()
        return torch.nn.functional.gelu(y)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()
    a = xn @ wa.float().T
    return torch.nn.functional.silu(a) * (xn @ wb.float().T) if kind == "ffn" else a


def shipped(kind: str, x: torch.Tensor, g: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor,
            b: torch.Tensor) -> Callable[[], object]:
    """fusetune's own call for this point (lookup table config)."""
    if kind == "ffn":
        return lambda: fusetune.ffn(x, g, wa, wb)
    if kind == "lola":
        return lambda: fusetune.lola(x, wa, b)
    wq, wk, wv = wa[:4096], wa[4096:8192], wa[8192:]
    x3 = x.view(1, 1, DIM)
    return lambda: fusetune.qkv(x3, g, wq, wk, wv, interleaved=False)


def sweep(kind: str, sms: int, t0: float) -> None:
    """Times shipped, read-only and every persistent config for `kind`; prints the best."""
    torch.manual_seed(0)
    n = SHAPES[kind]
    x = torch.randn(1, DIM, device="cuda", dtype=torch.float16)
    g = (1 + 0.1 * torch.randn(DIM, device="cuda")).to(torch.float16)
    wa = (torch.randn(n, DIM, device="cuda") * 0.02).to(torch.float16)
    wb = (torch.randn(n, DIM, device="cuda") * 0.02).to(torch.float16)
    b = (0.1 * torch.randn(n, device="cuda")).to(torch.float16)
    ref = reference(kind, x, g, wa, wb, b)
    nbytes = wa.numel() * 2 * (2 if kind == "ffn" else 1)
    flat = (torch.cat([wa.view(-1), wb.view(-1)]) if kind == "ffn" else wa.view(-1)
            ).view(torch.uint8)
    # The read-only kernel's fastest shapes on the H100: one short block per program.
    read = min(read_us(flat.view(torch.float16), blk, 1, nw, evict=ev)
               for blk, nw, ev in itertools.product((1024, 2048), (4, 8), (True, False)))
    del flat
    ship = median_us(as_graph(shipped(kind, x, g, wa, wb, b)))
    out = torch.empty(n, device="cuda", dtype=torch.float16)
    res: list[tuple[float, str]] = []
    for per_sm, bn, bk, nw, st in itertools.product((1, 2, 4, 8), (1, 2, 4, 8),
                                                    (1024, 2048, 4096), (4, 8), (1, 3)):
        per_thread = (2 if kind == "ffn" else 1) * bn * bk // (32 * nw)
        if not 8 <= per_thread <= 128 or per_sm * nw > 64:
            continue
        progs = min(sms * per_sm, math.ceil(n / bn))

        def run(progs: int = progs, bn: int = bn, bk: int = bk, nw: int = nw,
                st: int = st) -> None:
            _persistent_gemv[(progs,)](
                x, g, wa, wb, b, out, n, DIM, 1e-5 if kind == "lola" else 1e-6, progs,
                KIND=("ffn", "qkv", "lola").index(kind), BLOCK_N=bn, BLOCK_K=bk,
                num_warps=nw, num_stages=st)

        name = f"{per_sm},{bn},{bk},{nw},{st}"
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # out of resources: not a result
            res.append((float("inf"), f"{name} {type(exc).__name__}"))
            continue
        err = float((out.float() - ref.view(-1)).norm() / ref.norm())
        if err > 1e-2:
            res.append((float("inf"), f"{name} WRONG {err:.1e}"))
            continue
        res.append((median_us(as_graph(run)), name))
    res.sort()
    floor = nbytes / 3.0e6
    print(f"\n{kind}: {nbytes / 1e6:.0f} MB of weights; floor {floor:.1f} µs; read-only "
          f"{read:.1f}; shipped fusetune {ship:.1f}; persistent best "
          f"{res[0][0]:.1f} ({res[0][1]})  [{time.time() - t0:.0f} s, {len(res)} configs]")
    for t, name in res[:12]:
        print(f"  {t:7.1f}  {name}")
    bad = [name for t, name in res if math.isinf(t)]
    if bad:
        print(f"  not timed: {len(bad)} ({', '.join(bad[:4])} ...)")
    sys.stdout.flush()


def main() -> int:
    if cuda_gpu() is None:
        return 2
    kinds = sys.argv[1:] or list(SHAPES)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, Triton "
          f"{triton.__version__}; median µs of CUDA-graph replays (do_bench, L2 flushed); "
          "configs as PROGS_PER_SM,BLOCK_N,BLOCK_K,num_warps,num_stages", flush=True)
    t0 = time.time()
    for kind in kinds:
        sweep(kind, sms, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
