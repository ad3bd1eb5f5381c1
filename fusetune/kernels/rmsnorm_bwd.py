"""RMSNorm backward: the gradients of y = x · rstd · weight, rstd = rsqrt(mean(x²) + eps), with
respect to x and weight, computed in float32 (the forward's numerics).

With xhat = x · rstd and g = dy · weight (per row):
    dx      = rstd · (g − xhat · mean(g · xhat))
    dweight = Σ_rows dy · xhat
rstd is recomputed from x (one extra sum per row) rather than stored by the forward.

The rows go in steps of ROWS, dealt out round-robin: program p takes steps p, p + P, p + 2P,
... of the P programs, so that at any moment the programs read neighbouring rows, one stretch
of memory, rather than P stretches far apart (which the memory serves more slowly). Each
program writes its rows' dx and adds their share of dweight into one float32 partial row of a
[P, D] buffer; a second, small kernel adds the partial rows up (in float32, in a fixed order)
and casts once into weight's dtype. x and dy are read once per row (twice when the row is
walked in blocks: the second read mostly from L2).

Tunables (all data, see search_spaces/rmsnorm_bwd.yaml): BLOCK_D (columns a program holds at
once; smaller than D, it walks each row twice), ROWS (rows per step of a program's loop),
PROGRAMS (at most this many programs, fewer where there are fewer steps; the partial-sum
buffer has a row per program), num_warps, num_stages (software pipelining of the loops' loads),
PREFETCH (single pass: each step loads the next step's rows before its own math, so that a
program keeps reads in flight while it computes and stores), EVICT (single pass: x and dy are
loaded as evict-first in the L2, since each byte is read once; whether that pays depends on
the size against the L2, so the search decides). PREFETCH and EVICT are 0 or 1; a config that
leaves one out has 0.
A config changes the order of the float32 partial sums of dweight, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels._direct import direct
from fusetune.models import ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    as_rows,
    cdiv,
    check_device,
    check_eps,
    check_no_grad,
    dtype_name,
    next_pow2,
    torch_dtype,
)

# The reduction of the partial rows: columns per program and partial rows per step. It reads
# programs × D float32 (a small part of what the main kernel moves while programs ≪ rows), so
# its blocks are fixed and the search spends its trials on the main kernel. The read is short
# and bound by latency, from the L2 where the main kernel just wrote it: 256 partial rows a
# step cover the usual 128-256 programs in one round of loads, and 16-column blocks give one
# or two programs per SM at D = 2048-4096.
SUM_BLOCK_D = 16
SUM_BLOCK_P = 256


@triton.jit
def _load_rows(X, DY, rows, row_end, cols, col_ok, stride_xm, stride_dym,
               POLICY: tl.constexpr):
    # x and dy of `rows` [ROWS] at `cols` [BLOCK_D], in their own dtype; rows at or past
    # row_end and columns past D (col_ok false) read 0. Row offsets in int64: M * stride can
    # pass 2**31 elements for long sequences. POLICY: the loads' L2 eviction policy ("" or
    # "evict_first").
    mask = (rows < row_end)[:, None] & col_ok[None, :]
    rows64 = rows[:, None].to(tl.int64)
    x = tl.load(X + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0,
                eviction_policy=POLICY)
    dy = tl.load(DY + rows64 * stride_dym + cols[None, :], mask=mask, other=0.0,
                 eviction_policy=POLICY)
    return x, dy


@triton.jit
def _rmsnorm_bwd_kernel(
    X,  # *[M, D] the forward's input, row stride stride_xm, unit column stride
    W,  # *[D] weight
    DY,  # *[M, D] gradient of the output, row stride stride_dym, unit column stride
    DX,  # *[M, D] gradient of x (written when STORE_DX), row stride stride_dxm
    DWP,  # *[programs, D] float32 partial sums of dweight, row `pid` this program's own
    M,  # rows
    D,  # columns (the normalized width)
    stride_xm,
    stride_dym,
    stride_dxm,
    eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_D >= D: the whole row fits, no loop over columns
    STORE_DX: tl.constexpr,  # x requires grad
    STORE_DW: tl.constexpr,  # weight requires grad
    PREFETCH: tl.constexpr,  # single pass: load the next step's rows before this step's math
    POLICY: tl.constexpr,  # single pass: x's and dy's eviction policy ("evict_first" with EVICT)
):
    # Program `pid` takes the steps of ROWS rows that start at rows pid · ROWS, then `step`
    # rows further each time (every program's step in between); only the last step can pass
    # M, and its rows past M are masked.
    pid = tl.program_id(0)
    row_begin = pid * ROWS
    step = tl.num_programs(0) * ROWS
    row_end = M
    # This program's partial row of dweight (int64: programs * D could pass 2**31 one day).
    dwp_row = DWP + pid.to(tl.int64) * D

    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D  # BLOCK_D is a power of two >= D: mask the tail columns
        # Masked columns read 0 for x, dy and the weight: they add nothing to any sum below.
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        # dweight of all this program's rows, in registers until the end.
        dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if PREFETCH:
            # The first step's rows, loaded ahead (masked past row_end like every step's).
            x_next, dy_next = _load_rows(X, DY, row_begin + tl.arange(0, ROWS), row_end, cols,
                                         col_ok, stride_xm, stride_dym, POLICY)
        for r0 in range(row_begin, row_end, step):
            rows = r0 + tl.arange(0, ROWS)
            row_ok = rows < row_end
            # The dx store's mask and int64 row offsets (as _load_rows makes them).
            mask = row_ok[:, None] & col_ok[None, :]
            rows64 = rows[:, None].to(tl.int64)
            if PREFETCH:
                # This step's rows were loaded by the step before; the next step's are issued
                # now, so that their reads are in flight while this step computes and stores.
                # Past row_end the mask is all false: no memory is read.
                x, dy = x_next, dy_next
                x_next, dy_next = _load_rows(X, DY, rows + step, row_end, cols, col_ok,
                                             stride_xm, stride_dym, POLICY)
            else:
                x, dy = _load_rows(X, DY, rows, row_end, cols, col_ok, stride_xm, stride_dym,
                                   POLICY)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            # A masked row is all zeros: its rstd is finite (eps > 0) and its xhat zero, so it
            # adds nothing to dweight.
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [ROWS], float32
            xhat = x * rstd[:, None]
            g = dy * w[None, :]
            if STORE_DX:
                c = tl.sum(g * xhat, axis=1) / D  # mean(g · xhat) per row
                dx = (g - xhat * c[:, None]) * rstd[:, None]
                # Cast to x's element type only at the store.
                tl.store(DX + rows64 * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty),
                         mask=mask)
            if STORE_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
        if STORE_DW:
            tl.store(dwp_row + cols, dw_acc, mask=col_ok)
    else:
        if STORE_DW:
            # The partial row is added to block by block below: start it at zero.
            for off in range(0, D, BLOCK_D):
                cols = off + tl.arange(0, BLOCK_D)
                tl.store(dwp_row + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=cols < D)
        for r0 in range(row_begin, row_end, step):
            rows = r0 + tl.arange(0, ROWS)
            row_ok = rows < row_end
            rows64 = rows[:, None].to(tl.int64)
            x_rows = X + rows64 * stride_xm  # [ROWS, 1] pointers to row starts
            dy_rows = DY + rows64 * stride_dym
            # Pass 1: x² and g·x elementwise in float32, reduced once after the loop.
            acc_xx = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            acc_gx = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for off in range(0, D, BLOCK_D):
                cols = off + tl.arange(0, BLOCK_D)
                col_ok = cols < D
                mask = row_ok[:, None] & col_ok[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc_xx += x * x
                acc_gx += dy * w[None, :] * x
            rstd = tl.rsqrt(tl.sum(acc_xx, axis=1) / D + eps)
            c = tl.sum(acc_gx, axis=1) * rstd / D  # mean(g · xhat) = rstd · mean(g · x)
            if STORE_DW:
                # The partial row is read back below by other threads than those that stored
                # it (the zeros, or the last step's sums): the barrier makes every store of
                # the program visible to all its threads first.
                tl.debug_barrier()
            # Pass 2: re-read the rows (mostly from L2), write dx, add to the partial row.
            for off in range(0, D, BLOCK_D):
                cols = off + tl.arange(0, BLOCK_D)
                col_ok = cols < D
                mask = row_ok[:, None] & col_ok[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                if STORE_DX:
                    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
                    dx = (dy * w[None, :] - xhat * c[:, None]) * rstd[:, None]
                    tl.store(DX + rows64 * stride_dxm + cols[None, :],
                             dx.to(DX.dtype.element_ty), mask=mask)
                if STORE_DW:
                    partial = tl.load(dwp_row + cols, mask=col_ok, other=0.0)
                    tl.store(dwp_row + cols, partial + tl.sum(dy * xhat, axis=0), mask=col_ok)


@triton.jit
def _dw_sum_kernel(
    DWP,  # *[P, D] float32 partial rows of dweight
    DW,  # *[D] dweight (written, in weight's dtype)
    P,  # partial rows
    D,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program `pid` adds up columns [pid*BLOCK_D, pid*BLOCK_D + BLOCK_D) of every partial row:
    # BLOCK_P rows a step into a float32 tile, summed over the rows once after the loop (a
    # fixed order, so a config gives the same dweight at every call).
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        mask = (ps < P)[:, None] & col_ok[None, :]
        acc += tl.load(DWP + ps[:, None].to(tl.int64) * D + cols[None, :], mask=mask, other=0.0)
    # Cast to weight's element type once, at the store.
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_ok)


def programs(m: int, config: Mapping[str, int]) -> int:
    """Programs launched at m rows: PROGRAMS, or one per step of ROWS rows where there are
    fewer steps."""
    return min(config["PROGRAMS"], cdiv(m, config["ROWS"]))


def _launch_2d(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor | None,
               dw: torch.Tensor | None, eps: float, config: Config) -> None:
    """Launches on 2-D views x, dy, dx of shape [M, D] (unit column stride) with exactly
    `config`; dx None: x's gradient is not computed, dw None: weight's is not."""
    m, d = x.shape
    if m == 0:
        if dw is not None:
            dw.zero_()  # a sum over no rows
        return
    block_d = config["BLOCK_D"]
    single = block_d >= d  # the row in one block: the single pass and its flags
    grid = programs(m, config)
    partials = (torch.empty((grid, d), dtype=torch.float32, device=x.device)
                if dw is not None else x)  # not read or written without STORE_DW
    direct(_rmsnorm_bwd_kernel)[(grid,)](
        x, weight, dy, x if dx is None else dx, partials, m, d, x.stride(0), dy.stride(0),
        0 if dx is None else dx.stride(0), eps,
        BLOCK_D=block_d, ROWS=config["ROWS"], SINGLE_PASS=single,
        STORE_DX=dx is not None, STORE_DW=dw is not None,
        PREFETCH=bool(config.get("PREFETCH", 0)) and single,
        POLICY="evict_first" if config.get("EVICT", 0) and single else "",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if dw is not None:
        direct(_dw_sum_kernel)[(cdiv(d, SUM_BLOCK_D),)](
            partials, dw, grid, d, BLOCK_P=SUM_BLOCK_P, BLOCK_D=SUM_BLOCK_D, num_warps=4)


def rmsnorm_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    dy: torch.Tensor,
    *,
    eps: float,
    grad_x: bool = True,
    grad_weight: bool = True,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dx, dweight) of y = rmsnorm(x, weight, eps=eps) for the output gradient `dy`
    (x's shape, any leading shape), in float32; dx in x's dtype, dweight in weight's. A
    gradient not asked for (`grad_x`, `grad_weight` False) is not computed and comes back None.

    fusetune.rmsnorm calls it from autograd; the launch configuration comes from the lookup
    tables (kernel rmsnorm_bwd) for this GPU and shape, unless `config` (BLOCK_D, ROWS,
    PROGRAMS, num_warps, num_stages; the flags PREFETCH and EVICT, 0 when left out) is given.
    """
    if x.ndim < 1:
        raise ValueError("rmsnorm_bwd: x must have at least one dimension")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm_bwd: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if dy.shape != x.shape:
        raise ValueError(f"rmsnorm_bwd: dy has shape {tuple(dy.shape)}, expected x's "
                         f"{tuple(x.shape)}")
    for name, t in (("weight", weight), ("dy", dy)):
        if t.device != x.device:
            raise ValueError(f"rmsnorm_bwd: {name} is on {t.device}, x on {x.device}")
    check_device(x, "rmsnorm_bwd")
    check_eps("rmsnorm_bwd", eps)
    check_no_grad("rmsnorm_bwd", x, weight, dy)
    dtype = dtype_name(x.dtype)
    dtype_name(weight.dtype)  # raise for dtypes the kernel cannot read
    dtype_name(dy.dtype)
    x2 = as_rows(x, d)
    dy2 = as_rows(dy, d)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if grad_x else None
    dw = torch.empty((d,), dtype=weight.dtype, device=x.device) if grad_weight else None
    if dx is None and dw is None:
        return None, None
    m = x2.shape[0]
    if config is None:
        from fusetune.runtime import cached_config

        cfg = cached_config(SPEC, (("dim", d),), dtype, m, "", x.device)
    else:
        cfg = SPEC.validate_config(config)
    _launch_2d(x2, weight.contiguous(), dy2, None if dx is None else dx.view(-1, d), dw,
               float(eps), cfg)
    return dx, dw


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    d = point.dim["dim"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, d, device=device, dtype=torch.float32)
    weight = 1.0 + 0.1 * torch.randn(d, device=device, dtype=torch.float32)
    dy = torch.randn(point.batch, point.seq, d, device=device, dtype=torch.float32)
    return {"x": x.to(dtype), "weight": weight.to(dtype), "dy": dy.to(dtype), "eps": 1e-6}


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"dx": torch.empty_like(inputs["x"]), "dw": torch.empty_like(inputs["weight"])}


def _reference(inputs: Tensors) -> Tensors:
    # torch's autograd through the forward's float32 formula (on detached copies: .float() of
    # a float32 tensor is the tensor itself).
    x = inputs["x"].detach().float().requires_grad_()
    w = inputs["weight"].detach().float().requires_grad_()
    with torch.enable_grad():
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"]) * w
        dx, dw = torch.autograd.grad(y, (x, w), inputs["dy"].float())
    return {"dx": dx, "dw": dw}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, dy, dx = inputs["x"], inputs["dy"], outputs["dx"]
    d = x.shape[-1]
    _launch_2d(x.view(-1, d), inputs["weight"], dy.view(-1, d), dx.view(-1, d), outputs["dw"],
               inputs["eps"], config)


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    # One row a step, the whole row in registers up to 16K columns, more warps for wider rows;
    # about two programs per SM, so that every SM is busy and the partial rows stay few. Where
    # the row fits, each step loads the next one ahead: with two programs an SM, a program's
    # math and stores otherwise leave the memory idle (the prefetch was as fast or faster at
    # every size measured, 2K to 8K columns; BENCHMARKS.md, "Training"). A 16K-wide row takes
    # an SM's whole register file (one program per SM, no room for the next row's tiles);
    # wider rows go in two passes of 8K blocks.
    d = point.dim["dim"]
    block_d = next_pow2(d) if next_pow2(d) <= 16384 else 8192
    num_warps = 4 if block_d < 2048 else 8 if block_d < 8192 else 16
    per_sm = 1 if block_d >= 16384 else 2
    programs = 1 << ((per_sm * gpu.sms).bit_length() - 1)  # a power of two <= per_sm · SMs
    return {"BLOCK_D": block_d, "ROWS": 1, "PROGRAMS": programs, "num_warps": num_warps,
            "num_stages": 1, "PREFETCH": int(d <= block_d < 16384), "EVICT": 0}


def _canonical(config: Config, point: Point) -> Config:
    # Configs that compile to the same kernel and launch the same grid collapse onto one:
    # BLOCK_D past the padded row width and ROWS past the row count only add masked lanes, and
    # PROGRAMS past one step of ROWS rows per program launches no more programs. num_stages
    # stays: the loop over a program's rows is pipelined in both variants.
    d, m = point.dim["dim"], point.rows
    c = dict(config)
    c["BLOCK_D"] = min(c["BLOCK_D"], next_pow2(d))
    c["ROWS"] = min(c["ROWS"], next_pow2(m))
    c["PROGRAMS"] = min(c["PROGRAMS"], next_pow2(cdiv(m, c["ROWS"])))
    if c["BLOCK_D"] < next_pow2(d):
        # The two-pass walk has no prefetch variant, and its first pass's lines must stay in
        # the L2 for the second: both flags belong to the single pass.
        c["PREFETCH"] = 0
        c["EVICT"] = 0
    return c


def _resources(config: Config, point: Point) -> Resources:
    elt = DTYPE_BYTES[point.dtype]
    warps = config["num_warps"]
    threads = 32 * warps
    block_d, rows, stages = config["BLOCK_D"], config["ROWS"], config["num_stages"]
    per_thread = -(-(rows * block_d) // threads)
    per_thread_1d = -(-block_d // threads)
    # float32 tiles: x and dy and, in one pass, one temporary at a time (xhat and g take x's
    # and dy's places), in two passes the two sums' accumulators beside them; addresses and
    # bookkeeping. Then the weight and the dweight sums as vectors, which are the same for
    # every step: where the registers run out, the compiler keeps them in local memory, read
    # once a step from the L1, while the tiles must stay in registers. So the vectors may spill
    # (`spill_regs`: they count only up to the registers the tiles leave; a 16K-wide row with
    # 16 warps spills about 50 registers and was the fastest config at 12-16K columns; with 32
    # warps, where the tiles alone spill, it was slower). An estimate that is too high prunes
    # configs that run.
    single = block_d >= next_pow2(point.dim["dim"])
    tiles = (3 if single else 4) * per_thread + 32
    if config.get("PREFETCH") and single:
        tiles += per_thread  # the next step's x and dy, in their own dtype until used
    vectors = 2 * per_thread_1d
    # Cross-warp scratch of the two per-row sums, of the column sums over ROWS rows, and the
    # pipelined x and dy tiles.
    smem = 2 * rows * warps * 4
    if rows > 1:
        smem += block_d * 4
    if stages > 1:
        smem += (stages - 1) * 2 * rows * block_d * elt
    return Resources(smem_bytes=smem, regs_per_thread=tiles + vectors, threads=threads,
                     spill_regs=vectors)


def _cost(point: Point) -> Cost:
    m, d = point.rows, point.dim["dim"]
    elt = DTYPE_BYTES[point.dtype]
    # Read x and dy, write dx; read the weight and write its gradient once. Per element: x²
    # and its sum (2), g = dy·w (1), g·xhat and its sum (3), dx (3), dy·xhat and its sum (2).
    return Cost(bytes=3 * m * d * elt + 2 * d * elt, flops=11 * m * d)


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    return {"dim": model.dim}


SPEC = KernelSpec(
    name="rmsnorm_bwd",
    description="RMSNorm backward: dx and dweight (float32 math, dweight from float32 partial "
                "sums), any leading shape",
    dim_names=("dim",),
    config_keys=("BLOCK_D", "ROWS", "PROGRAMS", "num_warps", "num_stages", "PREFETCH", "EVICT"),
    flags={"PREFETCH": 0, "EVICT": 0},
    pow2_keys=("BLOCK_D", "ROWS", "PROGRAMS", "num_warps"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    dims_from_model=_dims_from_model,
    # A config lends itself to no other width: its rows a step, warps and eviction are fitted
    # to the row's width and the bytes moved, and carried to other widths (or to the row
    # counts outside a width's tuned range, which borrow from other widths) they ran slower
    # than the default heuristic as often as faster (BENCHMARKS.md, "Training").
    carry_same=("dim",),
    source_objects=(_load_rows, _rmsnorm_bwd_kernel, _dw_sum_kernel, programs, _launch_2d),
)
