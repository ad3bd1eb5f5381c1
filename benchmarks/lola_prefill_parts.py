"""Where lola's time goes at prefill sizes: a diagnostic, not a kernel of fusetune.

At 4096 rows, 768 -> 3072 (GPT-2's MLP up-projection) fusetune.lola took twice the cuBLAS
GEMM alone. This script times, in one process as CUDA-graph replays (medians of do_bench, L2
flushed), the parts and variants of the work on the same inputs:

- `cublas x·Wᵀ`, `cublas linear+gelu` (F.gelu(F.linear(xn, w, b)) on normalized rows);
- `layernorm pass`: lola's first pass alone (PASSES = 2), as lola launches it and with other
  rows per program and warps;
- `triton EPI=k` for tiles BM/BN/BK/warps/stages: lola's tensor-core K loop (pointer loads,
  normalized rows) copied here, with epilogues k = 0 (the product stored as is), 1 (+ bias),
  2 (+ bias, exact GELU through tl.erf), 3 (+ bias, exact GELU through erf_fast below), and
  EPI 2 with at most 128 registers a thread for the 8-warp tiles;
- `persistent TMA EPI=k`: the same product through TMA descriptors by one or two programs
  per SM walking the tiles, with the tile loop flattened (the next tile's loads pipelined
  under this one's epilogue) or not, epilogues 0 and 2;
- `ws …`: those programs with the GELU epilogue, the tile loop warp-specialized or not, the
  epilogue in two column halves or not, descriptors made on the host or in the kernel;
- `fusetune.lola CONFIG`: the kernel itself with the shipped config and a few others (both
  passes included), with its relative error against the float32 reference;

with the most registers per thread and the spills of the Triton kernels each row launched.

    python -m benchmarks.lola_prefill_parts [--rows 4096 --dim 768 --out 3072]
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import fusetune
from benchmarks.lola_fold_check import parse_on_gpu, shape_parser, tile_pointers
from benchmarks.persistent_tma import _tile
from benchmarks.timing import as_graph, median_us
from fusetune.kernels._spec import next_pow2
from fusetune.kernels.lola import SPEC, _layernorm_kernel, layernorm_rows
from fusetune.tuner.launches import kernel_stats, launched_kernels

TILES = [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3), (128, 256, 32, 8, 4),
         (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
PERSISTENT_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3)]
WS_TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4)]
LN_VARIANTS = [(1, 4), (1, 8), (1, 16), (2, 8), (4, 8), (4, 16), (8, 16)]  # ROWS, num_warps
LOLA_CONFIGS = [  # BM, BN, BK, GM, PASSES, TMA, warps, stages
    (128, 128, 32, 8, 2, 0, 8, 4), (128, 128, 64, 8, 2, 1, 8, 3), (128, 256, 64, 8, 2, 1, 8, 3),
    (128, 128, 32, 8, 2, 1, 8, 4), (64, 128, 64, 8, 2, 1, 4, 4), (128, 64, 64, 8, 2, 1, 4, 4),
    (128, 128, 64, 8, 1, 0, 8, 3), (128, 256, 32, 8, 1, 0, 8, 3)]


@triton.jit
def erf_fast(x):
    """erf(x) to 1.5e-7 (Abramowitz and Stegun 7.1.26): one reciprocal, one exponential and
    a degree-5 polynomial, instead of libdevice's erff."""
    ax = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * ax)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                         + t * 1.061405429))))
    r = 1.0 - poly * tl.exp(-ax * ax)
    return tl.where(x < 0, -r, r)


@triton.jit
def _epilogue_store(acc, B, OUT, rm, rn, M, N, stride_om, EPI: tl.constexpr):
    # The diagnostics' epilogues: EPI 0 stores the product, 1 adds the bias, 2 then applies the
    # exact GELU through tl.erf, 3 through erf_fast; masked to the [M, N] output.
    y = acc
    if EPI >= 1:
        y += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if EPI == 2:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    if EPI == 3:
        y = 0.5 * y * (1.0 + erf_fast(y * 0.7071067811865476))
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             y.to(OUT.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _gemm_epilogue(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EPI: tl.constexpr):
    rm, rn, m_ok, n_ok, rk, x_ptrs, w_ptrs = tile_pointers(X, W, M, N, stride_xm, stride_wn,
                                                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue_store(acc, B, OUT, rm, rn, M, N, stride_om, EPI)


@triton.jit
def _gemm_persistent(XD, WD, B, OUT, M, N, K, stride_om, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, EPI: tl.constexpr):
    # The same product through TMA descriptors (XD over xn [M, K], WD over W [N, K]), one
    # program per SM (or a few) walking the tiles p, p + NUM_PROGS, ... in grouped order;
    # FLATTEN lets the compiler pipeline the next tile's loads under this tile's epilogue.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(XD.load([pid_m * BLOCK_M, k0]), WD.load([pid_n * BLOCK_N, k0]).T, acc)
        _epilogue_store(acc, B, OUT, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                        pid_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N, stride_om, EPI)


@triton.jit
def _gemm_ws(XD, WD, X, W, B, OUT, M, N, K, stride_om, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             NUM_PROGS: tl.constexpr, WS: tl.constexpr, SUBTILE: tl.constexpr,
             DEVICE_DESC: tl.constexpr):
    # _gemm_persistent with the loop flattened, bias + exact GELU, and: WS, the tile loop
    # warp-specialized (tl.range(warp_specialize=True)); SUBTILE, the epilogue in two halves of
    # BLOCK_N / 2 columns; DEVICE_DESC, descriptors made in the kernel (tl.make_tensor_descriptor)
    # instead of on the host. The epilogue's tile comes from a counter of its own, as in
    # Triton's persistent matmul tutorial.
    if DEVICE_DESC:
        xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
        wd = tl.make_tensor_descriptor(W, shape=[N, K], strides=[K, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    else:
        xd = XD
        wd = WD
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    out_tile = tl.program_id(0) - NUM_PROGS
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True,
                         warp_specialize=WS):
        pid_m, pid_n = _tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(xd.load([pid_m * BLOCK_M, k0]), wd.load([pid_n * BLOCK_N, k0]).T, acc)
        out_tile += NUM_PROGS
        out_m, out_n = _tile(out_tile, num_pid_m, num_pid_n, GROUP_M)
        rm = out_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n0 = out_n * BLOCK_N
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            _epilogue_store(acc0, B, OUT, rm, n0 + tl.arange(0, BLOCK_N // 2), M, N, stride_om,
                            2)
            _epilogue_store(acc1, B, OUT, rm, n0 + BLOCK_N // 2 + tl.arange(0, BLOCK_N // 2),
                            M, N, stride_om, 2)
        else:
            _epilogue_store(acc, B, OUT, rm, n0 + tl.arange(0, BLOCK_N), M, N, stride_om, 2)


def main() -> int:
    ap = shape_parser(__doc__)
    ap.add_argument("--only", default="", help="comma-separated row kinds: cublas, layernorm, "
                    "triton, persistent, ws, lola (default: all)")
    args = parse_on_gpu(ap)
    if args is None:
        return 2
    m, k, n = args.rows, args.dim, args.out
    inputs = SPEC.make_inputs(fusetune.kernels._spec.Point.make(
        "lola", {"dim": k, "out": n}, 1, m, "float16"), "cuda")
    x, w, b = inputs["x"].view(m, k), inputs["weight"], inputs["bias"]
    ref = SPEC.reference(inputs)["y"].view(m, n)
    xn = layernorm_rows(x, 1e-5)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    floor = max((2 * m * k + m * n * 2 + n * k * 2) / 3.0e6, 2 * m * n * k / 727e6)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; {m} rows, {k} -> {n}, fp16; CUDA-graph replays, do_bench "
          f"median µs (L2 flushed); floor {floor:.1f} µs")
    print("| what | µs | relative error | registers/spills (Triton) |\n|---|---:|---:|---|")

    only = set(filter(None, args.only.split(",")))

    def row(name: str, fn: Callable[[], object], result: Callable[[], torch.Tensor] | None = None
            ) -> None:
        """Times `fn` alone; `result` (a call whose output is checked) where given."""
        if only and name.split()[0].removeprefix("fusetune.") not in only:
            return
        try:
            with launched_kernels() as kernels:
                fn()
            stats = kernel_stats(kernels)
            t = median_us(as_graph(fn))
        except Exception as e:  # a variant that fails is a row of the report
            print(f"| {name} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | |",
                  flush=True)
            return
        err = ""
        if result is not None:
            y = result().view(m, n)
            err = f"{float((y.float() - ref).norm() / ref.norm()):.1e}"
        regs = f"{stats.n_regs}/{stats.n_spills}" if stats.n_regs is not None else ""
        print(f"| {name} | {t:.1f} | {err} | {regs} |", flush=True)

    row("cublas x·Wᵀ", lambda: torch.mm(xn, w.T, out=out))
    row("cublas linear+gelu", lambda: F.gelu(F.linear(xn, w, b)),
        lambda: F.gelu(F.linear(xn, w, b)))
    row("layernorm pass", lambda: layernorm_rows(x, 1e-5))
    block = next_pow2(k)
    for rows, warps in LN_VARIANTS:
        if block > 16384 or rows * block > 16384:
            continue
        row(f"layernorm pass ROWS={rows} warps={warps}", lambda r=rows, nw=warps: _layernorm_kernel[
            (triton.cdiv(m, r),)](x, xn, m, k, x.stride(0), 1e-5, BLOCK_K=block, ROWS=r,
                                  SINGLE_PASS=True, num_warps=nw))
    for bm, bn, bk, nw, st in TILES:
        for epi in range(4):
            def launch(epi: int = epi, t: tuple[int, ...] = (bm, bn, bk, nw, st)) -> None:
                grid = (triton.cdiv(m, t[0]) * triton.cdiv(n, t[1]),)
                _gemm_epilogue[grid](xn, w, b, out, m, n, k, xn.stride(0), w.stride(0),
                                     out.stride(0), BLOCK_M=t[0], BLOCK_N=t[1], BLOCK_K=t[2],
                                     GROUP_M=8, EPI=epi, num_warps=t[3], num_stages=t[4])
            def result(launch: Callable[[], None] = launch) -> torch.Tensor:
                launch()
                return out
            row(f"triton EPI={epi} {bm}/{bn}/{bk}/{nw}/{st}", launch,
                result if epi >= 2 else None)
        if nw == 8:  # the GELU epilogue within 128 registers (two programs per SM)
            def capped(t: tuple[int, ...] = (bm, bn, bk, nw, st)) -> None:
                grid = (triton.cdiv(m, t[0]) * triton.cdiv(n, t[1]),)
                _gemm_epilogue[grid](xn, w, b, out, m, n, k, xn.stride(0), w.stride(0),
                                     out.stride(0), BLOCK_M=t[0], BLOCK_N=t[1], BLOCK_K=t[2],
                                     GROUP_M=8, EPI=2, num_warps=t[3], num_stages=t[4],
                                     maxnreg=128)
            row(f"triton EPI=2 {bm}/{bn}/{bk}/{nw}/{st} maxnreg=128", capped)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (bm, bn, bk, nw, st), per_sm, flatten, epi in itertools.product(
            PERSISTENT_TILES, (1, 2), (0, 1), (0, 2)):
        xd = TensorDescriptor.from_tensor(xn, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        progs = min(per_sm * sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))

        def persistent(t: tuple[int, ...] = (bm, bn, bk, nw, st), progs: int = progs,
                       flatten: int = flatten, epi: int = epi, xd: object = xd,
                       wd: object = wd) -> None:
            _gemm_persistent[(progs,)](xd, wd, b, out, m, n, k, out.stride(0), BLOCK_M=t[0],
                                       BLOCK_N=t[1], BLOCK_K=t[2], GROUP_M=8, NUM_PROGS=progs,
                                       FLATTEN=flatten, EPI=epi, num_warps=t[3],
                                       num_stages=t[4])

        def result(persistent: Callable[[], None] = persistent) -> torch.Tensor:
            persistent()
            return out
        row(f"persistent TMA EPI={epi} {bm}/{bn}/{bk}/{nw}/{st}, {per_sm}/SM, flatten "
            f"{flatten}", persistent, result if epi == 2 else None)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    for (bm, bn, bk, nw, st), ws, subtile, device_desc in itertools.product(
            WS_TILES, (0, 1), (0, 1), (0, 1)):
        xd = TensorDescriptor.from_tensor(xn, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        progs = min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))

        def specialized(t: tuple[int, ...] = (bm, bn, bk, nw, st), progs: int = progs,
                        flags: tuple[int, ...] = (ws, subtile, device_desc), xd: object = xd,
                        wd: object = wd) -> None:
            _gemm_ws[(progs,)](xd, wd, xn, w, b, out, m, n, k, out.stride(0), BLOCK_M=t[0],
                               BLOCK_N=t[1], BLOCK_K=t[2], GROUP_M=8, NUM_PROGS=progs,
                               WS=flags[0], SUBTILE=flags[1], DEVICE_DESC=flags[2],
                               num_warps=t[3], num_stages=t[4])

        def result(specialized: Callable[[], None] = specialized) -> torch.Tensor:
            specialized()
            return out
        row(f"ws {bm}/{bn}/{bk}/{nw}/{st}, 1/SM, flattened, GELU; warp_specialize {ws}, "
            f"epilogue halves {subtile}, device descriptors {device_desc}", specialized, result)
    shipped = fusetune.lookup("lola", {"dim": k, "out": n}, "float16", rows=m)
    configs = [shipped] + [
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "PASSES": p, "SPLIT_K": 1,
         "ACT_FP8": 0, "UNROLL_K": 0, "TMA": tma, "num_warps": nw, "num_stages": st}
        for bm, bn, bk, gm, p, tma, nw, st in LOLA_CONFIGS]
    for i, cfg in enumerate(configs):
        name = "/".join(str(cfg[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M",
                                                  "PASSES", "TMA", "num_warps", "num_stages"))
        row(f"fusetune.lola {'shipped ' if i == 0 else ''}{name}",
            lambda c=cfg: fusetune.lola(x, w, b, config=c),
            lambda c=cfg: fusetune.lola(x, w, b, config=c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
