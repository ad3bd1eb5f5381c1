"""FP8 weights in qkv, ffn and lola, and fusetune.quantize_fp8 (interpreter on CPU).

References are float64 on the dequantized weights (Wq · per-channel scale), i.e. the weights the
kernel multiplies by. FP8 weights are weight-only unless the caller asks for FP8 activations:
every structure is then held to the 16-bit tolerance against that reference. With
fp8_activations=True the kernel also rounds the normalized activations to e4m3 (one scale per
row); its reference then does the same in torch (fp8.quantize_rows), so that mode is held to the
16-bit tolerance too, and to its stated bound (fp8.ACT_FP8_TOLERANCE) against the plain
dequantizing reference.

Rounding to FP8 in Triton's interpreter is not torch's: its float -> FP8 conversion drops the
carry of a mantissa that rounds up (7.93 becomes 4.0 in e4m3, not 8.0), so a kernel relying on
`.to(tl.float8e4nv)` differs from torch by whole binades on a few elements. The activations'
pass rounds in integer arithmetic instead (fp8.e4m3_byte), which matches torch bit for bit on every
backend (test_e4m3_byte_is_torchs_rounding). Upcasts from FP8 are exact in the interpreter but
for e5m2's subnormals, which the kernels decode from the bytes themselves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from launched import compiled_kernels, descriptors_made

import fusetune
from fusetune import gpus
from fusetune.kernels import ffn as ffn_mod
from fusetune.kernels import fp8
from fusetune.kernels import lola as lola_mod
from fusetune.kernels import qkv as qkv_mod
from fusetune.spec import ConfigError, Point, check_fits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
FMTS = ("e4m3", "e5m2")
SPECS = {"ffn": ffn_mod.SPEC, "qkv": qkv_mod.SPEC, "lola": lola_mod.SPEC}


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


# ---- quantize_fp8 ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_fp8_never_saturates_and_rounds_to_nearest(fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # Channels of very different magnitudes, an outlier, a negative maximum.
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-4, 3, 64)[:, None]
    w[3, 7] = 5e4
    w[5] = -w[5].abs()
    wq, scale = fusetune.quantize_fp8(w, fmt)
    top = fp8.FP8_MAX[fmt]
    assert wq.dtype == fp8.FORMATS[fmt] and wq.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    q = wq.float()
    assert torch.isfinite(q).all()
    assert q.abs().max() <= top
    # Each channel's largest |w| lands on the format's largest value: the range is all used.
    assert torch.equal(q.abs().amax(dim=1), torch.full((64,), top))
    # Round to nearest: off by at most half a unit in the last place (3 mantissa bits for e4m3,
    # 2 for e5m2) of the value, or of the smallest normal for subnormals.
    mant, min_normal = {"e4m3": (3, 2.0**-6), "e5m2": (2, 2.0**-14)}[fmt]
    half_ulp = q.abs().clamp_min(min_normal) * 2.0 ** -(mant + 1)
    assert ((w / scale[:, None] - q).abs() <= half_ulp * (1 + 1e-6)).all()
    back = fp8.dequantize(wq, scale)
    assert float((back - w).norm() / w.norm()) < {"e4m3": 0.04, "e5m2": 0.08}[fmt]


def test_quantize_fp8_zero_rows_per_tensor_and_errors() -> None:
    w = torch.randn(4, 16)
    w[1] = 0
    wq, scale = fusetune.quantize_fp8(w)
    assert scale[1] == 1.0 and not wq[1].float().any()
    _, one = fusetune.quantize_fp8(w, "e5m2", per_channel=False)
    assert torch.equal(one, torch.full((4,), float(w.abs().max()) / 57344.0))
    _, zero = fusetune.quantize_fp8(torch.zeros(3, 5), per_channel=False)
    assert torch.equal(zero, torch.ones(3))
    with pytest.raises(ValueError, match=r"unknown fmt 'e3m4'; valid: e4m3, e5m2"):
        fusetune.quantize_fp8(w, "e3m4")
    with pytest.raises(ValueError, match=r"\[out_features, in_features\]"):
        fusetune.quantize_fp8(w[0])
    w[2, 3] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        fusetune.quantize_fp8(w)


def test_weights_key() -> None:
    assert fp8.weights_key(torch.float8_e4m3fn) == "fp8-e4m3"
    assert fp8.weights_key(torch.float8_e5m2) == "fp8-e5m2"
    assert fp8.weights_key(torch.float16) == ""


@triton.jit
def _e4m3_kernel(X, Q, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Q + r, fp8.e4m3_byte(tl.load(X + r)))


def test_e4m3_byte_is_torchs_rounding() -> None:
    # Every finite e4m3 value, the exact midpoints between neighbours (ties to even), the
    # floats just beside them, and random values over the whole range and near zero.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    vals = torch.cat([codes, mids, mids.nextafter(torch.tensor(1e9)),
                      mids.nextafter(torch.tensor(-1e9)),
                      (torch.rand(20000, generator=gen) * 2 - 1) * 448,
                      torch.randn(10000, generator=gen) * 1e-2])
    n = triton.cdiv(vals.numel(), 1024) * 1024
    x = torch.zeros(n, device=DEVICE)
    x[: vals.numel()] = vals.to(DEVICE)
    q = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _e4m3_kernel[(n // 1024,)](x, q, BLOCK=1024)
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    same = (q == expected) | (x == 0)  # -0.0 and 0.0 may differ in the sign bit
    assert same.all(), x[~same][:8].tolist()


# ---- the kernels against the dequantizing reference -----------------------------------------


def rope64(t: torch.Tensor, start_pos: int, theta: float = 10000.0) -> torch.Tensor:
    """Llama's interleaved RoPE on [b, s, heads, head_dim], float64."""
    _, s, _, d = t.shape
    ang = angles(start_pos, s, d, theta).to(t.device)
    tc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(tc * torch.polar(torch.ones_like(ang), ang)[None, :, None]).flatten(3)


def angles(start_pos: int, s: int, d: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.outer(torch.arange(start_pos, start_pos + s, dtype=torch.float64), freqs)


def tables(start_pos: int, s: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """[1, s, d/2] cos and sin of the positions start_pos.., in float32 (exact enough)."""
    ang = angles(start_pos, s, d)[None]
    return ang.cos().to(DEVICE, torch.float32), ang.sin().to(DEVICE, torch.float32)


class Case:
    """One kernel's inputs with FP8 weights, its call, and its float64 reference."""

    def __init__(self, kernel: str, fmt: str, scaled: bool, dtype: torch.dtype = torch.float16,
                 seed: int = 0, d: int = 100, rows: int = 37) -> None:
        """`rows` tokens (37: partial row tiles; the one-row structure runs a program per row,
        a few rows show it all)."""
        self.kernel, self.dtype = kernel, dtype
        gen = torch.Generator().manual_seed(seed)
        # d = 100, not a power of two: partial K-steps
        if kernel == "qkv":
            self.shape = (1, rows, d)  # 4 query heads, 2 kv heads (GQA) of 8
            outs = {"wq": 32, "wk": 16, "wv": 16}
        else:
            self.shape = (rows, d)
            outs = {"w1": 40, "w3": 40} if kernel == "ffn" else {"weight": 40}
        x = torch.randn(*self.shape, generator=gen)
        if kernel == "lola":  # rows with their own offset and scale
            x = x * (1 + torch.rand(rows, 1, generator=gen)) + torch.randn(rows, 1, generator=gen)
        self.x = x.to(DEVICE, dtype)
        self.g = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
        self.b = (0.1 * torch.randn(40, generator=gen)).to(DEVICE, dtype)
        self.w: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor | None] = {}
        for name, n in outs.items():
            w32 = torch.randn(n, d, generator=gen) / d**0.5
            if scaled:
                wq, s = fusetune.quantize_fp8(w32, fmt)
            else:  # raw FP8 values, no scale (they fit the format as they are)
                wq, s = w32.to(fp8.FORMATS[fmt]), None
            self.w[name] = wq.to(DEVICE)
            self.s[name] = None if s is None else s.to(DEVICE)

    def run(self, config: dict[str, int] | None = None, head_dim: int = 8, act: bool = False
            ) -> tuple[torch.Tensor, ...]:
        kw: dict[str, Any] = {f"{n}_scale" if n != "weight" else "weight_scale": s
                              for n, s in self.s.items()}
        kw.update(config=config, fp8_activations=act)
        if self.kernel == "ffn":
            return (fusetune.ffn(self.x, self.g, self.w["w1"], self.w["w3"], eps=1e-6, **kw),)
        if self.kernel == "qkv":
            cos, sin = tables(3, self.shape[1], head_dim, self.dtype)
            return fusetune.qkv(self.x, self.g, self.w["wq"], self.w["wk"], self.w["wv"], cos,
                                sin, eps=1e-6, head_dim=head_dim, interleaved=True, **kw)
        return (fusetune.lola(self.x, self.w["weight"], self.b, eps=1e-5, **kw),)

    def reference(self, act_fp8: bool, head_dim: int = 8) -> tuple[torch.Tensor, ...]:
        """float64, on the inputs' device."""
        x = self.x.double()
        if self.kernel == "lola":
            xn = F.layer_norm(x, (x.shape[-1],), eps=1e-5)
        else:
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g.double()
        if act_fp8:  # what the ACT_FP8 pass hands the K loop: e4m3 rows times their scales
            q, s = fp8.quantize_rows(xn.float())
            xn = q.double() * s.double()[..., None]
        w = {n: fp8.dequantize(self.w[n], self.s[n]).double() for n in self.w}
        if self.kernel == "ffn":
            return (F.silu(xn @ w["w1"].T) * (xn @ w["w3"].T),)
        if self.kernel == "qkv":
            b, s, _ = self.shape
            q, k, v = ((xn @ w[n].T).view(b, s, -1, head_dim) for n in ("wq", "wk", "wv"))
            return rope64(q, 3), rope64(k, 3), v
        return (F.gelu(xn @ w["weight"].T + self.b.double()),)

    def check(self, config: dict[str, int] | None, act_fp8: bool, head_dim: int = 8) -> float:
        """Runs (with FP8 activations where `act_fp8`), compares with the reference (the FP8
        activations' own where `act_fp8`); returns the error against the plain dequantizing
        reference."""
        outs = self.run(config, head_dim, act_fp8)
        refs = self.reference(act_fp8, head_dim)
        plains = self.reference(False, head_dim) if act_fp8 else refs
        worst = 0.0
        for out, ref, plain in zip(outs, refs, plains, strict=True):
            assert out.dtype == self.dtype and torch.isfinite(out).all()
            o = out.double()
            err = float((o - ref).norm() / ref.norm())
            assert err <= TOL[self.dtype], f"relative error {err:.3e} > {TOL[self.dtype]:.1e}"
            worst = max(worst, float((o - plain).norm() / plain.norm()))
        return worst


def cfg(bm: int, passes: int, split: int, gm: int = 1) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": gm, "PASSES": passes,
            "SPLIT_K": split, "num_warps": 4, "num_stages": 2}


# The structures: the norm folded into the K loop (with FP8 activations the norm pass runs
# anyway: the mode, not the config, decides), the norm pass first, split-K (the scales apply
# after the partial sums are added), and one row per program (no tensor cores).
CONFIGS = {"folded": cfg(16, 1, 1), "pass": cfg(32, 2, 1, gm=4), "split": cfg(16, 1, 4),
           "pass-split": cfg(32, 2, 2, gm=4), "gemv": {**cfg(1, 2, 2), "BLOCK_N": 8}}
# Each structure in both modes, with one format or the other (both formats go through every
# structure across the two modes).
CASES = [(name, act, FMTS[(i + act) % 2]) for i, name in enumerate(CONFIGS)
         for act in (False, True)]


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
@pytest.mark.parametrize(("name", "act", "fmt"), CASES,
                         ids=[f"{n}-{'fp8act' if a else 'wonly'}-{f}" for n, a, f in CASES])
def test_fp8_weights_match_dequantizing_reference(kernel: str, name: str, act: bool,
                                                  fmt: str) -> None:
    rows = 3 if CONFIGS[name]["BLOCK_M"] == 1 else 37
    plain_err = Case(kernel, fmt, scaled=True, rows=rows).check(CONFIGS[name], act)
    if act:  # the stated bound of FP8 activations, against the plain reference
        assert plain_err <= fp8.ACT_FP8_TOLERANCE["float16"], plain_err
    else:
        assert plain_err <= TOL[torch.float16]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("unroll", "rows", "spread", "thread_sum"),
                         [(1, 64, 0, 0), (1, 4, 1, 0), (0, 4, 1, 1)])
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_fp8_weights_one_row_per_program(kernel: str, unroll: int, rows: int, spread: int,
                                         thread_sum: int, fmt: str) -> None:
    # BLOCK_M = 1 multiplies without tensor cores (the decode structure). SPREAD = 1: each
    # program's rows (and their scales) lie far apart. THREAD_SUM = 1: each thread adds up the
    # products of its run of 16 weight bytes first.
    Case(kernel, fmt, scaled=True, rows=3).check(
        {**cfg(1, 2, 2), "BLOCK_N": rows, "UNROLL_K": unroll, "SPREAD": spread,
         "THREAD_SUM": thread_sum}, False)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_fp8_products_through_tma(kernel: str, fmt: str, monkeypatch: pytest.MonkeyPatch
                                  ) -> None:
    # FP8 activations with TMA: the e4m3 rows and the FP8 weights reach the tensor cores
    # through descriptors (K = 112: 16-byte rows, a partial last K-step; 37 rows: a partial row
    # tile). Split-K with e5m2.
    split = 2 if fmt == "e5m2" else 1
    made = descriptors_made(monkeypatch)
    Case(kernel, fmt, scaled=True, d=112).check({**cfg(16, 2, split), "TMA": 1}, True)
    assert [t.dtype for t in made][:1] == [torch.float8_e4m3fn]
    assert len(made) == {"ffn": 3, "qkv": 7, "lola": 2}[kernel]
    made.clear()  # weight-only: FP8 weights upcast in registers, through pointers
    Case(kernel, fmt, scaled=True, d=112).check({**cfg(16, 2, split), "TMA": 1}, False)
    assert made == []


def test_e4m3_operand_by_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU with the e4m3 type the GEMV loop (BLOCK_M = 1) uses Triton's conversion, the
    # tensor-core loop the bytes; e5m2 is always bytes; FP8 activations take FP8 as it is.
    w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    monkeypatch.setattr(fp8, "has_fp8", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    assert fp8.weight_operand(w, False, gemv=True)[1] == fp8.W_UPCAST
    assert fp8.weight_operand(w, False, gemv=False)[1] == fp8.W_E4M3_BYTES
    assert fp8.weight_operand(w, True, gemv=False)[1] == fp8.W_AS_IS
    assert fp8.weight_operand(w.to(torch.float8_e5m2), False, gemv=True)[1] == fp8.W_E5M2_BYTES
    monkeypatch.setattr(fp8, "has_fp8", lambda device: False)  # sm_80, sm_86
    assert fp8.weight_operand(w, False, gemv=True)[1] == fp8.W_E4M3_BYTES


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
@pytest.mark.parametrize("act", [False, True], ids=["wonly", "fp8act"])
def test_fp8_weights_without_scales(kernel: str, fmt: str, act: bool) -> None:
    Case(kernel, fmt, scaled=False).check(CONFIGS["pass"], act)


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_e4m3_decoded_from_bytes_before_sm89(kernel: str, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    # GPUs without the e4m3 type (sm_80, sm_86): the weights go in as bytes, decoded in the
    # kernel; FP8 activations are refused with the reason.
    monkeypatch.setattr(fp8, "has_fp8", lambda device: False)
    case = Case(kernel, "e4m3", scaled=True)
    assert fp8.weight_operand(case.w[next(iter(case.w))], False)[1] == fp8.W_E4M3_BYTES
    for name in ("folded", "pass", "split"):
        case.check(CONFIGS[name], False)
    with pytest.raises(ValueError, match=r"FP8 activations need FP8 tensor cores .* leave "
                                         r"fp8_activations off"):
        case.run(CONFIGS["pass"], act=True)


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
@pytest.mark.parametrize("act", [False, True], ids=["wonly", "fp8act"])
def test_bfloat16_activations_with_fp8_products(kernel: str, act: bool) -> None:
    # FP8 activations multiply FP8 by FP8; weight-only FP8 multiplies bfloat16 tiles, which
    # the kernels widen to float32 on the interpreter (its bfloat16 tl.dot is wrong otherwise).
    Case(kernel, "e4m3", scaled=True, dtype=torch.bfloat16).check(CONFIGS["pass-split"], act)


def test_scales_partly_given_and_default_lookup() -> None:
    case = Case("ffn", "e4m3", scaled=True)
    ones = torch.ones(40, device=DEVICE)
    # A missing scale is 1.
    w1 = (case.w["w1"].float() * case.s["w1"][:, None]).to(torch.float8_e4m3fn)
    out = fusetune.ffn(case.x, case.g, w1, case.w["w3"], eps=1e-6, w3_scale=case.s["w3"])
    ref = fusetune.ffn(case.x, case.g, w1, case.w["w3"], eps=1e-6, w1_scale=ones,
                       w3_scale=case.s["w3"])
    assert torch.equal(out, ref)
    case.check(None, False)  # the default heuristic's config (no tables): weight-only
    case.check(None, True)  # and with FP8 activations


def test_bad_fp8_inputs() -> None:
    case = Case("ffn", "e4m3", scaled=True)
    x, g, w1, w3 = case.x, case.g, case.w["w1"], case.w["w3"]
    with pytest.raises(TypeError, match=r"w1 and w3 must have one dtype"):
        fusetune.ffn(x, g, w1, w3.view(torch.float8_e5m2), eps=1e-6)
    with pytest.raises(TypeError, match=r"w3 is torch\.int8, expected x's dtype .* FP8 type"):
        fusetune.ffn(x, g, w1, w3.view(torch.int8), eps=1e-6)
    with pytest.raises(ValueError, match=r"w1_scale must be float32 of shape \(40,\)"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, w1_scale=case.s["w1"][:8])
    with pytest.raises(ValueError, match=r"w3_scale must be float32 .* got torch\.float16"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, w3_scale=case.s["w3"].half())
    with pytest.raises(TypeError, match=r"weight_scale is for FP8 weights; weight is "
                                        r"torch\.float16"):
        fusetune.lola(x, w1.half(), case.b, eps=1e-5, weight_scale=case.s["w1"])
    q = Case("qkv", "e5m2", scaled=False)
    cos, sin = tables(3, 37, 8, torch.float16)
    with pytest.raises(TypeError, match=r"wq and wk and wv must have one dtype"):
        fusetune.qkv(q.x, q.g, q.w["wq"], q.w["wk"].half(), q.w["wv"], cos, sin, eps=1e-6,
                     head_dim=8, interleaved=True)
    # FP8 activations are the caller's mode, never a config key (a table entry could otherwise
    # change the results), and only beside FP8 weights.
    with pytest.raises(ConfigError, match=r"unknown ACT_FP8.*ACT_FP8 is no config key"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, config={**cfg(16, 2, 1), "ACT_FP8": 1})
    with pytest.raises(ValueError, match=r"fp8_activations=True needs FP8 weights"):
        fusetune.ffn(x, g, w1.half(), w3.half(), eps=1e-6, fp8_activations=True)
    with pytest.raises(ConfigError, match=r"BLOCK_K=16 with FP8 activations"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, fp8_activations=True,
                     config={**cfg(16, 2, 1), "BLOCK_K": 16})


# ---- the specs: search points with FP8 weights ----------------------------------------------


def spec_point(kernel: str, rows: int, weights: str, dtype: str = "float16",
               llama: bool = True, act: str = "") -> Point:
    if llama:
        dims = {"ffn": {"dim": 4096, "hidden": 11008}, "lola": {"dim": 4096, "out": 16384},
                "qkv": {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32,
                        "n_kv_heads": 32}}[kernel]
    else:
        dims = {"ffn": {"dim": 100, "hidden": 40}, "lola": {"dim": 100, "out": 40},
                "qkv": {"dim": 100, "head_dim": 8, "interleaved": 1, "n_heads": 4,
                        "n_kv_heads": 2}}[kernel]
    return Point.make(kernel, dims, 1, rows, dtype, weights, act)


BIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2, "SPLIT_K": 1,
       "num_warps": 8, "num_stages": 3}


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_canonical_by_activation_mode(kernel: str) -> None:
    spec = SPECS[kernel]
    assert "ACT_FP8" not in spec.config_keys  # numerics are never a tunable
    weight_only = spec_point(kernel, 4096, "fp8-e4m3")
    act = spec_point(kernel, 4096, "fp8-e4m3", act="fp8")
    # FP8 activations: the norm is always its own pass (it chooses each row's scale first).
    assert spec.canonical({**BIG, "PASSES": 1}, act)["PASSES"] == 2
    assert spec.canonical({**BIG, "PASSES": 1}, weight_only)["PASSES"] == 1
    # TMA: for FP8 weights only beside FP8 activations (no conversion in registers).
    assert spec.canonical({**BIG, "TMA": 1}, act)["TMA"] == 1
    assert spec.canonical({**BIG, "TMA": 1}, weight_only)["TMA"] == 0
    # Tiny K: the FP8 product needs BLOCK_K >= 32 (tensor-core tiles; the GEMV takes any).
    tiny = spec_point(kernel, 64, "fp8-e5m2", llama=False, act="fp8")
    tiny = Point(tiny.kernel, tuple((k, 16 if k == "dim" else v) for k, v in tiny.dims),
                 tiny.batch, tiny.seq, tiny.dtype, tiny.weights, tiny.activations)
    assert spec.canonical({**BIG, "BLOCK_K": 16}, tiny)["BLOCK_K"] == 32
    assert spec.canonical({**BIG, "BLOCK_M": 1, "BLOCK_K": 16}, tiny)["BLOCK_K"] == 16
    # The default heuristic: weight-only FP8 upcasts; no config of it asks for FP8 products.
    for p in (weight_only, act, spec_point(kernel, 1, "fp8-e4m3")):
        d = spec.canonical(spec.default_config(p, gpus.resolve("h100")), p)
        assert spec.validate_config(d) == d
        assert spec.resources(d, p).fp8_mma == p.fp8_activations


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_fp8_activations_pruned_without_fp8_tensor_cores(kernel: str) -> None:
    spec = SPECS[kernel]
    p = spec_point(kernel, 4096, "fp8-e4m3", act="fp8")
    c = {**BIG, "num_stages": 2}
    res = spec.resources(spec.canonical(c, p), p)
    assert res.fp8_mma
    why = check_fits(res, gpus.resolve("3090"))
    assert why is not None and why.startswith("fp8-tensor-cores: FP8 activations need FP8 "
                                              "tensor cores (compute capability 8.9+), "
                                              "rtx-3090 has 8.6")
    for name in ("4090", "l4", "h100", "h200"):
        assert gpus.resolve(name).fp8_tensor_cores
        assert "fp8" not in (check_fits(res, gpus.resolve(name)) or "")
    assert not spec.resources(c, spec_point(kernel, 4096, "fp8-e4m3")).fp8_mma
    # The catalogue's flag is compute capability 8.9 and later.
    for g in gpus.CATALOGUE:
        assert g.fp8_tensor_cores == (g.compute_capability >= (8, 9)), g.name


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_fp8_cost_and_shared_memory(kernel: str) -> None:
    spec = SPECS[kernel]
    p16, p8 = spec_point(kernel, 1, ""), spec_point(kernel, 1, "fp8-e5m2")
    n_w = {"ffn": 2 * 11008 * 4096, "qkv": 3 * 4096 * 4096, "lola": 16384 * 4096}[kernel]
    # One byte per weight element instead of two (plus float32 scales, a few KB).
    assert spec.cost(p16).bytes - spec.cost(p8).bytes == pytest.approx(n_w, rel=1e-3)
    assert spec.cost(p8).flops == spec.cost(p16).flops
    n_weights = 1 if kernel == "lola" else 2
    big_act = spec_point(kernel, 4096, "fp8-e4m3", act="fp8")
    act = spec.canonical(BIG, big_act)
    bm, bn, bk, stages = act["BLOCK_M"], act["BLOCK_N"], act["BLOCK_K"], act["num_stages"]
    out_tile = bm * bn * 2 if kernel != "lola" else 0  # the 16-bit output, staged
    # FP8 by FP8: one byte per element of every pipelined tile, both kept whole per stage.
    tile = bm * bk + n_weights * bk * bn
    assert spec.resources(act, big_act).smem_bytes == max(
        (stages - 1) * tile + out_tile + 1024, stages * tile)
    # Upcast in registers: FP8 weight tiles in the pipeline, plus one converted (16-bit) set
    # staged for the tensor cores; or, where it is more (lola: Triton 3.6 compiled 81920 B for
    # these tiles on sm_90), num_stages whole sets plus one FP8 weight tile.
    big8 = spec_point(kernel, 4096, "fp8-e4m3")
    up = spec.canonical(BIG, big8)
    tile = bm * bk * 2 + n_weights * bk * bn
    expected = max((stages - 1) * tile + out_tile + 1024 + n_weights * bk * bn * 2,
                   stages * tile + n_weights * bk * bn)
    assert spec.resources(up, big8).smem_bytes == expected


@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
@pytest.mark.parametrize("weights", ["fp8-e4m3", "fp8-e5m2"])
def test_spec_inputs_reference_and_tolerance(kernel: str, weights: str) -> None:
    # Every config of a point is held to its mode's one tolerance: the 16-bit one for
    # weight-only FP8, ACT_FP8_TOLERANCE for FP8 activations.
    spec = SPECS[kernel]
    torch.manual_seed(0)
    for act in ("", "fp8"):
        p = spec_point(kernel, 19, weights, llama=False, act=act)
        inputs = spec.make_inputs(p, DEVICE)
        assert inputs["fp8_activations"] == bool(act)
        w_names = [k for k in inputs if k.endswith("_scale")]
        assert w_names
        for s_name in w_names:
            w = inputs[s_name.removesuffix("_scale")]
            assert w.dtype == fp8.FORMATS[weights.removeprefix("fp8-")]
            assert inputs[s_name].dtype == torch.float32
            assert inputs[s_name].shape == (w.shape[0],)
        tol = spec.tolerance_for(p)
        assert tol == (fp8.ACT_FP8_TOLERANCE if act else spec.tolerance)["float16"]
        ref = spec.reference(inputs)
        for config in (cfg(16, 1, 2), cfg(16, 2, 1)):
            c = spec.canonical(config, p)
            outputs = spec.make_outputs(inputs)
            spec.launch(inputs, outputs, c)
            for name, r in ref.items():
                err = float((outputs[name].float() - r).norm() / r.norm())
                assert err <= tol, (name, c, err)


def test_search_checks_each_mode_with_its_own_tolerance() -> None:
    # The search's correctness gate: ffn with FP8 activations is ~4% off the dequantizing
    # reference, far over the 16-bit tolerance, and passes with its mode's bound; weight-only
    # FP8 is held to 16-bit with the very same config.
    from fusetune.tuner.bench import Evaluator

    backend = "cuda" if DEVICE == "cuda" else "interpreter"
    act_p = spec_point("ffn", 40, "fp8-e4m3", llama=False, act="fp8")
    act = Evaluator(ffn_mod.SPEC, act_p, backend, DEVICE).check(
        ffn_mod.SPEC.canonical(cfg(16, 2, 1), act_p))
    assert act.ok and act.rel_err > 4 * ffn_mod.SPEC.tolerance["float16"], act
    up_p = spec_point("ffn", 40, "fp8-e4m3", llama=False)
    up = Evaluator(ffn_mod.SPEC, up_p, backend, DEVICE).check(
        ffn_mod.SPEC.canonical(cfg(16, 2, 1), up_p))
    assert up.ok and up.rel_err < ffn_mod.SPEC.tolerance["float16"], up


def test_act_fp8_error_is_what_the_tolerance_says() -> None:
    # The error rounding the activations to e4m3 adds, in float32 torch at a Llama width: the
    # measurement behind ACT_FP8_TOLERANCE (twice the largest of the three kernels).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen)
    w1, w3 = (torch.randn(1024, 4096, generator=gen) / 64 for _ in range(2))
    q, s = fp8.quantize_rows(x)
    xq = q.float() * s[:, None]

    def rel(f: Callable[[torch.Tensor], torch.Tensor]) -> float:
        return float((f(xq) - f(x)).norm() / f(x).norm())

    linear = rel(lambda t: t @ w1.T)
    gate = rel(lambda t: F.silu(t @ w1.T) * (t @ w3.T))
    assert 0.02 < linear < 0.03 and 0.03 < gate < 0.045, (linear, gate)
    assert fp8.ACT_FP8_TOLERANCE["float16"] == pytest.approx(2 * gate, rel=0.1)


def table_text(gpu: str, kernel: str, dims: str, weights: str, config: str,
               activations: str | None = None, rows: int = 37) -> str:
    act = f"      activations: {activations}\n" if activations else ""
    return ("schema_version: 1\nprovenance: {}\ngpus:\n"
            f"  {gpu}:\n    {kernel}:\n    - dims: {dims}\n      dtype: float16\n"
            f"      weights: {weights}\n{act}      batch: 1\n      seq: {rows}\n"
            f"      config: {config}\n")


LOLA_CFG = ("{BLOCK_M: 32, BLOCK_N: 16, BLOCK_K: 32, GROUP_M: 1, PASSES: 2, SPLIT_K: 1, "
            "num_warps: 4, num_stages: 2}")


def test_lookup_keeps_each_mode_to_its_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    # A table entry for FP8 weights applies to FP8 weights of its format and of its activation
    # mode only: a weight-only call never runs a config tuned with FP8 activations, and keeps
    # the 16-bit tolerance whatever the table holds.
    case = Case("lola", "e4m3", scaled=True)
    gpu = fusetune.runtime.gpu_for_device(case.x.device).name
    table = tmp_path / "t.yaml"
    table.write_text(table_text(gpu, "lola", "{dim: 100, out: 40}", "fp8-e4m3", LOLA_CFG,
                                activations="fp8"))
    fusetune.load_tables(table)
    seen: list[Any] = []
    real = lola_mod._launch_2d
    monkeypatch.setattr(lola_mod, "_launch_2d",
                        lambda *a, **k: (seen.append((a[5], a[7])), real(*a, **k)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusetune.FusetuneWarning)
        case.check(None, True)  # the table's entry, with FP8 activations
    assert seen[-1] == (lola_mod.SPEC.validate_config(yaml_config(LOLA_CFG)), True)
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config.*weights fp8-e4m3"):
        case.check(None, False)  # weight-only: not that entry, the 16-bit tolerance holds
    assert seen[-1][1] is False
    e5m2 = Case("lola", "e5m2", scaled=True)
    with pytest.warns(fusetune.FusetuneWarning, match="no tuned config.*weights fp8-e5m2"):
        e5m2.run(act=True)
    with pytest.warns(fusetune.FusetuneWarning, match=r"no tuned config for lola .*float16"):
        fusetune.lola(case.x, fp8.dequantize(case.w["weight"], case.s["weight"]).half(), case.b,
                      eps=1e-5)


def yaml_config(text: str) -> dict[str, int]:
    import yaml

    return yaml.safe_load(text)


def test_table_weights_and_modes_are_validated() -> None:
    from fusetune.tables import TableError, parse_tables

    ffn_cfg = ("{BLOCK_M: 16, BLOCK_N: 64, BLOCK_K: 128, GROUP_M: 1, PASSES: 1, SPLIT_K: 4, "
               "num_warps: 4, num_stages: 4}")
    ffn_dims = "{dim: 64, hidden: 32}"
    ok = parse_tables(table_text("h100", "ffn", ffn_dims, "fp8-e5m2", ffn_cfg, "fp8"), "t.yaml")
    ((key, _),) = ok.groups.items()
    assert key[-2:] == ("fp8-e5m2", "fp8")
    with pytest.raises(TableError, match=r"weights 'int4': expected one of fp8-e4m3, fp8-e5m2"):
        parse_tables(table_text("h100", "ffn", ffn_dims, "int4", ffn_cfg), "t.yaml")
    with pytest.raises(TableError, match=r"weights 'fp8-e4m3': expected left out \(rmsnorm "
                                         r"has no weights\)"):
        parse_tables(table_text("h100", "rmsnorm", "{dim: 64}", "fp8-e4m3",
                                "{BLOCK_D: 64, ROWS: 1, num_warps: 4, num_stages: 1}"),
                     "t.yaml")
    with pytest.raises(TableError, match=r"unknown activation mode 'fp4'; valid: 16bit"):
        parse_tables(table_text("h100", "ffn", ffn_dims, "fp8-e5m2", ffn_cfg, "fp4"), "t.yaml")
    # A config of an older table that carried the mode as a tunable: refused with the reason.
    with pytest.raises(TableError, match=r"ACT_FP8 is no config key"):
        parse_tables(table_text("h100", "ffn", ffn_dims, "fp8-e5m2",
                                ffn_cfg.replace("}", ", ACT_FP8: 1}")), "t.yaml")


# ---- on the GPU -----------------------------------------------------------------------------

LLAMA = {"ffn": (4096, 11008), "lola": (4096, 16384), "qkv": (4096, 4096)}


def llama_case(kernel: str, fmt: str, m: int, dtype: torch.dtype) -> Case:
    """A Case at Llama-2-7B widths (qkv: 32 heads of 128 and 8 kv heads)."""
    case = Case.__new__(Case)
    case.kernel, case.dtype = kernel, dtype
    gen = torch.Generator().manual_seed(0)
    d, n = LLAMA[kernel]
    x = torch.randn(m, d, generator=gen)
    if kernel == "lola":
        x = x * (1 + torch.rand(m, 1, generator=gen)) + torch.randn(m, 1, generator=gen)
    outs = {"ffn": {"w1": n, "w3": n}, "lola": {"weight": n},
            "qkv": {"wq": 4096, "wk": 1024, "wv": 1024}}[kernel]
    case.shape = (1, m, d) if kernel == "qkv" else (m, d)
    case.x = x.view(case.shape).to(DEVICE, dtype)
    case.g = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    case.b = (0.1 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    case.w, case.s = {}, {}
    for name, rows in outs.items():
        w32 = (torch.randn(rows, d, generator=gen) / d**0.5).to(DEVICE)
        case.w[name], case.s[name] = fusetune.quantize_fp8(w32, fmt)
    return case


GPU_CONFIGS = {
    "decode-split": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "PASSES": 1,
                     "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
    "prefill": BIG,
    "prefill-split": {**BIG, "BLOCK_M": 64, "SPLIT_K": 2, "num_warps": 4},
    # one row per program: e4m3 through Triton's conversion on sm_89+, two K-steps a loop
    "gemv": {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
             "SPLIT_K": 2, "UNROLL_K": 1, "num_warps": 4, "num_stages": 1},
    # its rows (pairs) spread over the matrix, with the per-channel scales that go with them
    "gemv-spread": {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "GROUP_M": 1, "PASSES": 1,
                    "SPLIT_K": 1, "UNROLL_K": 1, "SPREAD": 1, "num_warps": 2, "num_stages": 1},
    # each thread's 16 weight bytes added up before accumulating
    "gemv-thread-sum": {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 256, "GROUP_M": 1, "PASSES": 1,
                        "SPLIT_K": 1, "UNROLL_K": 1, "THREAD_SUM": 1, "num_warps": 2,
                        "num_stages": 1},
}
GPU_CASES = [("decode-split", 1), ("decode-split", 37), ("prefill", 300), ("prefill-split", 37),
             ("gemv", 1), ("gemv", 3), ("gemv-spread", 1), ("gemv-thread-sum", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("act", [False, True], ids=["wonly", "fp8act"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
@pytest.mark.parametrize(("name", "m"), GPU_CASES, ids=[f"{n}-m{m}" for n, m in GPU_CASES])
def test_gpu_fp8_llama_dims(kernel: str, fmt: str, dtype: torch.dtype, name: str, m: int,
                            act: bool) -> None:
    # Weight-only: the 16-bit tolerance against the dequantized weights (Case.check); FP8
    # activations: that against their own reference, and their stated bound against it.
    if act and not fp8.has_fp8(torch.device("cuda")):
        pytest.skip("FP8 activations need FP8 tensor cores (compute capability 8.9+)")
    plain_err = llama_case(kernel, fmt, m, dtype).check(GPU_CONFIGS[name], act, head_dim=128)
    bound = fp8.ACT_FP8_TOLERANCE["float16"] if act else TOL[dtype]
    assert plain_err <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_gpu_e4m3_from_bytes_and_default_config(kernel: str, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The default config (no tables: empty shipped ones, so that the lookup has no entry),
    # then the decoding that GPUs before sm_89 use, run here.
    monkeypatch.setattr(fusetune.runtime, "_shipped", fusetune.tables.Tables())
    case = llama_case(kernel, "e4m3", 37, dtype)
    with pytest.warns(fusetune.FusetuneWarning, match="default heuristic"):
        case.check(None, False, head_dim=128)
    monkeypatch.setattr(fp8, "has_fp8", lambda device: False)
    case.check(GPU_CONFIGS["decode-split"], False, head_dim=128)
    case.check(GPU_CONFIGS["prefill"], False, head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["ffn", "qkv", "lola"])
def test_gpu_smem_model_covers_fp8_compiles(kernel: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    # The shared memory Triton allocates for FP8 configs on this GPU against the model's
    # prediction: never less (or configs that cannot run would be compiled), not far more.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shared-memory model is calibrated on sm_90")
    main = {"ffn": "_ffn_kernel", "qkv": "_qkv_kernel", "lola": "_lola_kernel"}[kernel]
    compiled = compiled_kernels(monkeypatch, main)
    spec = SPECS[kernel]
    case = llama_case(kernel, "e4m3", 256, torch.float16)
    from fusetune.tables import gpu_for_device

    limit = gpu_for_device(torch.device("cuda")).smem_per_block
    report = []
    for act in (False, True):
        p = spec_point(kernel, 256, "fp8-e4m3", act="fp8" if act else "")
        for c in (BIG, {**BIG, "BLOCK_N": 64, "BLOCK_K": 128}, {**BIG, "TMA": 1},
                  {**BIG, "BLOCK_K": 128, "TMA": 1, "num_stages": 4},
                  {**BIG, "BLOCK_K": 128, "num_stages": 2}, GPU_CONFIGS["decode-split"]):
            c = spec.canonical(c, p)
            predicted = spec.resources(c, p).smem_bytes
            if predicted > limit:
                continue  # pruned before compiling: the compiler would refuse it too
            compiled.clear()
            case.run(c, head_dim=128, act=act)
            actual = max(k.metadata.shared for k in compiled)
            report.append((c, act, actual, predicted))
    assert {a for _, a, _, _ in report} == {False, True}  # configs of both modes compiled
    bad = [r for r in report if not r[2] <= r[3] <= 2 * r[2]]
    assert not bad, "\n".join(f"{c} act={a}: compiled {x} B, predicted {p} B"
                              for c, a, x, p in report)
