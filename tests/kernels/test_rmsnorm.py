"""fusetune.rmsnorm against a plain torch reference (Triton interpreter on CPU), and its spec."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune
from fusetune import gpus
from fusetune.kernels import REGISTRY, get_spec
from fusetune.kernels import rmsnorm as rmsnorm_mod
from fusetune.spec import ConfigError, Point, cdiv, dtype_name, next_pow2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPEC = rmsnorm_mod.SPEC


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref))


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, device: str = DEVICE
         ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype)
    return x, w


def check(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, **kw) -> torch.Tensor:
    y = fusetune.rmsnorm(x, w, eps=eps, **kw)
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert y.device == x.device
    assert not torch.isnan(y).any()
    ref = reference(x, w, eps)
    err = rel_err(y, ref)
    assert err <= TOL[x.dtype], f"relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return y


CFG_LOOP = {"BLOCK_D": 64, "ROWS": 1, "num_warps": 2, "num_stages": 2}
CFG_SINGLE = {"BLOCK_D": 256, "ROWS": 1, "num_warps": 4, "num_stages": 1}


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    """Every launch without a config uses the default heuristic (no tables loaded)."""
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


# ---- correctness ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "shape",
    [(3, 3000), (4, 1), (5, 64), (37, 64), (2, 3, 64), (7, 200)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = make(shape, dtype)
    check(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "config",
    [
        CFG_LOOP,  # BLOCK_D < D: two passes over the row, D not a multiple of BLOCK_D
        {"BLOCK_D": 128, "ROWS": 4, "num_warps": 4, "num_stages": 3},  # loop, ROWS > 1
        CFG_SINGLE,  # single pass, masked tail columns
        {"BLOCK_D": 256, "ROWS": 8, "num_warps": 1, "num_stages": 1},  # single, ROWS > 1
    ],
    ids=["loop", "loop-rows4", "single", "single-rows8"],
)
def test_explicit_configs(config: dict[str, int], dtype: torch.dtype) -> None:
    # M=13 is not a multiple of ROWS: the last program's extra rows must be masked off.
    x, w = make((13, 200), dtype, seed=1)
    check(x, w, config=config)


def test_non_contiguous_column_slice() -> None:
    big, _ = make((9, 96), torch.float16, seed=2)
    x = big[:, :64]
    assert not x.is_contiguous() and x.stride() == (96, 1)
    _, w = make((64,), torch.float16, seed=3)
    y = check(x, w)
    assert y.is_contiguous()
    # the untouched columns of the source are not the kernel's business
    torch.testing.assert_close(big[:, :64], x)


def test_permuted_leading_layout() -> None:
    base, w = make((3, 2, 64), torch.float32, seed=4)
    x = base.permute(1, 0, 2)  # [2, 3, 64], leading dims not collapsible into one stride
    assert not x.is_contiguous()
    y = check(x, w)
    torch.testing.assert_close(y, fusetune.rmsnorm(x.contiguous(), w, eps=1e-6), rtol=0, atol=0)


def test_transposed_last_dim() -> None:
    # x[m, d] with a column stride != 1: a copy is made, the result is still right.
    base, _ = make((64, 5), torch.float32, seed=5)
    x = base.t()
    assert x.stride(-1) != 1
    _, w = make((64,), torch.float32, seed=6)
    check(x, w)


def test_eps_is_honoured() -> None:
    x, w = make((4, 64), torch.float32, seed=7)
    x = x * 0.01  # mean(x²) ~ 1e-4, so eps=1 changes the result a lot
    y_small = check(x, w, eps=1e-6)
    y_big = check(x, w, eps=1.0)
    assert rel_err(y_big, reference(x, w, 1e-6)) > 0.5
    assert rel_err(y_small, reference(x, w, 1.0)) > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_weight_dtype_may_differ(dtype: torch.dtype) -> None:
    x, w = make((3, 64), dtype, seed=8)
    y = check(x, w.float())
    assert y.dtype == dtype


def test_zero_rows() -> None:
    x = torch.empty(0, 64, device=DEVICE, dtype=torch.float16)
    w = torch.ones(64, device=DEVICE, dtype=torch.float16)
    y = fusetune.rmsnorm(x, w, eps=1e-6)
    assert y.shape == (0, 64) and y.dtype == torch.float16


@pytest.mark.parametrize(
    "config",
    [CFG_LOOP, {"BLOCK_D": 64, "ROWS": 4, "num_warps": 2, "num_stages": 2},
     {"BLOCK_D": 256, "ROWS": 2, "num_warps": 4, "num_stages": 1}],
    ids=["loop", "loop-rows4", "single-rows2"],
)
def test_every_element_written(config: dict[str, int]) -> None:
    """The output starts NaN-poisoned: an element the kernel skips stays NaN."""
    x, w = make((11, 200), torch.float16, seed=9)
    y = torch.full_like(x, float("nan"))
    rmsnorm_mod._launch_2d(x, w, y, 1e-6, config)
    assert int(torch.isnan(y).sum()) == 0
    assert rel_err(y, reference(x, w)) <= TOL[torch.float16]


def test_public_entry_writes_every_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """rmsnorm's output buffer, poisoned through torch.empty, has no NaN left."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    x, w = make((13, 200), torch.float16, seed=10)
    monkeypatch.setattr(torch, "empty", poisoned)
    y = fusetune.rmsnorm(x, w, eps=1e-6, config={"BLOCK_D": 64, "ROWS": 4, "num_warps": 2,
                                       "num_stages": 2})
    monkeypatch.undo()
    assert int(torch.isnan(y).sum()) == 0
    assert rel_err(y, reference(x, w)) <= TOL[torch.float16]


# ---- errors --------------------------------------------------------------------------------


def test_weight_shape_mismatch_names_shapes() -> None:
    x, _ = make((2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"\(32,\).*\(64,\)"):
        fusetune.rmsnorm(x, torch.ones(32, device=DEVICE), eps=1e-6)
    with pytest.raises(ValueError, match=r"\(1, 64\)"):
        fusetune.rmsnorm(x, torch.ones(1, 64, device=DEVICE), eps=1e-6)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"BLOCK_D": 64, "ROWS": 1, "num_warps": 4}, "num_stages"),  # missing
        ({"BLOCK_D": 96, "ROWS": 1, "num_warps": 4, "num_stages": 1}, "BLOCK_D"),  # not pow2
        ({"BLOCK_D": 64, "ROWS": 1, "num_warps": 4, "num_stages": 1, "SPLIT": 2}, "SPLIT"),
        ({"BLOCK_D": 64, "ROWS": 0, "num_warps": 4, "num_stages": 1}, "ROWS"),
        ({"BLOCK_D": 64, "ROWS": 1, "num_warps": 4.0, "num_stages": 1}, "num_warps"),
    ],
    ids=["missing", "non-pow2", "unknown", "zero", "float"],
)
def test_bad_config_raises_config_error(config: dict, key: str) -> None:
    x, w = make((2, 64), torch.float32)
    with pytest.raises(ConfigError, match=key):
        fusetune.rmsnorm(x, w, eps=1e-6, config=config)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64])
def test_unsupported_dtype_raises_type_error(dtype: torch.dtype) -> None:
    x = torch.ones(2, 64, dtype=dtype, device=DEVICE)
    w = torch.ones(64, dtype=dtype, device=DEVICE)
    with pytest.raises(TypeError, match="unsupported dtype"):
        fusetune.rmsnorm(x, w, eps=1e-6)


def test_launch_helpers_grid_arithmetic_and_dtype_names() -> None:
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float32) == "float32"
    for _ in range(2):  # answers are remembered; refusals are not
        with pytest.raises(TypeError, match=r"unsupported dtype torch\.int8"):
            dtype_name(torch.int8)


def test_scalar_input_rejected() -> None:
    with pytest.raises(ValueError, match="at least one dimension"):
        fusetune.rmsnorm(torch.tensor(1.0), torch.ones(1), eps=1e-6)


# ---- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [4096, 3000])
def test_cuda_large(dtype: torch.dtype, d: int) -> None:
    x, w = make((4096, d), dtype, seed=11, device="cuda")
    y = fusetune.rmsnorm(x, w, eps=1e-6)
    torch.cuda.synchronize()
    assert y.device.type == "cuda" and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert rel_err(y, reference(x, w)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CFG_LOOP, {"BLOCK_D": 1024, "ROWS": 4, "num_warps": 8,
                                               "num_stages": 3}])
def test_cuda_looping_bf16(config: dict[str, int]) -> None:
    x, w = make((4096, 3000), torch.bfloat16, seed=12, device="cuda")
    y = fusetune.rmsnorm(x, w, eps=1e-6, config=config)
    torch.cuda.synchronize()
    assert rel_err(y, reference(x, w)) <= TOL[torch.bfloat16]


# ---- KernelSpec ----------------------------------------------------------------------------


def test_registry() -> None:
    assert REGISTRY["rmsnorm"] is SPEC
    assert get_spec("rmsnorm") is SPEC
    with pytest.raises(ValueError,
                       match="valid: ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, rope, "
                             "rope_bwd, swiglu"):
        get_spec("layernorm")


def _point(d: int, batch: int = 1, seq: int = 1, dtype: str = "float16") -> Point:
    return Point.make("rmsnorm", {"dim": d}, batch, seq, dtype)


def test_canonical_collapses_block_d_to_padded_width() -> None:
    p = _point(200, batch=64)
    c = SPEC.canonical({"BLOCK_D": 4096, "ROWS": 1, "num_warps": 4, "num_stages": 3}, p)
    assert c == {"BLOCK_D": 256, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    assert next_pow2(200) == 256


def test_canonical_single_pass_drops_stages_but_loop_keeps_them() -> None:
    p = _point(200, batch=64)
    single = SPEC.canonical({"BLOCK_D": 256, "ROWS": 2, "num_warps": 4, "num_stages": 4}, p)
    loop = SPEC.canonical({"BLOCK_D": 64, "ROWS": 2, "num_warps": 4, "num_stages": 4}, p)
    assert single["num_stages"] == 1
    assert loop == {"BLOCK_D": 64, "ROWS": 2, "num_warps": 4, "num_stages": 4}


@pytest.mark.parametrize(("rows", "expected"), [(1, 1), (3, 4), (5, 8), (64, 16)])
def test_canonical_caps_rows(rows: int, expected: int) -> None:
    c = SPEC.canonical({"BLOCK_D": 64, "ROWS": 16, "num_warps": 4, "num_stages": 1},
                       _point(64, batch=rows))
    assert c["ROWS"] == expected


def test_canonical_does_not_modify_its_argument() -> None:
    config = {"BLOCK_D": 4096, "ROWS": 16, "num_warps": 4, "num_stages": 3}
    SPEC.canonical(config, _point(64))
    assert config == {"BLOCK_D": 4096, "ROWS": 16, "num_warps": 4, "num_stages": 3}


def test_resources_more_stages_more_smem_when_looping() -> None:
    p = _point(4096, batch=16)
    smem = [SPEC.resources({"BLOCK_D": 1024, "ROWS": 2, "num_warps": 4, "num_stages": s}, p)
            .smem_bytes for s in (1, 2, 3, 4)]
    assert smem == sorted(smem) and len(set(smem)) == 4
    # stage s adds (s-1) pipelined [ROWS+1, BLOCK_D] fp16 tiles to the reduction scratch
    assert smem[0] == 2 * 4 * 4
    assert smem[3] - smem[0] == 3 * 3 * 1024 * 2


def test_resources_single_pass_ignores_stages() -> None:
    p = _point(1024, batch=16)
    a = SPEC.resources({"BLOCK_D": 1024, "ROWS": 2, "num_warps": 4, "num_stages": 1}, p)
    b = SPEC.resources({"BLOCK_D": 1024, "ROWS": 2, "num_warps": 4, "num_stages": 4}, p)
    assert a == b
    assert a.threads == 128


@pytest.mark.parametrize(("dtype", "elt"), [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_cost_bytes_formula(dtype: str, elt: int) -> None:
    p = _point(4096, batch=2, seq=8, dtype=dtype)
    c = SPEC.cost(p)
    m, d = 16, 4096
    assert c.bytes == 2 * m * d * elt + d * elt  # read x, write y, read the weight once
    assert c.flops == 4 * m * d


@pytest.mark.parametrize("d", [1, 3000, 4096, 20000])
@pytest.mark.parametrize("gpu", ["interpreter", "3090", "h100"])
def test_default_config_is_valid(d: int, gpu: str) -> None:
    p = _point(d, batch=4)
    config = SPEC.default_config(p, gpus.resolve(gpu))
    assert SPEC.validate_config(config) == config
    assert config["BLOCK_D"] >= min(d, 16384)


def test_validate_config_returns_plain_ints() -> None:
    out = SPEC.validate_config({"num_stages": 2, "num_warps": 4, "ROWS": 2, "BLOCK_D": 128})
    assert out == {"BLOCK_D": 128, "ROWS": 2, "num_warps": 4, "num_stages": 2}
    assert list(out) == list(SPEC.config_keys)
    with pytest.raises(ConfigError, match="BLOCK_D=True"):
        SPEC.validate_config({"BLOCK_D": True, "ROWS": 1, "num_warps": 4, "num_stages": 1})
    with pytest.raises(ConfigError, match="expected a mapping"):
        SPEC.validate_config([64, 1, 4, 1])  # type: ignore[arg-type]


def test_spec_reference_matches_test_reference() -> None:
    p = _point(64, batch=2, seq=3, dtype="float32")
    inputs = SPEC.make_inputs(p, DEVICE)
    assert inputs["x"].shape == (2, 3, 64)
    assert not (inputs["x"] == 0).all()
    ref = SPEC.reference(inputs)["y"]
    torch.testing.assert_close(ref, reference(inputs["x"], inputs["weight"], inputs["eps"]))
    out = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, out, CFG_SINGLE)
    assert rel_err(out["y"], ref) <= TOL[torch.float32]


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fusetune.rmsnorm(x, torch.ones(64), eps=1e-6)


@pytest.mark.parametrize("block_d", [128, 32])  # the whole row in one block; two passes
def test_residual_epilogue(block_d: int) -> None:
    # Gemma's norm of a block's output before its residual add: residual + norm(x)·w, added in
    # float32, rounded once; through the tuner's check at a point keyed by the optional dim.
    from fusetune.tuner.bench import Evaluator

    spec = rmsnorm_mod.SPEC
    point = Point.make("rmsnorm", {"dim": 96, "residual": 1}, 2, 5, "float32")
    config = spec.canonical({"BLOCK_D": block_d, "ROWS": 2, "num_warps": 2, "num_stages": 2},
                            point)
    out = Evaluator(spec, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok" and out.rel_err is not None and out.rel_err <= 1e-5, out.reason
    x, w, r = torch.randn(3, 96), 1 + 0.1 * torch.randn(96), torch.randn(3, 96)
    got = fusetune.rmsnorm(x, w, eps=1e-6, residual=r)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w + r
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"residual must be x's shape \(3, 96\)"):
        fusetune.rmsnorm(x, w, eps=1e-6, residual=r[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4096])
@pytest.mark.parametrize("dim", [3584, 3840])
def test_gpu_residual_epilogue_gemma_dims(dim: int, rows: int) -> None:
    from fusetune.tuner.bench import Evaluator

    point = Point.make("rmsnorm", {"dim": dim, "residual": 1}, 1, rows, "bfloat16")
    ev = Evaluator(SPEC, point, "cuda", "cuda")
    out = ev.check(SPEC.canonical(SPEC.default_config(point, gpus.resolve("h200")), point))
    assert out.status == "ok", out.reason
