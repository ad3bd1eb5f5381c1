"""fusetune.moe (grouped experts: gate/up + SiLU·mul, then down, weighted, summed over top-k)
against a plain torch loop over the experts (interpreter on CPU), at awkward shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from triton_run import genuine_triton_run

import fusetune
from fusetune import gpus
from fusetune.kernels import moe as moe_mod
from fusetune.spec import ConfigError, Point, check_fits
from fusetune.tuner.bench import Evaluator

SPEC = moe_mod.SPEC
CONFIGS = {
    "decode tile": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2,
                    "num_stages": 2},
    "prefill tile": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4,
                     "num_stages": 3},
    "per pair": {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1},
    # launch 2's own tile: 8 columns wide (72 = 9 of them; launch 1's 32: 40 = 1.25), K-steps
    # of 16 (40 = 2.5), 4 warps
    "per pair, own down tile": {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2,
                                "num_stages": 1, "DOWN_N": 8, "DOWN_K": 16, "DOWN_WARPS": 4},
    # launch 2 a programmatic dependent of launch 1 (its first K-step peeled: 40 = 16 + 16 + 8)
    "per pair, PDL": {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2,
                      "num_stages": 1, "DOWN_N": 8, "DOWN_K": 16, "DOWN_WARPS": 4, "PDL": 1},
    "unfused": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2,
                "UNFUSED": 1},
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("tokens", "experts", "top_k"),
                         [(1, 8, 2), (37, 8, 2), (5, 16, 4), (3, 5, 1), (4, 6, 3)])
def test_configs_pass_the_tuners_check(tokens: int, experts: int, top_k: int,
                                       name: str) -> None:
    # dims not multiples of the tiles (K = 72 in launch 1, 40 in launch 2; N = 40 and 72);
    # one token, most experts idle; 37 tokens: no expert's rows a whole number of blocks; top_k
    # 1, and 3 (the per-pair structure's tiles hold 4 pairs, one masked off)
    point = Point.make("moe", {"dim": 72, "experts": experts, "hidden": 40, "top_k": top_k},
                       1, tokens, "float32")
    out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(CONFIGS[name])
    assert out.status == "ok", out.reason
    assert out.rel_err is not None and out.rel_err <= 1e-5


@pytest.mark.parametrize("name", ["decode tile", "per pair", "per pair, own down tile",
                                  "per pair, PDL", "unfused"])
def test_awkward_routing(name: str) -> None:
    # an expert no token chose, one token routed to every expert of its top-k, repeated
    # experts across tokens, bfloat16
    torch.manual_seed(0)
    t, d, h, e = 6, 64, 48, 5
    x = torch.randn(t, d).bfloat16()
    gate_up = (torch.randn(e, 2 * h, d) / 8).bfloat16()
    down = (torch.randn(e, d, h) / 7).bfloat16()
    ids = torch.tensor([[0, 1], [0, 1], [1, 3], [3, 0], [1, 0], [4, 3]])  # expert 2 idle
    w = torch.rand(t, 2)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    inputs = {"x": x, "gate_up": gate_up, "down": down, "topk_ids": ids, "topk_weights": w}
    want = moe_mod._reference(inputs)["out"]
    got = fusetune.moe(x, gate_up, down, ids, w, config=CONFIGS[name])
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() <= 1.6e-2
    pairs, block_expert = moe_mod.group_pairs(ids, e, 4, torch.empty(t * 2, 64))
    # 4 pairs of experts 0 and 1, 3 of 3, 1 of 4: a block of 4 rows each; the rest padding
    assert block_expert.tolist()[:4] == [0, 1, 3, 4]
    assert min(block_expert.tolist()[4:]) >= e
    assert sorted(p for p in pairs.tolist() if p < t * 2) == list(range(t * 2))
    for b, expert in enumerate(block_expert.tolist()[:4]):  # each block holds its expert's pairs
        rows = [p for p in pairs.tolist()[4 * b:4 * b + 4] if p < t * 2]
        assert sorted(rows) == [p for p in range(t * 2) if ids.flatten()[p] == expert]


@pytest.mark.parametrize("name", ["decode tile", "per pair", "unfused"])
def test_ids_outside_the_experts_give_nan_rows(name: str) -> None:
    # An id the caller's router could not have made: that token's output is NaN, the others
    # are untouched (no synchronization with the device to refuse it before the launches).
    torch.manual_seed(0)
    x = torch.randn(3, 32)
    gate_up, down = torch.randn(4, 48, 32) / 6, torch.randn(4, 32, 24) / 5
    ids = torch.tensor([[0, 1], [2, 7], [3, 0]])
    w = torch.full((3, 2), 0.5)
    got = fusetune.moe(x, gate_up, down, ids, w, config=CONFIGS[name])
    assert got[1].isnan().all()
    ok = torch.tensor([[0, 1], [2, 2], [3, 0]])
    want = moe_mod._reference({"x": x, "gate_up": gate_up, "down": down, "topk_ids": ok,
                               "topk_weights": w})["out"]
    assert torch.allclose(got[[0, 2]], want[[0, 2]], atol=1e-5)


def test_nan_rows_past_the_first_rows_of_a_block() -> None:
    # The grouped structure's rows of pairs with a bad id are set NaN a few rows at a time:
    # a bad pair well inside a block (pair 41) and one in its last rows (pair 59).
    torch.manual_seed(1)
    t = 30
    x = torch.randn(t, 32)
    gate_up, down = torch.randn(4, 48, 32) / 6, torch.randn(4, 32, 24) / 5
    ok = torch.randint(0, 4, (t, 2))
    ok[:, 1] = (ok[:, 0] + 1) % 4
    ids = ok.clone()
    ids[20, 1], ids[29, 1] = 9, -1
    w = torch.full((t, 2), 0.5)
    got = fusetune.moe(x, gate_up, down, ids, w, config=CONFIGS["decode tile"])
    assert got[[20, 29]].isnan().all()
    want = moe_mod._reference({"x": x, "gate_up": gate_up, "down": down, "topk_ids": ok,
                               "topk_weights": w})["out"]
    rest = [i for i in range(t) if i not in (20, 29)]
    assert torch.allclose(got[rest], want[rest], atol=1e-5)


def test_bad_inputs() -> None:
    x, gu, dn = torch.randn(3, 8), torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    ids, w = torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"down must be \[2, 8, 6\]"):
        fusetune.moe(x, gu, dn.transpose(1, 2), ids, w)
    with pytest.raises(ValueError, match=r"topk_ids and topk_weights must both be \[3, top_k\]"):
        fusetune.moe(x, gu, dn, ids[:2], w[:2])
    with pytest.raises(TypeError, match="topk_ids must be integers"):
        fusetune.moe(x, gu, dn, w, w)


def test_per_pair_structure_is_for_decode() -> None:
    # the search does not try a program per pair where experts have many pairs; the default
    # takes it where they have about one
    def point(rows: int) -> Point:
        return Point.make("moe", {"dim": 2048, "experts": 128, "hidden": 768, "top_k": 8}, 1,
                          rows, "bfloat16")

    per_pair = CONFIGS["per pair"]
    assert SPEC.resources(per_pair, point(32)).unfit == ""
    assert "BLOCK_M=1" in SPEC.resources(per_pair, point(33)).unfit
    assert SPEC.canonical(per_pair | {"num_stages": 4}, point(1))["num_stages"] == 1
    # the down launch's own tile means something in the per-pair structure only; there its
    # narrower tiles take fewer registers, and launch 1's values written out are the same
    # config as 0
    own = {"DOWN_N": 8, "DOWN_K": 64, "DOWN_WARPS": 8}
    grouped = SPEC.validate_config(CONFIGS["decode tile"] | own)
    assert all(SPEC.canonical(grouped, point(64))[k] == 0 for k in own)
    half = SPEC.validate_config(per_pair | {"DOWN_N": 8})
    assert SPEC.canonical(half, point(1))["DOWN_N"] == 8
    assert (SPEC.resources(half, point(1)).regs_per_thread
            < SPEC.resources(SPEC.validate_config(per_pair), point(1)).regs_per_thread)
    same = SPEC.validate_config(per_pair | {"DOWN_N": 16, "DOWN_K": 32, "DOWN_WARPS": 2})
    assert SPEC.canonical(same, point(1)) == SPEC.canonical(SPEC.validate_config(per_pair),
                                                           point(1))
    with pytest.raises(ConfigError, match="DOWN_N=12 must be a power of two"):
        SPEC.validate_config(per_pair | {"DOWN_N": 12})
    h200 = gpus.resolve("h200")
    assert SPEC.default_config(point(16), h200)["BLOCK_M"] == 1
    assert SPEC.default_config(point(17), h200)["BLOCK_M"] == 16


def _pdl_inputs(device: str, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, 72, device=device, generator=g).to(dtype)
    gate_up = (torch.randn(6, 80, 72, device=device, generator=g) / 8).to(dtype)
    down = (torch.randn(6, 72, 40, device=device, generator=g) / 6).to(dtype)
    w, ids = torch.softmax(torch.randn(tokens, 6, device=device, generator=g), -1).topk(3, -1)
    return x, gate_up, down, ids, w.to(dtype)


def test_pdl_changes_no_bit() -> None:
    # PDL=1 peels launch 2's first K-step and, on a GPU, waits for launch 1 there: the same
    # products in the same order, so the same bits as PDL=0
    args = _pdl_inputs("cpu", 5, torch.bfloat16)
    with_pdl = CONFIGS["per pair, PDL"]
    without = with_pdl | {"PDL": 0}
    got = fusetune.moe(*args, config=with_pdl)
    assert torch.equal(got, fusetune.moe(*args, config=without))
    assert not got.isnan().any()


def test_pdl_is_for_the_per_pair_structure_on_gpus_that_have_it() -> None:
    point = Point.make("moe", {"dim": 2048, "experts": 128, "hidden": 768, "top_k": 8}, 1, 1,
                       "bfloat16")
    per_pair = SPEC.validate_config(CONFIGS["per pair, PDL"])
    grouped = SPEC.validate_config(CONFIGS["decode tile"] | {"PDL": 1})
    assert SPEC.canonical(grouped, point)["PDL"] == 0  # the grouped launches are no dependents
    assert SPEC.canonical(per_pair, point)["PDL"] == 1
    assert SPEC.validate_config(CONFIGS["per pair"])["PDL"] == 0  # a config leaving it out
    res = SPEC.resources(per_pair, point)
    assert check_fits(res, gpus.resolve("h200")) is None
    assert check_fits(res, gpus.resolve("interpreter")) is None
    reason = check_fits(res, gpus.resolve("a100"))
    assert reason is not None and reason.startswith("pdl: PDL=1 needs programmatic dependent")
    assert "8.0" in reason
    assert check_fits(SPEC.resources(per_pair | {"PDL": 0}, point), gpus.resolve("a100")) is None


@pytest.mark.gpu
def test_gpu_pdl_launches_a_programmatic_dependent(monkeypatch: pytest.MonkeyPatch) -> None:
    # on compute capability 9.0+ launch 2 is compiled and launched as a programmatic dependent
    # (griddepcontrol), and its result is PDL=0's bit for bit, also in a CUDA graph
    from fusetune.kernels._direct import direct

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    genuine_triton_run(monkeypatch)
    with_pdl = CONFIGS["per pair, PDL"]
    for tokens in (1, 4):
        args = _pdl_inputs("cuda", tokens, torch.bfloat16)
        want = fusetune.moe(*args, config=with_pdl | {"PDL": 0})
        assert torch.equal(fusetune.moe(*args, config=with_pdl), want)
        out = torch.empty_like(want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(fusetune.moe(*args, config=with_pdl))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, want)
    dependents = [kernel.metadata.launch_pdl
                  for kernel, _ in direct(moe_mod._token_gemv_kernel).kernels.values()]
    assert True in dependents


def test_default_configs_fit_the_gpus() -> None:
    for gpu in ("h100", "h200", "3090"):
        for rows in (1, 8, 256, 4096):
            point = Point.make("moe", {"dim": 4096, "experts": 8, "hidden": 14336, "top_k": 2},
                               1, rows, "bfloat16")
            res = SPEC.resources(SPEC.default_config(point, gpus.resolve(gpu)), point)
            assert res.smem_bytes <= gpus.resolve(gpu).smem_per_block


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["", "fp8-e4m3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("dims", "tokens"), [
    ({"dim": 4096, "experts": 8, "hidden": 14336, "top_k": 2}, 1),  # Mixtral-8x7B, decode
    ({"dim": 4096, "experts": 8, "hidden": 14336, "top_k": 2}, 333),
    ({"dim": 2048, "experts": 128, "hidden": 768, "top_k": 8}, 8),  # Qwen3-30B-A3B
    ({"dim": 2048, "experts": 128, "hidden": 768, "top_k": 8}, 1000),
])
def test_gpu_real_dims(dims: dict[str, int], tokens: int, dtype: str, weights: str) -> None:
    # each tile and the default heuristic's config at the models' dims, the tuner's check
    # (output against the float32 reference, the dtype's tolerance)
    point = Point.make("moe", dims, 1, tokens, dtype, weights)
    ev = Evaluator(SPEC, point, "cuda", "cuda")
    configs = [*CONFIGS.values(), {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                                   "num_warps": 8, "num_stages": 4},
               SPEC.default_config(point, gpus.resolve("h200"))]
    for config in configs:
        out = ev.check(config)
        assert out.status == "ok", (config, out.reason)


@pytest.mark.parametrize("weights", ["fp8-e4m3", "fp8-e5m2"])
def test_fp8_weights_pass_the_tuners_check(weights: str) -> None:
    # weight-only FP8: converted in the kernels, each output column times its expert's channel
    # scale; the 16-bit tolerance against the dequantized weights
    point = Point.make("moe", {"dim": 72, "experts": 8, "hidden": 40, "top_k": 2}, 1, 37,
                       "bfloat16", weights)
    inputs = SPEC.make_inputs(point, "cpu")
    assert inputs["gate_up"].dtype != torch.bfloat16 and inputs["down_scale"].shape == (8, 72)
    for config in CONFIGS.values():
        out = Evaluator(SPEC, point, "interpreter", "cpu").evaluate(config)
        assert out.status == "ok", (config, out.reason)


@pytest.mark.parametrize("name", ["decode tile", "per pair", "per pair, own down tile",
                                  "per pair, PDL", "unfused"])
def test_fp8_weights_through_the_call(name: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 64).bfloat16()
    gate_up, down = torch.randn(4, 96, 64) / 8, torch.randn(4, 64, 48) / 7
    gq, gs = fusetune.quantize_fp8(gate_up)
    dq, ds = fusetune.quantize_fp8(down)
    assert gs.shape == (4, 96) and ds.shape == (4, 64)
    ids = torch.tensor([[0, 3], [1, 3], [2, 2], [0, 1], [3, 0]])
    w = torch.rand(5, 2).bfloat16()
    got = fusetune.moe(x, gq, dq, ids, w, gate_up_scale=gs, down_scale=ds,
                       config=CONFIGS[name])
    want = moe_mod._reference({"x": x, "gate_up": gq, "gate_up_scale": gs, "down": dq,
                               "down_scale": ds, "topk_ids": ids, "topk_weights": w})["out"]
    assert ((got.float() - want).norm() / want.norm()).item() <= 1.6e-2
    unscaled = fusetune.moe(x, gq, dq, ids, w, config=CONFIGS[name])
    assert not torch.allclose(unscaled.float(), got.float(), rtol=0.1)  # the scales count
    with pytest.raises(TypeError, match="gate_up and down must have one dtype"):
        fusetune.moe(x, gq, down.bfloat16(), ids, w, gate_up_scale=gs)
    with pytest.raises(ValueError, match=r"down_scale must be float32 of shape \(4, 64\)"):
        fusetune.moe(x, gq, dq, ids, w, gate_up_scale=gs, down_scale=ds[0])
    with pytest.raises(TypeError, match="gate_up_scale is for FP8 weights"):
        fusetune.moe(x, gate_up.bfloat16(), down.bfloat16(), ids, w, gate_up_scale=gs)


def test_a_repeated_call_takes_the_config_it_looked_up(tmp_path: Path, fresh_tables: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # moe keeps what its checks and lookup decided per call signature (_call_memo): a repeat
    # of the signature (other values) looks nothing up; another signature does
    import fusetune.runtime

    dims = {"dim": 64, "experts": 4, "hidden": 48, "top_k": 2}
    config = SPEC.validate_config(CONFIGS["per pair"])
    table = tmp_path / "moe.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        "interpreter": {"moe": [{"dims": dims, "dtype": "float32", "batch": 1, "seq": 3,
                                 "config": config}]}}}))
    fusetune.load_tables(table)
    gate_up, down = torch.randn(4, 96, 64) / 8, torch.randn(4, 64, 48) / 7
    ids = torch.tensor([[0, 3], [1, 3], [2, 2]])

    def call(x: torch.Tensor, w: torch.Tensor, **kw: object) -> torch.Tensor:
        with torch.no_grad():
            return fusetune.moe(x, gate_up, down, ids, w, **kw)  # type: ignore[arg-type]

    call(torch.randn(3, 64), torch.rand(3, 2))
    looked_up = []
    real = fusetune.runtime.cached_config
    monkeypatch.setattr(fusetune.runtime, "cached_config",
                        lambda *a, **k: looked_up.append(a) or real(*a, **k))
    x, w = torch.randn(3, 64), torch.rand(3, 2)
    torch.testing.assert_close(call(x, w), call(x, w, config=config), rtol=0, atol=0)
    assert looked_up == [] and len(moe_mod._MEMO) == 1
    with torch.no_grad():
        fusetune.moe(torch.randn(2, 64), gate_up, down, ids[:2], torch.rand(2, 2))
    assert len(looked_up) == 1 and len(moe_mod._MEMO) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decode tile", "prefill tile", "per pair",
                                  "per pair, own down tile", "per pair, PDL", "unfused"])
def test_gpu_repeated_calls_replay_the_first(name: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A config served from a table: moe's repeated calls (other tokens, routing and routing
    weights each time, the same shapes) replay the first call's launches and torch calls
    (fusetune.kernels._replay), equal to the full path (a config handed in is checked every
    call); the unfused form (torch's sort and grouped GEMMs) takes the full path every call."""
    from fusetune.gpus import current_gpu

    genuine_triton_run(monkeypatch)
    monkeypatch.delenv(fusetune.tables.ENV_VAR, raising=False)
    config = SPEC.validate_config(CONFIGS[name])
    # the per-pair structure is for a few pairs an expert (unfit, the default served, at more)
    dims, tokens = {"dim": 256, "experts": 8, "hidden": 128, "top_k": 2}, (
        3 if config["BLOCK_M"] == 1 else 37)
    table = tmp_path / "moe.yaml"
    table.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {}, "gpus": {
        current_gpu().name: {"moe": [{"dims": dims, "dtype": "bfloat16", "batch": 1,
                                      "seq": tokens, "config": config}]}}}))
    fusetune.load_tables(table)
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(8, 256, 256, device="cuda", generator=g) / 16).bfloat16()
    down = (torch.randn(8, 256, 128, device="cuda", generator=g) / 12).bfloat16()
    try:
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(tokens, 256, device="cuda", generator=g).bfloat16()
                logits = torch.randn(tokens, 8, device="cuda", generator=g)
                w, ids = torch.softmax(logits, -1).topk(2, dim=-1)
                w = w.bfloat16()
                got = fusetune.moe(x, gate_up, down, ids, w)
                assert torch.equal(got, fusetune.moe(x, gate_up, down, ids, w, config=config))
        ((kept, plan),) = moe_mod._MEMO.values()
        assert kept == config
        if name == "unfused":
            assert plan is None
        else:
            assert plan is not None and plan.runs == 3
            torch_calls = [fn for fn, grid, _, _ in plan.launches if grid is None]
            assert torch_calls == ([] if config["BLOCK_M"] == 1 else
                                   [torch.zeros, torch.full, torch.sum, torch.mul])
    finally:
        fusetune.tables.reset()
