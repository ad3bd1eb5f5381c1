"""The unfused candidates of the matmul kernels (UNFUSED = 1, fusetune/kernels/_unfused.py):
checked like every config, one config of each space, tried by every search, served where a
table names them, refused where the kernel or the mode has none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from triton_run import genuine_triton_run

import fusetune
from fusetune import gpus
from fusetune.kernels import _unfused, ffn, linear, lola, moe, qkv
from fusetune.spec import ConfigError, Point, check_fits
from fusetune.tuner.bench import Evaluator
from fusetune.tuner.seeds import start_configs
from fusetune.tuner.space import load_space, make_plan

FFN_POINT = Point.make("ffn", {"dim": 64, "hidden": 96}, 3, 5, "float32")
LINEAR_POINTS = [Point.make("linear", {"bias": b, "dim": 64, "out": 80, "residual": r}, 2, 3,
                            "float32") for b in (0, 1) for r in (0, 1)]
QKV_POINTS = [Point.make("qkv", {"dim": 64, "head_dim": 16, "n_heads": 4, "interleaved": i,
                                 "n_kv_heads": 2}, 2, 3, "float32") for i in (0, 1)]
MOE_POINT = Point.make("moe", {"dim": 64, "experts": 6, "hidden": 40, "top_k": 2}, 1, 7,
                       "float32")
SPECS = {"ffn": ffn.SPEC, "linear": linear.SPEC, "qkv": qkv.SPEC, "moe": moe.SPEC}


def _unfused_config(spec: object, point: Point) -> dict[str, int]:
    default = spec.default_config(point, gpus.INTERPRETER)  # type: ignore[attr-defined]
    return spec.canonical({**default, "UNFUSED": 1}, point)  # type: ignore[attr-defined]


@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
@pytest.mark.parametrize("point", [FFN_POINT, *LINEAR_POINTS, *QKV_POINTS, MOE_POINT],
                         ids=lambda p: p.label)
def test_unfused_passes_the_same_check(point: Point, weights: str) -> None:
    spec = SPECS[point.kernel]
    point = Point.make(point.kernel, point.dim, point.batch, point.seq,
                       "bfloat16" if weights else point.dtype, weights)
    config = _unfused_config(spec, point)
    assert config["UNFUSED"] == 1
    out = Evaluator(spec, point, "interpreter", "cpu").evaluate(config)
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= spec.tolerance_for(point)


def test_one_unfused_config_per_space_tried_first() -> None:
    for spec, point in ((ffn.SPEC, FFN_POINT), (linear.SPEC, LINEAR_POINTS[3]),
                        (qkv.SPEC, QKV_POINTS[0]), (moe.SPEC, MOE_POINT)):
        space = load_space(spec)
        assert "UNFUSED" in [p.name for p in space.params]
        plan = make_plan(space, spec, point, gpus.resolve("h100"))
        unfused = [c for c in plan.feasible if c["UNFUSED"]]
        assert len(unfused) == 1  # every UNFUSED config collapses onto one
        default = spec.canonical(spec.default_config(point, gpus.resolve("h100")), point)
        starts = start_configs(spec, point, space, plan, default, [])
        assert starts[:2] == [default, unfused[0]]


def test_no_unfused_form_is_refused() -> None:
    # FP8 activations: the fused kernels' own rounding of them; lola: not yet.
    act = Point.make("ffn", {"dim": 64, "hidden": 96}, 1, 16, "bfloat16", "fp8-e4m3", "fp8")
    res = ffn.SPEC.resources(_unfused_config(ffn.SPEC, act), act)
    assert res.unfit.startswith("unfused: FP8 activations")
    for spec, dims in ((lola.SPEC, {"dim": 64, "out": 96}),):
        point = Point.make(spec.name, dims, 1, 16, "float16")
        config = {**spec.default_config(point, gpus.resolve("h100")), "UNFUSED": 1}
        why = check_fits(spec.resources(config, point), gpus.resolve("h100"))
        assert why is not None and "no unfused form" in why
    x = torch.randn(4, 64)
    with pytest.raises(ConfigError, match="UNFUSED=1: this kernel has no unfused form"):
        fusetune.lola(x, torch.randn(96, 64), torch.zeros(96), eps=1e-5,
                      config={**lola.SPEC.default_config(
                          Point.make("lola", {"dim": 64, "out": 96}, 1, 4, "float32"),
                          gpus.INTERPRETER), "UNFUSED": 1})


def _load_unfused_table(tmp_path: Path, spec: object, point: Point) -> None:
    """A table whose one entry, at `point` on the interpreter, is the unfused form; loaded."""
    config = _unfused_config(spec, point)
    doc = {"schema_version": 1, "provenance": {}, "gpus": {"interpreter": {point.kernel: [
        {"dims": point.dim, "dtype": point.dtype, "batch": point.rows, "seq": 1,
         "config": config}]}}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    fusetune.load_tables(path)


def test_a_table_naming_the_unfused_winner_is_served_as_one(
        tmp_path: Path, fresh_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    point = Point.make("ffn", {"dim": 64, "hidden": 96}, 1, 8, "float32")
    _load_unfused_table(tmp_path, ffn.SPEC, point)
    ran = []
    real = ffn._unfused_2d
    monkeypatch.setattr(ffn, "_unfused_2d", lambda *a: ran.append(1) or real(*a))
    # W1 and W3 as the halves of one stacked matrix, as fusetune.patch holds them.
    both = torch.randn(192, 64) / 8
    x, g = torch.randn(8, 64), 1 + 0.1 * torch.randn(64)
    with torch.no_grad():
        h = fusetune.ffn(x, g, both[:96], both[96:], eps=1e-6)
    assert ran == [1]
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    want = torch.nn.functional.silu(xn @ both[:96].T) * (xn @ both[96:].T)
    torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-4)
    assert fusetune.resolve("ffn", point.dim, "float32", rows=8).config["UNFUSED"] == 1


def test_stacked_and_chunked_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    both = torch.randn(10, 4)
    assert torch.equal(_unfused.stacked(both[:5], both[5:]), both)
    assert _unfused.stacked(both[5:], both[:5]) is None  # not in that order
    assert _unfused.stacked(torch.randn(5, 4), torch.randn(5, 4)) is None
    w = torch.randn(40, 16)
    wq, scale = fusetune.quantize_fp8(w)
    x, add = torch.randn(3, 16), torch.randn(3, 40)
    whole = _unfused.matmul(x, wq, scale, torch.empty(3, 40), add)
    monkeypatch.setattr(_unfused, "WORKSPACE_BYTES", 16 * 4 * 7)  # 7 channels fit
    monkeypatch.setattr(_unfused, "CHUNK_CHANNELS", 4)
    assert _unfused._chunks(wq, torch.float32) == 8  # 6 parts of 7 -> multiples of 4
    chunked = _unfused.matmul(x, wq, scale, torch.empty(3, 40), add)
    torch.testing.assert_close(chunked, whole)
    bias = torch.randn(40)  # a bias's slices too, into a wider output's columns
    wide = torch.full((3, 50), float("nan"))
    _unfused.matmul(x, wq, scale, wide[:, 5:45], bias)
    torch.testing.assert_close(wide[:, 5:45], x @ fusetune.kernels.fp8.dequantize(wq, scale).T
                               + bias, rtol=1e-5, atol=1e-5)
    assert wide[:, :5].isnan().all() and wide[:, 45:].isnan().all()
    torch.testing.assert_close(whole, x @ fusetune.kernels.fp8.dequantize(wq, scale).T + add,
                               rtol=1e-5, atol=1e-5)


def test_stacked_parts_of_other_sizes_and_the_upcast() -> None:
    whole = torch.randn(16, 4)
    assert torch.equal(_unfused.stacked(whole[:8], whole[8:12], whole[12:]), whole)
    assert _unfused.stacked(whole[:8], whole[12:]) is None  # a gap between them
    assert _unfused.stacked(whole[:8, :2], whole[8:, :2]) is None  # not contiguous
    for fmt in ("e4m3", "e5m2"):
        wq, scale = fusetune.quantize_fp8(torch.randn(7, 3000), fmt)  # a row of two blocks
        want = (wq.float() * scale[:, None]).half()
        assert torch.equal(_unfused._upcast(wq, scale, torch.float16), want)
        assert torch.equal(_unfused._upcast(wq[:, 5:], scale, torch.float16), want[:, 5:])
        assert torch.equal(_unfused._upcast(wq, None, torch.float16), wq.half())
        # bfloat16: Triton's interpreter truncates float32 to it (the GPU rounds to nearest
        # even, test_upcast_rounds_once_on_the_gpu): one unit of the last place here
        got = _unfused._upcast(wq, scale, torch.bfloat16).float()
        exact = wq.float() * scale[:, None]
        assert ((got - exact).abs() <= exact.abs() * 2**-7).all()


@pytest.mark.gpu
def test_upcast_rounds_once_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    genuine_triton_run(monkeypatch)  # a wrapped JITFunction.run sends launches down Triton's path
    for fmt in ("e4m3", "e5m2"):
        wq, scale = fusetune.quantize_fp8(torch.randn(300, 5000, device="cuda"), fmt)
        for dtype in (torch.bfloat16, torch.float16):
            want = (wq.float() * scale[:, None]).to(dtype)
            assert torch.equal(_unfused._upcast(wq, scale, dtype), want)
    # repeated upcasts take the short launch path (_direct), not Triton's argument binding
    from fusetune.kernels._direct import direct

    launcher = direct(_unfused._upcast_kernel)
    hits = launcher.hits
    _unfused._upcast(wq, scale, torch.bfloat16)
    assert launcher.hits == hits + 1


@pytest.mark.parametrize("stack", [False, True], ids=["separate", "stacked"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_qkv_unfused_with_biases_matches_the_fused_kernel(interleaved: bool, stack: bool,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Qwen2's q/k/v biases go in by cuBLAS's beta, before RoPE, as the fused kernel adds
    them; where the weights (and biases) are views of one stacked matrix, by one GEMM."""
    from fusetune.kernels._rotary import rotary_tables

    torch.manual_seed(0)
    d, hd, b, s = 64, 16, 2, 3
    x, g = torch.randn(b, s, d), 1 + 0.1 * torch.randn(d)
    w_all, b_all = torch.randn(128, d) / 8, 0.1 * torch.randn(128)
    if not stack:
        w_all, b_all = w_all.clone(), b_all.clone()
    parts = ((0, 64), (64, 96), (96, 128))
    wq, wk, wv = (w_all[a:z] if stack else w_all[a:z].clone() for a, z in parts)
    bq, bk, bv = (b_all[a:z] if stack else b_all[a:z].clone() for a, z in parts)
    gemms: list[int] = []
    real = _unfused.matmul
    monkeypatch.setattr(_unfused, "matmul", lambda xn, w, *a: gemms.append(w.shape[0])
                        or real(xn, w, *a))
    cos, sin = rotary_tables(torch.arange(s)[None, :] + torch.arange(b)[:, None], hd,
                             theta=10000.0, dtype=torch.float32)
    point = Point.make("qkv", {"dim": d, "head_dim": hd, "n_heads": 4,
                               "interleaved": int(interleaved), "n_kv_heads": 2}, b, s,
                       "float32")
    fused = qkv.SPEC.canonical(qkv.SPEC.default_config(point, gpus.INTERPRETER), point)
    args = (x, g, wq, wk, wv, cos, sin)
    kw = {"eps": 1e-6, "head_dim": hd, "interleaved": interleaved, "bq": bq, "bk": bk, "bv": bv}
    with torch.no_grad():
        want = fusetune.qkv(*args, **kw, config=fused)
        got = fusetune.qkv(*args, **kw, config=_unfused_config(qkv.SPEC, point))
    assert gemms == ([128] if stack else [64, 32, 32])
    for g_, w_ in zip(got, want, strict=True):
        assert g_.is_contiguous()
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)


def test_a_table_naming_the_unfused_moe_is_served_as_one(
        tmp_path: Path, fresh_tables: None, monkeypatch: pytest.MonkeyPatch) -> None:
    point = Point.make("moe", MOE_POINT.dim, 1, 5, "float32")
    _load_unfused_table(tmp_path, moe.SPEC, point)
    ran = []
    real = moe._launch_unfused
    monkeypatch.setattr(moe, "_launch_unfused", lambda *a: ran.append(1) or real(*a))
    torch.manual_seed(0)
    inputs = moe.SPEC.make_inputs(point, "cpu")
    args = [inputs[k] for k in ("x", "gate_up", "down", "topk_ids", "topk_weights")]
    got = fusetune.moe(*args)
    assert ran == [1]
    torch.testing.assert_close(got, moe._reference(inputs)["out"], rtol=1e-4, atol=1e-4)
    assert fusetune.resolve("moe", point.dim, "float32", rows=5).config["UNFUSED"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
def test_gpu_unfused_calls_replay_their_cublas_calls(weights: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Served from a table, the unfused forms' repeated calls replay their first call (the
    cuBLAS calls through _replay.torch_call beside the norm, upcast, SiLU·mul and RoPE
    launches), each on its own new tensors: equal to the full path (a config handed in is
    checked every call). Weights of the same shapes that are no longer one stack make the
    replay decline, and the call takes the full path."""
    from fusetune.gpus import current_gpu
    from fusetune.kernels.rope import rotary_tables

    genuine_triton_run(monkeypatch)
    monkeypatch.delenv(fusetune.tables.ENV_VAR, raising=False)
    d, hidden, hd, rows = 512, 1024, 64, 64
    dims = {"ffn": {"dim": d, "hidden": hidden},
            "linear": {"bias": 0, "dim": hidden, "out": d, "residual": 1},
            "qkv": {"dim": d, "head_dim": hd, "interleaved": 0, "n_heads": d // hd,
                    "n_kv_heads": d // hd // 4}}
    configs = {k: _unfused_config(SPECS[k], Point.make(k, v, rows, 1, "bfloat16", weights))
               for k, v in dims.items()}
    table = tmp_path / "unfused.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        current_gpu().name: {k: [{"dims": dims[k], "dtype": "bfloat16", "batch": rows,
                                  "seq": 1, "config": configs[k],
                                  **({"weights": weights} if weights else {})}]
                             for k in dims}}}))
    fusetune.load_tables(table)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16)

    def weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return fusetune.quantize_fp8(w) if weights else (w, None)

    def split(w: torch.Tensor, *sizes: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Views of one stacked (and for FP8, quantized) weight, with their scales."""
        q, s = weight(w)
        return list(q.split(sizes)), [None] * len(sizes) if s is None else list(s.split(sizes))

    norm = randn(d, scale=0.1) + 1
    (w1, w3), (s1, s3) = split(randn(2 * hidden, d, scale=d**-0.5), hidden, hidden)
    wd, sd = weight(randn(d, hidden, scale=hidden**-0.5))
    kv = d // 4
    (wq, wk, wv), (sq, sk, sv) = split(randn(d + 2 * kv, d, scale=d**-0.5), d, kv, kv)
    cos, sin = rotary_tables(torch.arange(rows, device="cuda")[None], hd, theta=1e4,
                             dtype=torch.bfloat16)

    def calls(x: torch.Tensor, r: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
              config: Any = None) -> list[torch.Tensor]:
        cf = None if config is None else configs["ffn"]
        h = fusetune.ffn(x, norm, w1, w3, eps=1e-5, w1_scale=s1, w3_scale=s3, config=cf)
        cl = None if config is None else configs["linear"]
        cq = None if config is None else configs["qkv"]
        return [h, fusetune.linear(h, wd, residual=r, weight_scale=sd, config=cl),
                *fusetune.qkv(x, norm, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd,
                              interleaved=False, wq_scale=sq, wk_scale=sk, wv_scale=sv,
                              config=cq)]

    try:
        with torch.no_grad():
            for _ in range(4):
                x, r = randn(1, rows, d), randn(1, rows, d)  # new tensors every call
                for got, want in zip(calls(x, r, w1, w3), calls(x, r, w1, w3, "full"),
                                     strict=True):
                    assert torch.equal(got, want)
            plans = {m.__name__: m._MEMO.copy() for m in (ffn, linear, qkv)}
            for name, memo in plans.items():
                ((config, plan),) = memo.values()
                assert config["UNFUSED"] == 1, name
                assert plan is not None and plan.runs == 3, name
                assert any(grid is None for _, grid, _, _ in plan.launches), name  # cuBLAS
            ffn_plan = next(iter(plans["fusetune.kernels.ffn"].values()))[1]
            assert (2, 3) in ffn_plan.stacks  # W1 and W3 (the memo's inputs 2 and 3)
            # W1 and W3 of the same shapes, no longer one stack: the full path, still right
            apart1, apart3 = w1.clone(), w3.clone()
            x = randn(1, rows, d)
            got = fusetune.ffn(x, norm, apart1, apart3, eps=1e-5, w1_scale=s1, w3_scale=s3)
            assert ffn_plan.runs == 3
            want = fusetune.ffn(x, norm, w1, w3, eps=1e-5, w1_scale=s1, w3_scale=s3,
                                config=configs["ffn"])
            assert torch.equal(got, want)
    finally:
        fusetune.tables.reset()
