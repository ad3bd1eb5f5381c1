"""fusetune.qkv (RMSNorm -> Q, K, V (+ bias) -> RoPE on q, k) against plain torch (interpreter on
CPU). The reference rotates with angles of its own, in float64 (Llama's complex numbers for
interleaved pairs, Hugging Face's rotate_half otherwise); the kernel gets them as cos/sin
tables, per token, the way a rotary embedding hands them over."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from launched import compiled_kernels, descriptors_made

import fusetune
from fusetune import gpus, ops
from fusetune.kernels import fp8
from fusetune.kernels import qkv as qkv_mod
from fusetune.spec import ConfigError, Point, check_fits
from fusetune.tuner.bench import Evaluator

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
SPEC = qkv_mod.SPEC
THETA = 10000.0


def positions(b: int, s: int, start: int = 3) -> torch.Tensor:
    """[b, s] positions, each row of the batch elsewhere (as in a left-padded batch)."""
    return torch.arange(s)[None, :] + start + 5 * torch.arange(b)[:, None]


def angles(pos: torch.Tensor, hd: int, scale: float = 1.0) -> torch.Tensor:
    """[b, s, hd/2] angles of the plain rotary embedding, float64; `scale` stretches them as a
    position-interpolating rope scaling would."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    return pos.double()[..., None] * inv_freq / scale


def tables(ang: torch.Tensor, dtype: torch.dtype, attn_scale: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, s, hd] as Hugging Face's rotary embedding returns them (both halves equal,
    times the attention scaling, in the activations' dtype)."""
    emb = torch.cat((ang, ang), dim=-1)
    return tuple((f(emb) * attn_scale).to(device=DEVICE, dtype=dtype) for f in (torch.cos,
                                                                               torch.sin))


def rope_ref(t: torch.Tensor, ang: torch.Tensor, interleaved: bool, attn_scale: float = 1.0
             ) -> torch.Tensor:
    """t [b, s, h, d] float64 rotated by ang [b, s, d/2]."""
    a = ang[:, :, None, :]
    if interleaved:
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(tc * torch.polar(torch.ones_like(a), a)).flatten(3)
    else:
        emb = torch.cat((a, a), dim=-1)
        half = t.shape[-1] // 2
        out = t * emb.cos() + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * emb.sin()
    return out * attn_scale


def make(b: int, s: int, d: int, n_heads: int, n_kv: int, hd: int, dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=gen)
    g = 1 + 0.1 * torch.randn(d, generator=gen)
    ws = [torch.randn(n * hd, d, generator=gen) / d**0.5 for n in (n_heads, n_kv, n_kv)]
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (x, g, *ws))


def make_bias(tensors: tuple[torch.Tensor, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((0.5 * torch.randn(w.shape[0], generator=gen)).to(device=DEVICE, dtype=w.dtype)
                 for w in tensors[2:])


def reference(tensors: tuple[torch.Tensor, ...], head_dim: int, ang: torch.Tensor,
              interleaved: bool, bias: tuple[torch.Tensor, ...] | None = None,
              attn_scale: float = 1.0, eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    x, g, *ws = (t.cpu().double() for t in tensors)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g
    b, s, _ = x.shape
    bs = [0.0] * 3 if bias is None else [t.cpu().double() for t in bias]
    q, k, v = ((xn @ w.T + bb).view(b, s, -1, head_dim) for w, bb in zip(ws, bs, strict=True))
    return (rope_ref(q, ang, interleaved, attn_scale), rope_ref(k, ang, interleaved, attn_scale),
            v)


def check(tensors: tuple[torch.Tensor, ...], head_dim: int, interleaved: bool = True,
          pos: torch.Tensor | None = None, bias: tuple[torch.Tensor, ...] | None = None,
          attn_scale: float = 1.0, table: str = "hf", **kw) -> tuple[torch.Tensor, ...]:
    """fusetune.qkv against the reference. table: "hf" ([b, s, hd] as HF returns them),
    "half" ([b, s, hd/2]), "shared" ([1, s, hd]: one row of positions for the whole batch)."""
    x = tensors[0]
    b, s = x.shape[:2]
    pos = positions(b, s) if pos is None else pos
    if table == "shared":
        pos = pos[:1]
    ang = angles(pos, head_dim)
    cos, sin = tables(ang, x.dtype, attn_scale)
    if table == "half":
        cos, sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    biases = {} if bias is None else dict(zip(("bq", "bk", "bv"), bias, strict=True))
    outs = fusetune.qkv(*tensors, cos, sin, eps=1e-6, head_dim=head_dim,
                        interleaved=interleaved, **biases, **kw)
    refs = reference(tensors, head_dim, ang.expand(b, -1, -1), interleaved, bias, attn_scale)
    for name, out, ref in zip("qkv", outs, refs, strict=True):
        assert out.shape == ref.shape and out.dtype == x.dtype, name
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        # cos and sin rounded to x's dtype, as the model hands them over, cost a little more.
        assert err <= TOL[x.dtype], f"{name}: relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return outs


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("dtype", "b", "s", "d", "nh", "nkv", "hd"), [
    (torch.float32, 1, 1, 64, 4, 2, 8),  # decode, grouped-query
    (torch.float16, 2, 5, 48, 4, 4, 8),  # multi-head, each row of the batch at its positions
    (torch.float16, 1, 37, 64, 8, 2, 16),  # awkward token count
])
def test_matches_reference(b: int, s: int, d: int, nh: int, nkv: int, hd: int,
                           dtype: torch.dtype, interleaved: bool) -> None:
    check(make(b, s, d, nh, nkv, hd, dtype), hd, interleaved=interleaved)


def stacked_views(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(x, g, wq, wk, wv) with the three weights made views of one stacked matrix, as
    fusetune.patch holds them."""
    x, g, *ws = tensors
    w_all = torch.cat(ws)
    cols = [0, ws[0].shape[0], ws[0].shape[0] + ws[1].shape[0], w_all.shape[0]]
    return (x, g, *(w_all[a:b] for a, b in itertools.pairwise(cols)))


def unfused_config(tensors: tuple[torch.Tensor, ...], head_dim: int, interleaved: bool
                   ) -> dict[str, int]:
    x, _, wq, wk, _ = tensors
    point = Point.make("qkv", {"dim": x.shape[-1], "head_dim": head_dim,
                               "interleaved": int(interleaved), "n_heads": wq.shape[0] // head_dim,
                               "n_kv_heads": wk.shape[0] // head_dim}, 1,
                       x.shape[0] * x.shape[1], "float32")
    return SPEC.canonical({**SPEC.default_config(point, gpus.INTERPRETER), "UNFUSED": 1}, point)


@pytest.mark.parametrize("table", ["hf", "half", "shared"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_unfused_form_of_a_stacked_matrix(interleaved: bool, table: str) -> None:
    # One GEMM over the stacked weights, then one launch that rotates q's and k's heads out of
    # its workspace and copies v's: with biases, each row of the batch at its own positions.
    tensors = stacked_views(make(2, 5, 64, 4, 2, 8, torch.float32))
    config = unfused_config(tensors, 8, interleaved)
    check(tensors, 8, interleaved=interleaved, table=table,
          bias=make_bias(tensors), config=config)


def test_unfused_form_copies_v_as_the_gemm_wrote_it() -> None:
    # v's heads are copied, not rotated by an angle of 0: an infinite value stays infinite
    tensors = make(1, 3, 64, 4, 2, 8, torch.float32)
    x, g, wq, wk, wv = tensors
    x, wv = x.abs() + 0.1, wv.clone()
    wv[5] = 0.0
    wv[5, 0] = float("inf")
    tensors = stacked_views((x, g.abs(), wq, wk, wv))
    ang = angles(positions(1, 3), 8)
    cos, sin = tables(ang, torch.float32)
    q, k, v = fusetune.qkv(*tensors, cos, sin, eps=1e-6, head_dim=8, interleaved=True,
                           config=unfused_config(tensors, 8, True))
    others = torch.ones(v.shape, dtype=torch.bool)
    others[..., 0, 5] = False  # its pair's partner, element 4, stays finite too
    assert torch.isinf(v[..., 0, 5]).all() and torch.isfinite(v[others]).all()
    assert torch.isfinite(q).all() and torch.isfinite(k).all()


def test_small_heads_need_their_layout() -> None:
    # 4 query heads and 2 KV heads of 64 (dim 256): 128 also divides both widths, so a guess
    # would split q into 2 heads of 128 and rotate the wrong pairs. Without head_dim: an error.
    tensors = make(1, 3, 256, 4, 2, 64, torch.float32)
    cos, sin = tables(angles(positions(1, 3), 64), torch.float32)
    with pytest.raises(TypeError, match="head_dim"):
        fusetune.qkv(*tensors, cos, sin, eps=1e-6, interleaved=False)  # type: ignore[call-arg]
    q, k, v = check(tensors, 64, interleaved=False)
    assert q.shape == (1, 3, 4, 64) and k.shape == v.shape == (1, 3, 2, 64)


@pytest.mark.parametrize("interleaved", [True, False])
def test_bias_tables_and_scaling(interleaved: bool) -> None:
    # Qwen2's q/k/v bias (added before the rotation), tables of half width and one row of
    # positions shared by the batch, and attention scaling folded into cos and sin.
    tensors = make(2, 4, 64, 4, 2, 16, torch.float32)
    check(tensors, 16, interleaved=interleaved, bias=make_bias(tensors), attn_scale=1.25)
    check(tensors, 16, interleaved=interleaved, table="half")
    check(tensors, 16, interleaved=interleaved, table="shared")
    # Only one of the three biases: the others are zero.
    wk, wv = tensors[3:]
    bq = make_bias(tensors)[0]
    only_q = check(tensors, 16, interleaved=interleaved,
                   bias=(bq, torch.zeros_like(wk[:, 0]), torch.zeros_like(wv[:, 0])))
    cos, sin = tables(angles(positions(2, 4), 16), torch.float32)
    got = fusetune.qkv(*tensors, cos, sin, eps=1e-6, head_dim=16, interleaved=interleaved,
                       bq=bq)
    assert all(torch.equal(a, b) for a, b in zip(got, only_q, strict=True))


def test_positions_are_per_token() -> None:
    # Two rows of one batch at unrelated positions (a long prompt and a short, left-padded
    # one): each row is rotated by its own angles, not by one start position for all.
    tensors = make(2, 3, 64, 4, 2, 16, torch.float32)
    pos = torch.tensor([[0, 1, 2], [4093, 4094, 4095]])
    check(tensors, 16, interleaved=False, pos=pos)


GEMV = {"BLOCK_M": 1, "GROUP_M": 1, "num_stages": 1}


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "num_warps": 2, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 1,
     "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "PASSES": 1, "SPLIT_K": 4,
     "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 2, "SPLIT_K": 2,
     "num_warps": 4, "num_stages": 3},
    # BLOCK_M = 1: one row per program, no tensor cores (the decode structure)
    {**GEMV, "BLOCK_N": 8, "BLOCK_K": 32, "PASSES": 1, "SPLIT_K": 1, "num_warps": 2},
    {**GEMV, "BLOCK_N": 16, "BLOCK_K": 64, "PASSES": 2, "SPLIT_K": 2, "num_warps": 4},
    # two K-steps per iteration (K = 96: two steps of 32 and an empty one after the third)
    {**GEMV, "BLOCK_N": 8, "BLOCK_K": 32, "PASSES": 1, "SPLIT_K": 1, "UNROLL_K": 1,
     "num_warps": 2},
    # one pair per program, the whole row in one iteration (two steps of 64 over 96)
    {**GEMV, "BLOCK_N": 1, "BLOCK_K": 64, "PASSES": 1, "SPLIT_K": 1, "UNROLL_K": 1,
     "num_warps": 2},
])
def test_configs(config: dict[str, int]) -> None:
    # Blocks straddle heads and the Q/K/V boundaries, rows span several row-blocks (the
    # one-row structure: a program per row, so a few rows show it), with bias.
    rows = (1, 3) if config["BLOCK_M"] == 1 else (2, 19)
    tensors = make(*rows, 96, 6, 2, 12, torch.float16)
    check(tensors, 12, bias=make_bias(tensors), config=config)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("pairs", "split", "unroll", "thread_sum"),
                         [(4, 1, 1, 0), (8, 2, 0, 1), (2, 1, 0, 1)])
def test_gemv_spread_and_thread_sum(interleaved: bool, pairs: int, split: int, unroll: int,
                                    thread_sum: int) -> None:
    # SPREAD = 1: a program's pairs lie cdiv(n_pairs, BLOCK_N) apart in their matrix, across
    # heads (12 heads of 12 for Q, 3 of K and V: 72 and 18 pairs), stored column by column.
    # The same K loop as with adjacent pairs: bit-identical outputs. THREAD_SUM = 1: each
    # thread's 16-byte run of a weight row added up first; 96-wide rows leave a partial step.
    tensors = make(1, 2, 96, 12, 3, 12, torch.float16)
    config = {**GEMV, "BLOCK_N": pairs, "BLOCK_K": 64, "PASSES": 1, "SPLIT_K": split,
              "UNROLL_K": unroll, "THREAD_SUM": thread_sum, "num_warps": 2}
    spread = check(tensors, 12, interleaved=interleaved, config={**config, "SPREAD": 1})
    cos, sin = tables(angles(positions(1, 2), 12), torch.float16)
    adjacent = fusetune.qkv(*tensors, cos, sin, eps=1e-6, head_dim=12, interleaved=interleaved,
                            config={**config, "SPREAD": 0})
    for a, b in zip(spread, adjacent, strict=True):
        assert torch.equal(a, b)


TMA = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 1,
       "TMA": 1, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("dtype", "split", "d"), [(torch.float16, 1, 96),
                                                   (torch.float32, 2, 3000)])
def test_tma_descriptors(interleaved: bool, dtype: torch.dtype, split: int, d: int,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    # x and, per matrix, the rows of the pairs' columns a and b through descriptors: the even
    # and odd rows (interleaved), or W itself read from two row offsets (half-split, 16-pair
    # tiles within 16-pair heads). 35 tokens leave a partial row tile; K = 96 is three whole
    # K-steps, K = 3000 ends with a partial one.
    made = descriptors_made(monkeypatch)
    check(make(1, 35, d, 6, 2, 32, dtype), 32, interleaved=interleaved,
          config={**TMA, "SPLIT_K": split})
    assert len(made) == 7
    n_rows = [t.shape[0] for t in made[1:]]
    assert n_rows == ([96, 96, 32, 32, 32, 32] if interleaved else [192, 192, 64, 64, 64, 64])


# ---- bfloat16 through the tensor-core loop ---------------------------------------------------

# The structures with tl.dot (BLOCK_M > 1): the norm folded into the K loop, the norm pass with
# split-K, tiles through TMA descriptors. Triton's interpreter gets tl.dot on bfloat16 tiles
# wrong unless the kernel widens them first (_matmul.dot, INTERPRETED).
BF16_STRUCTURES = {
    "folded": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1,
               "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
    "pass-split": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 2,
                   "SPLIT_K": 2, "num_warps": 4, "num_stages": 2},
    "tma": {**TMA, "GROUP_M": 1},
}
# 19 tokens: a partial row tile; K = 104: three K-steps and a partial one, rows of 208 bytes
# (16-byte boundaries: TMA can read them); 2 query heads and 1 KV head of 32, so that a tile
# of 16 pairs lies in one head (what the TMA loop needs for half-split pairs).
BF16_DIMS = (1, 19, 104, 2, 1, 32)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("structure", list(BF16_STRUCTURES))
def test_bfloat16_tensor_core_structures(structure: str, interleaved: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    made = descriptors_made(monkeypatch)
    tensors = make(*BF16_DIMS, torch.bfloat16)
    check(tensors, 32, interleaved=interleaved, bias=make_bias(tensors),
          config=BF16_STRUCTURES[structure])
    assert len(made) == (7 if structure == "tma" else 0)  # x, then two per matrix


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("structure", ["folded", "pass-split"])
def test_bfloat16_with_fp8_weights(structure: str, fmt: str) -> None:
    # Weight-only FP8: the weight tiles are decoded and rounded to bfloat16 (exact) for tl.dot,
    # then the same product as with bfloat16 weights, against the dequantized weights.
    x, g, *ws = make(*BF16_DIMS, torch.float32)
    quantized = [fusetune.quantize_fp8(w, fmt) for w in ws]
    x, g = x.bfloat16(), g.bfloat16()
    ang = angles(positions(1, 19), 32)
    cos, sin = tables(ang, torch.bfloat16)
    outs = fusetune.qkv(x, g, *(q for q, _ in quantized), cos, sin, eps=1e-6, head_dim=32,
                        interleaved=False, wq_scale=quantized[0][1], wk_scale=quantized[1][1],
                        wv_scale=quantized[2][1], config=BF16_STRUCTURES[structure])
    refs = reference((x, g, *(fp8.dequantize(q.cpu(), s.cpu()) for q, s in quantized)), 32, ang,
                     False)
    for name, out, ref in zip("qkv", outs, refs, strict=True):
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert out.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], (name, err)


def test_bfloat16_through_the_ops() -> None:
    # fusetune.ops.qkv (Hugging Face's pairing) and the custom op that torch.compile sees call
    # the same launcher, with the tables' config (the default heuristic here: tensor-core
    # tiles at 19 tokens).
    tensors = make(*BF16_DIMS, torch.bfloat16)
    ang = angles(positions(1, 19), 32)
    cos, sin = tables(ang, torch.bfloat16)
    refs = reference(tensors, 32, ang, False)
    nones = (None,) * 6  # biases, scales
    for outs in (ops.qkv(*tensors, cos, sin, 1e-6, 32),
                 torch.ops.fusetune.qkv(*tensors, cos, sin, 1e-6, 32, *nones, False)):
        for name, out, ref in zip("qkv", outs, refs, strict=True):
            err = float((out.cpu().double() - ref.flatten(2)).norm() / ref.norm())
            assert out.dtype == torch.bfloat16 and err <= TOL[torch.bfloat16], (name, err)


def test_no_row_views_without_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without TMA the launch makes no strided views of the weights and passes None for the six
    # row descriptors: at decode the launch path's CPU time exceeds the kernel's GPU time, and
    # the views and six more tensor arguments were a large part of it.
    sliced: list[object] = []
    real_getitem = torch.Tensor.__getitem__

    def getitem(self: torch.Tensor, index: object) -> torch.Tensor:
        sliced.append(index)
        return real_getitem(self, index)

    args: list[tuple[object, ...]] = []
    real_kernel = qkv_mod._qkv_kernel

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            def launch(*a: object, **kw: object) -> object:
                args.append(a)
                return real_kernel[grid](*a, **kw)
            return launch

    tensors = make(1, 3, 96, 6, 2, 32, torch.float16)
    ang = angles(positions(1, 3), 32)
    cos, sin = tables(ang, torch.float16)
    monkeypatch.setattr(qkv_mod, "_qkv_kernel", Recorder())
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    gemv = {**GEMV, "BLOCK_N": 2, "BLOCK_K": 64, "PASSES": 1, "SPLIT_K": 1, "UNROLL_K": 1,
            "num_warps": 2}
    outs = fusetune.qkv(*tensors, cos, sin, eps=1e-6, head_dim=32, interleaved=True,
                        config=gemv)
    monkeypatch.undo()
    assert sliced == []
    assert len(args) == 1 and args[0][5:11] == (None,) * 6  # X, G, WQ, WK, WV, then QA..VB
    refs = reference(tensors, 32, ang, True)
    for name, out, ref in zip("qkv", outs, refs, strict=True):
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err <= TOL[torch.float16], f"{name}: relative error {err:.3e}"


def test_tma_where_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    made = descriptors_made(monkeypatch)
    # Half-split tiles of 32 pairs span two heads of 16: pointers, right results.
    check(make(1, 35, 96, 6, 2, 32, torch.float16), 32, interleaved=False,
          config={**TMA, "BLOCK_N": 32})
    # Rows of 100 float16 (200 bytes) do not start on 16-byte boundaries; TMA with the norm
    # folded in: pointers.
    check(make(1, 20, 100, 6, 2, 32, torch.float16), 32, config=TMA)
    check(make(1, 20, 96, 6, 2, 32, torch.float16), 32, config={**TMA, "PASSES": 1})
    assert made == []
    # The canonical config says so too; where it keeps TMA, GPUs before Hopper prune it.
    tile = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "PASSES": 2,
            "SPLIT_K": 1, "TMA": 1, "num_warps": 8, "num_stages": 3}
    p = llama_point(4096)
    half = Point.make("qkv", {**p.dim, "interleaved": 0}, 1, 4096, "float16")
    assert SPEC.canonical(tile, p)["TMA"] == 1
    assert SPEC.canonical(tile, half)["TMA"] == 1  # 64 pairs: one head of 128
    assert SPEC.canonical({**tile, "BLOCK_N": 128}, half)["TMA"] == 0
    assert SPEC.canonical({**tile, "BLOCK_N": 128}, p)["TMA"] == 1
    assert SPEC.canonical({**tile, "PASSES": 1}, p)["TMA"] == 0
    res = SPEC.resources(SPEC.canonical(tile, p), p)
    assert res.tma and check_fits(res, gpus.resolve("h100")) is None
    why = check_fits(res, gpus.resolve("a100"))
    assert why is not None and why.startswith("tma: TMA=1 needs TMA descriptors"), why


def test_bad_inputs() -> None:
    tensors = make(1, 2, 64, 4, 2, 8, torch.float16)
    x, g, wq, wk, wv = tensors
    cos, sin = tables(angles(positions(1, 2), 8), torch.float16)
    layout = {"eps": 1e-6, "head_dim": 8, "interleaved": True}
    with pytest.raises(ValueError, match=r"batch, seq, dim"):
        fusetune.qkv(x[0], g, wq, wk, wv, cos, sin, **layout)
    with pytest.raises(ValueError, match=r"wk must be \[out_features, 64\]"):
        fusetune.qkv(x, g, wq, wk.T, wv, cos, sin, **layout)
    with pytest.raises(ValueError, match="same shape"):
        fusetune.qkv(x, g, wq, wk, wv[:8], cos, sin, **layout)
    with pytest.raises(ValueError, match=r"head_dim=6 must be an even integer that divides "
                                         r"wq's 32 and wk's 16 output features"):
        fusetune.qkv(*tensors, cos, sin, **{**layout, "head_dim": 6})
    with pytest.raises(TypeError, match="interleaved=1 must be True"):
        fusetune.qkv(*tensors, cos, sin, **{**layout, "interleaved": 1})
    for eps in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"eps=.* must be a positive finite number"):
            fusetune.qkv(*tensors, cos, sin, **{**layout, "eps": eps})
    with pytest.raises(ValueError, match=r"cos has shape \(1, 3, 8\); expected \[1 or 1, 2, 8 "
                                         r"or 4\]"):
        fusetune.qkv(*tensors, *tables(angles(positions(1, 3), 8), torch.float16), **layout)
    with pytest.raises(ValueError, match=r"cos has shape .* and sin"):
        fusetune.qkv(*tensors, cos, sin[..., :4], **layout)
    with pytest.raises(ValueError, match=r"bk must be \[16\]"):
        fusetune.qkv(*tensors, cos, sin, bk=torch.zeros(8, dtype=x.dtype, device=DEVICE),
                     **layout)
    with pytest.raises(TypeError, match=r"wv is torch\.float32"):
        fusetune.qkv(x, g, wq, wk, wv.float(), cos, sin, **layout)
    with pytest.raises(ConfigError, match="num_stages"):
        fusetune.qkv(*tensors, cos, sin, **layout,
                     config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1,
                             "PASSES": 1, "SPLIT_K": 1, "num_warps": 2})


def test_inputs_that_require_grad_are_refused() -> None:
    # No backward pass: a silently detached output would train nothing.
    x, g, wq, wk, wv = make(1, 2, 64, 4, 2, 8, torch.float32)
    cos, sin = tables(angles(positions(1, 2), 8), torch.float32)
    layout = {"eps": 1e-6, "head_dim": 8, "interleaved": True}
    with pytest.raises(RuntimeError, match="no backward pass"):
        fusetune.qkv(x, g, wq.requires_grad_(), wk, wv, cos, sin, **layout)
    with torch.no_grad():
        q, _, _ = fusetune.qkv(x, g, wq, wk, wv, cos, sin, **layout)
    assert not q.requires_grad


def llama_point(rows: int) -> Point:
    return Point.make("qkv", {"dim": 4096, "head_dim": 128, "interleaved": 1, "n_heads": 32,
                              "n_kv_heads": 32}, 1, rows, "float16")


def test_spec() -> None:
    for gpu in ("3090", "h100"):
        for rows in (1, 4096):
            p = llama_point(rows)
            c = SPEC.canonical(SPEC.default_config(p, gpus.resolve(gpu)), p)
            assert SPEC.validate_config(c) == c
            assert check_fits(SPEC.resources(c, p), gpus.resolve(gpu)) is None
    assert SPEC.cost(llama_point(1)).bytes >= 3 * 4096 * 4096 * 2  # the three weights
    # Shared memory Triton 3.9 allocated on sm_90 for these configs must not exceed the model.
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PASSES) -> bytes.
    for (bm, bn, bk, w, st, passes), actual in {(16, 32, 128, 4, 4, 1): 61696,
                                                (128, 64, 64, 8, 3, 1): 82176,
                                                (16, 32, 128, 4, 4, 2): 61440,
                                                (128, 64, 64, 8, 3, 2): 98304}.items():
        c = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PASSES": passes,
             "SPLIT_K": 1, "num_warps": w, "num_stages": st}
        assert actual <= SPEC.resources(c, llama_point(4096)).smem_bytes <= 1.2 * actual


def test_spec_inputs_match_the_reference() -> None:
    # What the tuner checks every config against: the spec's own inputs (per-token tables in
    # x's dtype) and reference, through the default config.
    p = Point.make("qkv", {"dim": 64, "head_dim": 16, "interleaved": 0, "n_heads": 4,
                           "n_kv_heads": 2}, 2, 3, "float32")
    inputs = SPEC.make_inputs(p, DEVICE)
    outputs = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, outputs, SPEC.canonical(SPEC.default_config(p, gpus.INTERPRETER), p))
    ref = SPEC.reference(inputs)
    for name in "qkv":
        err = float((outputs[name].float() - ref[name]).norm() / ref[name].norm())
        assert err <= SPEC.tolerance["float32"], (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_gpu_llama_dims(dtype: torch.dtype, interleaved: bool, rows: int) -> None:
    tensors = make(2, rows, 4096, 32, 8, 128, dtype)
    check(tensors, 128, interleaved=interleaved, pos=positions(2, rows, start=4000),
          bias=make_bias(tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "split"), [(300, 1), (37, 2)])
def test_gpu_tma_descriptors(dtype: torch.dtype, interleaved: bool, rows: int, split: int,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    made = descriptors_made(monkeypatch)
    compiled = compiled_kernels(monkeypatch, "_qkv_kernel")
    p = Point.make("qkv", {"dim": 4096, "head_dim": 128, "interleaved": int(interleaved),
                           "n_heads": 32, "n_kv_heads": 8}, 1, rows, "float16")
    c = SPEC.canonical({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                        "PASSES": 2, "SPLIT_K": split, "TMA": 1, "num_warps": 8,
                        "num_stages": 3}, p)
    check(make(1, rows, 4096, 32, 8, 128, dtype), 128, interleaved=interleaved,
          pos=positions(1, rows, start=4000), config=c)
    assert len(made) == 7
    # The shared memory the compiler allocated: never more than the model predicts.
    actual = max(k.metadata.shared for k in compiled)
    predicted = SPEC.resources(c, p).smem_bytes
    assert actual <= predicted <= 1.5 * actual, (actual, predicted)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "unroll", "spread", "thread_sum"),
                         [(1, 0, 0, 0), (4, 0, 0, 0), (1, 1, 0, 0), (1, 1, 1, 0), (3, 0, 1, 0),
                          (1, 1, 1, 1), (3, 0, 0, 1)])
def test_gpu_gemv_structure(dtype: torch.dtype, interleaved: bool, rows: int, unroll: int,
                            spread: int, thread_sum: int) -> None:
    config = {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "GROUP_M": 1, "PASSES": 1,
              "SPLIT_K": 2, "UNROLL_K": unroll, "SPREAD": spread, "THREAD_SUM": thread_sum,
              "num_warps": 4, "num_stages": 2}
    check(make(1, rows, 4096, 32, 8, 128, dtype), 128, interleaved=interleaved,
          pos=positions(1, rows, start=4000), config=config)


# ---- Qwen3's per-head q/k norms (qk_norm) --------------------------------------------------

QK_CONFIGS = {
    # head_dim 16: 8 pairs a head; tiles of one and of two heads
    "one head a tile": {"BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1,
                        "SPLIT_K": 1, "num_warps": 2, "num_stages": 2},
    "two heads, split-K": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4,
                           "PASSES": 2, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2},
    "one-row": {**GEMV, "BLOCK_N": 16, "BLOCK_K": 32, "PASSES": 1, "SPLIT_K": 1,
                "num_warps": 2},
    # split-K: the products' tiles cut heads (or spread their pairs); the finishing pass
    # normalizes over tiles of whole heads
    "one-row, spread, split-K": {**GEMV, "BLOCK_N": 2, "BLOCK_K": 16, "PASSES": 1,
                                 "SPLIT_K": 4, "SPREAD": 1, "num_warps": 2},
    "tma": {**TMA, "BLOCK_N": 8},
    "unfused": {"UNFUSED": 1},
}


def qk_point(interleaved: int, dtype: str = "float32", weights: str = "", rows: int = 7
             ) -> Point:
    return Point.make("qkv", {"dim": 64, "head_dim": 16, "interleaved": interleaved,
                              "n_heads": 4, "n_kv_heads": 2, "qk_norm": 1}, 1, rows, dtype,
                      weights)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("name", list(QK_CONFIGS))
def test_qk_norm_configs_pass_the_tuners_check(name: str, interleaved: int) -> None:
    point = qk_point(interleaved, rows=1 if name.startswith("one-row") else 7)
    default = SPEC.default_config(point, gpus.INTERPRETER)
    config = SPEC.canonical({**default, "TMA": 0, **QK_CONFIGS[name]}, point)
    assert not SPEC.resources(config, point).unfit
    out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= 1e-4


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_qk_norm_split_k_tiles_of_part_of_a_head(interleaved: int, tma: int) -> None:
    # head_dim 64: 32 pairs a head, tensor-core tiles of 16 pairs (half a head) with the K
    # loop split, by pointers and through TMA; the finishing pass runs over tiles of whole
    # heads
    point = Point.make("qkv", {"dim": 64, "head_dim": 64, "interleaved": interleaved,
                               "n_heads": 2, "n_kv_heads": 1, "qk_norm": 1}, 1, 7, "float32")
    config = SPEC.canonical({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1,
                             "PASSES": 2, "SPLIT_K": 2, "TMA": tma, "num_warps": 2,
                             "num_stages": 2}, point)
    assert (config["BLOCK_N"], config["TMA"]) == (16, tma)
    assert not SPEC.resources(config, point).unfit
    out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= 1e-4


@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
def test_qk_norm_bfloat16_and_fp8_weights(weights: str) -> None:
    point = qk_point(0, "bfloat16", weights)
    config = SPEC.canonical(SPEC.default_config(point, gpus.INTERPRETER), point)
    out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= SPEC.tolerance_for(point)


def test_qk_norm_is_applied_and_keyed() -> None:
    # The norms change q and k (a config that left them out would fail the check), v not; a
    # tile that splits a head is unfit at such points and refused by the call; the lookup keys
    # the points apart from those without norms (an entry of one never serves the other).
    point = qk_point(0)
    inputs = SPEC.make_inputs(point, "cpu")
    plain = {k: v for k, v in inputs.items() if k not in ("q_norm", "k_norm", "qk_eps")}
    with_norm, without = SPEC.reference(inputs), SPEC.reference(plain)
    assert not torch.allclose(with_norm["q"], without["q"])
    assert torch.equal(with_norm["v"], without["v"])
    split = {**SPEC.default_config(point, gpus.INTERPRETER), "BLOCK_N": 4, "SPLIT_K": 1}
    assert "whole heads" in SPEC.resources(split, point).unfit
    assert not SPEC.resources({**split, "SPLIT_K": 2}, point).unfit
    x = inputs["x"]
    args = (x, inputs["rms_weight"], inputs["wq"], inputs["wk"], inputs["wv"], inputs["cos"],
            inputs["sin"])
    kw = {"eps": 1e-6, "head_dim": 16, "interleaved": False, "q_norm": inputs["q_norm"],
          "k_norm": inputs["k_norm"], "qk_eps": 1e-6}
    with pytest.raises(ConfigError, match=r"BLOCK_N=4 pairs must be a multiple of "
                                          r"head_dim/2 = 8"):
        fusetune.qkv(*args, **kw, config=split)
    with pytest.raises(ValueError, match="q_norm, k_norm and qk_eps come together"):
        fusetune.qkv(*args, **{**kw, "k_norm": None})
    with pytest.raises(ValueError, match=r"q_norm must be \[16\] \(head_dim\)"):
        fusetune.qkv(*args, **{**kw, "q_norm": torch.ones(8)})
    ref = SPEC.reference(inputs)
    # the lookup's default, and a split-K tile of half a head, through the public call
    for config in (None, {**split, "SPLIT_K": 2}):
        q, k, v = fusetune.qkv(*args, **kw, config=config)
        for got, name in ((q, "q"), (k, "k"), (v, "v")):
            assert (got - ref[name]).norm() / ref[name].norm() <= 1e-4, (config, name)
    assert SPEC.short_dims(qk_point(0).dim) == qk_point(0).dim
    assert "qk_norm" not in SPEC.short_dims({**qk_point(0).dim, "qk_norm": 0})


def test_qk_norm_points_search_export_and_serve(tmp_path: Path) -> None:
    # The optional dim through the whole flow: --dims with qk_norm=1, a search on the
    # interpreter, its winner exported with the dim, and the lookup serving it to a call with
    # the norms, not to one without them.
    from cli_helpers import run_interpreted

    dims = "dim=64,head_dim=16,interleaved=0,n_heads=4,n_kv_heads=2,qk_norm=1"
    db = f"sqlite:///{tmp_path / 'r.db'}"
    ran = run_interpreted(tmp_path, "search", "--kernel", "qkv", "--backend", "interpreter",
                          "--dims", dims, "--batch", "1", "--seq", "4", "--dtype", "float32",
                          "--trials", "3", "--db", db)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    table = tmp_path / "t.yaml"
    ran = run_interpreted(tmp_path, "export", str(table), "--db", db)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    entry = yaml.safe_load(table.read_text())["gpus"]["interpreter"]["qkv"][0]
    assert entry["dims"]["qk_norm"] == 1
    fusetune.load_tables(table)
    try:
        point = {k: int(v) for k, v in (kv.split("=") for kv in dims.split(","))}
        res = fusetune.resolve("qkv", point, "float32", rows=4)
        assert res.source == "exact" and res.config == entry["config"]
        plain = {k: v for k, v in point.items() if k != "qk_norm"}
        assert fusetune.resolve("qkv", plain, "float32", rows=4).source != "exact"
        assert fusetune.resolve("qkv", {**plain, "qk_norm": 0}, "float32",
                                rows=4).source != "exact"
    finally:
        fusetune.tables.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
@pytest.mark.parametrize("rows", [1, 333])
@pytest.mark.parametrize("dims", [
    {"dim": 4096, "head_dim": 128, "interleaved": 0, "n_heads": 32, "n_kv_heads": 8},  # Qwen3-8B
    {"dim": 3840, "head_dim": 256, "interleaved": 0, "n_heads": 16, "n_kv_heads": 8},  # Gemma 3
])
def test_gpu_qk_norm_model_dims(dims: dict[str, int], rows: int, weights: str) -> None:
    # whole heads per tile at the models' head widths (one head: 64 or 128 pairs): the default
    # config, one head a tile, split-K products over 16 pairs (a finishing pass over whole
    # heads) and the unfused form, through the tuner's check on the H200
    point = Point.make("qkv", {**dims, "qk_norm": 1}, 1, rows, "bfloat16", weights)
    ev = Evaluator(SPEC, point, "cuda", "cuda")
    default = SPEC.default_config(point, gpus.resolve("h200"))
    for config in (default, {**default, "UNFUSED": 1},
                   {**default, "BLOCK_N": dims["head_dim"] // 2, "SPLIT_K": 1, "TMA": 0},
                   {**default, "BLOCK_N": 16, "SPLIT_K": 4, "TMA": 0}):
        out = ev.check(SPEC.canonical(config, point))
        assert out.status == "ok", (config, out.reason)
