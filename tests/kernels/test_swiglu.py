"""fusetune.swiglu (silu(a)·b) and its autograd against torch (Triton interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fusetune
from fusetune import api, gpus
from fusetune.kernels import REGISTRY
from fusetune.kernels import swiglu as swiglu_mod
from fusetune.spec import ConfigError, Point
from fusetune.tuner.space import load_space, make_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPEC = swiglu_mod.SPEC


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().norm())


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0,
          device: str = DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a.double()) * b.double()


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


# ---- forward --------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype"), [((37, 300), torch.float32),
                                              ((2, 3, 37), torch.float16),
                                              ((1, 1), torch.float32),
                                              ((5, 64), torch.float16)])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    a, b = randn(*shape, dtype=dtype, seed=1, scale=3.0), randn(*shape, dtype=dtype, seed=2)
    y = fusetune.swiglu(a, b)
    assert y.shape == a.shape and y.dtype == dtype and y.device == a.device
    assert rel_err(y, reference(a, b)) <= TOL[dtype]


@pytest.mark.parametrize("config", [
    {"BLOCK": 64, "ROWS": 2, "num_warps": 1},      # five column blocks a row, the last masked
    {"BLOCK": 128, "ROWS": 4, "num_warps": 2},     # 37 rows: the last row block masked
    {"BLOCK": 16384, "ROWS": 16, "num_warps": 16},  # the space's top: one program for all
])
def test_configs_of_the_space_agree(config: dict[str, int]) -> None:
    values = {p.name: p.values for p in load_space(SPEC).params}
    assert all(v in values[k] for k, v in config.items())
    a, b = randn(37, 300, seed=3, scale=3.0), randn(37, 300, seed=4)
    base = fusetune.swiglu(a, b)
    assert rel_err(base, reference(a, b)) <= 1e-5
    assert torch.equal(fusetune.swiglu(a, b, config=config), base)


def test_strided_halves_of_a_fused_projection() -> None:
    # a and b as the two halves of one [.., 2H] gate/up output: rows strided, no copy.
    gu = randn(2, 7, 2 * 300, seed=5, scale=2.0)
    a, b = gu[..., :300], gu[..., 300:]
    assert not a.is_contiguous()
    y = fusetune.swiglu(a, b)
    assert y.is_contiguous() and rel_err(y, reference(a, b)) <= 1e-5
    assert fusetune.swiglu(randn(0, 3, 16), randn(0, 3, 16)).shape == (0, 3, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_gate_of_ffns_unfused_form(dtype: torch.dtype) -> None:
    # gate 1: Gemma's GeGLU, gelu in its tanh form, on the strided halves of one projection
    gu = randn(37, 2 * 300, dtype=dtype, seed=6, scale=3.0)
    a, b = gu[:, :300], gu[:, 300:]
    y = torch.empty(37, 300, dtype=dtype, device=DEVICE)
    swiglu_mod._launch_2d(a, b, y, {"BLOCK": 64, "ROWS": 4, "num_warps": 2}, gate=1)
    want = F.gelu(a.double(), approximate="tanh") * b.double()
    assert rel_err(y, want) <= TOL[dtype]
    assert rel_err(y, reference(a, b)) > 0.05  # gelu, not silu


def test_bad_inputs() -> None:
    a = randn(3, 8)
    with pytest.raises(ValueError, match=r"swiglu: a has shape \(3, 8\) and b \(3, 9\); they "
                                         r"must match"):
        fusetune.swiglu(a, randn(3, 9))
    with pytest.raises(ValueError, match=r"a must be \[\.\.\., hidden\] with hidden >= 1, got "
                                         r"shape \(\)"):
        fusetune.swiglu(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(TypeError, match=r"a is torch.float32 and b torch.float16"):
        fusetune.swiglu(a, a.half())
    with pytest.raises(TypeError, match="unsupported dtype"):
        fusetune.swiglu(a.double(), a.double())
    with pytest.raises(ConfigError, match=r"missing ROWS \(a swiglu config has exactly BLOCK, "
                                          r"ROWS, num_warps\)"):
        fusetune.swiglu(a, a, config={"BLOCK": 64, "num_warps": 1})
    with pytest.raises(ConfigError, match="BLOCK=100 must be a power of two"):
        fusetune.swiglu(a, a, config={"BLOCK": 100, "ROWS": 1, "num_warps": 1})


# ---- autograd -------------------------------------------------------------------------------


def test_gradients_match_torch_autograd() -> None:
    # 37 rows of H=300 under two leading dims; a fused gate/up tensor, so the two gradients
    # land in one tensor's halves.
    gu = randn(1, 37, 600, seed=6, scale=3.0).requires_grad_()
    dy = randn(1, 37, 300, seed=7)
    y = fusetune.swiglu(gu[..., :300], gu[..., 300:])
    assert y.grad_fn is not None
    y.backward(dy)
    ref = gu.detach().double().requires_grad_()
    (F.silu(ref[..., :300]) * ref[..., 300:]).backward(dy.double())
    assert gu.grad is not None and rel_err(gu.grad, ref.grad) <= 1e-5
    assert rel_err(gu.grad[..., :300], ref.grad[..., :300]) <= 1e-5  # da on its own


def test_gradient_of_one_input_only() -> None:
    a, b = randn(4, 37, seed=8).requires_grad_(), randn(4, 37, seed=9)
    fusetune.swiglu(a, b).sum().backward()
    ar = a.detach().double().requires_grad_()
    (F.silu(ar) * b.double()).sum().backward()
    assert b.grad is None and rel_err(a.grad, ar.grad) <= 1e-5


def test_no_grad_and_inference_paths_record_nothing() -> None:
    a, b = randn(3, 16).requires_grad_(), randn(3, 16)
    with torch.no_grad():
        y = fusetune.swiglu(a, b)
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        assert torch.equal(fusetune.swiglu(a, b), y)


# ---- the spec -------------------------------------------------------------------------------


def point(rows: int = 8192, hidden: int = 14336, dtype: str = "bfloat16") -> Point:
    return Point.make("swiglu", {"hidden": hidden}, 1, rows, dtype)


def test_spec() -> None:
    assert REGISTRY["swiglu"] is SPEC and fusetune.swiglu is api.swiglu
    p = point(rows=3, hidden=300)
    assert SPEC.canonical({"BLOCK": 16384, "ROWS": 16, "num_warps": 4}, p) == \
        {"BLOCK": 512, "ROWS": 4, "num_warps": 4}
    for hidden in (14336, 300, 8, 1):
        d = SPEC.default_config(point(hidden=hidden), gpus.resolve("h100"))
        assert SPEC.validate_config(d) == d and d["BLOCK"] * d["ROWS"] <= 1024
    assert SPEC.cost(point()).bytes == 3 * 8192 * 14336 * 2
    plan = make_plan(load_space(SPEC), SPEC, point(), gpus.resolve("h100"))
    assert plan.feasible and plan.infeasible  # register-hungry tiles pruned
    inputs = SPEC.make_inputs(Point.make("swiglu", {"hidden": 300}, 2, 3, "float32"), DEVICE)
    out = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, out, SPEC.default_config(p, gpus.resolve("h100")))
    assert rel_err(out["y"], SPEC.reference(inputs)["y"]) <= 1e-5


# ---- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_llama3_8b() -> None:
    # A training step's MLP gate at Llama-3-8B: 4 x 2048 tokens, H = 14336.
    shape = (4, 2048, 14336)
    a32, b32 = randn(*shape, seed=10, scale=3.0, device="cuda"), randn(*shape, seed=11,
                                                                         device="cuda")
    dy32 = randn(*shape, seed=12, device="cuda")
    a, b = a32.bfloat16().requires_grad_(), b32.bfloat16().requires_grad_()
    y = fusetune.swiglu(a, b)
    y.backward(dy32.bfloat16())
    torch.cuda.synchronize()
    ar, br = a32.requires_grad_(), b32.requires_grad_()
    yr = F.silu(ar) * br
    yr.backward(dy32)
    assert y.dtype == a.grad.dtype == b.grad.dtype == torch.bfloat16
    for out, ref in ((y, yr), (a.grad, ar.grad), (b.grad, br.grad)):
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= 1e-2, err
