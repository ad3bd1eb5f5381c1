"""fusetune.rope against Llama's and Hugging Face's formulas (Triton interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune
from fusetune import gpus
from fusetune.kernels import rope as rope_mod
from fusetune.kernels._spec import ConfigError, Point

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPEC = rope_mod.SPEC


def llama_reference(x: torch.Tensor, start_pos: int, theta: float) -> torch.Tensor:
    """Llama's apply_rotary_emb: pairs (2i, 2i+1) as complex numbers, in float64."""
    _, s, _, d = x.shape
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(start_pos, start_pos + s, dtype=torch.float64)
    freqs_cis = torch.polar(torch.ones(s, d // 2, dtype=torch.float64), torch.outer(t, freqs))
    xc = torch.view_as_complex(x.cpu().double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def hf_reference(x: torch.Tensor, start_pos: int, theta: float) -> torch.Tensor:
    """Hugging Face's x*cos + rotate_half(x)*sin, pairs (i, i + d/2), in float64."""
    _, s, _, d = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(start_pos, start_pos + s, dtype=torch.float64)
    emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)[None, :, None, :]
    xd = x.cpu().double()
    rotated = torch.cat((-xd[..., d // 2 :], xd[..., : d // 2]), dim=-1)
    return xd * emb.cos() + rotated * emb.sin()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.cpu().double() - ref).norm() / ref.norm())


def check(x: torch.Tensor, start_pos: int = 0, theta: float = 10000.0, interleaved: bool = True,
          **kw) -> torch.Tensor:
    y = fusetune.rope(x, start_pos, theta, interleaved=interleaved, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert not torch.isnan(y).any()
    ref = (llama_reference if interleaved else hf_reference)(x, start_pos, theta)
    err = rel_err(y, ref)
    assert err <= TOL[x.dtype], f"relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return y


def randn(*shape: int, dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 5, 3, 64), (1, 7, 4, 128), (3, 2, 5, 6), (1, 1, 1, 2)])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, interleaved: bool) -> None:
    check(randn(*shape, dtype=dtype), start_pos=11, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
def test_layouts_differ_and_theta_matters(interleaved: bool) -> None:
    x = randn(1, 4, 2, 16, dtype=torch.float32)
    a = check(x, 3, interleaved=interleaved)
    b = check(x, 3, interleaved=not interleaved)
    assert not torch.allclose(a, b)
    c = check(x, 3, theta=500000.0, interleaved=interleaved)
    assert not torch.allclose(a, c)


def test_position_zero_is_identity_and_norm_is_kept() -> None:
    x = randn(1, 1, 3, 8, dtype=torch.float32)
    assert torch.allclose(fusetune.rope(x, 0), x)
    y = fusetune.rope(randn(2, 6, 3, 8, dtype=torch.float32), 100)
    # A rotation keeps the length of every pair, so of every head vector.
    assert torch.allclose(y.norm(dim=-1), randn(2, 6, 3, 8, dtype=torch.float32).norm(dim=-1),
                          rtol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
def test_strided_inputs(interleaved: bool) -> None:
    # A [B, H, S, D] tensor viewed as [B, S, H, D] (attention layouts), and a slice of a wider
    # head dimension: strides are honoured, the last dimension is made contiguous.
    x = randn(2, 3, 5, 16, dtype=torch.float32).transpose(1, 2)
    assert not x.is_contiguous()
    check(x, 2, interleaved=interleaved)
    wide = randn(2, 5, 3, 24, dtype=torch.float32)[..., :16]
    check(wide, 2, interleaved=interleaved)


@pytest.mark.parametrize("config", [
    {"BLOCK_T": 1, "BLOCK_H": 1, "num_warps": 1},
    {"BLOCK_T": 4, "BLOCK_H": 2, "num_warps": 2},   # heads not a multiple of BLOCK_H
    {"BLOCK_T": 16, "BLOCK_H": 8, "num_warps": 4},  # blocks larger than the tensor
])
@pytest.mark.parametrize("interleaved", [True, False])
def test_configs(config: dict[str, int], interleaved: bool) -> None:
    check(randn(2, 5, 3, 32), 5, interleaved=interleaved, config=config)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="batch, seq, heads, head_dim"):
        fusetune.rope(randn(2, 3, 8))
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        fusetune.rope(randn(1, 2, 3, 7))
    with pytest.raises(ValueError, match="start_pos=-1"):
        fusetune.rope(randn(1, 2, 3, 8), -1)
    with pytest.raises(ValueError, match="theta"):
        fusetune.rope(randn(1, 2, 3, 8), 0, 0.0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        fusetune.rope(torch.zeros(1, 2, 3, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ConfigError, match="BLOCK_T"):
        fusetune.rope(randn(1, 2, 3, 8), config={"BLOCK_H": 1, "num_warps": 1})
    with pytest.raises(ConfigError, match="BLOCK_H=3 must be a power of two"):
        fusetune.rope(randn(1, 2, 3, 8), config={"BLOCK_T": 1, "BLOCK_H": 3, "num_warps": 1})


def test_empty_input() -> None:
    assert fusetune.rope(randn(0, 3, 2, 8)).shape == (0, 3, 2, 8)


# ---- the spec -------------------------------------------------------------------------------


def point(rows: int = 512, heads: int = 32, head_dim: int = 128, interleaved: int = 1) -> Point:
    return Point.make("rope", {"heads": heads, "head_dim": head_dim,
                               "interleaved": interleaved}, 1, rows, "float16")


def test_spec_canonical_and_default() -> None:
    p = point(rows=3, heads=5)
    c = SPEC.canonical({"BLOCK_T": 64, "BLOCK_H": 64, "num_warps": 4}, p)
    assert c == {"BLOCK_T": 4, "BLOCK_H": 8, "num_warps": 4}
    for heads, hd in ((32, 128), (8, 64), (3, 6), (64, 256)):
        d = SPEC.default_config(point(heads=heads, head_dim=hd), gpus.resolve("h100"))
        assert SPEC.validate_config(d) == d


def test_spec_resources_and_cost() -> None:
    p = point()
    small = SPEC.resources({"BLOCK_T": 1, "BLOCK_H": 32, "num_warps": 4}, p)
    big = SPEC.resources({"BLOCK_T": 64, "BLOCK_H": 64, "num_warps": 1}, p)
    assert small.regs_per_thread < 255 < big.regs_per_thread
    assert SPEC.cost(p).bytes == 2 * 512 * 32 * 128 * 2


def test_spec_reference_matches_formulas() -> None:
    x = randn(2, 3, 4, 8, dtype=torch.float32)
    for inter, ref in ((True, llama_reference), (False, hf_reference)):
        got = SPEC.reference({"x": x, "start_pos": 5, "theta": 10000.0, "interleaved": inter})
        assert rel_err(got["y"], ref(x, 5, 10000.0)) < 1e-6


# ---- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_sequence(dtype: torch.dtype, interleaved: bool) -> None:
    # Positions up to ~8K: the in-kernel angles must stay accurate far from zero.
    x = torch.randn(2, 4096, 32, 128, device="cuda", dtype=dtype)
    check(x, start_pos=4000, interleaved=interleaved)
    check(torch.randn(3, 37, 8, 64, device="cuda", dtype=dtype), 9, interleaved=interleaved)
