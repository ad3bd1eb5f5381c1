"""What qkv's prefill time is made of: variants of its kernel at M = 4096 (the PASSES = 2 path)
beside cuBLAS and the shipped kernel, with each compiled variant's registers, spills and
shared memory. A variant runs one launch per matrix (pointers fixed per launch); ROPE=False
stores the two products without rotating them; STORE=1 (interleaved only) joins each pair into
one contiguous row of wide stores.

    TRITON_INTERPRET=1 python -m benchmarks.qkv_variants check   # CPU: variants == shipped
    python -m benchmarks.qkv_variants bench                      # GPU timings
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fusetune.kernels._matmul import grouped_tile, two_products

# BLOCK_M, BLOCK_N (pairs), BLOCK_K, GROUP_M, num_warps, num_stages
Cfg = tuple[int, int, int, int, int, int]


@triton.jit
def _qkv_variant(X, W, Y, M, K, S, n_pairs, HALF, stride_xm, stride_w, start_pos, nl2t,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, INTERLEAVED: tl.constexpr, ROPE: tl.constexpr,
                 STORE: tl.constexpr):
    # One matrix W [2·n_pairs, K] (X already normalized): pairs p of this program, as in
    # fusetune/kernels/qkv.py, with libdevice's sin/cos.
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(n_pairs, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    p_ok = p < n_pairs
    head = p // HALF
    i = p % HALF
    if INTERLEAVED:
        col_a = head * (2 * HALF) + 2 * i
        col_b = col_a + 1
    else:
        col_a = head * (2 * HALF) + i
        col_b = col_a + HALF
    a, b, _ = two_products(X, X, W, col_a[None, :].to(tl.int64) * stride_w, W,
                           col_b[None, :].to(tl.int64) * stride_w, rm, m_ok, p_ok, K, stride_xm,
                           BLOCK_M, BLOCK_N, BLOCK_K, 1, 2, False, 0, 0)
    if ROPE:
        pos = (start_pos + rm % S).to(tl.float32)
        angle = pos[:, None] * tl.exp2(i.to(tl.float32) * nl2t)[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        ya = a * cos - b * sin
        yb = a * sin + b * cos
    else:
        ya = a
        yb = b
    o_row = Y + rm[:, None].to(tl.int64) * (2 * n_pairs)
    if STORE == 0:
        mp_ok = m_ok[:, None] & p_ok[None, :]
        tl.store(o_row + col_a[None, :], ya.to(Y.dtype.element_ty), mask=mp_ok)
        tl.store(o_row + col_b[None, :], yb.to(Y.dtype.element_ty), mask=mp_ok)
    else:
        y = tl.join(ya, yb).reshape(BLOCK_M, 2 * BLOCK_N)
        c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        tl.store(o_row + c[None, :], y.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & (c < 2 * n_pairs)[None, :])


def run_variant(xn: torch.Tensor, ws: tuple[torch.Tensor, ...], outs: list[torch.Tensor],
                seq: int, hd: int, cfg: Cfg, inter: bool, rope: bool, store: int = 0) -> object:
    bm, bn, bk, gm, nw, ns = cfg
    m, k = xn.shape
    kernel = None
    for w, y in zip(ws, outs, strict=True):
        n_pairs = w.shape[0] // 2
        grid = (triton.cdiv(m, bm) * triton.cdiv(n_pairs, bn),)
        kernel = _qkv_variant[grid](
            xn, w, y, m, k, seq, n_pairs, hd // 2, xn.stride(0), w.stride(0), 0,
            -math.log2(10000.0) / (hd // 2), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
            INTERLEAVED=inter, ROPE=rope, STORE=store, num_warps=nw, num_stages=ns)
    return kernel


def main(mode: str) -> int:
    from fusetune.kernels.ffn import _launch_2d as ffn_launch
    from fusetune.kernels.qkv import _launch_2d
    from fusetune.kernels.rmsnorm import rmsnorm

    interp = mode == "check"
    dev = "cpu" if interp else "cuda"
    torch.manual_seed(0)
    m, d, hd, nh = (64, 64, 16, 4) if interp else (4096, 4096, 128, 32)
    dt = torch.float32 if interp else torch.float16
    x = torch.randn(m, d, device=dev, dtype=dt)
    g = (1 + 0.1 * torch.randn(d, device=dev)).to(dt)
    wq, wk, wv = ((torch.randn(nh * hd, d, device=dev) / d**0.5).to(dt) for _ in range(3))
    full = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
            "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    if interp:
        full.update(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)

    def shipped(inter: bool) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.empty(m, nh * hd, device=dev, dtype=dt) for _ in range(3))
        _launch_2d(x, g, wq, wk, wv, q, k, v, m, hd, 0, 10000.0, 1e-6, inter, full)
        return q, k, v

    xn = rmsnorm(x, g, 1e-6)
    base: Cfg = (full["BLOCK_M"], full["BLOCK_N"], full["BLOCK_K"], 8, full["num_warps"],
                 full["num_stages"])
    if interp:
        for inter in (True, False):
            ref = shipped(inter)
            for store in ((0, 1) if inter else (0,)):
                outs = [torch.empty_like(ref[0]) for _ in range(3)]
                run_variant(xn, (wq, wk, wv), outs, m, hd, base, inter, True, store)
                # q and k (the variant rotates v too, which qkv does not)
                err = max(float((o - r).abs().max())
                          for o, r in zip(outs[:2], ref[:2], strict=True))
                print(f"interleaved={inter} store={store}: max |variant - shipped| {err:.2e}")
        return 0

    import torch.nn.functional as F
    from triton.testing import do_bench

    def us(fn: Callable[[], object]) -> float:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    wqkv = torch.cat([wq, wk, wv])
    print(f"cuBLAS [Wq;Wk;Wv] M={m}: {us(lambda: F.linear(xn, wqkv)):.1f} us")
    print(f"rmsnorm pass alone: {us(lambda: rmsnorm(x, g, 1e-6)):.1f} us")
    for inter in (True, False):
        print(f"shipped qkv {base} interleaved={inter}: "
              f"{us(lambda inter=inter: shipped(inter)):.1f} us")
    outs = [torch.empty(m, nh * hd, device=dev, dtype=dt) for _ in range(3)]
    for cfg in ((128, 64, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
                (64, 128, 64, 8, 4, 4), (128, 64, 128, 8, 8, 3), (128, 32, 64, 8, 4, 4)):
        for inter, rope, store in ((True, True, 0), (True, True, 1), (True, False, 0),
                                   (False, True, 0), (False, False, 0)):
            def run(cfg: Cfg = cfg, inter: bool = inter, rope: bool = rope,
                    store: int = store) -> object:
                return run_variant(xn, (wq, wk, wv), outs, m, hd, cfg, inter, rope, store)

            kernel = run()
            print(f"3 launches cfg={cfg} interleaved={inter} rope={rope} store={store}: "
                  f"{us(run):.1f} us  regs={kernel.n_regs} spills={kernel.n_spills} "
                  f"smem={kernel.metadata.shared}", flush=True)
    # The ffn kernel on the same flops (2 x 6144 columns) for comparison.
    w1, w3 = wq.repeat(2, 1)[:6144].contiguous(), wk.repeat(2, 1)[:6144].contiguous()
    o = torch.empty(m, 6144, device=dev, dtype=dt)
    for bn in (64, 128):
        c = dict(full, BLOCK_N=bn)
        t = us(lambda c=c: ffn_launch(x, g, w1, w3, o, 1e-6, c))
        print(f"ffn kernel N=2x6144 PASSES=2 128/{bn}/64/8/8/3: {t:.1f} us")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("check", "bench"):
        sys.exit("usage: python -m benchmarks.qkv_variants check|bench")
    sys.exit(main(sys.argv[1]))
