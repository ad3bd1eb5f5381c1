"""fusetune.linear (x·Wᵀ · scale + bias + residual) against plain torch (interpreter on CPU)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from launched import compiled_kernels, descriptors_made

import fusetune
from fusetune import api, gpus, ops, runtime
from fusetune.kernels import REGISTRY, fp8
from fusetune.kernels import linear as linear_mod
from fusetune.models import preset
from fusetune.spec import ConfigError, Point, check_fits
from fusetune.tuner.space import load_space

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
SPEC = linear_mod.SPEC
K, N = 300, 72  # awkward: partial K-steps and a partial last column-block


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


def make(m: int, k: int, n: int, dtype: torch.dtype, *, bias: bool = True,
         residual: bool = True, fmt: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of fusetune.linear: x [m, k], weight [n, k] (FP8 `fmt` with scales,
    or x's dtype), bias, residual."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = 0.1 * torch.randn(n, generator=gen)
    r = torch.randn(m, n, generator=gen)
    scale = None
    if fmt is not None:
        w, scale = fusetune.quantize_fp8(w, fmt)
        scale = scale.to(DEVICE)
    return {"x": x.to(DEVICE, dtype), "weight": w.to(DEVICE, w.dtype if fmt else dtype),
            "bias": b.to(DEVICE, dtype) if bias else None,
            "residual": r.to(DEVICE, dtype) if residual else None, "weight_scale": scale}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
              **_: Any) -> torch.Tensor:
    """float64 on the CPU, on the dequantized weights for FP8."""
    scale = None if weight_scale is None else weight_scale.cpu()
    y = x.cpu().double() @ fp8.dequantize(weight.cpu(), scale).double().T
    if bias is not None:
        y = y + bias.cpu().double()
    if residual is not None:
        y = y + residual.cpu().double()
    return y


def check(args: dict[str, Any], config: dict[str, int] | None = None) -> torch.Tensor:
    x = args["x"]
    out = fusetune.linear(**args, config=config)
    assert out.shape == (*x.shape[:-1], args["weight"].shape[0]) and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    ref = reference(**args)
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err <= TOL[x.dtype], f"relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return out


def point(m: int, k: int = K, n: int = N, dtype: str = "float16", bias: int = 1,
          residual: int = 1, weights: str = "") -> Point:
    return Point.make("linear", {"dim": k, "out": n, "bias": bias, "residual": residual}, 1, m,
                      dtype, weights)


def poisoned_launch(p: Point, config: dict[str, int]) -> None:
    """SPEC.launch on an output filled with NaN (an element the kernel fails to write stays
    NaN), compared with SPEC.reference at the spec's tolerance for the point."""
    torch.manual_seed(0)
    inputs = SPEC.make_inputs(p, DEVICE)
    outputs = SPEC.make_outputs(inputs)
    outputs["y"].fill_(float("nan"))
    SPEC.launch(inputs, outputs, config)
    out, ref = outputs["y"].float(), SPEC.reference(inputs)["y"]
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} unwritten elements"
    err = float((out - ref).norm() / ref.norm())
    assert err <= SPEC.tolerance[p.dtype], f"relative error {err:.3e}"


def tiles(bm: int, bn: int, bk: int, split: int = 1, **flags: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "PASSES": 2,
            "SPLIT_K": split, "num_warps": 2, "num_stages": 2, **flags}


# ---- the public call against torch ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "bias", "residual"),
                         [(1, True, True), (5, False, False), (37, False, True),
                          (37, True, False)])
def test_matches_reference(m: int, bias: bool, residual: bool, dtype: torch.dtype) -> None:
    # The default heuristic's config (no tables): the GEMV at one row, tiles above.
    check(make(m, K, N, dtype, bias=bias, residual=residual))


def test_leading_shape_and_strided_rows() -> None:
    args = make(6, 64, 40, torch.float32)
    out = check({**args, "x": args["x"].view(2, 3, 64),
                 "residual": args["residual"].view(2, 3, 40)})
    assert out.shape == (2, 3, 40)
    wide = torch.cat([args["x"], args["x"]], dim=1)[:, :64]  # rows 128 apart
    wide_r = torch.cat([args["residual"], args["residual"]], dim=1)[:, 40:]
    check({**args, "x": wide, "residual": wide_r})
    # A transposed weight's copy: nn.Linear's layout needs unit column stride, the launcher
    # makes one.
    check({**args, "weight": args["weight"].T.contiguous().T})
    assert fusetune.linear(args["x"][:0], args["weight"]).shape == (0, 40)


def test_addition_order_and_one_rounding() -> None:
    # float16: a residual of 2048 beside products of about 1 rounds once, after the sum in
    # float32; rounding x·Wᵀ first would lose what survives the one rounding here.
    args = make(4, 64, 16, torch.float16, bias=True)
    args["residual"] = torch.full((4, 16), 2048.0, device=DEVICE, dtype=torch.float16)
    out = fusetune.linear(**args)
    exact = reference(**args).float().to(torch.float16)
    assert torch.equal(out.cpu(), exact)


# ---- every structure, on poisoned outputs ---------------------------------------------------


STRUCTURES = {
    # one row per program (GEMV); 5 rows: one program per row; K = 300 in partial steps
    "gemv": (5, tiles(1, 8, 64)),
    "gemv-unroll-split2": (1, tiles(1, 8, 64, 2, UNROLL_K=1)),
    "gemv-spread-split4": (1, tiles(1, 16, 32, 4, SPREAD=1)),  # N = 72: a partial block
    "gemv-thread-sum": (5, tiles(1, 8, 64, 2, UNROLL_K=1, THREAD_SUM=1)),
    # tensor-core tiles, pipelined
    "tiles": (37, tiles(16, 32, 64)),
    "tiles-grouped-split2": (37, {**tiles(16, 32, 32, 2), "GROUP_M": 2}),
    "tiles-split4": (5, tiles(16, 64, 16, 4)),
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_structures_on_poisoned_outputs(name: str) -> None:
    rows, config = STRUCTURES[name]
    poisoned_launch(point(rows), config)


def test_spread_rows_equal_adjacent_rows() -> None:
    # The same K loop per output, whichever program computes it: bit-identical.
    args = make(1, K, 37, torch.float16)
    config = tiles(1, 8, 64, 2, UNROLL_K=1)
    spread = check(args, {**config, "SPREAD": 1})
    assert torch.equal(spread, fusetune.linear(**args, config={**config, "SPREAD": 0}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("split", [1, 2])
def test_tma_descriptors(split: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
                         ) -> None:
    # K = 312: rows on 16-byte boundaries, a partial last K-step; 37 x 72: boxes past the
    # bottom and right edges.
    made = descriptors_made(monkeypatch)
    config = {**tiles(16, 32, 32, split), "TMA": 1}
    check(make(37, 312, N, dtype), config)
    assert len(made) == 2  # x and W
    made.clear()
    # 300 float16 (600 bytes) a row cannot start on 16-byte boundaries: read by pointers.
    if dtype == torch.float16:
        check(make(37, K, N, dtype), config)
        assert made == []


# ---- bfloat16 through the tensor-core loop ---------------------------------------------------

# The structures with tl.dot (BLOCK_M > 1): tiles by pointers, split-K, TMA descriptors.
# Triton's interpreter gets tl.dot on bfloat16 tiles wrong unless the kernel widens them first
# (_matmul.dot, INTERPRETED). 19 rows x 72 outputs: partial row and column tiles; K = 104:
# three K-steps and a partial one, rows on 16-byte boundaries (TMA can read them).
BF16_STRUCTURES = {"tiles": tiles(16, 16, 32), "split2": tiles(16, 16, 32, 2),
                   "tma": {**tiles(16, 16, 32), "TMA": 1}}
BF16_ROWS, BF16_K = 19, 104


@pytest.mark.parametrize("structure", list(BF16_STRUCTURES))
def test_bfloat16_tensor_core_structures(structure: str, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    made = descriptors_made(monkeypatch)
    check(make(BF16_ROWS, BF16_K, N, torch.bfloat16), BF16_STRUCTURES[structure])
    assert len(made) == (2 if structure == "tma" else 0)  # x and W


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("structure", ["tiles", "split2"])
def test_bfloat16_with_fp8_weights(structure: str, fmt: str) -> None:
    # Weight-only FP8: the weight tiles are decoded and rounded to bfloat16 (exact) for tl.dot,
    # then the same product as with bfloat16 weights, against the dequantized weights.
    check(make(BF16_ROWS, BF16_K, N, torch.bfloat16, fmt=fmt), BF16_STRUCTURES[structure])


def test_bfloat16_through_the_ops() -> None:
    # fusetune.ops.linear and the custom op that torch.compile sees call the same launcher,
    # with the tables' config (the default heuristic here: tensor-core tiles at 19 rows).
    args = make(BF16_ROWS, BF16_K, N, torch.bfloat16)
    x, w, b, r = args["x"], args["weight"], args["bias"], args["residual"]
    ref = reference(**args)
    for out in (ops.linear(x, w, b, r), torch.ops.fusetune.linear(x, w, b, r, None, False)):
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert out.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], err


# ---- FP8 weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(("rows", "config"), [
    (1, tiles(1, 16, 64, 2, UNROLL_K=1, THREAD_SUM=1)),
    (37, {**tiles(16, 32, 32, 2), "TMA": 1, "PASSES": 1}),
], ids=["gemv", "tiles"])
def test_fp8_weights(fmt: str, rows: int, config: dict[str, int],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Weight-only FP8 (the default), held to the 16-bit tolerance against the dequantized
    # weights: scales applied after the split-K sums, before bias and residual. TMA = 1 and
    # PASSES = 1 mean their one value here: weights upcast, read by pointers.
    made = descriptors_made(monkeypatch)
    check(make(rows, 312, N, torch.float16, fmt=fmt), config)
    assert made == []


@pytest.mark.parametrize(("fmt", "rows", "config"), [
    ("e4m3", 1, tiles(1, 16, 64, 2, UNROLL_K=1)),
    ("e5m2", 37, {**tiles(16, 32, 32, 2), "TMA": 1}),
], ids=["gemv", "tiles"])
def test_fp8_activations(fmt: str, rows: int, config: dict[str, int],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Asked for: x's rows quantized to e4m3 (no norm) with a scale each, FP8 by FP8 (through
    # TMA where the config says so: 320 one-byte elements a row start on 16-byte boundaries);
    # the reference rounds x the same way, and the result stays within the mode's stated
    # bound of the plain one.
    args = make(rows, 320, N, torch.float16, fmt=fmt)
    made = descriptors_made(monkeypatch)
    y = fusetune.linear(**args, fp8_activations=True, config=config)
    assert made == [] if config["BLOCK_M"] == 1 else len(made) == 2
    q, s = fp8.quantize_rows(args["x"].float())
    wd = fp8.dequantize(args["weight"], args["weight_scale"]).double()
    xq = q.double() * s.double()[..., None]
    extra = args["bias"].double() + args["residual"].double()
    for xin, tol in ((xq, 5e-3), (args["x"].double(), fp8.ACT_FP8_TOLERANCE["float16"])):
        ref = xin @ wd.T + extra
        err = float((y.double() - ref).norm() / ref.norm())
        assert err <= tol, err
    with pytest.raises(ValueError, match="fp8_activations=True needs FP8 weights"):
        fusetune.linear(**make(rows, 320, N, torch.float16), fp8_activations=True)


def test_fp8_weights_decoded_from_bytes_and_without_scales(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # GPUs without the e4m3 type decode the bytes in the kernel; a weight without scales
    # multiplies as stored.
    monkeypatch.setattr(fp8, "has_fp8", lambda device: False)
    args = make(5, K, N, torch.float32, fmt="e4m3")
    check(args, tiles(16, 32, 64))
    check({**args, "weight_scale": None}, tiles(1, 16, 64))
    poisoned_launch(point(37, weights="fp8-e5m2", bias=0), tiles(16, 32, 64, 2))


# ---- the spec -------------------------------------------------------------------------------


def test_lookup_key_names_bias_and_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[Any, ...]] = []
    real = runtime.cached_config

    def cached_config(spec: Any, dims: Any, *args: Any, **kw: Any) -> Any:
        asked.append((dims, *args[:3], kw.get("activations", "")))
        return real(spec, dims, *args, **kw)

    monkeypatch.setattr(runtime, "cached_config", cached_config)
    args = make(3, 64, 40, torch.float16, bias=False)
    fusetune.linear(**args)
    fusetune.linear(**{**args, "residual": None, "bias": torch.zeros(40, dtype=torch.float16,
                                                                     device=DEVICE)})
    fp8_args = {**args, "weight": fusetune.quantize_fp8(args["weight"])[0]}
    fusetune.linear(**fp8_args)
    fusetune.linear(**fp8_args, fp8_activations=True)
    key = (("bias", 0), ("dim", 64), ("out", 40), ("residual", 1))
    assert asked == [
        (key, "float16", 3, "", ""),
        ((("bias", 1), ("dim", 64), ("out", 40), ("residual", 0)), "float16", 3, "", ""),
        (key, "float16", 3, "fp8-e4m3", ""),
        (key, "float16", 3, "fp8-e4m3", "fp8"),
    ]


def test_canonical_and_defaults() -> None:
    p = point(4096, 14336, 4096, "bfloat16", bias=0)
    for gpu in ("3090", "h100"):
        for rows in (1, 16, 4096):
            for weights in ("", "fp8-e4m3"):
                q = point(rows, 14336, 4096, "bfloat16", bias=0, weights=weights)
                c = SPEC.default_config(q, gpus.resolve(gpu))
                assert SPEC.validate_config(c) == c == SPEC.canonical(c, q)
                assert c["PASSES"] == 2
                assert check_fits(SPEC.resources(c, q), gpus.resolve(gpu)) is None
                assert (c["BLOCK_M"] == 1) == (rows == 1)
    h100 = SPEC.default_config(p, gpus.resolve("h100"))
    assert h100["TMA"] == 1  # 4096 rows of 16-bit weights on a GPU with TMA
    # PASSES has one meaning: configs that differ only there are one kernel, priced alike.
    one = tiles(64, 64, 64)
    other = {**one, "PASSES": 1}
    assert SPEC.canonical(other, p) == SPEC.canonical(one, p)
    assert SPEC.resources(other, p) == SPEC.resources(one, p)
    assert SPEC.canonical({**one, "TMA": 1}, p)["TMA"] == 1
    assert SPEC.canonical({**one, "TMA": 1}, point(4096, 14336, 4096, weights="fp8-e4m3")
                          )["TMA"] == 0
    # The one-row structure serves one row.
    gemv = tiles(1, 8, 512)
    assert SPEC.resources(gemv, point(1)).unfit == ""
    assert SPEC.resources(gemv, point(2)).unfit.startswith("structure: ")


def test_search_space_has_one_meaning_of_passes() -> None:
    space = load_space(SPEC)
    values = {p.name: p.values for p in space.params}
    assert values["PASSES"] == (2,) and "ACT_FP8" not in values
    assert [p.name for p in space.params] == list(SPEC.config_keys)


def test_cost_dims_and_registry() -> None:
    bf16 = point(16, 14336, 4096, "bfloat16", bias=0)
    c = SPEC.cost(bf16)
    assert c.flops == 2 * 16 * 14336 * 4096
    assert c.bytes == 2 * (16 * 14336 + 2 * 16 * 4096) + 2 * 14336 * 4096
    assert SPEC.cost(point(16, 14336, 4096, "bfloat16", bias=1, residual=0)).bytes \
        == c.bytes - 2 * 16 * 4096 + 2 * 4096
    assert SPEC.cost(point(16, 14336, 4096, "bfloat16", bias=0, weights="fp8-e4m3")).bytes \
        == c.bytes - 14336 * 4096 + 4 * 4096
    llama = preset("llama-3-8b")
    assert SPEC.dims_from_model(llama) == {"dim": 14336, "out": 4096, "bias": 0, "residual": 1}
    assert linear_mod.model_uses(llama)["o_proj"] == {"dim": 4096, "out": 4096, "bias": 0,
                                                       "residual": 1}
    assert sorted(SPEC.dims_from_model(llama)) == sorted(SPEC.dim_names)
    assert REGISTRY["linear"] is SPEC and fusetune.linear is api.linear
    assert "linear" in fusetune.__all__


def test_bad_inputs() -> None:
    args = make(2, 64, 32, torch.float16)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, 64\] .*got \(64, 32\)"):
        fusetune.linear(args["x"], args["weight"].T)
    with pytest.raises(ValueError, match=r"weight must be .*got \(32, 64, 1\)"):
        fusetune.linear(args["x"], args["weight"][..., None])
    with pytest.raises(ValueError, match="at least one dimension"):
        fusetune.linear(args["x"][0, 0], args["weight"])
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(32,\)"):
        fusetune.linear(**{**args, "bias": args["bias"][:3]})
    with pytest.raises(TypeError, match=r"bias is torch\.float32, expected x's dtype"):
        fusetune.linear(**{**args, "bias": args["bias"].float()})
    with pytest.raises(ValueError, match=r"residual has shape \(2, 31\), expected \(2, 32\)"):
        fusetune.linear(**{**args, "residual": args["residual"][:, :31]})
    with pytest.raises(ValueError, match=r"residual has shape \(1, 2, 32\), expected \(2, 32\)"):
        fusetune.linear(**{**args, "residual": args["residual"][None]})
    with pytest.raises(TypeError, match=r"residual is torch\.float32, expected x's dtype"):
        fusetune.linear(**{**args, "residual": args["residual"].float()})
    with pytest.raises(TypeError, match=r"weight is torch\.float32, expected x's dtype"):
        fusetune.linear(**{**args, "weight": args["weight"].float()})
    with pytest.raises(TypeError, match=r"unsupported dtype torch\.int32"):
        fusetune.linear(**{**args, "x": args["x"].int()})
    with pytest.raises(TypeError, match="weight_scale is for FP8 weights"):
        fusetune.linear(**{**args, "weight_scale": torch.ones(32, device=DEVICE)})
    wq, s = fusetune.quantize_fp8(args["weight"].cpu())
    with pytest.raises(ValueError, match=r"weight_scale must be float32 of shape \(32,\)"):
        fusetune.linear(**{**args, "weight": wq.to(DEVICE), "weight_scale": s[:4].to(DEVICE)})
    meta = {k: v.to("meta") for k, v in args.items() if v is not None}
    for name in ("weight", "bias", "residual"):
        with pytest.raises(ValueError, match=f"{name} is on meta, x on {DEVICE}"):
            fusetune.linear(**{**args, name: meta[name]})
    with pytest.raises(ValueError, match="tensors are on meta"):
        fusetune.linear(**meta)
    with pytest.raises(ConfigError, match="BLOCK_K=48 must be a power of two"):
        fusetune.linear(**args, config={**tiles(16, 16, 32), "BLOCK_K": 48})
    with pytest.raises(RuntimeError, match="no backward pass"):
        fusetune.linear(**{**args, "weight": args["weight"].float().requires_grad_()
                           .to(torch.float16)})


# Shared memory Triton 3.6 allocated for this kernel on the H100 (sm_90), with and without the
# residual alike: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA) -> bytes, bfloat16.
COMPILED_SMEM = {(16, 64, 128, 4, 4, 0): 61440, (16, 128, 128, 4, 4, 0): 110592,
                 (64, 64, 64, 4, 4, 0): 65536, (64, 128, 64, 4, 4, 0): 98304,
                 (128, 128, 64, 8, 3, 0): 98304, (128, 128, 64, 8, 4, 0): 131072,
                 (128, 256, 64, 8, 3, 0): 147456, (128, 256, 32, 8, 4, 0): 98304,
                 (64, 256, 64, 8, 3, 0): 122880, (128, 128, 64, 8, 3, 1): 98328,
                 (128, 128, 64, 8, 4, 1): 131104, (128, 256, 64, 8, 3, 1): 147480,
                 (64, 128, 64, 4, 4, 1): 98336}
# The same with e4m3 weights (upcast in registers, read by pointers).
COMPILED_SMEM_E4M3 = {(16, 64, 128, 4, 4, 0): 36864, (16, 128, 128, 4, 4, 0): 61440,
                      (64, 64, 64, 4, 4, 0): 53248, (64, 128, 64, 4, 4, 0): 73728,
                      (128, 128, 64, 8, 3, 0): 81920, (128, 128, 64, 8, 4, 0): 106496,
                      (128, 256, 64, 8, 3, 0): 114688, (128, 256, 32, 8, 4, 0): 73728,
                      (64, 256, 64, 8, 3, 0): 90112}


def smem_config(bm: int, bn: int, bk: int, warps: int, stages: int, tma: int
                ) -> dict[str, int]:
    return {**tiles(bm, bn, bk), "GROUP_M": 8, "TMA": tma, "num_warps": warps,
            "num_stages": stages}


@pytest.mark.parametrize(("compiled", "weights"), [(COMPILED_SMEM, ""),
                                                   (COMPILED_SMEM_E4M3, "fp8-e4m3")])
def test_smem_model_covers_the_compiler(compiled: dict[tuple[int, ...], int], weights: str
                                        ) -> None:
    p = point(4096, 4096, 4096, "bfloat16", bias=0, weights=weights)
    for key, actual in compiled.items():
        c = SPEC.canonical(smem_config(*key), p)
        assert c["TMA"] == key[-1]
        predicted = SPEC.resources(c, p).smem_bytes
        assert actual <= predicted <= 1.1 * actual, (c, predicted, actual)


# ---- on the GPU -----------------------------------------------------------------------------

# Llama-3-8B's projections that linear serves, each with the residual add behind it.
LLAMA3 = {"down_proj": (14336, 4096), "o_proj": (4096, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("proj", list(LLAMA3))
@pytest.mark.parametrize("m", [1, 16, 4096])
def test_gpu_llama3_projections(m: int, proj: str, dtype: torch.dtype) -> None:
    k, n = LLAMA3[proj]
    check(make(m, k, n, dtype, bias=False))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "config"), [
    (1, {**tiles(1, 8, 512, 2), "num_warps": 4}),
    (1, {**tiles(1, 16, 256, 4, UNROLL_K=1, SPREAD=1, THREAD_SUM=1), "num_warps": 4}),
    (16, {**tiles(16, 64, 128, 4), "num_warps": 4, "num_stages": 4}),
    (512, {**tiles(128, 128, 64, 2, TMA=1), "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
    (512, {**tiles(128, 128, 64), "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
], ids=["gemv", "gemv-flags", "tiles-split4", "tma-split2", "tiles"])
def test_gpu_structures(m: int, config: dict[str, int], dtype: torch.dtype) -> None:
    poisoned_launch(point(m, 14336, 4096, "bfloat16" if dtype == torch.bfloat16 else "float16"),
                    config)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("m", [1, 16, 4096])
def test_gpu_fp8_weights(m: int, fmt: str) -> None:
    check(make(m, 14336, 4096, torch.bfloat16, bias=False, fmt=fmt))


@pytest.mark.gpu
def test_gpu_smem_model_covers_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same configs as COMPILED_SMEM, compiled by this GPU's Triton, with the residual.
    compiled = compiled_kernels(monkeypatch, "_linear_kernel")
    for weights, table in (("", COMPILED_SMEM), ("fp8-e4m3", COMPILED_SMEM_E4M3)):
        p = point(4096, 4096, 4096, "bfloat16", bias=0, weights=weights)
        for key in table:
            compiled.clear()
            c = smem_config(*key)
            poisoned_launch(p, c)
            actual = compiled[0].metadata.shared
            predicted = SPEC.resources(SPEC.canonical(c, p), p).smem_bytes
            assert actual <= predicted <= 1.1 * actual, (weights, c, predicted, actual)
