"""fusetune.ffn (RMSNorm -> W1, W3 -> silu·mul) against plain torch (interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from launched import descriptors_made

import fusetune
from fusetune import gpus, ops
from fusetune.kernels import ffn as ffn_mod
from fusetune.kernels import fp8
from fusetune.kernels._matmul_spec import launch_args
from fusetune.spec import ConfigError, Point, check_fits, interpreting
from fusetune.tuner.space import load_space

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
SPEC = ffn_mod.SPEC


def reference(x: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """Llama's RMSNorm followed by its MLP gate: silu(x W1ᵀ) * (x W3ᵀ), in float64."""
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    return torch.nn.functional.silu(xn @ w1.double().T) * (xn @ w3.double().T)


def make(m: int, d: int, h: int, dtype: torch.dtype, seed: int = 0
         ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    g = 1 + 0.1 * torch.randn(d, generator=gen)
    w1 = torch.randn(h, d, generator=gen) / d**0.5
    w3 = torch.randn(h, d, generator=gen) / d**0.5
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (x, g, w1, w3))


def check(x: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, **kw
          ) -> torch.Tensor:
    kw.setdefault("eps", 1e-6)
    out = fusetune.ffn(x, g, w1, w3, **kw)
    assert out.shape == (*x.shape[:-1], w1.shape[0]) and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    ref = reference(x.cpu(), g.cpu(), w1.cpu(), w3.cpu(), kw.get("eps", 1e-6))
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err <= TOL[x.dtype], f"relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return out


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "d", "h"), [(1, 64, 96), (37, 100, 40), (3, 300, 72),
                                           (16, 64, 64)])
def test_matches_reference(m: int, d: int, h: int, dtype: torch.dtype) -> None:
    check(*make(m, d, h, dtype))


@pytest.mark.parametrize(("passes", "split"), [(1, 1), (2, 1), (1, 4), (2, 16)])
def test_awkward_width_d3000(passes: int, split: int) -> None:
    x, g, w1, w3 = make(2, 3000, 24, torch.float16)
    check(x, g, w1, w3, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1,
                                "PASSES": passes, "SPLIT_K": split, "num_warps": 4,
                                "num_stages": 2})


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "num_warps": 2, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 1,
     "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8, "PASSES": 1, "SPLIT_K": 1,
     "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "PASSES": 1, "SPLIT_K": 2,
     "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "PASSES": 2, "SPLIT_K": 4,
     "num_warps": 4, "num_stages": 3},
    # BLOCK_M = 1: one row per program, no tensor cores (the decode structure)
    {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "num_warps": 2, "num_stages": 1},
    {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 64, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 2,
     "num_warps": 4, "num_stages": 2},
])
def test_configs_and_grouping(config: dict[str, int]) -> None:
    # 70 rows x 80 hidden: several row- and column-blocks, partial tiles on both edges. The
    # one-row structure runs a program per row: three rows show it all.
    rows = 3 if config["BLOCK_M"] == 1 else 70
    check(*make(rows, 96, 80, torch.float16), config=config)


@pytest.mark.parametrize(("passes", "split", "unroll"),
                         [(1, 1, 0), (2, 1, 0), (1, 4, 0), (2, 16, 0), (1, 1, 1), (2, 4, 1),
                          (1, 2, 1)])
def test_gemv_awkward_width_d3000(passes: int, split: int, unroll: int) -> None:
    # K = 3000 is not a multiple of BLOCK_K: the last step of the last K-slice is partial.
    # UNROLL_K = 1 takes the steps two by two: 12 steps whole, 3 per slice with SPLIT_K = 4 (the
    # second step of each slice's last iteration is empty), 6 per slice with 2.
    x, g, w1, w3 = make(3, 3000, 24, torch.float16)
    check(x, g, w1, w3, config={"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 256, "GROUP_M": 1,
                                "PASSES": passes, "SPLIT_K": split, "UNROLL_K": unroll,
                                "num_warps": 2, "num_stages": 1})


@pytest.mark.parametrize(("rows", "unroll", "warps"), [(1, 1, 2), (2, 1, 4), (2, 0, 8)])
def test_gemv_whole_rows(rows: int, unroll: int, warps: int) -> None:
    # One or two weight rows per program and K-steps of 2048: the 3000-wide row in one
    # iteration (UNROLL_K = 1: a whole step and a partial one) or in two.
    x, g, w1, w3 = make(2, 3000, 5, torch.float16)
    check(x, g, w1, w3, config={"BLOCK_M": 1, "BLOCK_N": rows, "BLOCK_K": 2048, "GROUP_M": 1,
                                "PASSES": 1, "SPLIT_K": 1, "UNROLL_K": unroll,
                                "num_warps": warps, "num_stages": 1})


@pytest.mark.parametrize(("rows", "split", "unroll", "passes"),
                         [(8, 1, 0, 1), (4, 2, 1, 1), (2, 1, 1, 2), (16, 4, 0, 2)])
def test_gemv_spread_rows(rows: int, split: int, unroll: int, passes: int) -> None:
    # SPREAD = 1: program p takes rows p, p + P, ... (P = cdiv(37, rows) programs); 37 hidden
    # rows leave the last program(s) part of a block past the end. Every output comes from
    # the same K loop as with adjacent rows, so the two results are bit-identical.
    x, g, w1, w3 = make(3, 300, 37, torch.float16)
    config = {"BLOCK_M": 1, "BLOCK_N": rows, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": passes,
              "SPLIT_K": split, "UNROLL_K": unroll, "num_warps": 2, "num_stages": 1}
    spread = check(x, g, w1, w3, config={**config, "SPREAD": 1})
    assert torch.equal(spread, fusetune.ffn(x, g, w1, w3, eps=1e-6, config={**config, "SPREAD": 0}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "bk", "passes", "split", "unroll"),
                         [(8, 256, 1, 1, 0), (4, 256, 2, 4, 1), (2, 2048, 1, 1, 1),
                          (16, 64, 1, 2, 0)])
def test_gemv_thread_sum(dtype: torch.dtype, rows: int, bk: int, passes: int, split: int,
                         unroll: int) -> None:
    # THREAD_SUM = 1: each thread adds the products of its 16-byte run of a weight row (8
    # float16 or 4 float32 elements) before accumulating; K = 3000 leaves partial steps and,
    # with SPLIT_K, a partial slice. The sums come in another order: close to THREAD_SUM = 0,
    # not bit-identical. Two rows, 13 outputs: partial column blocks, a program per row.
    x, g, w1, w3 = make(2, 3000, 13, dtype)
    config = {"BLOCK_M": 1, "BLOCK_N": rows, "BLOCK_K": bk, "GROUP_M": 1, "PASSES": passes,
              "SPLIT_K": split, "UNROLL_K": unroll, "num_warps": 2, "num_stages": 1}
    summed = check(x, g, w1, w3, config={**config, "THREAD_SUM": 1})
    plain = fusetune.ffn(x, g, w1, w3, eps=1e-6, config={**config, "THREAD_SUM": 0})
    assert torch.allclose(summed.float(), plain.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_thread_sum_only_for_the_one_row_structure() -> None:
    gemv = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
            "SPLIT_K": 1, "UNROLL_K": 1, "THREAD_SUM": 1, "num_warps": 4, "num_stages": 1}
    assert SPEC.canonical(gemv, point(1))["THREAD_SUM"] == 1
    tiles = {**gemv, "BLOCK_M": 16, "BLOCK_N": 64}
    assert SPEC.canonical(tiles, point(16))["THREAD_SUM"] == 0  # the tensor-core loop
    assert SPEC.validate_config({k: v for k, v in gemv.items() if k != "THREAD_SUM"})[
        "THREAD_SUM"] == 0  # tables written before the flag
    # One float32 accumulator per 8 float16 products: fewer registers a thread.
    regs = [SPEC.resources({**gemv, "THREAD_SUM": t}, point(1)).regs_per_thread for t in (0, 1)]
    assert regs[1] < regs[0]


def test_spread_only_where_rows_can_lie_apart() -> None:
    gemv = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
            "SPLIT_K": 1, "UNROLL_K": 1, "SPREAD": 1, "num_warps": 4, "num_stages": 1}
    assert SPEC.canonical(gemv, point(1))["SPREAD"] == 1
    assert SPEC.canonical({**gemv, "BLOCK_N": 1}, point(1))["SPREAD"] == 0  # one row
    # Tensor-core tiles store whole rows of adjacent columns.
    assert SPEC.canonical({**gemv, "BLOCK_M": 16, "BLOCK_N": 64}, point(16))["SPREAD"] == 0
    one_block = Point.make("ffn", {"dim": 4096, "hidden": 8}, 1, 1, "float16")
    assert SPEC.canonical(gemv, one_block)["SPREAD"] == 0  # all 8 rows in one program
    # Tables written before the flag mean 0.
    assert SPEC.validate_config({k: v for k, v in gemv.items() if k != "SPREAD"})["SPREAD"] == 0


TMA_CONFIGS = [
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 1,
     "TMA": 1, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 2, "SPLIT_K": 2,
     "TMA": 1, "num_warps": 4, "num_stages": 3},
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("config", TMA_CONFIGS, ids=["tma", "tma-split"])
def test_tma_descriptors(config: dict[str, int], dtype: torch.dtype) -> None:
    # Tiles through TMA descriptors: 70 rows x 80 hidden leave boxes past the bottom and right
    # edges; K = 96 is three whole K-steps, K = 3000 ends with a partial one.
    check(*make(70, 96, 80, dtype), config=config)
    check(*make(5, 3000, 24, dtype), config=config)


@pytest.mark.parametrize("structure", [{"PASSES": 1}, {"BLOCK_M": 1, "BLOCK_N": 8}])
def test_tma_asked_where_the_structure_has_no_tma_loop(structure: dict[str, int]) -> None:
    # A config= that asks for TMA with the norm folded in, or for the GEMV: pointers, right.
    check(*make(5, 96, 40, torch.float16), config={**TMA_CONFIGS[0], **structure})


def test_tma_falls_back_to_pointers_where_descriptors_cannot_cover() -> None:
    # Rows of 100 float16 (200 bytes) do not start on 16-byte boundaries; a weight that starts
    # 2 bytes into its storage neither: the same tiles are read by pointers.
    check(*make(3, 100, 24, torch.float16), config=TMA_CONFIGS[0])
    x, g, w1, w3 = make(3, 64, 24, torch.float16)
    w1_off = torch.empty(24 * 64 + 1, dtype=w1.dtype, device=w1.device)[1:].view(24, 64)
    w1_off.copy_(w1)
    assert w1_off.data_ptr() % 16 != 0
    check(x, g, w1_off, w3, config=TMA_CONFIGS[0])


# ---- bfloat16 through the tensor-core loop ---------------------------------------------------

# The structures with tl.dot (BLOCK_M > 1): the norm folded into the K loop, the norm pass with
# split-K, tiles through TMA descriptors. Triton's interpreter gets tl.dot on bfloat16 tiles
# wrong unless the kernel widens them first (_matmul.dot, INTERPRETED).
BF16_STRUCTURES = {
    "folded": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1,
               "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
    "pass-split": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 2,
                   "SPLIT_K": 2, "num_warps": 4, "num_stages": 2},
    "tma": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 2,
            "SPLIT_K": 1, "TMA": 1, "num_warps": 4, "num_stages": 2},
}
# 19 rows x 40 hidden: partial row and column tiles; K = 104: three K-steps and a partial one,
# rows of 208 bytes (16-byte boundaries: TMA descriptors can cover them).
BF16_SHAPE = (19, 104, 40)


@pytest.mark.parametrize("structure", list(BF16_STRUCTURES))
def test_bfloat16_tensor_core_structures(structure: str, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    made = descriptors_made(monkeypatch)
    check(*make(*BF16_SHAPE, torch.bfloat16), config=BF16_STRUCTURES[structure])
    assert len(made) == (3 if structure == "tma" else 0)  # x, W1, W3


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("structure", ["folded", "pass-split"])
def test_bfloat16_with_fp8_weights(structure: str, fmt: str) -> None:
    # Weight-only FP8: the weight tiles are decoded and rounded to bfloat16 (exact) for tl.dot,
    # then the same product as with bfloat16 weights, against the dequantized weights.
    x, g, w1, w3 = make(*BF16_SHAPE, torch.float32)
    (q1, s1), (q3, s3) = (fusetune.quantize_fp8(w, fmt) for w in (w1, w3))
    x, g = x.bfloat16(), g.bfloat16()
    out = fusetune.ffn(x, g, q1, q3, eps=1e-6, w1_scale=s1, w3_scale=s3,
                       config=BF16_STRUCTURES[structure])
    ref = reference(x.cpu(), g.cpu(), fp8.dequantize(q1.cpu(), s1.cpu()),
                    fp8.dequantize(q3.cpu(), s3.cpu()))
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert out.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], err


def test_bfloat16_through_the_ops() -> None:
    # fusetune.ops.ffn and the custom op that torch.compile sees call the same launcher, with
    # the tables' config (the default heuristic here: tensor-core tiles at 19 rows).
    x, g, w1, w3 = make(*BF16_SHAPE, torch.bfloat16)
    ref = reference(x.cpu(), g.cpu(), w1.cpu(), w3.cpu())
    for out in (ops.ffn(x, g, w1, w3, 1e-6),
                torch.ops.fusetune.ffn(x, g, w1, w3, 1e-6, None, None, False)):
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert out.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], err


def test_interpreter_flag_is_a_property_of_the_backend() -> None:
    # Every launch passes INTERPRETED (the interpreter or not); no config, search space or
    # table holds it.
    args = launch_args(BF16_STRUCTURES["folded"], act=False, w_fp8=0, ieee=False,
                       w_scaled=False, tma=False)
    assert args["INTERPRETED"] is interpreting()
    assert "INTERPRETED" not in SPEC.config_keys
    assert "INTERPRETED" not in [p.name for p in load_space(SPEC).params]
    with pytest.raises(ConfigError, match="INTERPRETED"):
        SPEC.validate_config({**BF16_STRUCTURES["folded"], "INTERPRETED": 1})


def test_leading_shape_strides_and_eps() -> None:
    x, g, w1, w3 = make(2 * 3, 64, 48, torch.float32)
    out = check(x.view(2, 3, 64), g, w1, w3, eps=1e-2)
    assert out.shape == (2, 3, 48)
    wide = torch.cat([x, x], dim=1)[:, :64]  # strided rows
    check(wide, g, w1, w3)
    # Transposed weight storage still means [hidden, dim]; it is made contiguous.
    check(x, g, w1.T.contiguous().T, w3)


def test_bad_inputs() -> None:
    x, g, w1, w3 = make(2, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="rms_weight has shape"):
        fusetune.ffn(x, g[:8], w1, w3, eps=1e-6)
    with pytest.raises(ValueError, match=r"nn\.Linear layout"):
        fusetune.ffn(x, g, w1.T, w3, eps=1e-6)
    with pytest.raises(ValueError, match=r"nn\.Linear layout"):
        fusetune.ffn(x, g, w1, w3[:16], eps=1e-6)
    with pytest.raises(TypeError, match=r"w3 is torch\.float32"):
        fusetune.ffn(x, g, w1, w3.float(), eps=1e-6)
    with pytest.raises(ConfigError, match="GROUP_M"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32,
                                            "num_warps": 2, "num_stages": 2})


def test_empty_rows() -> None:
    x, g, w1, w3 = make(0, 64, 32, torch.float16)
    assert fusetune.ffn(x, g, w1, w3, eps=1e-6).shape == (0, 32)


# ---- the spec -------------------------------------------------------------------------------


def point(rows: int, d: int = 4096, h: int = 11008, dtype: str = "float16") -> Point:
    return Point.make("ffn", {"dim": d, "hidden": h}, 1, rows, dtype)


@pytest.mark.parametrize("gpu", ["3090", "a100", "h100", "l4"])
@pytest.mark.parametrize("rows", [1, 16, 64, 4096])
def test_default_config_fits_every_gpu(gpu: str, rows: int) -> None:
    p = point(rows)
    spec_gpu = gpus.resolve(gpu)
    c = SPEC.canonical(SPEC.default_config(p, spec_gpu), p)
    assert SPEC.validate_config(c) == c
    assert check_fits(SPEC.resources(c, p), spec_gpu) is None


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_gemv_structure_only_for_one_row(rows: int) -> None:
    # BLOCK_M = 1 redoes the multiply for every row: pruned, with the reason, above one row.
    p = point(rows)
    gemv = SPEC.canonical({"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1,
                           "PASSES": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}, p)
    why = check_fits(SPEC.resources(gemv, p), gpus.resolve("h100"))
    if rows == 1:
        assert why is None
    else:
        assert why is not None and "structure: BLOCK_M=1" in why and f"{rows} rows" in why


def test_canonical_and_resources() -> None:
    p = point(1)
    c = SPEC.canonical({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                        "PASSES": 1, "SPLIT_K": 128, "num_warps": 4, "num_stages": 3}, p)
    assert c["SPLIT_K"] == 64  # 4096 / 64 steps of K: no empty slices
    assert c["BLOCK_M"] == 16 and c["GROUP_M"] == 1
    big = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "PASSES": 1, "SPLIT_K": 1,
           "num_warps": 8, "num_stages": 4}
    res = SPEC.resources(big, point(4096))
    assert res.smem_bytes == 3 * (128 * 128 + 2 * 128 * 256) * 2 + 128 * 256 * 2 + 1024
    assert check_fits(res, gpus.resolve("h100")) is not None  # 655 KB of stages: too much
    cost = SPEC.cost(point(1))
    assert cost.bytes > 2 * 11008 * 4096 * 2  # both weight matrices at least


def test_unroll_k_only_where_there_are_steps_to_pair() -> None:
    gemv = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
            "SPLIT_K": 1, "UNROLL_K": 1, "num_warps": 4, "num_stages": 1}
    assert SPEC.canonical(gemv, point(1))["UNROLL_K"] == 1  # 8 K-steps
    assert SPEC.canonical({**gemv, "SPLIT_K": 4}, point(1))["UNROLL_K"] == 1  # 2 per slice
    assert SPEC.canonical({**gemv, "SPLIT_K": 8}, point(1))["UNROLL_K"] == 0  # 1 per slice
    # The tensor-core loop is pipelined by num_stages: UNROLL_K means nothing there.
    assert SPEC.canonical({**gemv, "BLOCK_M": 16, "BLOCK_N": 64}, point(16))["UNROLL_K"] == 0
    # A config without it (tables written before it) means 0.
    assert SPEC.validate_config({k: v for k, v in gemv.items() if k != "UNROLL_K"})[
        "UNROLL_K"] == 0
    # Two steps' loaded tiles live in registers at once.
    regs = [SPEC.resources({**gemv, "UNROLL_K": u}, point(1)).regs_per_thread for u in (0, 1)]
    assert regs[1] > regs[0]


def test_tma_only_where_descriptors_can_feed_the_tensor_cores() -> None:
    tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
            "SPLIT_K": 1, "TMA": 1, "num_warps": 8, "num_stages": 3}
    p = point(4096)
    assert SPEC.canonical(tile, p)["TMA"] == 1
    assert SPEC.canonical({**tile, "PASSES": 1}, p)["TMA"] == 0  # x is scaled in registers
    assert SPEC.canonical({**tile, "BLOCK_M": 1, "BLOCK_N": 8}, point(1))["TMA"] == 0  # GEMV
    fp8_point = Point.make("ffn", {"dim": 4096, "hidden": 11008}, 1, 4096, "float16", "fp8-e4m3")
    assert SPEC.canonical(tile, fp8_point)["TMA"] == 0  # FP8 weights
    odd = Point.make("ffn", {"dim": 100, "hidden": 64}, 1, 4096, "float16")
    assert SPEC.canonical(tile, odd)["TMA"] == 0  # 200-byte rows: no descriptor
    # Pruned before compiling where the GPU has no TMA (before Hopper), with the reason.
    res = SPEC.resources(SPEC.canonical(tile, p), p)
    assert check_fits(res, gpus.resolve("h100")) is None
    why = check_fits(res, gpus.resolve("a100"))
    assert why is not None and why.startswith("tma: TMA=1 needs TMA descriptors"), why
    assert SPEC.validate_config({k: v for k, v in tile.items() if k != "TMA"})["TMA"] == 0
    # The default heuristic takes TMA at many rows with 16-bit weights and K of at least 768,
    # on GPUs that have it.
    h100, a100 = gpus.resolve("h100"), gpus.resolve("a100")
    assert SPEC.default_config(p, h100)["TMA"] == 1
    assert SPEC.default_config(p, a100)["TMA"] == 0
    assert SPEC.default_config(point(512), h100)["TMA"] == 0
    assert SPEC.default_config(fp8_point, h100)["TMA"] == 0
    gpt2 = Point.make("ffn", {"dim": 768, "hidden": 3072}, 1, 4096, "float16")
    assert SPEC.default_config(gpt2, h100)["TMA"] == 1
    short = Point.make("ffn", {"dim": 512, "hidden": 3072}, 1, 4096, "float16")
    assert SPEC.default_config(short, h100)["TMA"] == 0


# Shared memory Triton 3.9 allocated when compiling the kernel for sm_90 (fp16/bf16, fp32):
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PASSES) -> bytes. The model must not
# predict less, or configs that cannot run would be compiled.
COMPILED_SMEM = {
    "float16": {(16, 64, 128, 4, 4, 1): 110848, (128, 128, 64, 8, 3, 1): 131328,
                (64, 256, 32, 8, 2, 1): 69696, (16, 64, 128, 4, 4, 2): 110592,
                (128, 128, 64, 8, 3, 2): 147456, (64, 256, 32, 8, 2, 2): 73728},
    "float32": {(16, 64, 128, 4, 4, 1): 230912, (128, 128, 64, 8, 3, 1): 229888,
                (64, 256, 32, 8, 2, 1): 82048, (16, 64, 128, 4, 4, 2): 221184,
                (128, 128, 64, 8, 3, 2): 196608, (64, 256, 32, 8, 2, 2): 73728},
}


@pytest.mark.parametrize("dtype", sorted(COMPILED_SMEM))
def test_smem_model_covers_the_compiler(dtype: str) -> None:
    for (bm, bn, bk, w, st, passes), actual in COMPILED_SMEM[dtype].items():
        c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PASSES": passes,
             "SPLIT_K": 1, "num_warps": w, "num_stages": st}
        predicted = SPEC.resources(c, point(4096, dtype=dtype)).smem_bytes
        # Close for 2-byte types (so that the pruning does not throw good configs away);
        # float32 is rare and modelled loosely.
        slack = 1.5 if dtype == "float16" else 2.0
        assert actual <= predicted <= slack * actual, (c, predicted, actual)


# ---- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 37, 512])
def test_gpu_llama_dims(dtype: torch.dtype, m: int) -> None:
    check(*make(m, 4096, 11008, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "split"), [(300, 1), (37, 2)])
def test_gpu_tma_descriptors(dtype: torch.dtype, m: int, split: int) -> None:
    check(*make(m, 4096, 11008, dtype), config={
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
        "SPLIT_K": split, "TMA": 1, "num_warps": 8, "num_stages": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "split", "unroll"), [(1, 1, 0), (1, 4, 0), (5, 2, 0), (1, 1, 1),
                                                    (3, 2, 1)])
def test_gpu_gemv_structure(dtype: torch.dtype, m: int, split: int, unroll: int) -> None:
    check(*make(m, 4096, 11008, dtype), config={
        "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "GROUP_M": 1, "PASSES": 1,
        "SPLIT_K": split, "UNROLL_K": unroll, "num_warps": 2, "num_stages": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(("spread", "thread_sum"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gpu_gemv_whole_rows(dtype: torch.dtype, m: int, spread: int, thread_sum: int) -> None:
    # Two weight rows per program (adjacent, or half the matrix apart), the 4096-wide row in
    # one iteration (two K-steps of 2048); each thread's run of a row added up first or not.
    check(*make(m, 4096, 11008, dtype), config={
        "BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 2048, "GROUP_M": 1, "PASSES": 1,
        "SPLIT_K": 1, "UNROLL_K": 1, "SPREAD": spread, "THREAD_SUM": thread_sum,
        "num_warps": 8, "num_stages": 1})


# ---- Gemma's GeGLU gate (act = 1: gelu, tanh form) ------------------------------------------

GELU_CONFIGS = {
    "folded": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1,
               "SPLIT_K": 1, "num_warps": 2, "num_stages": 2},
    "split-K": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "PASSES": 2,
                "SPLIT_K": 2, "num_warps": 4, "num_stages": 2},
    "one-row": {"BLOCK_M": 1, "GROUP_M": 1, "BLOCK_N": 8, "BLOCK_K": 32, "PASSES": 1,
                "SPLIT_K": 1, "num_warps": 2, "num_stages": 1},
    "unfused": {"UNFUSED": 1},
}


@pytest.mark.parametrize("name", list(GELU_CONFIGS))
def test_gelu_gate_configs_pass_the_tuners_check(name: str) -> None:
    from fusetune.tuner.bench import Evaluator

    point = Point.make("ffn", {"act": 1, "dim": 64, "hidden": 96}, 1,
                       1 if name == "one-row" else 7, "float32")
    default = SPEC.default_config(point, gpus.INTERPRETER)
    config = SPEC.canonical({**default, "TMA": 0, **GELU_CONFIGS[name]}, point)
    out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= 1e-4


def test_gelu_gate_through_the_call() -> None:
    x, g, w1, w3 = make(5, 64, 96, torch.float32)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    want = torch.nn.functional.gelu(xn @ w1.T, approximate="tanh") * (xn @ w3.T)
    got = fusetune.ffn(x, g, w1, w3, eps=1e-6, activation="gelu_tanh")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    silu = fusetune.ffn(x, g, w1, w3, eps=1e-6)
    assert not torch.allclose(silu, got)  # the activation is applied, not silu's
    with pytest.raises(ValueError, match=r"activation='gelu'; valid: 'silu', 'gelu_tanh'"):
        fusetune.ffn(x, g, w1, w3, eps=1e-6, activation="gelu")
    # the point keys the activation: a silu entry never serves a gelu call
    assert SPEC.short_dims({"act": 0, "dim": 64, "hidden": 96}) == {"dim": 64, "hidden": 96}


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
@pytest.mark.parametrize("rows", [1, 333])
def test_gpu_gelu_gate_gemma_dims(rows: int, weights: str) -> None:
    # Gemma-2-9B's MLP (GeGLU, tanh GELU): the default config and the unfused form on the GPU
    from fusetune.tuner.bench import Evaluator

    point = Point.make("ffn", {"act": 1, "dim": 3584, "hidden": 14336}, 1, rows, "bfloat16",
                       weights)
    ev = Evaluator(SPEC, point, "cuda", "cuda")
    default = SPEC.default_config(point, gpus.resolve("h200"))
    for config in (default, {**default, "UNFUSED": 1}):
        out = ev.check(SPEC.canonical(config, point))
        assert out.status == "ok", (config, out.reason)
