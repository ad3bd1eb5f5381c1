"""fusetune.qkv (RMSNorm -> Q, K, V -> RoPE on q, k) against plain torch (interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl
from launched import compiled_kernels, descriptors_made

import fusetune
from fusetune import gpus
from fusetune.kernels import qkv as qkv_mod
from fusetune.kernels._spec import ConfigError, Point, check_fits
from fusetune.kernels._trig import sincos

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
SPEC = qkv_mod.SPEC


def rope(t: torch.Tensor, start_pos: int, theta: float, interleaved: bool) -> torch.Tensor:
    """Llama's complex-number RoPE, or Hugging Face's rotate_half, in float64."""
    _, s, _, d = t.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(start_pos, start_pos + s, dtype=torch.float64), freqs)
    if interleaved:
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(tc * torch.polar(torch.ones_like(ang), ang)[None, :, None]
                                  ).flatten(3)
    emb = torch.cat((ang, ang), dim=-1)[None, :, None, :]
    rotated = torch.cat((-t[..., d // 2 :], t[..., : d // 2]), dim=-1)
    return t * emb.cos() + rotated * emb.sin()


def reference(x: torch.Tensor, g: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
              wv: torch.Tensor, head_dim: int, start_pos: int, interleaved: bool,
              theta: float = 10000.0, eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    b, s, _ = x.shape
    q, k, v = ((xn @ w.double().T).view(b, s, -1, head_dim) for w in (wq, wk, wv))
    return rope(q, start_pos, theta, interleaved), rope(k, start_pos, theta, interleaved), v


def make(b: int, s: int, d: int, n_heads: int, n_kv: int, hd: int, dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=gen)
    g = 1 + 0.1 * torch.randn(d, generator=gen)
    ws = [torch.randn(n * hd, d, generator=gen) / d**0.5 for n in (n_heads, n_kv, n_kv)]
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (x, g, *ws))


def check(tensors: tuple[torch.Tensor, ...], head_dim: int, start_pos: int = 0,
          interleaved: bool = True, **kw) -> tuple[torch.Tensor, ...]:
    x, g, wq, wk, wv = tensors
    outs = fusetune.qkv(x, g, wq, wk, wv, start_pos, head_dim=head_dim,
                        interleaved=interleaved, **kw)
    refs = reference(*(t.cpu() for t in tensors), head_dim, start_pos, interleaved)
    for name, out, ref in zip("qkv", outs, refs, strict=True):
        assert out.shape == ref.shape and out.dtype == x.dtype, name
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err <= TOL[x.dtype], f"{name}: relative error {err:.3e} > {TOL[x.dtype]:.1e}"
    return outs


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("b", "s", "d", "nh", "nkv", "hd"), [
    (1, 1, 64, 4, 2, 8),  # decode, grouped-query
    (2, 5, 48, 4, 4, 8),  # multi-head
    (1, 37, 64, 8, 2, 16),  # awkward token count
])
def test_matches_reference(b: int, s: int, d: int, nh: int, nkv: int, hd: int,
                           dtype: torch.dtype, interleaved: bool) -> None:
    check(make(b, s, d, nh, nkv, hd, dtype), hd, start_pos=3, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("nh", "nkv", "hd"), [(32, 8, 64), (4, 2, 128)])
def test_llama_head_layouts(nh: int, nkv: int, hd: int, interleaved: bool) -> None:
    # n_kv_heads=8 with n_heads=32 (Llama-3 GQA) and head_dim 64 and 128, inferred from shapes
    # where it can be (128 divides both widths).
    tensors = make(1, 3, 64, nh, nkv, hd, torch.float16)
    x, g, wq, wk, wv = tensors
    q, k, v = check(tensors, hd, start_pos=9, interleaved=interleaved)
    assert q.shape == (1, 3, nh, hd) and k.shape == v.shape == (1, 3, nkv, hd)
    if hd == 128:
        inferred = fusetune.qkv(x, g, wq, wk, wv, 9, interleaved=interleaved)
        assert all(torch.equal(a, b) for a, b in zip(inferred, (q, k, v), strict=True))


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
    {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "num_warps": 2, "num_stages": 1},
    {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 2,
     "num_warps": 4, "num_stages": 2},
    # two K-steps per iteration (K = 96: two steps of 32 and an empty one after the third)
    {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "UNROLL_K": 1, "num_warps": 2, "num_stages": 1},
    # one or two pairs per program, the whole row in one iteration (two steps of 64 over 96)
    {"BLOCK_M": 1, "BLOCK_N": 1, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "UNROLL_K": 1, "num_warps": 2, "num_stages": 1},
    {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 128, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
     "UNROLL_K": 0, "num_warps": 4, "num_stages": 1},
])
def test_configs(config: dict[str, int]) -> None:
    # Blocks straddle heads and the Q/K/V boundaries, rows span several row-blocks.
    check(make(2, 35, 96, 6, 2, 12, torch.float16), 12, start_pos=1, config=config)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("pairs", "split", "unroll"), [(4, 1, 1), (8, 2, 0), (2, 1, 0)])
def test_gemv_spread_pairs(interleaved: bool, pairs: int, split: int, unroll: int) -> None:
    # SPREAD = 1: a program's pairs lie cdiv(n_pairs, BLOCK_N) apart in their matrix, across
    # heads (12 heads of 12 for Q, 3 of K and V: 72 and 18 pairs), stored column by column.
    # The same K loop as with adjacent pairs: bit-identical outputs.
    tensors = make(1, 2, 96, 12, 3, 12, torch.float16)
    config = {"BLOCK_M": 1, "BLOCK_N": pairs, "BLOCK_K": 32, "GROUP_M": 1, "PASSES": 1,
              "SPLIT_K": split, "UNROLL_K": unroll, "num_warps": 2, "num_stages": 1}
    spread = check(tensors, 12, start_pos=3, interleaved=interleaved,
                   config={**config, "SPREAD": 1})
    x, g, wq, wk, wv = tensors
    adjacent = fusetune.qkv(x, g, wq, wk, wv, 3, head_dim=12, interleaved=interleaved,
                            config={**config, "SPREAD": 0})
    for a, b in zip(spread, adjacent, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("pairs", "split", "unroll", "spread"),
                         [(4, 1, 1, 0), (8, 2, 0, 1), (2, 1, 0, 0)])
def test_gemv_thread_sum(interleaved: bool, pairs: int, split: int, unroll: int,
                         spread: int) -> None:
    # THREAD_SUM = 1: each thread's 16-byte run of a weight row added up before accumulating;
    # 96-wide rows leave a partial K-step.
    config = {"BLOCK_M": 1, "BLOCK_N": pairs, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 1,
              "SPLIT_K": split, "UNROLL_K": unroll, "SPREAD": spread, "THREAD_SUM": 1,
              "num_warps": 2, "num_stages": 1}
    check(make(1, 2, 96, 12, 3, 12, torch.float16), 12, start_pos=3, interleaved=interleaved,
          config=config)


TMA = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 4, "PASSES": 2, "SPLIT_K": 1,
       "TMA": 1, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("split", [1, 2])
def test_tma_descriptors(interleaved: bool, dtype: torch.dtype, split: int,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    # x and, per matrix, the rows of the pairs' columns a and b through descriptors: the even
    # and odd rows (interleaved), or W itself read from two row offsets (half-split, 16-pair
    # tiles within 16-pair heads). 70 tokens leave a partial row tile; K = 96 is three whole
    # K-steps, K = 3000 ends with a partial one.
    made = descriptors_made(monkeypatch)
    for d in (96, 3000):
        made.clear()
        check(make(2, 35, d, 6, 2, 32, dtype), 32, start_pos=3, interleaved=interleaved,
              config={**TMA, "SPLIT_K": split})
        assert len(made) == 7
        n_rows = [t.shape[0] for t in made[1:]]
        assert n_rows == ([96, 96, 32, 32, 32, 32] if interleaved else
                          [192, 192, 64, 64, 64, 64])


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
    monkeypatch.setattr(qkv_mod, "_qkv_kernel", Recorder())
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    gemv = {"BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": 64, "GROUP_M": 1, "PASSES": 1, "SPLIT_K": 1,
            "UNROLL_K": 1, "num_warps": 2, "num_stages": 1}
    outs = fusetune.qkv(*tensors, head_dim=32, config=gemv)
    monkeypatch.undo()
    assert sliced == []
    assert len(args) == 1 and args[0][5:11] == (None,) * 6  # X, G, WQ, WK, WV, then QA..VB
    refs = reference(*(t.cpu() for t in tensors), 32, 0, True)
    for name, out, ref in zip("qkv", outs, refs, strict=True):
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err <= TOL[torch.float16], f"{name}: relative error {err:.3e}"


def test_tma_where_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    made = descriptors_made(monkeypatch)
    # Half-split tiles of 32 pairs span two heads of 16: pointers, right results.
    check(make(2, 35, 96, 6, 2, 32, torch.float16), 32, interleaved=False,
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
    x, g, wq, wk, wv = make(1, 2, 64, 4, 2, 8, torch.float16)
    with pytest.raises(ValueError, match=r"batch, seq, dim"):
        fusetune.qkv(x[0], g, wq, wk, wv, head_dim=8)
    with pytest.raises(ValueError, match=r"wk must be \[out_features, 64\]"):
        fusetune.qkv(x, g, wq, wk.T, wv, head_dim=8)
    with pytest.raises(ValueError, match="same shape"):
        fusetune.qkv(x, g, wq, wk, wv[:8], head_dim=8)
    with pytest.raises(ValueError, match="head_dim=6 must be even and divide"):
        fusetune.qkv(x, g, wq, wk, wv, head_dim=6)
    with pytest.raises(ValueError, match="cannot infer head_dim"):
        fusetune.qkv(x, g, wq, wk, wv)
    with pytest.raises(TypeError, match=r"wv is torch\.float32"):
        fusetune.qkv(x, g, wq, wk, wv.float(), head_dim=8)
    with pytest.raises(ConfigError, match="num_stages"):
        fusetune.qkv(x, g, wq, wk, wv, head_dim=8,
                     config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1,
                             "PASSES": 1, "SPLIT_K": 1,
                             "num_warps": 2})


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


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_gpu_llama_dims(dtype: torch.dtype, interleaved: bool, rows: int) -> None:
    check(make(1, rows, 4096, 32, 8, 128, dtype), 128, start_pos=4000, interleaved=interleaved)


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
    check(make(1, rows, 4096, 32, 8, 128, dtype), 128, start_pos=4000, interleaved=interleaved,
          config=c)
    assert len(made) == 7
    # The shared memory the compiler allocated: never more than the model predicts.
    actual = max(k.metadata.shared for k in compiled)
    predicted = SPEC.resources(c, p).smem_bytes
    assert actual <= predicted <= 1.5 * actual, (actual, predicted)


@triton.jit
def _sincos_kernel(A, S, C, N: tl.constexpr):
    r = tl.arange(0, N)
    s, c = sincos(tl.load(A + r))
    tl.store(S + r, s)
    tl.store(C + r, c)


def test_sincos_accuracy() -> None:
    """The epilogue's polynomial sin/cos against float64, over angles up to 1e5 radians."""
    kernel = _sincos_kernel
    n = 4096
    a = torch.cat([torch.linspace(-10.0, 10.0, n // 2), torch.linspace(0.0, 1e5, n // 2)])
    a = a.to(DEVICE)
    s, c = torch.empty_like(a), torch.empty_like(a)
    kernel[(1,)](a, s, c, n)
    ad = a.double().cpu()
    assert float((s.double().cpu() - ad.sin()).abs().max()) < 2e-6
    assert float((c.double().cpu() - ad.cos()).abs().max()) < 2e-6


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
    check(make(1, rows, 4096, 32, 8, 128, dtype), 128, start_pos=4000, interleaved=interleaved,
          config=config)
