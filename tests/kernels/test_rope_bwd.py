"""rope_bwd (the inverse rotation) and fusetune.rope's autograd against torch autograd of the
reference rotation, computed in float64 (Triton interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune
from fusetune import gpus
from fusetune.kernels import REGISTRY
from fusetune.kernels import rope as rope_mod
from fusetune.kernels import rope_bwd as bwd_mod
from fusetune.kernels._rotary import rotary_tables, rotated
from fusetune.spec import ConfigError, Point
from fusetune.tuner.space import load_space, make_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = bwd_mod.SPEC
rope_bwd = bwd_mod.rope_bwd
# The awkward shape: head_dim 64, 37 tokens, 3 heads, a batch of 2 at other positions each.
SHAPE = (2, 37, 3, 64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.cpu()).norm() / ref.norm())


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0,
          device: str = DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def tables(b: int, s: int, d: int, start: int = 5, device: str = DEVICE
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s, d] tables: each row of the batch at other positions (a left-padded batch)."""
    pos = torch.arange(s)[None, :] + start + 7 * torch.arange(b)[:, None]
    return rotary_tables(pos.to(device), d, theta=10000.0)


def reference_grad(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dy: torch.Tensor,
                   interleaved: bool) -> torch.Tensor:
    """x's gradient by torch autograd through the reference rotation, in float64."""
    xd = x.detach().double().requires_grad_()
    y = _rotated64(xd, cos.double(), sin.double(), interleaved)
    (g,) = torch.autograd.grad(y, xd, dy.double())
    return g


def _rotated64(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
               ) -> torch.Tensor:
    """The reference rotation (`rotated`, which computes in float32) in t's dtype."""
    half = t.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    a, b = t[..., :half], t[..., half:]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


# ---- the kernel -----------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
def test_matches_autograd_of_the_reference(interleaved: bool) -> None:
    x, dy = randn(*SHAPE, seed=1), randn(*SHAPE, seed=2)
    cos, sin = tables(2, 37, 64)
    dx = rope_bwd(dy, cos, sin, interleaved=interleaved)
    assert dx.shape == dy.shape and dx.dtype == dy.dtype
    assert rel_err(dx, reference_grad(x, cos, sin, dy, interleaved)) <= 1e-5


@pytest.mark.parametrize("interleaved", [True, False])
def test_round_trip_and_half_tables(interleaved: bool) -> None:
    x = randn(*SHAPE, seed=3)
    cos, sin = tables(2, 37, 64)
    y = fusetune.rope(x, cos, sin, interleaved=interleaved)
    back = rope_bwd(y, cos, sin, interleaved=interleaved)
    assert rel_err(back, x.double()) <= 1e-6
    assert not torch.allclose(y, x)
    # Half-width tables (column i for pair i) and one row of positions for the whole batch.
    half = rope_bwd(y, cos[..., :32], sin[..., :32], interleaved=interleaved)
    assert torch.equal(half, back)
    shared = rope_bwd(y, cos[:1], sin[:1], interleaved=interleaved)
    assert torch.equal(shared[0], back[0]) and not torch.allclose(shared[1], back[1])


@pytest.mark.parametrize("config", [
    {"BLOCK_T": 1, "BLOCK_H": 1, "num_warps": 1},
    {"BLOCK_T": 4, "BLOCK_H": 2, "num_warps": 2},    # heads not a multiple of BLOCK_H
    {"BLOCK_T": 64, "BLOCK_H": 64, "num_warps": 16},  # blocks past the tensor (space's top)
])
def test_configs_of_the_space_agree(config: dict[str, int]) -> None:
    values = {p.name: p.values for p in load_space(SPEC).params}
    assert all(v in values[k] for k, v in config.items())
    dy = randn(2, 9, 3, 64, seed=4)
    cos, sin = tables(2, 9, 64)
    for interleaved in (True, False):
        base = rope_bwd(dy, cos, sin, interleaved=interleaved,
                        config=SPEC.default_config(point(), gpus.resolve("h100")))
        assert torch.equal(rope_bwd(dy, cos, sin, interleaved=interleaved, config=config), base)


def test_strided_gradient() -> None:
    # dy as autograd may hand it: a transposed view, and one whose last dim is not unit-stride.
    cos, sin = tables(2, 5, 16)
    dy = randn(2, 3, 5, 16, seed=5).transpose(1, 2)
    ref = rope_bwd(dy.contiguous(), cos, sin, interleaved=False)
    assert torch.equal(rope_bwd(dy, cos, sin, interleaved=False), ref)
    wide = randn(2, 5, 3, 32, seed=6)[..., ::2]
    assert torch.equal(rope_bwd(wide, cos, sin, interleaved=True),
                       rope_bwd(wide.contiguous(), cos, sin, interleaved=True))


def test_bad_inputs() -> None:
    cos, sin = tables(1, 2, 8)
    with pytest.raises(ValueError, match=r"dy must be \[batch, seq, heads, head_dim\], got "
                                         r"shape \(2, 3, 8\)"):
        rope_bwd(randn(2, 3, 8), cos, sin, interleaved=True)
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        rope_bwd(randn(1, 2, 3, 7), cos, sin, interleaved=True)
    with pytest.raises(TypeError, match=r"interleaved=1 must be True .* or False"):
        rope_bwd(randn(1, 2, 3, 8), cos, sin, interleaved=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rope_bwd: cos has shape \(1, 2, 8\); expected "
                                         r"\[2 or 1, 3, 8 or 4\]"):
        rope_bwd(randn(2, 3, 3, 8), cos, sin, interleaved=True)
    with pytest.raises(ConfigError, match="BLOCK_H=3 must be a power of two"):
        rope_bwd(randn(1, 2, 3, 8), cos, sin, interleaved=True,
                 config={"BLOCK_T": 1, "BLOCK_H": 3, "num_warps": 1})
    with pytest.raises(RuntimeError, match="rope_bwd has no backward pass"):
        rope_bwd(randn(1, 2, 3, 8).requires_grad_(), cos, sin, interleaved=True)


# ---- fusetune.rope's autograd ---------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_gradient_matches_torch_autograd(interleaved: bool) -> None:
    # x as attention code holds it: [batch, heads, seq, head_dim], viewed as [b, s, h, d].
    base = randn(2, 3, 37, 64, seed=7).requires_grad_()
    cos, sin = tables(2, 37, 64)
    dy = randn(*SHAPE, seed=8)
    y = fusetune.rope(base.transpose(1, 2), cos, sin, interleaved=interleaved)
    assert y.requires_grad and y.grad_fn is not None
    y.backward(dy)
    ref = reference_grad(base.transpose(1, 2), cos, sin, dy, interleaved)
    assert base.grad is not None
    assert rel_err(base.grad.transpose(1, 2), ref) <= 1e-5


def test_tables_that_require_grad_raise() -> None:
    x = randn(1, 2, 3, 8).requires_grad_()
    cos, sin = tables(1, 2, 8)
    for c, s in ((cos.clone().requires_grad_(), sin), (cos, sin.clone().requires_grad_())):
        with pytest.raises(RuntimeError, match=r"cos or sin requires grad.*gradient of x only"):
            fusetune.rope(x, c, s, interleaved=True)
        with pytest.raises(RuntimeError, match="cos or sin requires grad"):
            fusetune.rope(x.detach(), c, s, interleaved=True)  # x alone needs no gradient
        with torch.no_grad():  # nothing is recorded: nothing is missing
            fusetune.rope(x, c, s, interleaved=True)


def test_no_grad_and_inference_paths_record_nothing() -> None:
    x = randn(1, 3, 2, 8).requires_grad_()
    cos, sin = tables(1, 3, 8)
    with torch.no_grad():
        y = fusetune.rope(x, cos, sin, interleaved=False)
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        z = fusetune.rope(x, cos, sin, interleaved=False)
    assert torch.equal(y, z)
    assert fusetune.rope(x.detach(), cos, sin, interleaved=False).grad_fn is None


def test_second_derivative_is_refused() -> None:
    x = randn(1, 2, 3, 8).requires_grad_()
    cos, sin = tables(1, 2, 8)
    y = fusetune.rope(x, cos, sin, interleaved=True)
    dy = torch.ones_like(y, requires_grad=True)
    (g,) = torch.autograd.grad(y, x, dy, create_graph=True)  # g depends on dy
    with pytest.raises(RuntimeError, match="twice"):
        g.sum().backward()


# ---- the spec -------------------------------------------------------------------------------


def point(rows: int = 8192, heads: int = 32, head_dim: int = 128, interleaved: int = 0,
          dtype: str = "bfloat16") -> Point:
    return Point.make("rope_bwd", {"heads": heads, "head_dim": head_dim,
                                   "interleaved": interleaved}, 1, rows, dtype)


def test_spec_is_registered_and_shares_the_forward_kernel() -> None:
    assert REGISTRY["rope_bwd"] is SPEC and REGISTRY["rope"] is rope_mod.SPEC
    assert SPEC.config_keys == rope_mod.SPEC.config_keys
    assert SPEC.source_hash == rope_mod.SPEC.source_hash  # one kernel, one INVERSE flag
    p = point(rows=3, heads=5)
    assert SPEC.canonical({"BLOCK_T": 64, "BLOCK_H": 64, "num_warps": 4}, p) == \
        {"BLOCK_T": 4, "BLOCK_H": 8, "num_warps": 4}
    d = SPEC.default_config(point(), gpus.resolve("h100"))
    assert SPEC.validate_config(d) == d
    assert SPEC.cost(point()).bytes == (2 * 8192 * 32 * 128 + 2 * 8192 * 64) * 2
    plan = make_plan(load_space(SPEC), SPEC, point(), gpus.resolve("h100"))
    assert plan.feasible and plan.infeasible  # register-hungry tiles pruned


def test_spec_reference_launch_and_tolerance() -> None:
    p = Point.make("rope_bwd", {"heads": 3, "head_dim": 64, "interleaved": 1}, 2, 5, "float32")
    inputs = SPEC.make_inputs(p, DEVICE)
    out = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, out, SPEC.default_config(p, gpus.resolve("h100")))
    ref = SPEC.reference(inputs)["dx"]
    assert rel_err(out["dx"], ref.double()) <= SPEC.tolerance_for(p)
    assert rel_err(rope_mod.SPEC.reference({**inputs, "x": out["dx"]})["y"],
                   inputs["dy"].double()) <= 1e-6


# ---- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_bf16_gradient_llama3_8b(interleaved: bool) -> None:
    # A training step's q at Llama-3-8B: 4 x 2048 tokens, 32 heads x 128, per-row positions.
    b, s, h, d = 4, 2048, 32, 128
    x32 = randn(b, s, h, d, seed=9, device="cuda")
    dy32 = randn(b, s, h, d, seed=10, device="cuda")
    cos, sin = tables(b, s, d, start=100, device="cuda")
    x = x32.bfloat16().requires_grad_()
    fusetune.rope(x, cos, sin, interleaved=interleaved).backward(dy32.bfloat16())
    torch.cuda.synchronize()
    xr = x32.requires_grad_()
    rotated(xr, cos, sin, interleaved).backward(dy32)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert rel_err(x.grad.float(), xr.grad.double()) <= 1e-2
