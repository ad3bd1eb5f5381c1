"""Models: the dimensions that decide each kernel's shapes, by preset name (`--model
llama-3-8b`) or read from a Hugging Face config.json (`--model path/to/model`), and the points a
patched model launches (`launched_dims`: what `fusetune search --model M --kernel all` and
`--kernel training` tune and `fusetune coverage` reports)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    name: str
    dim: int  # hidden size (the RMSNorm / LayerNorm width)
    hidden: int  # feed-forward width
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2's q/k/v projections have a bias
    qk_norm: bool = False  # Qwen3's RMSNorm of each q and k head before RoPE
    mlp_act: str = "silu"  # the MLP gate's activation (fusetune.kernels.ffn.ACTIVATIONS)
    post_norms: bool = False  # Gemma: o_proj's and down_proj's outputs normalized, then added
    experts: int = 0  # mixture of experts: the experts of a layer (0: a dense MLP)
    top_k: int = 0  # the experts each token is routed to
    expert_hidden: int = 0  # an expert's feed-forward width
    dense_layers: int = 0  # of a mixture-of-experts model: the layers with a dense MLP (`hidden`)
    shared_hidden: int = 0  # Qwen2-MoE: the shared expert's feed-forward width (0: none)
    dtype: str = "bfloat16"  # the dtype the model ships in


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-2-7b", dim=4096, hidden=11008, n_heads=32, n_kv_heads=32, head_dim=128,
                    norm_eps=1e-5, dtype="float16"),
        ModelPreset("llama-2-13b", dim=5120, hidden=13824, n_heads=40, n_kv_heads=40, head_dim=128,
                    norm_eps=1e-5, dtype="float16"),
        ModelPreset("llama-2-70b", dim=8192, hidden=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                    norm_eps=1e-5, dtype="float16"),
        ModelPreset("llama-3-8b", dim=4096, hidden=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                    norm_eps=1e-5),
        ModelPreset("llama-3-70b", dim=8192, hidden=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                    norm_eps=1e-5),
        ModelPreset("mistral-7b", dim=4096, hidden=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                    norm_eps=1e-5),
        ModelPreset("qwen2.5-7b", dim=3584, hidden=18944, n_heads=28, n_kv_heads=4, head_dim=128,
                    qkv_bias=True),
        ModelPreset("gemma-2-9b", dim=3584, hidden=14336, n_heads=16, n_kv_heads=8,
                    head_dim=256, mlp_act="gelu_tanh", post_norms=True),
        ModelPreset("gemma-3-12b", dim=3840, hidden=15360, n_heads=16, n_kv_heads=8,
                    head_dim=256, mlp_act="gelu_tanh", post_norms=True, qk_norm=True),
        ModelPreset("qwen3-8b", dim=4096, hidden=12288, n_heads=32, n_kv_heads=8, head_dim=128,
                    qk_norm=True),
        ModelPreset("phi-3-mini", dim=3072, hidden=8192, n_heads=32, n_kv_heads=32, head_dim=96,
                    norm_eps=1e-5),
        ModelPreset("mixtral-8x7b", dim=4096, hidden=14336, n_heads=32, n_kv_heads=8,
                    head_dim=128, norm_eps=1e-5, experts=8, top_k=2, expert_hidden=14336),
        ModelPreset("qwen3-30b-a3b", dim=2048, hidden=6144, n_heads=32, n_kv_heads=4,
                    head_dim=128, qk_norm=True, experts=128, top_k=8, expert_hidden=768),
        ModelPreset("qwen1.5-moe-a2.7b", dim=2048, hidden=5632, n_heads=16, n_kv_heads=16,
                    head_dim=128, qkv_bias=True, experts=60, top_k=4, expert_hidden=1408,
                    shared_hidden=5632),
        ModelPreset("gpt2", dim=768, hidden=3072, n_heads=12, n_kv_heads=12, head_dim=64,
                    dtype="float32"),
        # Small enough for Triton's CPU interpreter (the default grid without a GPU).
        ModelPreset("tiny", dim=256, hidden=688, n_heads=4, n_kv_heads=2, head_dim=64,
                    dtype="float16"),
    )
}
# Model types whose config.json fusetune reads: the families fusetune.patch runs.
CONFIG_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                "qwen2_moe", "qwen3_moe")
GEMMA = ("gemma2", "gemma3_text")


class ModelError(ValueError):
    """A model name or config that cannot be used; the message says why and what can."""


def preset(name: str) -> ModelPreset:
    """The preset called `name` (case-insensitive); ValueError listing the valid names."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ModelError(f"unknown model {name!r}; valid: {', '.join(PRESETS)}, or the path of "
                         "a Hugging Face model directory or its config.json")
    return PRESETS[key]


def load_model(name_or_path: str) -> ModelPreset:
    """A preset by name, or the dims of the Hugging Face model whose directory or config.json
    `name_or_path` is (read locally: nothing is downloaded, no weights are read)."""
    path = Path(name_or_path)
    if name_or_path.strip().lower() in PRESETS or not (path.exists() or path.suffix == ".json"
                                                       or "/" in name_or_path):
        return preset(name_or_path)
    config_file = path if path.suffix == ".json" and not path.is_dir() else path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"model {name_or_path!r}: no such file {str(config_file)!r} (a "
                         f"Hugging Face model directory with a config.json, the config.json "
                         f"itself, or a preset: {', '.join(PRESETS)})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"model {name_or_path!r}: cannot read {str(config_file)!r} as JSON: "
                         f"{e}") from None
    if not isinstance(config, Mapping):
        raise ModelError(f"model {name_or_path!r}: {str(config_file)!r} is not a JSON object")
    return from_hf_config(config, str(config_file))


def from_hf_config(config: Mapping[str, Any], source: str) -> ModelPreset:
    """The dims of a Hugging Face config (a config.json's contents) of a supported family."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), Mapping):
        # Gemma 3's multimodal checkpoints: fusetune.patch runs the language model
        config = {"torch_dtype": config.get("torch_dtype"), **config["text_config"],
                  "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in CONFIG_TYPES:
        raise ModelError(f"{source}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(CONFIG_TYPES)}")

    def field(name: str) -> int:
        v = config.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelError(f"{source}: {name}={v!r}; expected a positive integer")
        return v

    dim, n_heads = field("hidden_size"), field("num_attention_heads")
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or dim // n_heads
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ModelError(f"{source}: rms_norm_eps={eps!r}; expected a positive number")
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ModelError(f"{source}: torch_dtype {dtype!r}; expected float16, bfloat16 or "
                         "float32")
    experts = top_k = expert_hidden = dense_layers = shared_hidden = 0
    if model_type == "mixtral":  # every layer sparse; intermediate_size is an expert's
        experts, top_k = field("num_local_experts"), field("num_experts_per_tok")
        expert_hidden = field("intermediate_size")
    elif model_type in ("qwen2_moe", "qwen3_moe") and config.get("num_experts"):
        experts, top_k = field("num_experts"), field("num_experts_per_tok")
        expert_hidden = field("moe_intermediate_size")
        if model_type == "qwen2_moe":
            shared_hidden = field("shared_expert_intermediate_size")
        # a layer's MLP as Qwen2MoeDecoderLayer and Qwen3MoeDecoderLayer choose it
        step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or []
        dense_layers = sum(i in dense or (i + 1) % step != 0
                           for i in range(field("num_hidden_layers")))
    return ModelPreset(
        name=str(config.get("_name_or_path") or Path(source).parent.name or model_type),
        dim=dim, hidden=field("intermediate_size"), n_heads=n_heads, n_kv_heads=int(n_kv),
        head_dim=int(head_dim), norm_eps=float(eps),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe"
                                           and config.get("qkv_bias", True) is not False),
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        post_norms=model_type in GEMMA, mlp_act="gelu_tanh" if model_type in GEMMA else "silu",
        experts=experts, top_k=top_k, expert_hidden=expert_hidden, dense_layers=dense_layers,
        shared_hidden=shared_hidden, dtype=dtype)


# The kernels a patched model launches (fusetune.patch), and their dims in it.
PATCH_KERNELS = ("qkv", "ffn", "moe", "linear", "rmsnorm")


def patched_dims(model: ModelPreset) -> dict[str, list[dict[str, int]]]:
    """Each kernel's dims in a model run by fusetune.patch: q/k/v with Hugging Face's
    rotate_half pairing (interleaved 0), the feed-forward, the two output projections with the
    residual add (o_proj: heads·head_dim -> dim; down_proj: hidden -> dim), and the norms
    (the final one, and the first pass of qkv and ffn where a config has one). Gemma's
    projections add no residual (their outputs are normalized first).

    A mixture-of-experts model's sparse layers run `moe` (the router's chosen experts, down_proj
    included; the residual added after it) where a dense MLP runs ffn and down_proj's linear:
    those only where it has dense layers too. Their norm before the router is the rmsnorm of
    the same dims as the final one. Qwen2-MoE's shared expert runs ffn (hidden: its width) and
    its down_proj's linear without the residual (its output is gated, then added)."""
    residual = 0 if model.post_norms else 1
    dense = not model.experts or model.dense_layers > 0
    dims = {
        "qkv": [{"dim": model.dim, "head_dim": model.head_dim, "interleaved": 0,
                 "n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads,
                 **({"qk_norm": 1} if model.qk_norm else {})}],
        "ffn": [{"dim": model.dim, "hidden": model.hidden,
                 **({"act": 1} if model.mlp_act == "gelu_tanh" else {})}],
        "moe": [{"dim": model.dim, "experts": model.experts, "hidden": model.expert_hidden,
                 "top_k": model.top_k}],
        "linear": [{"dim": model.n_heads * model.head_dim, "out": model.dim, "bias": 0,
                    "residual": residual},
                   {"dim": model.hidden, "out": model.dim, "bias": 0, "residual": residual}],
        # Gemma: the attention's and the MLP's outputs normalized before their residual adds
        "rmsnorm": [{"dim": model.dim}, *([{"dim": model.dim, "residual": 1}]
                                          if model.post_norms else [])],
    }
    if not model.experts:
        del dims["moe"]
    if not dense:
        del dims["ffn"]
        dims["linear"] = dims["linear"][:1]  # o_proj
    if model.experts and model.shared_hidden:
        dims.setdefault("ffn", []).append({"dim": model.dim, "hidden": model.shared_hidden})
        dims["linear"].append({"dim": model.shared_hidden, "out": model.dim, "bias": 0,
                               "residual": 0})
    return dims


# The kernels a patched model launches in training mode (gradients recorded; the projections
# stay cuBLAS matmuls), and the token rows of a training step tuned by default (micro-batch ×
# sequence length; what `search --kernel training` and `coverage --training` take without
# --rows).
TRAINING_KERNELS = ("rmsnorm", "rmsnorm_bwd", "rope", "rope_bwd", "swiglu", "swiglu_bwd")
TRAINING_ROWS = (4096, 8192, 16384)


def trained_dims(model: ModelPreset) -> dict[str, list[tuple[str, dict[str, int]]]]:
    """(use, dims) of each kernel a model launches in fusetune.patch's training path: the norms
    and their backward, RoPE on q and on k (Hugging Face's rotate_half pairing, interleaved 0;
    one dims where the model has as many key/value heads as query heads) and its backward, the
    SwiGLU gate silu(gate)·up and its backward. ModelError for a mixture-of-experts model:
    its sparse layers have no training path (fusetune.moe has no backward kernel)."""
    if model.experts:
        raise ModelError(f"{model.name} is a mixture-of-experts model: fusetune.patch has no "
                         "training path for its experts (fusetune.moe has no backward kernel); "
                         "the training kernels are tuned for dense models")
    norm = [("norm", {"dim": model.dim})]
    if model.n_kv_heads == model.n_heads:
        rope = [("q, k", {"head_dim": model.head_dim, "heads": model.n_heads, "interleaved": 0})]
    else:
        rope = [(use, {"head_dim": model.head_dim, "heads": heads, "interleaved": 0})
                for use, heads in (("q", model.n_heads), ("k", model.n_kv_heads))]
    glu = [("gate", {"hidden": model.hidden})]
    return {"rmsnorm": norm, "rmsnorm_bwd": norm, "rope": rope, "rope_bwd": rope,
            "swiglu": glu, "swiglu_bwd": glu}


# What each inference kernel's dims stand for in a decoder layer (linear: two projections, o_proj
# alone in a mixture-of-experts model without dense layers; a shared expert's after those).
PATCH_USES = {"qkv": ("qkv",), "ffn": ("gate_up",), "moe": ("experts",),
              "linear": ("o_proj", "down_proj"), "rmsnorm": ("norm",)}
SHARED_USES = {"ffn": "shared_gate_up", "linear": "shared_down_proj"}


def launched_dims(model: ModelPreset, training: bool = False
                  ) -> dict[str, list[tuple[str, dict[str, int]]]]:
    """(use, dims) of each kernel fusetune.patch launches in `model`, kernel by kernel in the
    order of PATCH_KERNELS (its inference path: patched_dims, each dims named by PATCH_USES)
    or, with `training`, of TRAINING_KERNELS (its training path: trained_dims). What `search
    --kernel all|training` tunes and `coverage [--training]` reports."""
    if training:
        return trained_dims(model)
    dims = patched_dims(model)
    uses = {**PATCH_USES, "rmsnorm": ("norm", "post_norm")}
    if model.experts and model.shared_hidden:  # the shared expert's dims come last
        dense = 1 if model.dense_layers else 0
        uses = {**uses, "ffn": (*uses["ffn"][:dense], SHARED_USES["ffn"]),
                "linear": (*uses["linear"][:1 + dense], SHARED_USES["linear"])}
    return {k: list(zip(uses[k][:len(dims[k])], dims[k], strict=True))
            for k in PATCH_KERNELS if k in dims}


def model_rows(decode_batches: Sequence[int], prefill_tokens: Sequence[int]
               ) -> list[tuple[int, int]]:
    """(batch, seq) of the points: decode steps (seq 1) at each batch size, and prefills of
    each token count (batch 1; the kernels see batch·seq rows either way)."""
    rows = [(b, 1) for b in decode_batches] + [(1, s) for s in prefill_tokens]
    return list(dict.fromkeys(rows))
