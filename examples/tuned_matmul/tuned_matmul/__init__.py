"""C = A @ B in fp16 with fp32 accumulation: Triton's tutorial matmul, tuned by fusetune.

    from tuned_matmul import matmul
    c = matmul(a, b)  # the config for this GPU, (M, N, K) and dtype, from the tables
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fusetune

SPACE = {
    "params": {
        "BLOCK_M": {"pow2": [16, 128]},
        "BLOCK_N": {"pow2": [16, 256]},
        "BLOCK_K": {"pow2": [32, 128]},
        "GROUP_M": {"values": [1, 8]},
        "num_warps": {"pow2": [2, 8]},
        "num_stages": {"values": [2, 3, 4, 5]},
    },
    # Row blocks of 64 and more only where A has that many rows (16 rows fill one).
    "constraints": ["BLOCK_M <= max(32, M)"],
}


def resources(config: dict, point: fusetune.Point) -> fusetune.Resources:
    """One program's shared memory (A and B tiles per pipeline stage) and registers (its
    share of the float32 accumulator and of the operand tiles), to prune before compiling."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    threads = 32 * config["num_warps"]
    elt = 4 if point.dtype == "float32" else 2
    return fusetune.Resources(smem_bytes=(bm + bn) * bk * elt * config["num_stages"],
                              regs_per_thread=(bm * bn + (bm + bn) * bk // 2) // threads + 32,
                              threads=threads)


def cost(point: fusetune.Point) -> fusetune.Cost:
    M, N, K = (point.dim[k] for k in ("M", "N", "K"))
    elt = 4 if point.dtype == "float32" else 2
    return fusetune.Cost(bytes=(M * K + K * N + M * N) * elt, flops=2 * M * N * K)


def make_inputs(M: int, N: int, K: int, dtype: torch.dtype, device: str) -> dict:
    a = torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn(K, N, dtype=dtype, device=device) / K**0.5
    c = torch.empty(M, N, dtype=dtype, device=device)
    return {"a_ptr": a, "b_ptr": b, "c_ptr": c, "M": M, "N": N, "K": K,
            "stride_am": a.stride(0), "stride_ak": a.stride(1), "stride_bk": b.stride(0),
            "stride_bn": b.stride(1), "stride_cm": c.stride(0), "stride_cn": c.stride(1)}


def grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"]),)


def reference(args: dict) -> dict:
    return {"c_ptr": args["a_ptr"].float() @ args["b_ptr"].float()}


@fusetune.autotune(space=SPACE, key=["M", "N", "K"], make_inputs=make_inputs, grid=grid,
                   reference=reference, resources=resources, cost=cost, name="tuned_matmul",
                   tables=["tables.yaml"])
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Program ids in groups of GROUP_M row-blocks, so that neighbours share B's tiles in L2.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    # Rows and columns of this tile; out-of-range ones wrap (modulo) and are masked at the store.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # The K tail reads zeros past K.
        a_tile = tl.load(a, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)
        b_tile = tl.load(b, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
        a += BLOCK_K * stride_ak
        b += BLOCK_K * stride_bk
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cm[:, None] < M) & (cn[None, :] < N)
    tl.store(c_ptr + cm[:, None] * stride_cm + cn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] with the tuned config for this GPU and shape."""
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"matmul: a is {tuple(a.shape)}, b {tuple(b.shape)}: inner dims differ")
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                        c.stride(0), c.stride(1))
    return c
