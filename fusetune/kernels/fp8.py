"""FP8 weights for the matmul kernels (qkv, ffn, lola, linear): the formats, `quantize_fp8`,
and the pass that normalizes and quantizes the activations for FP8 activations.

A weight W [out_features, in_features] is stored as Wq in FP8 (e4m3 or e5m2) with one float32
scale per output channel, W ≈ s[:, None] · Wq. The kernels read Wq (one byte per element) and
apply s in their epilogue, y[:, n] = s[n] · (x·Wqᵀ)[:, n], after the split-K partial sums are
added and before SiLU / GELU / RoPE / the bias. Two numerics, the caller's choice (a mode of
the call and part of every key, Point.activations; never a tunable):

- weight-only (the default): each weight tile is upcast to the activations' dtype in registers
  (FP8 values are exact in float16, bfloat16 and float32, so the product sees exactly the
  stored weights: the 16-bit tolerances hold against the dequantized weights). Works on every
  GPU: e5m2 is read as bytes (the top byte of a float16); e4m3, which Triton knows only from
  sm_89 on, with Triton's conversion (the hardware's) in the one-row GEMV loop there, and as
  bytes decoded with integer operations otherwise (beside tl.dot that decoding is the faster
  of the two; see weight_operand).
- FP8 activations (`fp8_activations=True`, on GPUs with FP8 tensor cores): a pass normalizes
  the activations and writes them as e4m3 with one float32 scale per row (`norm_fp8_rows`),
  the K loop multiplies FP8 by FP8 with float32 accumulation (on the tensor cores; the one-row
  structure upcasts both in registers: the same products), and the epilogue multiplies by the
  row scale and the weight's channel scale. Every config of such a point rounds the same
  activations the same way (the norm is always its own pass: the specs' `canonical` sets
  PASSES = 2), so one tolerance, ACT_FP8_TOLERANCE, holds for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusetune.kernels._direct import direct
from fusetune.kernels._matmul import cuda_capability, row_norm_stats
from fusetune.kernels._replay import scratch
from fusetune.spec import (
    DTYPE_BYTES,
    WEIGHT_FORMATS,
    Config,
    Point,
    Tensors,
    interpreting,
    next_pow2,
)

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# The largest finite value of each format: quantize_fp8 maps each channel's largest |w| there.
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}

# ‖out − ref‖ / ‖ref‖ allowed with FP8 activations, against the reference that multiplies the
# unrounded normalized activations by the dequantized weights. Rounding the activations to e4m3
# (3 mantissa bits) costs a few percent of relative error, more for ffn's product of two
# (silu(a)·b) than for one product (qkv, lola, linear); twice ffn's is allowed. Weight-only FP8
# is held to the 16-bit tolerances: its products see the stored weights exactly.
ACT_FP8_TOLERANCE: dict[str, float] = {"float16": 0.08, "bfloat16": 0.08, "float32": 0.08}

# How a matmul kernel reads its weight tiles: the W_FP8 constexpr (see _matmul.mma_weight).
W_AS_IS = 0  # x's dtype, or FP8 multiplied as FP8 beside FP8 activations
W_UPCAST = 1  # an FP8 type this GPU's Triton has: upcast in registers
W_E4M3_BYTES = 2  # e4m3 before sm_89: read as uint8, decoded with integer operations
W_E5M2_BYTES = 3  # e5m2: read as uint8, the high byte of a float16


_FORMAT_OF: dict[torch.dtype, str] = {t: name for name, t in FORMATS.items()}


def fp8_format(dtype: torch.dtype) -> str | None:
    """The format ("e4m3" or "e5m2") of torch's FP8 weight types; None for any other dtype."""
    return _FORMAT_OF.get(dtype)


def weights_key(dtype: torch.dtype) -> str:
    """The Point.weights (and lookup-table `weights`) of weights stored as `dtype`: "fp8-e4m3",
    "fp8-e5m2", or "" for weights in the activations' dtype."""
    fmt = fp8_format(dtype)
    return f"fp8-{fmt}" if fmt else ""


def quantize_fp8(weight: torch.Tensor, fmt: str = "e4m3", *, per_channel: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq, scale): `weight` [out_features, in_features] in FP8 with one float32 scale per
    output channel, weight ≈ scale[:, None] · Wq; or a mixture of experts' [experts,
    out_features, in_features] with scales [experts, out_features] (fusetune.moe).

    Each channel's scale maps its largest |w| onto the format's largest value (448 for e4m3,
    57344 for e5m2), so nothing saturates; all-zero channels get scale 1. Values are rounded to
    nearest, ties to even. `per_channel=False` chooses one scale for the whole tensor (returned
    repeated per channel, so that it goes where the per-channel scales go). Quantize a model's
    weights once and pass (Wq, scale) to fusetune.ffn / qkv / lola / moe on every call.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantize_fp8: unknown fmt {fmt!r}; valid: {', '.join(FORMATS)}")
    if weight.ndim not in (2, 3):
        raise ValueError(f"quantize_fp8: weight must be [out_features, in_features] or [experts, "
                         f"out_features, in_features], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize_fp8: weight is {weight.dtype}; expected a floating-point "
                        "tensor")
    w = weight.float()
    if weight.numel() and not torch.isfinite(w).all():
        raise ValueError("quantize_fp8: weight has non-finite values (inf or nan)")
    top = FP8_MAX[fmt]
    channels = weight.shape[:-1]
    if per_channel:
        amax = w.abs().amax(dim=-1) if weight.shape[-1] else w.new_zeros(channels)
    else:
        amax = (w.abs().amax() if weight.numel() else w.new_zeros(())).expand(channels)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax)).contiguous()
    # The clamp only absorbs the last bit of rounding in w / scale at each channel's max.
    wq = (w / scale[..., None]).clamp(-top, top).to(FORMATS[fmt])
    return wq, scale


def dequantize(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 weights the kernels multiply by: Wq · scale per output channel (scale None:
    1)."""
    wf = w.float()
    return wf if scale is None else wf * scale.float()[..., None]


def quantize_rows(xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FP8 activations' norm pass makes of normalized activations xn [..., K], in torch:
    e4m3 values and one float32 scale per row (the row's largest |x| maps to 448)."""
    xf = xn.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX["e4m3"], torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-FP8_MAX["e4m3"], FP8_MAX["e4m3"])
    return q.to(torch.float8_e4m3fn), scale


def has_fp8(device: torch.device) -> bool:
    """Whether kernels on `device` have Triton's e4m3 type and FP8 tensor cores (compute
    capability 8.9+; the CPU interpreter emulates both)."""
    if device.type != "cuda":
        return interpreting()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_capability(index) >= (8, 9)


def weight_operand(w: torch.Tensor, fp8_activations: bool, gemv: bool = False
                   ) -> tuple[torch.Tensor, int]:
    """The tensor a kernel receives for the weight `w` and its W_FP8 constexpr; `gemv`: the
    config's structure is one row per program (BLOCK_M = 1)."""
    fmt = fp8_format(w.dtype)
    if fmt is None or fp8_activations:
        return w, W_AS_IS
    if fmt == "e5m2":
        return w.view(torch.uint8), W_E5M2_BYTES
    # e4m3 where this GPU's Triton has the type (sm_89+) and the interpreter: Triton's
    # conversion, which on sm_90 is the hardware's (two bytes per instruction), is the faster
    # decoding in the GEMV loop; beside tl.dot the integer decoding is, so the tensor-core
    # loop reads bytes.
    if not has_fp8(w.device) or (w.device.type == "cuda" and not gemv):
        return w.view(torch.uint8), W_E4M3_BYTES
    return w, W_UPCAST


def check_weights(kernel: str, x: torch.Tensor, weights: dict[str, torch.Tensor],
                  scales: dict[str, torch.Tensor | None]) -> str:
    """Checks the weights' dtypes (one for all, x's or an FP8 type) and the scales (float32, one
    per output channel: the weight's shape but its last dim; on x's device, FP8 weights only);
    returns the weights' Point.weights."""
    if (all(w.dtype == x.dtype for w in weights.values())
            and all(s is None for s in scales.values())):
        return ""  # the common case, decided without the checks below (a launcher's every call)
    names = list(weights)
    dtypes = {w.dtype for w in weights.values()}
    for name, w in weights.items():
        if w.dtype != x.dtype and fp8_format(w.dtype) is None:
            raise TypeError(f"{kernel}: {name} is {w.dtype}, expected x's dtype {x.dtype} or an "
                            f"FP8 type ({', '.join(map(str, FORMATS.values()))})")
    if len(dtypes) > 1:
        got = ", ".join(f"{n} {w.dtype}" for n, w in weights.items())
        raise TypeError(f"{kernel}: {' and '.join(names)} must have one dtype, got {got}")
    key = weights_key(next(iter(dtypes)))
    for (name, w), (sname, s) in zip(weights.items(), scales.items(), strict=True):
        if s is None:
            continue
        if not key:
            raise TypeError(f"{kernel}: {sname} is for FP8 weights; {name} is {w.dtype} (pass "
                            f"{sname}=None, or FP8 weights from fusetune.quantize_fp8)")
        if s.shape != w.shape[:-1] or s.dtype != torch.float32:
            raise ValueError(f"{kernel}: {sname} must be float32 of shape {tuple(w.shape[:-1])} "
                             f"(one scale per output channel of {name}), got {s.dtype} of shape "
                             f"{tuple(s.shape)}")
        if s.device != x.device:
            raise ValueError(f"{kernel}: {sname} is on {s.device}, x on {x.device}")
    return key


def check_fp8_activations(kernel: str, weights: str, device: torch.device) -> None:
    """ValueError unless FP8 activations can run: beside FP8 weights (Point.weights `weights`),
    on a device with Triton's e4m3 type and FP8 tensor cores."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"{kernel}: fp8_activations=True needs FP8 weights (e.g. from "
                         "fusetune.quantize_fp8); these weights are in the activations' dtype")
    if has_fp8(device):
        return
    has = "none"
    if device.type == "cuda":
        major, minor = cuda_capability(device.index if device.index is not None
                                   else torch.cuda.current_device())
        has = f"compute capability {major}.{minor}"
    raise ValueError(f"{kernel}: FP8 activations need FP8 tensor cores (compute capability "
                     f"8.9+), {device} has {has}; leave fp8_activations off (weight-only FP8)")


# ---- what the specs need --------------------------------------------------------------------


def collapse_fp8_activations(config: Config, point: Point, k: int) -> Config:
    """With FP8 activations the norm is always its own pass (it chooses each row's scale before
    the K loop: PASSES = 2), and tensor-core tiles need BLOCK_K >= 32 (the K-step of 8-bit
    MMAs)."""
    if not point.fp8_activations:
        return config
    c = dict(config)
    c["PASSES"] = 2
    if c["BLOCK_M"] > 1 and c["BLOCK_K"] < 32:
        c["BLOCK_K"] = 32
        while c["SPLIT_K"] > 1 and c["SPLIT_K"] > -(-k // 32):
            c["SPLIT_K"] //= 2
    return c


def operand_bytes(point: Point) -> tuple[int, int, bool]:
    """(bytes per activation element in the K loop, per weight element, whether the weight
    tiles are converted in registers) at `point`."""
    elt = DTYPE_BYTES[point.dtype]
    if point.weights not in WEIGHT_FORMATS:
        return elt, elt, False
    if point.fp8_activations:
        return 1, 1, False
    return elt, 1, True


def spec_weight(w: torch.Tensor, point: Point) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float32 weight as a point's make_inputs stores it: in the activations' dtype (no
    scale), or quantized to the point's FP8 format with per-channel scales."""
    if point.weights not in WEIGHT_FORMATS:
        return w.to(getattr(torch, point.dtype)), None
    return quantize_fp8(w, point.weights.removeprefix("fp8-"))


def spec_dequantized(inputs: Tensors, name: str) -> torch.Tensor:
    """A make_inputs weight as the float32 the kernel multiplies by (the reference's)."""
    return dequantize(inputs[name], inputs.get(f"{name}_scale"))


# ---- the activations' pass for FP8 activations ----------------------------------------------


@triton.jit
def e4m3_byte(v):
    """The e4m3 byte (uint8) of float32 v, |v| <= 448: round to nearest, ties to even, as
    torch's .to(torch.float8_e4m3fn). In integer arithmetic, so that every backend rounds alike
    (the interpreter's float -> FP8 conversion drops the carry of a mantissa that rounds up)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (|v| >= 2^-6): keep 3 of float32's 23 mantissa bits by adding just under
    # half of the 20 dropped ones plus the kept lowest bit (ties to even); a carry out of the
    # mantissa moves into the exponent as it should. Then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal range: multiples of 2^-9. Adding 1.5·2^14 leaves float32 a spacing of 2^-9
    # there, so the addition rounds to nearest-even at exactly that spacing. 8·2^-9 = 2^-6
    # comes out as 8, the byte of the smallest normal value.
    sub = (((a + 24576.0) - 24576.0) * 512.0).to(tl.int32)
    mag = tl.where(a < 0.015625, sub, normal)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80  # arithmetic shift: 0x80 iff v < 0
    return (mag | sign).to(tl.uint8)


@triton.jit
def _normalized(x_row, G, cols, col_ok, mean, rstd, RMS: tl.constexpr):
    """The normalized values of the columns `cols` of one row, float32, 0 on masked lanes."""
    x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
    if RMS:
        y = x * rstd * tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        y = (x - mean) * rstd
    return tl.where(col_ok, y, 0.0)


@triton.jit
def _norm_fp8_kernel(
    X,  # *[M, K] activations, row stride stride_xm, unit column stride
    G,  # *[K] RMSNorm weight (RMS only)
    Q,  # *[M, K] uint8, contiguous: e4m3 bytes of the normalized rows divided by their scales
    S,  # *[M] float32 row scales: normalized row m ≈ S[m] · Q[m, :]
    K,
    stride_xm,
    eps,
    RMS: tl.constexpr,  # 1: RMSNorm x·rsqrt(mean(x²) + eps)·G; 0: LayerNorm without affine
    BLOCK_K: tl.constexpr,  # columns per step; K is covered in ceil(K / BLOCK_K) steps
    NORM: tl.constexpr,  # 0: no norm, the rows are quantized as they are (RMS 0)
):
    # One row per program, all in float32: the statistics, the row's largest |value|, then the
    # quantized values. The row is read from memory once, the later passes find it in cache.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    q_row = Q + row * K
    rk = tl.arange(0, BLOCK_K)
    if NORM:
        mean, rstd = row_norm_stats(x_row, K, eps, RMS, BLOCK_K)
    else:  # (x - 0) · 1: _normalized's LayerNorm branch passes the row through
        mean = 0.0
        rstd = 1.0
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        y = _normalized(x_row, G, k0 + rk, k0 + rk < K, mean, rstd, RMS)
        amax = tl.maximum(amax, tl.abs(y))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top / 448.0, 1.0)  # the row's largest |value| becomes 448
    for k0 in range(0, K, BLOCK_K):
        y = _normalized(x_row, G, k0 + rk, k0 + rk < K, mean, rstd, RMS)
        # The clamp only absorbs the last bit of rounding in y / scale at the row's max.
        v = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        tl.store(q_row + k0 + rk, e4m3_byte(v), mask=k0 + rk < K)
    tl.store(S + row, scale)


def norm_fp8_rows(x: torch.Tensor, g: torch.Tensor | None, eps: float, norm: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with weight `g` (LayerNorm without affine where g is None; no norm at all
    where `norm` is False) of x [M, K] (unit column stride), quantized per row: (e4m3 [M, K],
    float32 scales [M]); the first of the matmul kernels' two passes with FP8 activations.
    Matches `quantize_rows` of the normalized rows up to float32 rounding."""
    m, k = x.shape
    q = scratch((m, k), torch.uint8, x.device)
    s = scratch((m,), torch.float32, x.device)
    if m:
        block = min(next_pow2(k), 4096)
        direct(_norm_fp8_kernel)[(m,)](x, x if g is None else g, q, s, k, x.stride(0), eps,
                               RMS=norm and g is not None, BLOCK_K=block, NORM=norm,
                               num_warps=max(1, min(16, block // 256)))
    return q.view(torch.float8_e4m3fn), s


# The jit code of the FP8 activations' pass: part of the matmul kernels' source hashes.
FP8_SOURCES = (e4m3_byte, _normalized, row_norm_stats, _norm_fp8_kernel, norm_fp8_rows,
               weight_operand)
