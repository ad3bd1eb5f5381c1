"""fusetune.rope against Llama's and Hugging Face's formulas (Triton interpreter on CPU). The
references compute their own angles, in float64; the kernel reads them as cos/sin tables."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune
from fusetune import gpus
from fusetune.kernels import rope as rope_mod
from fusetune.spec import ConfigError, Point

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# cos and sin in float32 tables: float32 outputs are held to float32 rounding.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPEC = rope_mod.SPEC


def positions(b: int, s: int, start: int) -> torch.Tensor:
    """[b, s]: each row of the batch at other positions (as in a left-padded batch)."""
    return torch.arange(s)[None, :] + start + 7 * torch.arange(b)[:, None]


def angles(pos: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return pos.double()[..., None] * freqs  # [b, s, d/2]


def llama_reference(x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """Llama's apply_rotary_emb: pairs (2i, 2i+1) as complex numbers, in float64."""
    freqs_cis = torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
    xc = torch.view_as_complex(x.cpu().double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(3)


def hf_reference(x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """Hugging Face's x*cos + rotate_half(x)*sin, pairs (i, i + d/2), in float64."""
    d = x.shape[-1]
    emb = torch.cat((ang, ang), dim=-1)[:, :, None, :]
    xd = x.cpu().double()
    rotated = torch.cat((-xd[..., d // 2 :], xd[..., : d // 2]), dim=-1)
    return xd * emb.cos() + rotated * emb.sin()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.cpu().double() - ref).norm() / ref.norm())


def tables(pos: torch.Tensor, d: int, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    return rope_mod.rotary_tables(pos.to(DEVICE), d, theta=theta)


def check(x: torch.Tensor, start: int = 0, theta: float = 10000.0, interleaved: bool = True,
          shared: bool = False, **kw) -> torch.Tensor:
    """`shared`: one row of positions ([1, S] tables) for the whole batch."""
    b, s, _, d = x.shape
    pos = positions(1 if shared else b, s, start)
    cos, sin = tables(pos, d, theta)
    y = fusetune.rope(x, cos, sin, interleaved=interleaved, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert not torch.isnan(y).any()
    ang = angles(pos, d, theta).expand(b, -1, -1)
    ref = (llama_reference if interleaved else hf_reference)(x, ang)
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
@pytest.mark.parametrize(("shape", "dtype"), [((2, 5, 3, 64), torch.float16),
                                              ((1, 7, 4, 128), torch.float32),
                                              ((3, 2, 5, 6), torch.float16),
                                              ((1, 1, 1, 2), torch.float32)])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, interleaved: bool) -> None:
    check(randn(*shape, dtype=dtype), start=11, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
def test_layouts_differ_and_tables_matter(interleaved: bool) -> None:
    x = randn(2, 4, 2, 16, dtype=torch.float32)
    a = check(x, 3, interleaved=interleaved)
    b = check(x, 3, interleaved=not interleaved)
    assert not torch.allclose(a, b)
    c = check(x, 3, theta=500000.0, interleaved=interleaved)
    assert not torch.allclose(a, c)
    shared = check(x, 3, interleaved=interleaved, shared=True)  # both rows at row 0's positions
    assert torch.equal(shared[0], a[0]) and not torch.allclose(shared[1], a[1])
    # Tables of half width (column i for pair i) give the same result.
    cos, sin = tables(positions(2, 4, 3), 16)
    half = fusetune.rope(x, cos[..., :8], sin[..., :8], interleaved=interleaved)
    assert torch.equal(half, a)


def test_position_zero_is_identity_and_norm_is_kept() -> None:
    x = randn(1, 1, 3, 8, dtype=torch.float32)
    cos, sin = tables(torch.zeros(1, 1, dtype=torch.long), 8)
    assert torch.allclose(fusetune.rope(x, cos, sin, interleaved=True), x)
    z = randn(2, 6, 3, 8, dtype=torch.float32)
    y = fusetune.rope(z, *tables(positions(2, 6, 100), 8), interleaved=True)
    # A rotation keeps the length of every pair, so of every head vector.
    assert torch.allclose(y.norm(dim=-1), z.norm(dim=-1), rtol=1e-5)


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
def test_configs(config: dict[str, int]) -> None:
    check(randn(2, 5, 3, 32), 5, interleaved=True, config=config)
    check(randn(2, 5, 3, 32), 5, interleaved=False, config=config)


def test_bad_inputs() -> None:
    cos, sin = tables(positions(1, 2, 0), 8)
    with pytest.raises(ValueError, match="batch, seq, heads, head_dim"):
        fusetune.rope(randn(2, 3, 8), cos, sin, interleaved=True)
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        fusetune.rope(randn(1, 2, 3, 7), cos, sin, interleaved=True)
    with pytest.raises(TypeError, match="interleaved"):
        fusetune.rope(randn(1, 2, 3, 8), cos, sin)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"cos has shape \(1, 2, 8\); expected \[1 or 1, 3"):
        fusetune.rope(randn(1, 3, 3, 8), cos, sin, interleaved=True)
    with pytest.raises(TypeError, match="unsupported dtype"):
        fusetune.rope(torch.zeros(1, 2, 3, 8, dtype=torch.int32, device=DEVICE), cos, sin,
                      interleaved=True)
    with pytest.raises(ConfigError, match="BLOCK_T"):
        fusetune.rope(randn(1, 2, 3, 8), cos, sin, interleaved=True,
                      config={"BLOCK_H": 1, "num_warps": 1})
    with pytest.raises(ConfigError, match="BLOCK_H=3 must be a power of two"):
        fusetune.rope(randn(1, 2, 3, 8), cos, sin, interleaved=True,
                      config={"BLOCK_T": 1, "BLOCK_H": 3, "num_warps": 1})
    with pytest.raises(RuntimeError, match="cos or sin requires grad"):  # x's gradient only
        fusetune.rope(randn(1, 2, 3, 8, dtype=torch.float32).requires_grad_(),
                      cos.clone().requires_grad_(), sin, interleaved=True)
    with pytest.raises(ValueError, match="theta"):
        rope_mod.rotary_tables(positions(1, 2, 0), 8, theta=0.0)


def test_empty_input() -> None:
    cos, sin = tables(positions(1, 3, 0), 8)
    assert fusetune.rope(randn(0, 3, 2, 8), cos, sin, interleaved=True).shape == (0, 3, 2, 8)


def test_rotary_tables_are_hugging_faces() -> None:
    # Llama's rotary embedding (transformers' default rope): inv_freq, positions, both halves.
    pos = positions(2, 5, 3)
    cos, sin = rope_mod.rotary_tables(pos, 16, theta=500000.0)
    ang = angles(pos, 16, 500000.0)
    emb = torch.cat((ang, ang), dim=-1)
    assert cos.shape == sin.shape == (2, 5, 16)
    assert torch.allclose(cos.double(), emb.cos(), atol=1e-6)
    assert torch.allclose(sin.double(), emb.sin(), atol=1e-6)


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
    # x read and written, and the tables' half rows of cos and sin per token
    assert SPEC.cost(p).bytes == (2 * 512 * 32 * 128 + 2 * 512 * 64) * 2


def test_spec_reference_matches_formulas() -> None:
    x = randn(2, 3, 4, 8, dtype=torch.float32)
    pos = positions(2, 3, 5)
    cos, sin = tables(pos, 8)
    for inter, ref in ((True, llama_reference), (False, hf_reference)):
        got = SPEC.reference({"x": x, "cos": cos, "sin": sin, "interleaved": inter})
        assert rel_err(got["y"], ref(x, angles(pos, 8, 10000.0))) < 1e-6


# ---- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_sequence(dtype: torch.dtype, interleaved: bool) -> None:
    # Positions up to ~8K, float32 tables.
    x = torch.randn(2, 4096, 32, 128, device="cuda", dtype=dtype)
    check(x, start=4000, interleaved=interleaved)
    check(torch.randn(3, 37, 8, 64, device="cuda", dtype=dtype), 9, interleaved=interleaved)
