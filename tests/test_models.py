"""Models by preset or Hugging Face config.json, and the points a patched model launches
(`fusetune search --model M --kernel all`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusetune import cli
from fusetune.models import ModelError, load_model, model_rows, patched_dims

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
