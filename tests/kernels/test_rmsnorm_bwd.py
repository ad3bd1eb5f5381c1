"""RMSNorm backward (fusetune.rmsnorm_bwd, and autograd through fusetune.rmsnorm) against torch
autograd of the float32 reference (Triton interpreter on CPU), and its spec."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune
from fusetune import api, gpus
from fusetune.kernels import REGISTRY, get_spec
from fusetune.kernels import rmsnorm_bwd as bwd_mod
from fusetune.spec import ConfigError, Point, check_fits, next_pow2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SPEC = bwd_mod.SPEC
EPS = 1e-6


def reference(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float = EPS
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx, dweight by torch autograd of the forward in float32."""
    xf = x.detach().float().requires_grad_()
    wf = weight.detach().float().requires_grad_()
    with torch.enable_grad():
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * wf
        dx, dw = torch.autograd.grad(y, (xf, wf), dy.float())
    return dx, dw


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.float() - ref.float())
                 / torch.linalg.vector_norm(ref.float()))


def make(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0,
         device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    w = (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return x, w, dy


def check(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, **kw
          ) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, **kw)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dx.device == x.device
    assert dw.shape == w.shape and dw.dtype == w.dtype
    ref_dx, ref_dw = reference(x, w, dy)
    tol = TOL[x.dtype]
    assert rel_err(dx, ref_dx) <= tol, f"dx: relative error {rel_err(dx, ref_dx):.3e}"
    assert rel_err(dw, ref_dw) <= tol, f"dw: relative error {rel_err(dw, ref_dw):.3e}"
    return dx, dw


# single pass, one program per row step / looping over D with multi-row steps / ...
CFG_SINGLE = {"BLOCK_D": 512, "ROWS": 1, "PROGRAMS": 4, "num_warps": 4, "num_stages": 1}
CFG_LOOP = {"BLOCK_D": 64, "ROWS": 4, "PROGRAMS": 4, "num_warps": 2, "num_stages": 2}
CONFIGS = {
    "single": CFG_SINGLE,
    "single-rows8-2programs": {"BLOCK_D": 512, "ROWS": 8, "PROGRAMS": 2, "num_warps": 2,
                               "num_stages": 1},
    "single-a-program-a-row": {"BLOCK_D": 512, "ROWS": 1, "PROGRAMS": 64, "num_warps": 1,
                               "num_stages": 2},
    # Prefetch: 37 rows in 10 steps of 4 over 4 programs (programs 0 and 1 take three steps,
    # 2 and 3 two; the last step, rows 36-39, is cut by M; every program's prefetch after its
    # last step reads past M, masked), and one row a step in one program.
    "single-prefetch-rows4": {"BLOCK_D": 512, "ROWS": 4, "PROGRAMS": 4, "num_warps": 2,
                              "num_stages": 1, "PREFETCH": 1},
    "single-prefetch-one-program": {"BLOCK_D": 512, "ROWS": 1, "PROGRAMS": 1, "num_warps": 4,
                                    "num_stages": 2, "PREFETCH": 1},
    # Evict-first loads, with and without the prefetch (the interpreter ignores the policy:
    # this checks that both load paths take it).
    "single-evict-prefetch": {"BLOCK_D": 512, "ROWS": 2, "PROGRAMS": 4, "num_warps": 2,
                              "num_stages": 1, "PREFETCH": 1, "EVICT": 1},
    "single-evict": {"BLOCK_D": 512, "ROWS": 2, "PROGRAMS": 4, "num_warps": 2,
                     "num_stages": 1, "EVICT": 1},
    "loop-rows4": CFG_LOOP,
    "loop-rows2-many-programs": {"BLOCK_D": 128, "ROWS": 2, "PROGRAMS": 16, "num_warps": 2,
                                 "num_stages": 3},
    "loop-one-program": {"BLOCK_D": 256, "ROWS": 1, "PROGRAMS": 1, "num_warps": 4,
                         "num_stages": 1},
}


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    """Every launch without a config uses the default heuristic (no tables loaded)."""
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


# ---- the kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(37, 300), (2, 3, 64), (5, 7), (1, 300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_autograd_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check(*make(shape, dtype))


def test_one_column() -> None:
    # D = 1: y = w · x / sqrt(x² + eps) is flat in x but for eps, so dx is nearly zero (no
    # relative error means anything there); dweight is Σ dy · sign(x).
    x, w, dy = make((4, 1), seed=14)
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS)
    ref_dx, ref_dw = reference(x, w, dy)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=1e-5)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def single_config_result() -> tuple[torch.Tensor, torch.Tensor]:
    x, w, dy = make((37, 300), seed=1)
    return fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config=CFG_SINGLE)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_agree(name: str, single_config_result: tuple[torch.Tensor, torch.Tensor]
                       ) -> None:
    # 37 rows share out unevenly between programs and row steps; 300 columns are no multiple
    # of any BLOCK_D: every config must give the reference, and agree with the others within
    # float32 (only the order of the partial sums of dweight differs).
    x, w, dy = make((37, 300), seed=1)
    dx, dw = check(x, w, dy, config=CONFIGS[name])
    dx0, dw0 = single_config_result
    assert rel_err(dx, dx0) <= 1e-6 and rel_err(dw, dw0) <= 1e-6


def test_programs_are_at_most_one_per_step() -> None:
    assert bwd_mod.programs(37, {"ROWS": 4, "PROGRAMS": 8}) == 8  # 10 steps of 4 rows
    assert bwd_mod.programs(37, {"ROWS": 4, "PROGRAMS": 16}) == 10
    assert bwd_mod.programs(37, {"ROWS": 1, "PROGRAMS": 64}) == 37
    assert bwd_mod.programs(4096, {"ROWS": 2, "PROGRAMS": 256}) == 256


def test_every_row_is_written_once() -> None:
    # Steps dealt out round-robin: with 19 steps of 2 rows over 8 programs, program 0 takes
    # steps 0, 8 and 16, program 2 steps 2, 10 and 18 (the last cut by M), programs 3-7 two
    # each. dx starts as NaN, so a row that no program wrote stays NaN; dweight is wrong if
    # any row is added twice or missed.
    x, w, dy = make((37, 300), seed=3)
    dx = torch.full_like(x, float("nan"))
    dw = torch.full_like(w, float("nan"))
    cfg = SPEC.validate_config({"BLOCK_D": 512, "ROWS": 2, "PROGRAMS": 8, "num_warps": 2,
                                "num_stages": 1, "PREFETCH": 1})
    bwd_mod._launch_2d(x, w, dy, dx, dw, EPS, cfg)
    ref_dx, ref_dw = reference(x, w, dy)
    assert not dx.isnan().any()
    assert rel_err(dx, ref_dx) <= 1e-5 and rel_err(dw, ref_dw) <= 1e-5


@pytest.mark.parametrize("config", [CFG_SINGLE, CFG_LOOP], ids=["single", "loop"])
def test_only_the_gradients_asked_for(config: dict[str, int]) -> None:
    x, w, dy = make((13, 300), seed=2)
    ref_dx, ref_dw = reference(x, w, dy)
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_weight=False, config=config)
    assert dw is None and rel_err(dx, ref_dx) <= 1e-5
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_x=False, config=config)
    assert dx is None and rel_err(dw, ref_dw) <= 1e-5
    assert fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, grad_x=False, grad_weight=False) == (None,
                                                                                      None)


@pytest.mark.parametrize("config", [CFG_SINGLE, CFG_LOOP, CONFIGS["single-prefetch-rows4"]],
                         ids=["single", "loop", "prefetch"])
def test_every_element_written(config: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer torch.empty returns (dx, dweight, the partial rows) starts NaN: an element
    the kernels skip stays NaN, and a partial row read before it is written spreads NaN."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    x, w, dy = make((13, 300), torch.float16, seed=3)
    monkeypatch.setattr(torch, "empty", poisoned)
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config=config)
    monkeypatch.undo()
    assert int(torch.isnan(dx).sum()) == 0 and int(torch.isnan(dw).sum()) == 0
    ref_dx, ref_dw = reference(x, w, dy)
    assert rel_err(dx, ref_dx) <= TOL[torch.float16]
    assert rel_err(dw, ref_dw) <= TOL[torch.float16]


def test_strided_inputs() -> None:
    # x a column slice of a wider tensor, dy an expanded constant (what y.sum() hands back),
    # weight float32 beside float16 activations.
    big, w, _ = make((9, 96), torch.float16, seed=4)
    x = big[:, :64]
    w = w[:64].float()
    dy = torch.ones((), dtype=torch.float16, device=DEVICE).expand(9, 64)
    dx, dw = check(x, w, dy)
    assert dx.is_contiguous() and dx.dtype == torch.float16 and dw.dtype == torch.float32


def test_zero_rows() -> None:
    x, w, dy = make((0, 64))
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS)
    assert dx.shape == (0, 64)
    assert torch.equal(dw, torch.zeros(64, device=DEVICE))


# ---- autograd through fusetune.rmsnorm ------------------------------------------------------


@pytest.mark.parametrize("wants", [(True, False), (False, True), (True, True)],
                         ids=["x", "weight", "both"])
def test_autograd_through_rmsnorm(wants: tuple[bool, bool]) -> None:
    x, w, dy = make((2, 3, 300), seed=5)
    x.requires_grad_(wants[0])
    w.requires_grad_(wants[1])
    y = fusetune.rmsnorm(x, w, eps=EPS)
    assert y.requires_grad and y.grad_fn is not None
    y.backward(dy)
    ref_dx, ref_dw = reference(x, w, dy)
    if wants[0]:
        assert rel_err(x.grad, ref_dx) <= 1e-5
    if wants[1]:
        assert rel_err(w.grad, ref_dw) <= 1e-5
    assert (x.grad is None) != wants[0] and (w.grad is None) != wants[1]


def test_autograd_skips_the_gradient_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = bwd_mod._launch_2d

    def spy(x, weight, dy, dx, dw, eps, config):
        calls.append((dx is not None, dw is not None))
        real(x, weight, dy, dx, dw, eps, config)

    monkeypatch.setattr(bwd_mod, "_launch_2d", spy)
    x, w, dy = make((5, 64), seed=6)
    fusetune.rmsnorm(x.requires_grad_(), w, eps=EPS).backward(dy)
    assert calls == [(True, False)]


def test_autograd_matches_torch_for_a_loss() -> None:
    # A loss through the norm: dy is whatever autograd hands back (here an expanded constant
    # for the sum, a dense tensor for the square).
    x, w, _ = make((37, 300), seed=7)
    x.requires_grad_()
    w.requires_grad_()
    (fusetune.rmsnorm(x, w, eps=EPS).pow(2).sum() + fusetune.rmsnorm(x, w, eps=EPS).sum()
     ).backward()
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS) * wr
    (yr.pow(2).sum() + yr.sum()).backward()
    assert rel_err(x.grad, xr.grad) <= 1e-5
    assert rel_err(w.grad, wr.grad) <= 1e-5


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad",
                                                                               "inference"])
def test_no_grad_takes_the_plain_path(mode, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusetune.kernels import rmsnorm as fwd_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the autograd Function ran under " + mode.__name__)

    monkeypatch.setattr(fwd_mod._RMSNormFunction, "apply", refuse)
    x, w, _ = make((4, 64), seed=8)
    with mode():
        y = fusetune.rmsnorm(x.requires_grad_(), w.requires_grad_(), eps=EPS)
    assert not y.requires_grad


def test_double_backward_is_refused() -> None:
    x, w, dy = make((3, 64), seed=9)
    x.requires_grad_()
    y = fusetune.rmsnorm(x, w, eps=EPS)
    with pytest.raises(RuntimeError, match=r"no double backward.*create_graph=True"):
        torch.autograd.grad(y, x, dy, create_graph=True)


def test_custom_op_is_differentiable() -> None:
    # What torch.compile runs: the fusetune::rmsnorm op with its autograd formula and the
    # fusetune::rmsnorm_bwd op.
    from fusetune import ops

    x, w, dy = make((5, 64), seed=10)
    x.requires_grad_()
    w.requires_grad_()
    torch.ops.fusetune.rmsnorm(x, w, EPS).backward(dy)
    ref_dx, ref_dw = reference(x, w, dy)
    assert rel_err(x.grad, ref_dx) <= 1e-5 and rel_err(w.grad, ref_dw) <= 1e-5
    dx, dw = ops._rmsnorm_bwd_op(x.detach(), w.detach(), dy, EPS, True, False)
    assert rel_err(dx, ref_dx) <= 1e-5 and dw.shape == (0,)  # not asked for: empty


def test_custom_ops_pass_opcheck() -> None:
    # Schema, fake implementations, the autograd registration, and AOTAutograd tracing the
    # forward op's backward into the rmsnorm_bwd op (what a compiled training step runs).
    from fusetune import ops

    x, w, dy = make((3, 16), seed=15)
    torch.library.opcheck(ops._rmsnorm_op, (x.requires_grad_(), w.requires_grad_(), EPS))
    torch.library.opcheck(ops._rmsnorm_bwd_op, (x.detach(), w.detach(), dy, EPS, True, False))


# ---- errors --------------------------------------------------------------------------------


def test_shape_mismatch_names_the_shapes() -> None:
    x, w, dy = make((2, 64))
    with pytest.raises(ValueError, match=r"dy has shape \(2, 32\), expected x's \(2, 64\)"):
        fusetune.rmsnorm_bwd(x, w, dy[:, :32], eps=EPS)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\), expected \(64,\)"):
        fusetune.rmsnorm_bwd(x, w[:32], dy, eps=EPS)


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("inf")])
def test_bad_eps_names_the_value(eps: float) -> None:
    x, w, dy = make((2, 64))
    with pytest.raises(ValueError, match=f"eps={eps!r}"):
        fusetune.rmsnorm_bwd(x, w, dy, eps=eps)
    with pytest.raises(ValueError, match=f"eps={eps!r}"):
        fusetune.rmsnorm(x.requires_grad_(), w, eps=eps)


def test_bad_config_raises_config_error() -> None:
    x, w, dy = make((2, 64))
    with pytest.raises(ConfigError, match="PROGRAMS"):
        fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config={"BLOCK_D": 64, "ROWS": 1,
                                                        "num_warps": 4, "num_stages": 1})
    with pytest.raises(ConfigError, match="PROGRAMS=3 must be a power of two"):
        fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config={**CFG_SINGLE, "PROGRAMS": 3})


def test_inputs_that_require_grad_are_refused() -> None:
    x, w, dy = make((2, 64))
    with pytest.raises(RuntimeError, match="rmsnorm_bwd: an input requires grad"):
        fusetune.rmsnorm_bwd(x, w, dy.requires_grad_(), eps=EPS)


# ---- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [4096, 3000])
def test_cuda_large(dtype: torch.dtype, d: int) -> None:
    x, w, dy = make((4096, d), dtype, seed=11, device="cuda")
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS)
    torch.cuda.synchronize()
    ref_dx, ref_dw = reference(x, w, dy)
    assert rel_err(dx, ref_dx) <= 1e-2 and rel_err(dw, ref_dw) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CFG_LOOP, {"BLOCK_D": 1024, "ROWS": 2, "PROGRAMS": 512,
                                               "num_warps": 8, "num_stages": 3},
                                    {"BLOCK_D": 4096, "ROWS": 1, "PROGRAMS": 128,
                                     "num_warps": 16, "num_stages": 2},
                                    {"BLOCK_D": 4096, "ROWS": 2, "PROGRAMS": 256,
                                     "num_warps": 8, "num_stages": 1, "PREFETCH": 1},
                                    {"BLOCK_D": 4096, "ROWS": 2, "PROGRAMS": 128,
                                     "num_warps": 16, "num_stages": 1, "PREFETCH": 1,
                                     "EVICT": 1}],
                         ids=["loop64", "loop1024", "single", "single-prefetch",
                              "single-prefetch-evict"])
def test_cuda_configs_bf16(config: dict[str, int]) -> None:
    x, w, dy = make((4096, 3000), torch.bfloat16, seed=12, device="cuda")
    dx, dw = fusetune.rmsnorm_bwd(x, w, dy, eps=EPS, config=config)
    torch.cuda.synchronize()
    ref_dx, ref_dw = reference(x, w, dy)
    assert rel_err(dx, ref_dx) <= 1e-2 and rel_err(dw, ref_dw) <= 1e-2


@pytest.mark.gpu
def test_cuda_autograd_bf16_with_float32_weight() -> None:
    # Mixed precision as autocast leaves it: bf16 activations, a float32 weight.
    x, w, dy = make((4096, 4096), torch.bfloat16, seed=13, device="cuda")
    w = w.float().requires_grad_()
    x.requires_grad_()
    fusetune.rmsnorm(x, w, eps=EPS).backward(dy)
    ref_dx, ref_dw = reference(x, w, dy)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel_err(x.grad, ref_dx) <= 1e-2 and rel_err(w.grad, ref_dw) <= 1e-2


# ---- KernelSpec ----------------------------------------------------------------------------


def test_registry() -> None:
    assert REGISTRY["rmsnorm_bwd"] is SPEC and get_spec("rmsnorm_bwd") is SPEC
    assert fusetune.rmsnorm_bwd is api.rmsnorm_bwd and "rmsnorm_bwd" in fusetune.__all__


def _point(d: int, batch: int = 1, seq: int = 1, dtype: str = "float16") -> Point:
    return Point.make("rmsnorm_bwd", {"dim": d}, batch, seq, dtype)


def test_canonical_caps_block_rows_and_programs() -> None:
    config = {"BLOCK_D": 4096, "ROWS": 16, "PROGRAMS": 2048, "num_warps": 4, "num_stages": 3}
    c = SPEC.canonical(config, _point(200, batch=37))
    # BLOCK_D to the padded row, ROWS to the padded row count, PROGRAMS to one step each
    # (ceil(37 / 16) = 3 programs); num_stages stays (the loop over rows is pipelined).
    assert c == {"BLOCK_D": 256, "ROWS": 16, "PROGRAMS": 4, "num_warps": 4, "num_stages": 3}
    assert config["PROGRAMS"] == 2048  # the argument is not modified
    c = SPEC.canonical({**config, "ROWS": 1}, _point(4096, batch=4096))
    assert c["BLOCK_D"] == 4096 and c["PROGRAMS"] == 2048
    # PREFETCH belongs to the single pass: a block narrower than the row drops it.
    assert SPEC.canonical({**config, "PREFETCH": 1}, _point(200, batch=37))["PREFETCH"] == 1
    assert SPEC.canonical({**config, "BLOCK_D": 64, "PREFETCH": 1},
                          _point(200, batch=37))["PREFETCH"] == 0
    assert SPEC.validate_config(config)["PREFETCH"] == 0  # a flag: left out, it is 0
    # EVICT likewise: the two-pass walk re-reads its rows from the L2, so it is dropped there.
    assert SPEC.canonical({**config, "EVICT": 1}, _point(200, batch=37))["EVICT"] == 1
    assert SPEC.canonical({**config, "BLOCK_D": 64, "EVICT": 1},
                          _point(200, batch=37))["EVICT"] == 0
    assert SPEC.validate_config(config)["EVICT"] == 0


def test_canonical_configs_launch_the_same_grid() -> None:
    p = _point(300, batch=37)
    for cfg in CONFIGS.values():
        c = SPEC.canonical(cfg, p)
        assert bwd_mod.programs(37, c) == bwd_mod.programs(37, cfg)
        assert min(c["BLOCK_D"], 512) == min(cfg["BLOCK_D"], 512)


def test_resources_grow_with_the_tile_and_stages() -> None:
    p = _point(4096, batch=16)
    base = {"BLOCK_D": 1024, "ROWS": 2, "PROGRAMS": 64, "num_warps": 4, "num_stages": 1}
    smem = [SPEC.resources({**base, "num_stages": s}, p).smem_bytes for s in (1, 2, 3, 4)]
    assert smem == sorted(smem) and len(set(smem)) == 4
    regs = [SPEC.resources({**base, "ROWS": r}, p).regs_per_thread for r in (1, 2, 4)]
    assert regs == sorted(regs) and len(set(regs)) == 3
    # A whole 16K row of x and dy per thread of four warps cannot stay in registers.
    big = SPEC.resources({**base, "BLOCK_D": 16384, "ROWS": 1}, _point(16384))
    h100 = gpus.resolve("h100")
    assert check_fits(big, h100).startswith("registers")
    # With 16 warps the tiles fit and the weight and dweight vectors may spill (to the L1):
    # it runs; not with the next row's tiles beside them, nor in two passes (four tiles).
    wide = {**base, "BLOCK_D": 16384, "ROWS": 1, "num_warps": 16}
    assert check_fits(SPEC.resources(wide, _point(16384)), h100) is None
    assert check_fits(SPEC.resources({**wide, "PREFETCH": 1}, _point(16384)), h100) is not None
    assert check_fits(SPEC.resources(wide, _point(20000)), h100) is not None
    # Where everything fits, the vectors count in full.
    small = SPEC.resources({**base, "BLOCK_D": 2048, "ROWS": 1, "num_warps": 8}, _point(2048))
    assert small.regs_per_thread == 3 * 8 + 32 + 2 * 8


@pytest.mark.parametrize(("dtype", "elt"), [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_cost_bytes_formula(dtype: str, elt: int) -> None:
    c = SPEC.cost(_point(4096, batch=2, seq=8, dtype=dtype))
    m, d = 16, 4096
    assert c.bytes == 3 * m * d * elt + 2 * d * elt  # read x and dy, write dx; w and dw once
    assert c.flops == 11 * m * d


@pytest.mark.parametrize("d", [1, 300, 4096, 14336, 20000])
@pytest.mark.parametrize("gpu", ["interpreter", "3090", "h100"])
def test_default_config_is_valid_and_fits(d: int, gpu: str) -> None:
    p = _point(d, batch=4096)
    g = gpus.resolve(gpu)
    config = SPEC.default_config(p, g)
    assert SPEC.validate_config(config) == config
    # one pass up to 16K columns, two passes in 8K blocks past that
    assert config["BLOCK_D"] == (next_pow2(d) if d <= 16384 else 8192)
    assert config["PROGRAMS"] <= 2 * g.sms
    # the next row is loaded ahead wherever a row fits in one block of up to 8K columns (a
    # 16K row leaves no registers for it), never in two passes
    assert config["PREFETCH"] == int(next_pow2(d) <= 8192)
    assert check_fits(SPEC.resources(SPEC.canonical(config, p), p), g) is None


def test_spec_reference_and_launch() -> None:
    p = _point(64, batch=2, seq=3, dtype="float32")
    inputs = SPEC.make_inputs(p, DEVICE)
    assert inputs["x"].shape == inputs["dy"].shape == (2, 3, 64)
    assert not (inputs["dy"] == 0).all()
    ref = SPEC.reference(inputs)
    ref_dx, ref_dw = reference(inputs["x"], inputs["weight"], inputs["dy"], inputs["eps"])
    torch.testing.assert_close(ref["dx"], ref_dx)
    torch.testing.assert_close(ref["dw"], ref_dw)
    assert not inputs["x"].requires_grad  # the reference works on copies
    out = SPEC.make_outputs(inputs)
    SPEC.launch(inputs, out, CFG_LOOP)
    assert rel_err(out["dx"], ref["dx"]) <= 1e-5 and rel_err(out["dw"], ref["dw"]) <= 1e-5


def test_model_dims() -> None:
    from fusetune.models import preset

    assert SPEC.dims_from_model(preset("llama-3-8b")) == {"dim": 4096}
