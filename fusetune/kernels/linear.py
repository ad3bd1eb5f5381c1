"""Linear layer with its epilogue fused: y = x·Wᵀ (· per-channel scale) + bias + residual.

What a transformer's output projections (attention's o_proj, the MLP's down_proj) do together
with the residual add behind them, in one kernel: the residual is read in the epilogue instead
of a second kernel reading y back. Each program accumulates x·Wᵀ for one [BLOCK_M, BLOCK_N]
output tile in float32; the epilogue adds, in float32 and in this order, acc · scale (FP8
weights' per-output-channel scale) + bias + residual, and rounds once to x's dtype. Weights use
nn.Linear's layout [out_features, in_features], in x's dtype or in FP8 with float32 scales per
output channel (fp8.py).

There is no norm in front, so the K loop is the matmul kernels' loop over operands that go to
the tensor cores untouched (their PASSES = 2) and PASSES means nothing here: `canonical` maps
it to 2 and the launcher ignores it (the key stays, so that linear's configs, tables and
search space have the keys of the other matmul kernels). FP8 weights are weight-only unless
the caller asks for FP8 activations (fp8.py): a pass then quantizes x's rows to e4m3 with a
scale each, and the K loop multiplies FP8 by FP8.

Structures (docs/kernels.md): one row per program (BLOCK_M = 1, the GEMV for decode, with
UNROLL_K, SPREAD, THREAD_SUM), tensor-core tiles with a software-pipelined K loop (BLOCK_M >
1), the same tiles through TMA descriptors (TMA = 1, 16-bit weights, compute capability 9.0+),
and SPLIT_K programs per tile whose float32 partial sums a second launch (FINISH) adds up and
finishes with the epilogue.

Tunables (search_spaces/linear.yaml): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, UNROLL_K,
SPREAD, THREAD_SUM, TMA, num_warps, num_stages (and PASSES: see above).

The dims of a point: `dim` (in_features K), `out` (out_features N), `bias` and `residual`
(0 or 1: whether they are added; they change the kernel's code and the bytes it moves, so a
call with a residual never takes a config tuned without one).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fusetune.gpus import GpuSpec
from fusetune.kernels import _unfused, fp8
from fusetune.kernels._call_memo import CallMemo, tensor_key
from fusetune.kernels._direct import direct
from fusetune.kernels._matmul import (
    block_rows,
    default_tiles,
    dot,
    fp8_as_f16,
    gemv_one_product,
    gemv_weight,
    grouped_tile,
    k_slice,
    mma_weight,
    partial_ptrs,
    scale_product,
    tma_descriptors,
    tma_one_product,
    use_tma,
)
from fusetune.kernels._matmul_spec import (
    MATMUL_SPEC_FIELDS,
    first_pass,
    launch_args,
    launch_split,
    matmul_canonical,
    matmul_padding,
    matmul_resources,
    weight_bytes,
)
from fusetune.kernels._replay import scratch
from fusetune.models import ModelPreset
from fusetune.spec import (
    DTYPE_BYTES,
    Config,
    ConfigError,
    Cost,
    KernelSpec,
    Point,
    Resources,
    Tensors,
    as_rows,
    cdiv,
    check_device,
    check_fits,
    check_no_grad,
    dtype_name,
    torch_dtype,
)

# The one K loop linear has: the matmul kernels' loop without a norm folded in, operands to
# the tensor cores as loaded (PASSES = 2).
PASSES = 2


@triton.jit
def _linear_kernel(
    X,  # *[M, K] activations (FP8 with ACT_FP8), row stride stride_xm, unit column stride
    W,  # *[N, K] weight (nn.Linear layout), row stride stride_wn (X, W: TMA descriptors with TMA)
    B,  # *[N] bias (HAS_BIAS only)
    R,  # *[M, N] residual, row stride stride_rm, unit column stride (HAS_RESIDUAL only)
    OUT,  # *[M, N] output, row stride stride_om
    WS,  # *[SPLIT_K, M, N] float32 partial products (split-K only)
    SW,  # *[N] float32 per-output-channel scales of W (W_SCALED only)
    SX,  # *[M] float32 scales of X's rows (ACT_FP8 only)
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a slice of K
    FINISH: tl.constexpr,  # the split-K finishing pass: add the partials up, then the epilogue
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products instead of tf32
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter runs the kernel (_matmul.dot)
    W_FP8: tl.constexpr,  # how the weight tiles are read (fp8.W_*, _matmul.mma_weight)
    W_SCALED: tl.constexpr,  # W has per-output-channel scales SW
    ACT_FP8: tl.constexpr,  # X holds e4m3 rows with scales SX (FP8 activations)
    UNROLL_K: tl.constexpr,  # BLOCK_M == 1: two K-steps per loop iteration (gemv_one_product)
    SPREAD: tl.constexpr,  # BLOCK_M == 1: the program's BLOCK_N columns far apart (block_rows)
    THREAD_SUM: tl.constexpr,  # BLOCK_M == 1: each thread adds its weight run up first
    TMA: tl.constexpr,  # X and W are TMA descriptors (tensor-core tiles, see tma_one_product)
    HAS_BIAS: tl.constexpr,  # B is added in the epilogue
    HAS_RESIDUAL: tl.constexpr,  # R is added in the epilogue
):
    pid_m, pid_n = grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of X and OUT
    rn = block_rows(pid_n, N, BLOCK_N, SPREAD)  # rows of W, columns of OUT
    m_ok = rm < M
    n_ok = rn < N
    mn_ok = m_ok[:, None] & n_ok[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FINISH:
        for s in range(SPLIT_K):
            acc += tl.load(partial_ptrs(WS, s, rm, rn, M, N), mask=mn_ok, other=0.0)
    elif BLOCK_M == 1:  # one row per program, no tensor cores (the decode structure)
        # rn[None, :] · stride_wn: where each of the BLOCK_N weight rows starts (int64: N·K
        # may pass 2^31 elements). No norm (PASSES = 2): the row and column sums stay zero and
        # the compiler drops them.
        acc, _sum_x, _sum_x2, _sum_w = gemv_one_product(
            X, W, rn[None, :].to(tl.int64) * stride_wn, rm, m_ok, n_ok, K, stride_xm, BLOCK_N,
            BLOCK_K, SPLIT_K, 2, W_FP8, UNROLL_K, THREAD_SUM)
    elif TMA:  # the copy engine fetches the tiles; boxes past the edges arrive zero-filled
        acc = tma_one_product(X, W, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N,
                              BLOCK_K, SPLIT_K, IEEE, INTERPRETED)
    else:
        k_begin, k_end = k_slice(K, BLOCK_K, SPLIT_K)
        rk = tl.arange(0, BLOCK_K)
        # x tile [BLOCK_M, BLOCK_K]: row rm at rm · stride_xm, column k at k (unit stride). The
        # weight tile is read transposed, as [BLOCK_K, BLOCK_N]: element (k, n) of it is
        # W[rn[n], k], so tl.dot(x, w) is x·Wᵀ. Row offsets in int64, as above.
        x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_begin + rk)[None, :]
        w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + (k_begin + rk)[:, None]
        for k0 in range(k_begin, k_end, BLOCK_K):
            k_ok = rk < k_end - k0  # partial last step: masked lanes read 0 and add nothing
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            # FP8 weights: upcast exactly to x's type in registers. Otherwise the tiles go from
            # memory to the tensor cores untouched, which lets the compiler keep the
            # asynchronous load/MMA pipeline that many rows want.
            acc = dot(x, mma_weight(w, x, W_FP8), acc, IEEE, INTERPRETED)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

    if SPLIT_K > 1 and not FINISH:
        # This K-slice's partial sums; the finishing launch adds the slices and runs the
        # epilogue, so the scale, the bias and the residual are applied once, to the whole sum.
        tl.store(partial_ptrs(WS, tl.program_id(1), rm, rn, M, N), acc, mask=mn_ok)
    else:
        # float32 throughout, in this order: acc · scales (x's rows', W's channels') + bias
        # + residual, then one rounding to the output's dtype.
        y = scale_product(acc, SX, rm, m_ok, SW, rn, n_ok, ACT_FP8, W_SCALED)
        if HAS_BIAS:
            y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            # Masked elements (rows past M, columns past N) are neither read nor stored.
            r_ptrs = R + rm[:, None].to(tl.int64) * stride_rm + rn[None, :]
            y += tl.load(r_ptrs, mask=mn_ok, other=0.0).to(tl.float32)
        out_ptrs = OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mn_ok)


def linear_config(config: Config) -> Config:
    """`config` with linear's one meaning of PASSES (see the module docstring): what the
    launcher runs and what the resource model prices."""
    if config["PASSES"] == PASSES:
        return config
    return {**config, "PASSES": PASSES}


def _launch_2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               r: torch.Tensor | None, out: torch.Tensor, config: Config,
               sw: torch.Tensor | None = None, act: bool = False) -> None:
    """Launches on x [M, K], w [N, K] (unit column strides; x's dtype or FP8 with optional
    per-channel scales sw [N]), b [N] or None, r [M, N] (unit column stride) or None, out
    [M, N]; `act`: FP8 activations (x's rows quantized to e4m3 by a pass first).
    SPLIT_K > 1: SPLIT_K programs per output tile write float32 partial sums, and a second
    launch of the same kernel (FINISH) adds them up and applies the epilogue."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return
    if _unfused.unfused(config):
        _unfused_2d(x, w, b, r, out, sw, act)
        return
    config = linear_config(config)
    x, sx = first_pass(x, None, 0.0, config, act, None)
    w, w_fp8 = fp8.weight_operand(w, act, config["BLOCK_M"] == 1)
    # TMA: the K loop reads x and W through descriptors, where the config asks for it and the
    # tensors allow it (else the same tiles by pointers).
    descs = tma_descriptors("linear", config, w_fp8, x, [w])
    xa, wa = descs or (x, w)
    split = config["SPLIT_K"]
    ws = out  # not read unless split > 1
    if split > 1:
        ws = scratch((split, m, n), torch.float32, x.device)
    # PASSES has one meaning here: not a constexpr of the kernel
    args = launch_args(config, act=act, w_fp8=w_fp8, ieee=x.dtype == torch.float32,
                       w_scaled=sw is not None, tma=descs is not None, passes=False)
    # Absent operands: another tensor stands in for the pointer, never read (HAS_* = 0).
    bias = out if b is None else b
    res, stride_rm = (out, 0) if r is None else (r, r.stride(0))
    scales = out if sw is None else sw

    def launch(grid: tuple[int, int], finish: bool) -> None:
        direct(_linear_kernel)[grid](
            xa, wa, bias, res, out, ws, scales, out if sx is None else sx, m, n, k,
            x.stride(0), w.stride(0), stride_rm,
            out.stride(0), FINISH=finish, HAS_BIAS=b is not None, HAS_RESIDUAL=r is not None,
            **args,
        )

    launch_split(launch, cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]), split)


def _unfused_2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                r: torch.Tensor | None, out: torch.Tensor, sw: torch.Tensor | None,
                act: bool) -> None:
    """UNFUSED = 1 (_unfused): cuBLAS, the residual (and the bias) added by its beta
    (torch.addmm; FP8 weights upcast with their scales)."""
    if act:
        raise ConfigError("linear: UNFUSED=1 with FP8 activations: that mode runs fused only")
    add = r if b is None else b if r is None else r + b
    _unfused.matmul(x, w, sw, out, add)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """x·Wᵀ + bias + residual for x [..., in_features], weight [out_features, in_features]
    (nn.Linear's layout); returns a new tensor [..., out_features] in x's dtype.

    `weight` is in x's dtype, or FP8 (torch.float8_e4m3fn or float8_e5m2, e.g. from
    fusetune.quantize_fp8) with optional float32 scales per output channel `weight_scale`
    [out_features] (None: 1), W = weight_scale[:, None] · weight. `bias` [out_features] and
    `residual` [..., out_features] (x's leading shape) are in x's dtype, or None. The sum is
    taken in float32, (x·Wᵀ)·scale + bias + residual, and rounded once. FP8 weights are
    weight-only (x stays in its dtype) unless `fp8_activations=True` asks for x's rows
    rounded to e4m3 too (see fusetune.ffn). The config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    PASSES, SPLIT_K, UNROLL_K, SPREAD, THREAD_SUM, TMA, num_warps, num_stages) comes from the
    lookup tables (for this weight format and activation mode, with or without bias and
    residual) unless `config` is given; no config changes the numerics.
    """
    memo_key = None
    if _MEMO.active(config):
        memo_key = (tensor_key(x), tensor_key(weight), tensor_key(bias), tensor_key(residual),
                    tensor_key(weight_scale), fp8_activations)
        inputs = (x, weight, bias, residual, weight_scale)

        def run(cfg: Config) -> torch.Tensor:
            return _run(x, weight, bias, residual, weight_scale, fp8_activations, cfg)

        out = _MEMO.repeat(memo_key, inputs, run)
        if out is not None:
            return out
    if x.ndim < 1:
        raise ValueError("linear: x must have at least one dimension")
    k = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != k:
        raise ValueError(f"linear: weight must be [out_features, {k}] (nn.Linear layout, "
                         f"in_features = x's last dimension), got {tuple(weight.shape)}")
    n = weight.shape[0]
    dtype = dtype_name(x.dtype)
    weights = fp8.check_weights("linear", x, {"weight": weight}, {"weight_scale": weight_scale})
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"linear: bias has shape {tuple(bias.shape)}, expected ({n},)")
        if bias.dtype != x.dtype:
            raise TypeError(f"linear: bias is {bias.dtype}, expected x's dtype {x.dtype}")
    if residual is not None:
        lead = tuple(x.shape[:-1])
        if tuple(residual.shape) != (*lead, n):
            raise ValueError(f"linear: residual has shape {tuple(residual.shape)}, expected "
                             f"{(*lead, n)} (x's leading shape {lead}, out_features {n})")
        if residual.dtype != x.dtype:
            raise TypeError(f"linear: residual is {residual.dtype}, expected x's dtype "
                            f"{x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"linear: {name} is on {t.device}, x on {x.device}")
    check_device(x, "linear")
    check_no_grad("linear", x, weight, bias, residual)
    if fp8_activations:
        fp8.check_fp8_activations("linear", weights, x.device)
    if config is None:
        since = _MEMO.generation()
        from fusetune.runtime import cached_config

        dims = (("bias", int(bias is not None)), ("dim", k), ("out", n),
                ("residual", int(residual is not None)))
        m = x.numel() // k if k else 0
        cfg = cached_config(SPEC, dims, dtype, m, weights, x.device,
                            activations="fp8" if fp8_activations else "")
        if memo_key is not None:
            return _MEMO.first(memo_key, inputs, cfg, since, run)
    else:
        cfg = SPEC.validate_config(config)
    return _run(x, weight, bias, residual, weight_scale, fp8_activations, cfg)


_MEMO = CallMemo()


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         residual: torch.Tensor | None, weight_scale: torch.Tensor | None,
         fp8_activations: bool, cfg: Config) -> torch.Tensor:
    """linear's launch, once its inputs are checked and its config chosen."""
    k, n = x.shape[-1], weight.shape[0]
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _launch_2d(as_rows(x, k), w, None if bias is None else bias.contiguous(),
               None if residual is None else as_rows(residual, n), out.view(-1, n), cfg,
               None if weight_scale is None else weight_scale.contiguous(),
               bool(fp8_activations))
    return out


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    k, n = point.dim["dim"], point.dim["out"]
    dtype = torch_dtype(point.dtype)
    x = torch.randn(point.batch, point.seq, k, device=device)
    # nn.Linear's default init scale, so that x·Wᵀ is O(1) like the residual stream beside it.
    w, w_scale = fp8.spec_weight(torch.randn(n, k, device=device) / k**0.5, point)
    b = (0.1 * torch.randn(n, device=device)).to(dtype) if point.dim["bias"] else None
    r = (torch.randn(point.batch, point.seq, n, device=device).to(dtype)
         if point.dim["residual"] else None)
    return {"x": x.to(dtype), "weight": w, "weight_scale": w_scale, "bias": b, "residual": r,
            "fp8_activations": point.fp8_activations}


def _make_outputs(inputs: Tensors) -> Tensors:
    x, w = inputs["x"], inputs["weight"]
    return {"y": torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)}


def _reference(inputs: Tensors) -> Tensors:
    # FP8 weights: the dequantized weights the kernel multiplies by.
    y = inputs["x"].float() @ fp8.spec_dequantized(inputs, "weight").T
    if inputs.get("bias") is not None:
        y = y + inputs["bias"].float()
    if inputs.get("residual") is not None:
        y = y + inputs["residual"].float()
    return {"y": y}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    x, y, r = inputs["x"], outputs["y"], inputs.get("residual")
    _launch_2d(x.view(-1, x.shape[-1]), inputs["weight"], inputs.get("bias"),
               None if r is None else r.view(-1, r.shape[-1]), y.view(-1, y.shape[-1]), config,
               inputs.get("weight_scale"), inputs.get("fp8_activations", False))


def _default_config(point: Point, gpu: GpuSpec) -> Config:
    """The matmul kernels' default tiles (_matmul.default_tiles), adapted to a product with one
    weight matrix and a light epilogue where the GPU can hold the result (else those tiles)."""
    n, k = point.dim["out"], point.dim["dim"]
    base = default_tiles(point, gpu, _resources, n, k)
    c = dict(base)
    m = point.rows
    if m == 1:
        # Split K only where the column-blocks alone leave the SMs short of programs: with
        # one weight matrix the kernel is short, and the finishing launch and the round trip
        # of the partial sums weigh more than the extra programs gain once every SM has two.
        c["SPLIT_K"] = 1
        tiles = cdiv(n, c["BLOCK_N"])
        while (c["SPLIT_K"] < 8 and tiles * c["SPLIT_K"] < 2 * gpu.sms
               and c["SPLIT_K"] * 2 * c["BLOCK_K"] <= k):
            c["SPLIT_K"] *= 2
    elif m <= 16:
        # A few rows read the weights once per column-block: one weight tile per K-step
        # leaves room for twice the K-step, and half as many columns per program doubles the
        # programs (N = 4096: 128 of them rather than 64) that stream them.
        c.update(BLOCK_N=32, BLOCK_K=256)
    elif m > 128 and not point.weights:
        # One accumulator and no second weight tile: a 128 x 256 tile fits in registers and
        # shared memory, and reads x half as often as 128 x 128.
        c.update(BLOCK_N=256)
    if check_fits(_resources(c, point), gpu) is not None:
        c = base
    return _canonical(c, point)


def _canonical(config: Config, point: Point) -> Config:
    return matmul_canonical(linear_config(config), point, point.dim["out"], point.dim["dim"])


def _resources(config: Config, point: Point) -> Resources:
    # One weight tile per K-step, one accumulator. The residual tile is loaded in the epilogue,
    # beside the accumulator, and the register estimate leaves it out: the widest tiles may
    # then take a few registers more than predicted, which the timing judges (pruning them
    # would lose the tiles that prefill wants).
    return matmul_resources(linear_config(config), point, n_weights=1, epilogue=False,
                            base_regs=40, unfused=True)


def _cost(point: Point) -> Cost:
    m, k, n = point.rows, point.dim["dim"], point.dim["out"]
    elt = DTYPE_BYTES[point.dtype]
    # x read, y written, the weights (FP8: and their scales), the bias and the residual read.
    moved = m * k + m * n + point.dim["bias"] * n + point.dim["residual"] * m * n
    return Cost(bytes=moved * elt + weight_bytes(point, n, k), flops=2 * m * k * n)


def model_uses(model: ModelPreset) -> dict[str, dict[str, int]]:
    """linear's dims in a Llama-style decoder layer, by projection: attention's o_proj
    (n_heads·head_dim -> dim) and the MLP's down_proj (hidden -> dim), each followed by the
    residual add that the kernel fuses; neither has a bias."""
    return {"o_proj": {"dim": model.n_heads * model.head_dim, "out": model.dim, "bias": 0,
                       "residual": 1},
            "down_proj": {"dim": model.hidden, "out": model.dim, "bias": 0, "residual": 1}}


def _dims_from_model(model: ModelPreset) -> dict[str, int]:
    # A preset names one point per kernel: down_proj, the larger of the two projections (its
    # weights are hidden/dim times o_proj's, the most bytes a decode step reads through linear).
    # o_proj's dims: model_uses(model)["o_proj"].
    return model_uses(model)["down_proj"]



def _padding(config: Config, point: Point) -> float:
    return matmul_padding(linear_config(config), point, point.dim["out"], point.dim["dim"])

SPEC = KernelSpec(
    name="linear",
    description="x·Wᵀ (· FP8 channel scales) + bias + residual, fused epilogue",
    dim_names=("bias", "dim", "out", "residual"),
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_default_config,
    resources=_resources,
    cost=_cost,
    canonical=_canonical,
    padding=_padding,
    dims_from_model=_dims_from_model,
    source_objects=(_linear_kernel, grouped_tile, block_rows, k_slice, partial_ptrs, dot,
                    gemv_one_product, tma_one_product, fp8_as_f16, mma_weight, gemv_weight,
                    scale_product, linear_config, _launch_2d, launch_args, launch_split, use_tma,
                    tma_descriptors, fp8.weight_operand, _unfused_2d, *_unfused.SOURCES),
    algorithm_sources=(_unfused_2d, *_unfused.SOURCES),
    algorithm_keys=("UNFUSED",),
    dim_choices={"bias": {0: "no bias", 1: "a bias added"},
                 "residual": {0: "no residual", 1: "a residual added"}},
    **MATMUL_SPEC_FIELDS,
)
