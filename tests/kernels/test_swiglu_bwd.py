"""swiglu_bwd (da = dy·b·silu'(a), db = dy·silu(a)) against torch autograd of silu(a)·b
(Triton interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fusetune
from fusetune import gpus
from fusetune.kernels import REGISTRY
from fusetune.kernels import swiglu_bwd as bwd_mod
from fusetune.spec import ConfigError, Point
from fusetune.tuner.space import load_space, make_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = bwd_mod.SPEC
swiglu_bwd = bwd_mod.swiglu_bwd


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().norm())


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0
          ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(device=DEVICE, dtype=dtype)


def autograd_grads(a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) by torch autograd of silu(a)·b, in float64."""
    ad, bd = a.double().requires_grad_(), b.double().requires_grad_()
    da, db = torch.autograd.grad(F.silu(ad) * bd, (ad, bd), dy.double())
    return da, db


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


@pytest.mark.parametrize(("shape", "dtype"), [((37, 300), torch.float32),
                                              ((2, 3, 37), torch.float32),
                                              ((5, 64), torch.float16)])
def test_matches_torch_autograd(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # The gate's values reach silu's tails (|a| up to ~12), where σ' vanishes.
    a = randn(*shape, dtype=dtype, seed=1, scale=3.0)
    b, dy = randn(*shape, dtype=dtype, seed=2), randn(*shape, dtype=dtype, seed=3)
    da, db = swiglu_bwd(a, b, dy)
    assert da.shape == db.shape == a.shape and da.dtype == db.dtype == dtype
    ra, rb = autograd_grads(a, b, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(da, ra) <= tol and rel_err(db, rb) <= tol
    fa, fb = bwd_mod.reference(a, b, dy)  # the formulas the spec checks against
    assert rel_err(fa, ra) <= 1e-6 and rel_err(fb, rb) <= 1e-6


@pytest.mark.parametrize("config", [
    {"BLOCK": 64, "ROWS": 2, "num_warps": 1},
    {"BLOCK": 256, "ROWS": 8, "num_warps": 4},
    {"BLOCK": 16384, "ROWS": 16, "num_warps": 16},
])
def test_configs_of_the_space_agree(config: dict[str, int]) -> None:
    values = {p.name: p.values for p in load_space(SPEC).params}
    assert all(v in values[k] for k, v in config.items())
    a, b, dy = randn(37, 300, seed=4, scale=3.0), randn(37, 300, seed=5), randn(37, 300, seed=6)
    base = swiglu_bwd(a, b, dy)
    got = swiglu_bwd(a, b, dy, config=config)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


def test_strided_rows() -> None:
    gu, dy = randn(9, 2 * 40, seed=7, scale=2.0), randn(9, 40, seed=8)
    a, b = gu[:, :40], gu[:, 40:]
    da, db = swiglu_bwd(a, b, dy.t().contiguous().t())  # a column-major dy too
    ra, rb = autograd_grads(a, b, dy)
    assert da.is_contiguous() and rel_err(da, ra) <= 1e-5 and rel_err(db, rb) <= 1e-5


def test_bad_inputs() -> None:
    a = randn(3, 8)
    with pytest.raises(ValueError, match=r"swiglu_bwd: a has shape \(3, 8\) and dy \(8, 3\); "
                                         r"they must match"):
        swiglu_bwd(a, a, a.t())
    with pytest.raises(TypeError, match=r"a is torch.float32 and dy torch.float16"):
        swiglu_bwd(a, a, a.half())
    with pytest.raises(ConfigError, match=r"unknown BLOCK_D \(a swiglu_bwd config has exactly "
                                          r"BLOCK, ROWS, num_warps\)"):
        swiglu_bwd(a, a, a, config={"BLOCK": 64, "ROWS": 1, "num_warps": 1, "BLOCK_D": 64})
    with pytest.raises(RuntimeError, match="swiglu_bwd has no backward pass"):
        swiglu_bwd(a.clone().requires_grad_(), a, a)


def test_spec() -> None:
    assert REGISTRY["swiglu_bwd"] is SPEC
    p = Point.make("swiglu_bwd", {"hidden": 14336}, 4, 2048, "bfloat16")
    assert SPEC.cost(p).bytes == 5 * 8192 * 14336 * 2
    d = SPEC.default_config(p, gpus.resolve("h100"))
    assert SPEC.validate_config(d) == d
    plan = make_plan(load_space(SPEC), SPEC, p, gpus.resolve("h100"))
    assert plan.feasible and plan.infeasible
    # swiglu_bwd holds six floats an element, swiglu three: it prunes more.
    fwd = REGISTRY["swiglu"]
    big = {"BLOCK": 4096, "ROWS": 1, "num_warps": 4}
    assert SPEC.resources(big, p).regs_per_thread > fwd.resources(big, p).regs_per_thread
    small = Point.make("swiglu_bwd", {"hidden": 300}, 2, 3, "float32")
    inputs = SPEC.make_inputs(small, DEVICE)
    out = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, out, SPEC.default_config(small, gpus.resolve("h100")))
    ref = SPEC.reference(inputs)
    assert set(ref) == set(out) == {"da", "db"}
    assert all(rel_err(out[k], ref[k]) <= SPEC.tolerance_for(small) for k in ref)


@pytest.mark.gpu
def test_gpu_bf16_llama3_8b_kernel_alone() -> None:
    # The backward alone at Llama-3-8B's MLP (4 x 2048 tokens, H = 14336), against float32.
    shape = (8192, 14336)
    a32 = torch.randn(shape, device="cuda") * 3
    b32, dy32 = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")
    da, db = swiglu_bwd(a32.bfloat16(), b32.bfloat16(), dy32.bfloat16())
    ra, rb = bwd_mod.reference(a32, b32, dy32)
    for out, ref in ((da, ra), (db, rb)):
        assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
