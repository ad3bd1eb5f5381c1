"""Models by preset or Hugging Face config.json, and the points a patched model launches
(`fusetune search --model M --kernel all`, and `--kernel training` for its training path)."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from fusetune import cli, gpus
from fusetune.db.store import Store
from fusetune.models import (
    TRAINING_KERNELS,
    TRAINING_ROWS,
    ModelError,
    load_model,
    model_rows,
    patched_dims,
    trained_dims,
)
from fusetune.tuner import study, worker
from fusetune.tuner.children import start_child
from fusetune.tuner.search import Target
from fusetune.tuner.study import PointResult, PointTuner

LLAMA3 = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
          "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
QWEN = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16"}


def write(tmp_path: Path, config: dict, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_config_json_gives_the_presets_dims(tmp_path: Path) -> None:
    d = write(tmp_path, LLAMA3)
    for where in (d, d / "config.json"):  # the directory or the file
        m = load_model(str(where))
        assert (m.dim, m.hidden, m.n_heads, m.n_kv_heads, m.head_dim) == (4096, 14336, 32, 8,
                                                                          128)
        assert (m.norm_eps, m.dtype, m.qkv_bias) == (1e-5, "bfloat16", False)
    preset = load_model("llama-3-8b")
    assert patched_dims(load_model(str(d))) == patched_dims(preset)
    qwen = load_model(str(write(tmp_path, QWEN, "q")))
    assert qwen.qkv_bias and qwen.head_dim == 128  # hidden_size / heads: no head_dim field
    assert patched_dims(qwen) == patched_dims(load_model("qwen2.5-7b"))


def test_qwen3_config_and_preset(tmp_path: Path) -> None:
    # Qwen3-8B's config.json: a head_dim field; per-head q/k norms, so qkv's points carry
    # qk_norm (the dims of models without it leave it out: older tables keep their keys)
    qwen3 = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    m = load_model(str(write(tmp_path, qwen3)))
    assert m.qk_norm and not m.qkv_bias
    assert patched_dims(m) == patched_dims(load_model("qwen3-8b"))
    assert patched_dims(m)["qkv"] == [{"dim": 4096, "head_dim": 128, "interleaved": 0,
                                       "n_heads": 32, "n_kv_heads": 8, "qk_norm": 1}]
    assert "qk_norm" not in patched_dims(load_model("llama-3-8b"))["qkv"][0]


def test_gemma2_config_and_preset(tmp_path: Path) -> None:
    # Gemma-2-9B: head_dim 256 beside 16 heads of a 3584 width, a GeGLU gate (ffn's act 1),
    # o_proj and down_proj without the residual add (their outputs are normalized first)
    gemma = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
             "torch_dtype": "bfloat16"}
    m = load_model(str(write(tmp_path, gemma)))
    dims = patched_dims(m)
    assert dims == patched_dims(load_model("gemma-2-9b"))
    assert dims["ffn"] == [{"dim": 3584, "hidden": 14336, "act": 1}]
    assert dims["linear"] == [{"dim": 4096, "out": 3584, "bias": 0, "residual": 0},
                              {"dim": 14336, "out": 3584, "bias": 0, "residual": 0}]


def test_gemma3_multimodal_config_reads_its_language_model(tmp_path: Path) -> None:
    text = {"hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "model_type": "gemma3_text"}
    full = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model"}}
    m = load_model(str(write(tmp_path, full)))
    assert patched_dims(m) == patched_dims(load_model("gemma-3-12b"))
    assert patched_dims(m)["qkv"][0]["qk_norm"] == 1 and m.dtype == "bfloat16"


def test_phi3_config_and_preset(tmp_path: Path) -> None:
    # Phi-3-mini's config.json (microsoft/Phi-3-mini-4k-instruct): no head_dim field, 32 key /
    # value heads (no GQA), one qkv_proj and one gate_up_proj, whose row blocks are the points
    phi3 = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16"}
    m = load_model(str(write(tmp_path, phi3)))
    assert (m.dim, m.hidden, m.n_heads, m.n_kv_heads, m.head_dim, m.qkv_bias) == (
        3072, 8192, 32, 32, 96, False)
    assert patched_dims(m) == patched_dims(load_model("phi-3-mini"))
    assert patched_dims(m)["linear"][1] == {"dim": 8192, "out": 3072, "bias": 0, "residual": 1}


# Mixtral-8x7B's and Qwen3-30B-A3B's config.json (mistralai/Mixtral-8x7B-v0.1,
# Qwen/Qwen3-30B-A3B)
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "num_hidden_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "norm_topk_prob": True, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("config", "name"), [(MIXTRAL, "mixtral-8x7b"),
                                              (QWEN3_MOE, "qwen3-30b-a3b")])
def test_moe_config_and_preset(tmp_path: Path, config: dict[str, Any], name: str) -> None:
    from fusetune.kernels import get_spec
    from fusetune.models import launched_dims

    m = load_model(str(write(tmp_path, config)))
    preset = load_model(name)
    assert (m.experts, m.top_k, m.expert_hidden, m.dense_layers) == (
        preset.experts, preset.top_k, preset.expert_hidden, 0)
    dims = patched_dims(m)
    assert dims == patched_dims(preset)
    # the experts instead of ffn and down_proj's linear; o_proj, the norms and qkv as ever
    assert dims["moe"] == [get_spec("moe").dims_from_model(preset)]
    assert "ffn" not in dims and len(dims["linear"]) == 1
    assert dims["linear"][0]["dim"] == m.n_heads * m.head_dim
    assert dims["qkv"][0].get("qk_norm", 0) == (name == "qwen3-30b-a3b")
    assert [(k, [u for u, _ in uses]) for k, uses in launched_dims(m).items()] == [
        ("qkv", ["qkv"]), ("moe", ["experts"]), ("linear", ["o_proj"]), ("rmsnorm", ["norm"])]
    with pytest.raises(ModelError, match=r"mixture-of-experts model: fusetune.patch has no "
                                         r"training path"):
        launched_dims(m, training=True)


def test_qwen3_moe_dense_layers(tmp_path: Path) -> None:
    # Layers in mlp_only_layers, or off the decoder_sparse_step, have Qwen3's dense MLP: ffn
    # and down_proj's linear beside moe
    m = load_model(str(write(tmp_path, {**QWEN3_MOE, "num_hidden_layers": 6,
                                        "decoder_sparse_step": 2, "mlp_only_layers": [1]})))
    assert m.dense_layers == 4  # layers 0, 1, 2, 4
    dims = patched_dims(m)
    assert dims["ffn"] == [{"dim": 2048, "hidden": 6144}]
    assert dims["linear"][1] == {"dim": 6144, "out": 2048, "bias": 0, "residual": 1}
    assert dims["moe"] == [{"dim": 2048, "experts": 128, "hidden": 768, "top_k": 8}]
    dense = load_model(str(write(tmp_path, {**QWEN3_MOE, "num_experts": 0}, "dense")))
    assert dense.experts == 0 and "moe" not in patched_dims(dense)


# Qwen1.5-MoE-A2.7B's config.json (Qwen/Qwen1.5-MoE-A2.7B): every layer sparse, with a shared
# expert beside the 60 routed ones
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
             "num_experts_per_tok": 4, "num_hidden_layers": 24, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "norm_topk_prob": False, "rms_norm_eps": 1e-6,
             "torch_dtype": "bfloat16"}


def test_qwen2_moe_config_and_preset(tmp_path: Path) -> None:
    from fusetune.models import launched_dims

    m = load_model(str(write(tmp_path, QWEN2_MOE)))
    preset = load_model("qwen1.5-moe-a2.7b")
    assert (m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.qkv_bias, m.qk_norm) == (
        2048, 16, 16, 128, True, False)
    assert (m.experts, m.top_k, m.expert_hidden, m.shared_hidden, m.dense_layers) == (
        60, 4, 1408, 5632, 0)
    dims = patched_dims(m)
    assert dims == patched_dims(preset)
    assert dims["moe"] == [{"dim": 2048, "experts": 60, "hidden": 1408, "top_k": 4}]
    # the shared expert: ffn and its down_proj, whose output is gated before it is added
    assert dims["ffn"] == [{"dim": 2048, "hidden": 5632}]
    assert dims["linear"] == [{"dim": 2048, "out": 2048, "bias": 0, "residual": 1},
                              {"dim": 5632, "out": 2048, "bias": 0, "residual": 0}]
    assert [(k, [u for u, _ in uses]) for k, uses in launched_dims(m).items()] == [
        ("qkv", ["qkv"]), ("ffn", ["shared_gate_up"]), ("moe", ["experts"]),
        ("linear", ["o_proj", "shared_down_proj"]), ("rmsnorm", ["norm"])]
    # a dense layer (mlp_only_layers): its MLP's dims before the shared expert's
    dense = load_model(str(write(tmp_path, {**QWEN2_MOE, "intermediate_size": 1024,
                                            "mlp_only_layers": [3]}, "dense")))
    assert dense.dense_layers == 1
    assert patched_dims(dense)["ffn"] == [{"dim": 2048, "hidden": 1024},
                                          {"dim": 2048, "hidden": 5632}]
    assert [(k, [u for u, _ in uses]) for k, uses in launched_dims(dense).items()][1:4:2] == [
        ("ffn", ["gate_up", "shared_gate_up"]),
        ("linear", ["o_proj", "down_proj", "shared_down_proj"])]
    with pytest.raises(ModelError, match=r"shared_expert_intermediate_size=None; expected a "
                                         r"positive integer"):
        load_model(str(write(tmp_path, {k: v for k, v in QWEN2_MOE.items()
                                         if k != "shared_expert_intermediate_size"}, "bad")))


def test_patched_model_points() -> None:
    dims = patched_dims(load_model("llama-3-8b"))
    assert dims["qkv"] == [{"dim": 4096, "head_dim": 128, "interleaved": 0, "n_heads": 32,
                            "n_kv_heads": 8}]  # Hugging Face's rotate_half pairing
    assert dims["linear"] == [{"dim": 4096, "out": 4096, "bias": 0, "residual": 1},
                              {"dim": 14336, "out": 4096, "bias": 0, "residual": 1}]
    assert model_rows([1, 2, 4], [512, 4096]) == [(1, 1), (2, 1), (4, 1), (1, 512), (1, 4096)]


def test_bad_models_are_named_with_what_is_supported(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"unknown model 'llama-9'; valid: llama-2-7b.*"
                                         r"qwen2.5-7b.*or the path of a Hugging Face model"):
        load_model("llama-9")
    with pytest.raises(ModelError, match=r"no such file .*nowhere/config.json"):
        load_model(str(tmp_path / "nowhere"))
    gpt = write(tmp_path, {"model_type": "gpt2", "n_embd": 768}, "g")
    with pytest.raises(ModelError, match=r"model_type 'gpt2' is not supported; supported: "
                                         r"llama, mistral, qwen2"):
        load_model(str(gpt))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ModelError, match=r"cannot read .*broken.json.* as JSON"):
        load_model(str(broken))
    bad = write(tmp_path, {**LLAMA3, "hidden_size": "4096"}, "b")
    with pytest.raises(ModelError, match=r"hidden_size='4096'; expected a positive integer"):
        load_model(str(bad))


def test_search_all_kernels_of_a_model_plans_each(tmp_path: Path) -> None:
    d = write(tmp_path, QWEN)
    r = CliRunner().invoke(cli.main, ["search", "--model", str(d), "--kernel", "all", "--gpu",
                                      "h100", "--dry-run", "--max-batch", "4", "--prefill",
                                      "1024", "--weights", "fp8-e4m3"])
    assert r.exit_code == 0, r.output
    assert "5 kernels and dims, rows 1, 2, 4, 1024, bfloat16" in r.output
    for kernel in ("qkv", "ffn", "linear", "rmsnorm"):
        assert f"Plan for {kernel} on h100-sxm" in r.output
    assert "dim=3584,head_dim=128,interleaved=0,n_heads=28,n_kv_heads=4, weights fp8-e4m3" in \
        r.output
    assert "dim=18944,out=3584,residual=1, weights fp8-e4m3" in r.output
    assert "Points: dims dim=3584;" in r.output  # rmsnorm: no weights
    missing = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--gpu", "h100",
                                            "--dry-run"])
    assert missing.exit_code != 0 and "--kernel all tunes every kernel a model launches" in \
        missing.output
    unknown = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--model", "gpt-9",
                                            "--gpu", "h100", "--dry-run"])
    assert unknown.exit_code != 0 and "unknown model 'gpt-9'" in unknown.output


ISSUE_ROWS = [1, 4, 16, 64, 256, 1024, 4096]


def planned(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[tuple[Any, Any]]]:
    """The result of `search --kernel all --dry-run ARGS` and the (spec, point) it plans."""
    seen: list[tuple[Any, Any]] = []
    monkeypatch.setattr(cli, "_print_plan", lambda spec, space, points, target, trials:
                        seen.extend((spec, p) for p in points))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--gpu", "h100", "--dry-run",
                                      *args])
    return r, seen


@pytest.mark.parametrize("weights", [None, "fp8-e4m3"])
def test_search_all_at_rows_plans_one_point_per_row_count(monkeypatch: pytest.MonkeyPatch,
                                                          weights: str | None) -> None:
    extra = ["--weights", weights] if weights else []
    r, seen = planned(monkeypatch, "--model", "llama-3-8b", "--dtype", "bfloat16", "--rows",
                      ",".join(map(str, [*ISSUE_ROWS, 16])), *extra)  # a repeat: one point
    assert r.exit_code == 0, r.output
    assert "5 kernels and dims, rows 1, 4, 16, 64, 256, 1024, 4096, bfloat16" in r.output
    by_dims: dict[tuple[str, Any], list[Any]] = {}
    for spec, p in seen:
        by_dims.setdefault((spec.name, p.dims), []).append(p)
    assert sorted(k for k, _ in by_dims) == ["ffn", "linear", "linear", "qkv", "rmsnorm"]
    for (kernel, _), points in by_dims.items():
        assert [(p.batch, p.seq) for p in points] == [(r, 1) for r in ISSUE_ROWS]
        assert {p.dtype for p in points} == {"bfloat16"}
        assert {p.weights for p in points} == {"" if kernel == "rmsnorm" else weights or ""}


SERVER_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


@pytest.mark.parametrize(("extra", "moe_rows", "dense_rows"), [
    ([], SERVER_TOKENS, [1, 2, 4, 8, 512, 4096]),
    (["--max-batch", "2"], [1, 2, 512, 4096], [1, 2, 512, 4096]),
    (["--prefill", "1024"], [1, 2, 4, 8, 1024], [1, 2, 4, 8, 1024]),
    (["--rows", "1,64"], [1, 64], [1, 64]),
])
def test_search_all_of_a_moe_model_tunes_the_experts_at_a_servers_token_counts(
        monkeypatch: pytest.MonkeyPatch, extra: list[str], moe_rows: list[int],
        dense_rows: list[int]) -> None:
    # Decode batches up to 256 and prefills to 8192 for the experts, whose best structure
    # changes across them; the dense kernels keep the model's rows. Rows given in any way
    # are every kernel's.
    r, seen = planned(monkeypatch, "--model", "mixtral-8x7b", *extra)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())  # as printed, folded to the terminal's width
    assert ("(moe at rows 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192: its "
            "own" in said) == (not extra), said
    rows: dict[str, list[int]] = {}
    for spec, p in seen:
        rows.setdefault(spec.name, [])
        if p.batch * p.seq not in rows[spec.name]:
            rows[spec.name].append(p.batch * p.seq)
    assert rows.pop("moe") == moe_rows
    assert set(rows) == {"qkv", "linear", "rmsnorm"}
    assert all(r == dense_rows for r in rows.values()), rows


def test_search_moe_alone_tunes_a_servers_token_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(cli, "_print_plan", lambda spec, space, points, target, trials:
                        seen.extend(points))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "moe", "--model", "qwen3-30b-a3b",
                                      "--gpu", "h200", "--dtype", "bfloat16", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert [(p.batch, p.seq) for p in seen] == [(t, 1) for t in SERVER_TOKENS]
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "moe", "--model", "qwen3-30b-a3b",
                                      "--gpu", "h200", "--dtype", "bfloat16", "--batch", "3",
                                      "--dry-run"])
    assert r.exit_code == 0, r.output
    assert [(p.batch, p.seq) for p in seen[len(SERVER_TOKENS):]] == [(3, 1), (3, 512)]


def test_points_searched_at_rows_are_what_coverage_reports_exact(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_tables: None) -> None:
    # A table with an entry for every point that `search --rows` tunes (each at its default
    # config, as a search's winner could be): coverage at those rows finds each one exact.
    from fusetune import gpus

    h100 = gpus.resolve("h100")
    for weights in ([], ["--weights", "fp8-e4m3"]):
        r, seen = planned(monkeypatch, "--model", "qwen2.5-7b", "--rows", "1,4,64,4096",
                          *weights)
        assert r.exit_code == 0, r.output
        entries: dict[str, list[dict[str, Any]]] = {}
        for spec, p in seen:
            entries.setdefault(spec.name, []).append({
                "dims": p.dim, "dtype": p.dtype, "batch": p.batch, "seq": p.seq,
                "config": spec.default_config(p, h100), **({"weights": p.weights}
                                                          if p.weights else {})})
        path = tmp_path / "t.yaml"
        path.write_text(yaml.safe_dump({"schema_version": 1, "provenance": {},
                                        "gpus": {"h100": entries}}))
        cov = CliRunner().invoke(cli.main, ["coverage", "--model", "qwen2.5-7b", "--gpu", "h100",
                                            "--rows", "1,4,64,4096", "--tables", str(path),
                                            "--json", *weights])
        assert cov.exit_code == 0, cov.output
        report = json.loads(cov.output)
        assert len(report) == 5 * 4
        assert {(x["source"], x["rows"] == x["tuned_rows"]) for x in report} == {("exact", True)}


def test_trained_model_points() -> None:
    # RoPE runs on q and on k with Hugging Face's pairing; with grouped-query attention they
    # have different head counts and so different points, otherwise one.
    dims = trained_dims(load_model("llama-3-8b"))
    assert list(dims) == list(TRAINING_KERNELS)
    for kernel in ("rope", "rope_bwd"):
        assert dims[kernel] == [("q", {"head_dim": 128, "heads": 32, "interleaved": 0}),
                                ("k", {"head_dim": 128, "heads": 8, "interleaved": 0})]
    for kernel in ("rmsnorm", "rmsnorm_bwd"):
        assert dims[kernel] == [("norm", {"dim": 4096})]
    assert dims["swiglu"] == dims["swiglu_bwd"] == [("gate", {"hidden": 14336})]
    mha = trained_dims(load_model("llama-2-7b"))
    assert mha["rope"] == [("q, k", {"head_dim": 128, "heads": 32, "interleaved": 0})]


def planned_training(monkeypatch: pytest.MonkeyPatch, *args: str
                     ) -> tuple[Result, list[tuple[Any, Any]]]:
    """`search --kernel training --dry-run ARGS` and the (spec, point) it plans."""
    seen: list[tuple[Any, Any]] = []
    monkeypatch.setattr(cli, "_print_plan", lambda spec, space, points, target, trials:
                        seen.extend((spec, p) for p in points))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "training", "--gpu", "h100",
                                      "--dry-run", *args])
    return r, seen


def test_search_training_plans_the_training_paths_points(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    r, seen = planned_training(monkeypatch, "--model", "llama-3-8b")
    assert r.exit_code == 0, r.output
    assert "8 kernels and dims, rows 4096, 8192, 16384, bfloat16" in r.output
    by_dims: dict[tuple[str, Any], list[Any]] = {}
    for spec, p in seen:
        by_dims.setdefault((spec.name, p.dims), []).append(p)
    expected = {(k, tuple(sorted(d.items()))) for k, uses in
                trained_dims(load_model("llama-3-8b")).items() for _, d in uses}
    assert {(k, tuple(sorted(dict(dims).items()))) for k, dims in by_dims} == expected
    for points in by_dims.values():
        assert [(p.batch, p.seq) for p in points] == [(r, 1) for r in TRAINING_ROWS]
        assert {(p.dtype, p.weights, p.activations) for p in points} == {("bfloat16", "", "")}
    # --rows and --batch/--seq give other rows, as for --kernel all
    r, seen = planned_training(monkeypatch, "--model", "llama-3-8b", "--rows", "2048")
    assert r.exit_code == 0, r.output
    assert {(p.batch, p.seq) for _, p in seen} == {(2048, 1)}


@pytest.mark.parametrize(("args", "expected"), [
    (["--weights", "fp8-e4m3"], "leave out --weights"),
    (["--max-batch", "4"], "leave out --max-batch"),
    (["--prefill", "512"], "leave out --prefill"),
])
def test_search_training_refuses_inference_options(args: list[str], expected: str) -> None:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "training", "--model", "llama-3-8b",
                                      "--gpu", "h100", "--dry-run", *args])
    assert r.exit_code == 2, r.output
    assert "--kernel training tunes the training path" in r.output and expected in r.output
    missing = CliRunner().invoke(cli.main, ["search", "--kernel", "training", "--gpu", "h100",
                                            "--dry-run"])
    assert missing.exit_code != 0
    assert "--kernel training tunes every kernel a model launches in training" in missing.output


def test_search_training_points_file_takes_the_training_kernels_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[Any, Any]] = []
    monkeypatch.setattr(cli, "_print_plan", lambda spec, space, points, target, trials:
                        seen.extend((spec, p) for p in points))
    f = tmp_path / "points.yaml"
    f.write_text(yaml.safe_dump({"points": [
        {"kernel": "swiglu_bwd", "dims": {"hidden": 14336}, "rows": 8192, "dtype": "bfloat16"},
        {"kernel": "ffn", "dims": {"dim": 4096, "hidden": 14336}, "rows": 1,
         "dtype": "bfloat16"}]}))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "training", "--gpu", "h100",
                                      "--dry-run", "--points", str(f)])
    assert r.exit_code == 0, r.output
    assert [(spec.name, p.rows) for spec, p in seen] == [("swiglu_bwd", 8192)]
    g = tmp_path / "inference.yaml"
    g.write_text(yaml.safe_dump({"points": [
        {"kernel": "ffn", "dims": {"dim": 4096, "hidden": 14336}, "rows": 1,
         "dtype": "bfloat16"}]}))
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "training", "--gpu", "h100",
                                      "--dry-run", "--points", str(g)])
    assert r.exit_code != 0 and "no points of the training kernels" in r.output


@pytest.mark.parametrize(("args", "expected"), [
    (["--max-batch", "4"], "leave out --max-batch"),
    (["--prefill", "512"], "leave out --prefill"),
    (["--batch", "1,2", "--seq", "1"], "leave out --batch, --seq"),
])
def test_search_rows_refuses_the_other_ways_to_give_rows(args: list[str], expected: str) -> None:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "all", "--model", "llama-3-8b",
                                      "--gpu", "h100", "--dry-run", "--rows", "1,4", *args])
    assert r.exit_code == 2 and "--rows gives the row counts itself" in r.output, r.output
    assert expected in r.output


def test_search_rows_is_for_kernel_all() -> None:
    r = CliRunner().invoke(cli.main, ["search", "--kernel", "ffn", "--gpu", "h100", "--dry-run",
                                      "--rows", "1,4"])
    assert r.exit_code == 2, r.output
    assert "--rows applies to --kernel all and training; for --kernel ffn give the rows as " \
        "--batch" in r.output


# ---- `search --kernel all` on the interpreter: one worker per device serves every kernel -------

# Dims the interpreter runs in a fraction of a second, for every kernel a model launches (its
# time grows with the programs of the grid: the output columns over the block's).
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
        "torch_dtype": "float16"}
TINY_KERNELS = ["ffn", "linear", "linear", "qkv", "rmsnorm"]  # one search per kernel and dims


@pytest.fixture
def workers_started(monkeypatch: pytest.MonkeyPatch) -> list[mp.process.BaseProcess]:
    """Every worker process started from now on (the search runs the interpreter: the
    variable is set for the processes too, and restored after the test)."""
    started: list[mp.process.BaseProcess] = []

    def spy(proc: mp.process.BaseProcess) -> None:
        started.append(proc)
        start_child(proc)

    monkeypatch.setattr(worker, "start_child", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return started


def search_tiny(tmp_path: Path, *args: str) -> Result:
    return CliRunner().invoke(cli.main, [
        "search", "--kernel", "all", "--model", str(write(tmp_path, TINY)), "--backend",
        "interpreter", "--rows", "1", "--trials", "1", "--db", f"sqlite:///{tmp_path}/ft.db",
        *args])


def tuned_kernels(tmp_path: Path) -> list[str]:
    return sorted(p.kernel for p, _ in Store(f"sqlite:///{tmp_path}/ft.db").winners())


@pytest.mark.slow
def test_search_all_runs_every_kernel_in_one_worker(
        tmp_path: Path, workers_started: list[mp.process.BaseProcess]) -> None:
    r = search_tiny(tmp_path, "--isolate")
    assert r.exit_code == 0, r.output
    assert r.output.count("Winners on interpreter") == len(TINY_KERNELS)
    assert tuned_kernels(tmp_path) == TINY_KERNELS  # every config ran in a worker (--isolate)
    assert len(workers_started) == 1, workers_started  # started once, for all five
    assert not workers_started[0].is_alive()  # and stopped at the end


@pytest.mark.slow
@pytest.mark.parametrize(("error", "code"), [(KeyboardInterrupt, 130), (RuntimeError, 1)])
def test_search_all_stopped_in_a_later_kernel_stops_its_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        workers_started: list[mp.process.BaseProcess], error: type[BaseException],
        code: int) -> None:
    run = PointTuner.run
    kernels: list[str] = []

    def run_until_the_third(self: PointTuner) -> PointResult:
        kernels.append(self.spec.name)
        if len(kernels) == 3:
            raise error("stopped in the third search")
        return run(self)

    monkeypatch.setattr(PointTuner, "run", run_until_the_third)
    r = search_tiny(tmp_path, "--isolate")
    assert r.exit_code == code, r.output
    assert kernels == ["qkv", "ffn", "linear"]
    assert len(workers_started) == 1 and not workers_started[0].is_alive()


@pytest.mark.slow
def test_search_all_on_devices_starts_a_worker_per_device_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        workers_started: list[mp.process.BaseProcess]) -> None:
    # `search --devices` with the devices swapped for two CPU "devices" (as in test_devices)
    monkeypatch.setattr(cli, "choose_target", lambda *a: Target(
        "interpreter", gpus.INTERPRETER, "cpu:0", devices=("cpu:0", "cpu:1")))
    # A device finishing a point looks this often whether the other one's trial there ended
    # (the trial takes milliseconds here; at the default 0.5 s most of the test was waiting).
    monkeypatch.setattr(study, "WAIT_POLL_S", 0.02)
    r = search_tiny(tmp_path, "--devices", "0,1", "--trial-timeout", "120")
    assert r.exit_code == 0, r.output
    assert len(re.findall(r"Per device: cpu:0 .*; cpu:1 ", r.output)) == len(TINY_KERNELS)
    assert tuned_kernels(tmp_path) == TINY_KERNELS
    # at most one per device for all five (a device that only joined may have run nothing)
    assert 1 <= len(workers_started) <= 2, workers_started
    assert not any(p.is_alive() for p in workers_started)
