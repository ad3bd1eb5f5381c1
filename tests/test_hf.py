"""fusetune.patch / unpatch on tiny random transformers models (float32, CPU).

The wiring tests replace fusetune.ops by the plain torch formulas below (the ops' contract,
written independently of the kernels), so that they check only how the patched forwards call
the ops; the same checks then run with the real ops (the Triton kernels, through the
interpreter here) at a looser tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

import fusetune  # noqa: E402
from fusetune.integrations import hf  # noqa: E402
from fusetune.integrations.hf_check import SelfCheckError, layer_kinds  # noqa: E402
from fusetune.kernels import _unfused  # noqa: E402
from fusetune.kernels.fp8 import dequantize, quantize_fp8, quantize_rows  # noqa: E402

# --- the ops' contract in plain torch ----------------------------------------------------------


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if residual is None else y + residual.float()).to(x.dtype)


def _matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
            fp8_activations: bool = False) -> torch.Tensor:
    wf = w.float() if scale is None else w.float() * scale[:, None]
    xf = x.float()
    if fp8_activations:  # the rows rounded to e4m3 with a scale each, as the kernels do
        q, s = quantize_rows(xf)
        xf = q.float() * s[..., None]
    return xf @ wf.T


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotate_half RoPE on [B, S, H·head_dim], cos/sin [B or 1, S, head_dim]."""
    t = t.unflatten(-1, (-1, head_dim))
    a, b = t.chunk(2, dim=-1)
    c, s = cos.float()[:, :, None], sin.float()[:, :, None]
    return (t * c + torch.cat((-b, a), dim=-1) * s).flatten(-2)


def ref_qkv(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, bq=None, bk=None, bv=None,
            wq_scale=None, wk_scale=None, wv_scale=None, q_norm=None, k_norm=None, qk_eps=None,
            fp8_activations=False):
    n = ref_rmsnorm(x.float(), rms_weight, eps)
    q, k, v = (_matmul(n, w, s, fp8_activations) + (0 if b is None else b.float())
               for w, b, s in ((wq, bq, wq_scale), (wk, bk, wk_scale), (wv, bv, wv_scale)))
    if q_norm is not None:  # Qwen3: each head normalized before RoPE
        q = ref_rmsnorm(q.unflatten(-1, (-1, head_dim)), q_norm, qk_eps).flatten(-2)
        k = ref_rmsnorm(k.unflatten(-1, (-1, head_dim)), k_norm, qk_eps).flatten(-2)
    return (_rope(q, cos, sin, head_dim).to(x.dtype), _rope(k, cos, sin, head_dim).to(x.dtype),
            v.to(x.dtype))


def ref_ffn(x, rms_weight, w_gate, w_up, eps, gate_scale=None, up_scale=None,
            activation="silu", fp8_activations=False):
    n = ref_rmsnorm(x.float(), rms_weight, eps)
    if activation == "gelu_tanh":
        return (torch.nn.functional.gelu(_matmul(n, w_gate, gate_scale, fp8_activations),
                                         approximate="tanh")
                * _matmul(n, w_up, up_scale, fp8_activations)).to(x.dtype)
    return (torch.nn.functional.silu(_matmul(n, w_gate, gate_scale, fp8_activations))
            * _matmul(n, w_up, up_scale, fp8_activations)).to(x.dtype)


def ref_linear(x, weight, bias=None, residual=None, weight_scale=None, fp8_activations=False):
    y = _matmul(x, weight, weight_scale, fp8_activations)
    for t in (bias, residual):
        if t is not None:
            y = y + t.float()
    return y.to(x.dtype)


def ref_moe(x, gate_up, down, topk_ids, topk_weights, gate_up_scale=None, down_scale=None):
    """Each token's top-k experts, each an SwiGLU MLP, weighted and summed in float32 (FP8
    experts dequantized with their scales)."""
    xf = x.float().reshape(-1, x.shape[-1])
    gate_up, down = dequantize(gate_up, gate_up_scale), dequantize(down, down_scale)
    g, u = torch.einsum("td,tkhd->tkh", xf, gate_up[topk_ids]).chunk(2, dim=-1)
    y = torch.einsum("tkh,tkdh->tkd", torch.nn.functional.silu(g) * u, down[topk_ids])
    return (y * topk_weights.float()[..., None]).sum(1).to(x.dtype).view(x.shape)


REFERENCES = {"rmsnorm": ref_rmsnorm, "qkv": ref_qkv, "ffn": ref_ffn, "linear": ref_linear,
              "moe": ref_moe}


@pytest.fixture
def ref_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """fusetune.ops' functions replaced by the references; yields how often each was called."""
    calls = dict.fromkeys(REFERENCES, 0)

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    module = importlib.import_module("fusetune.ops")
    for name, fn in REFERENCES.items():
        monkeypatch.setattr(module, name, counted(name, fn), raising=False)
    yield calls


# --- tiny models -------------------------------------------------------------------------------

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
             bos_token_id=1, eos_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
               "rope_theta": 500000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "rope_theta": 10000.0}
LONG_ROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "rope_theta": 10000.0,
             "original_max_position_embeddings": 8}
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, head_dim=16),
    "llama3-rope": lambda: transformers.LlamaConfig(**SMALL, head_dim=16,
                                                    rope_parameters=LLAMA3_ROPE),
    # a window shorter than prompt + new tokens, so that the sliding mask matters
    "mistral": lambda: transformers.MistralConfig(**SMALL, head_dim=16, sliding_window=6),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),  # q/k/v with bias
    # YaRN scales cos and sin (attention_scaling != 1), which the fused qkv takes as they are
    "qwen2-yarn": lambda: transformers.Qwen2Config(**SMALL, rope_parameters=YARN_ROPE),
    # per-head q and k norms before RoPE; sliding windows on some layers (as Qwen2's)
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    # (1 + w) norms in float32, post-norms before the residual adds, GeGLU, soft-capped
    # attention logits, sliding and global layers, query_pre_attn_scalar
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=6,
                                                query_pre_attn_scalar=12,
                                                attn_logit_softcapping=5.0,
                                                final_logit_softcapping=30.0),
    # + q/k norms ((1 + w) too), a rotary embedding per layer type: linear-scaled on the
    # global layer, plain on the sliding one
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}}),
    "qwen3-window": lambda: transformers.Qwen3Config(**SMALL, head_dim=16,
                                                     use_sliding_window=True, sliding_window=6,
                                                     max_window_layers=1),
    # one qkv_proj and one gate_up_proj, taken as views; a sliding window as Mistral's
    "phi3": lambda: transformers.Phi3Config(**SMALL, sliding_window=6),
    # LongRoPE: per-frequency factors and attention scaling, past the original context
    "phi3-longrope": lambda: transformers.Phi3Config(**SMALL, rope_parameters=LONG_ROPE,
                                                     original_max_position_embeddings=8),
    # mixture of experts: the model's router (softmax, top 2, renormalized), 4 experts
    "mixtral": lambda: transformers.MixtralConfig(**{**SMALL, "intermediate_size": 32},
                                                  head_dim=16, num_local_experts=4,
                                                  num_experts_per_tok=2),
    # Qwen3's attention; 8 experts, top 2 renormalized; layer 1 a dense MLP (mlp_only_layers)
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=8,
                                                     num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     norm_topk_prob=True, mlp_only_layers=[1]),
    # the top-2 softmax weights as they are (norm_topk_prob False, Qwen3-30B-A3B's config)
    "qwen3-moe-unnormed": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False),
    # Qwen2's attention (q/k/v biases); 4 experts, top 2 as the softmax gives them (the
    # config's norm_topk_prob default); a shared expert of another width, sigmoid-gated
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**SMALL, num_experts=4,
                                                     num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48),
    # top 2 renormalized; layer 1 a dense MLP (mlp_only_layers)
    "qwen2-moe-dense": lambda: transformers.Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]),
}
MOE = ("mixtral", "qwen2-moe", "qwen2-moe-dense", "qwen3-moe", "qwen3-moe-unnormed")


def tiny(kind: str, **overrides) -> transformers.PreTrainedModel:
    """A float32 model of `kind` with random weights everywhere: norm weights around 1 and
    biases non-zero (transformers initialises them to 1 and 0, which would hide wiring bugs)."""
    config = CONFIGS[kind]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts, of 7 and 4 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    return out[mask.bool()]  # the padding positions' logits mean nothing


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         **kw)
    return out[:, ids.shape[1]:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def snapshot(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Callable]]:
    """The state dict (copied) and the forward function of every module."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, {n: m.forward.__func__ for n, m in model.named_modules()}


def assert_restored(model: torch.nn.Module, before: tuple[dict, dict]) -> None:
    state, forwards = before
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], v) and now[k].dtype == v.dtype for k, v in state.items())
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, name
        assert module.forward.__func__ is forwards[name] is type(module).forward, name


# --- (a) the wiring, with the reference ops ----------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_wiring_matches_the_model(kind: str, ref_ops: dict[str, int]) -> None:
    model = tiny(kind)
    ids, mask = prompts()
    before = snapshot(model)
    want_logits, want_tokens = logits(model, ids, mask), greedy(model, ids, mask)

    assert fusetune.patch(model) is model
    ref_ops.update(dict.fromkeys(ref_ops, 0))  # the patch's self-check calls them too
    got = logits(model, ids, mask)
    n_layers = model.config.num_hidden_layers
    sparse = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    mlp_only = len(getattr(model.config, "mlp_only_layers", None) or [])
    assert sparse == (n_layers - mlp_only if kind in MOE else 0)
    dense = n_layers - sparse
    # Qwen2-MoE: each sparse layer's shared expert runs ffn and linear as a dense MLP does
    shared = sparse if kind.startswith("qwen2-moe") else 0
    # + Gemma's post-norms; a sparse layer's norm before its router is an rmsnorm of its own
    norms = 1 + (2 * n_layers if kind.startswith("gemma") else 0) + sparse
    assert ref_ops == {"qkv": n_layers, "ffn": dense + shared,
                       "linear": n_layers + dense + shared, "rmsnorm": norms, "moe": sparse}
    assert rel_err(got, want_logits) <= 1e-5
    assert torch.equal(greedy(model, ids, mask), want_tokens)
    # gate and up: the halves of one matrix (the unfused ffn's one GEMM), q, k, v (and their
    # biases) the rows of one, no copy kept
    mlps = [getattr(layer.mlp, "shared_expert", layer.mlp) for layer in model.model.layers
            if not hasattr(layer.mlp, "experts") or hasattr(layer.mlp, "shared_expert")]
    assert len(mlps) == dense + shared
    assert kind.startswith("phi3") or all(
        _unfused.stacked(m.gate_proj.weight, m.up_proj.weight) is not None for m in mlps)
    attns = [layer.self_attn for layer in model.model.layers]
    fused = kind.startswith("phi3")  # qkv_proj, gate_up_proj: one matrix each already
    for a in [] if fused else attns:
        lins = (a.q_proj, a.k_proj, a.v_proj)
        assert _unfused.stacked(*(lin.weight for lin in lins)) is not None
        if a.q_proj.bias is not None:
            assert _unfused.stacked(*(lin.bias for lin in lins)) is not None

    assert fusetune.unpatch(model) is model
    assert_restored(model, before)
    if not fused:
        assert all(m.gate_proj.weight.untyped_storage().data_ptr()
                   != m.up_proj.weight.untyped_storage().data_ptr() for m in mlps)
        assert all(a.q_proj.weight.untyped_storage().data_ptr()
                   != a.k_proj.weight.untyped_storage().data_ptr() for a in attns)
    assert torch.equal(logits(model, ids, mask), want_logits)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                  "phi3", "mixtral", "qwen2-moe", "qwen2-moe-dense",
                                  "qwen3-moe"])
def test_static_cache_generate(kind: str, ref_ops: dict[str, int]) -> None:
    model = tiny(kind)
    ids, mask = prompts()
    want = greedy(model, ids, mask)
    fusetune.patch(model)
    assert torch.equal(greedy(model, ids, mask, cache_implementation="static"), want)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                  "phi3", "mixtral", "qwen2-moe", "qwen2-moe-dense",
                                  "qwen3-moe"])
def test_cached_decode_step_matches_a_full_forward(kind: str, ref_ops: dict[str, int]) -> None:
    """The next token's logits from the KV cache of the prompt equal those of one forward over
    the prompt and that token: the cache is filled and read (a forward that misses the cache's
    keyword attends to the new token alone)."""
    model = fusetune.patch(tiny(kind))
    ids, mask = prompts()
    step = torch.tensor([[5], [9]])
    full_ids, full_mask = torch.cat([ids, step], 1), torch.cat([mask, torch.ones_like(step)], 1)
    position = (full_mask.cumsum(-1) - 1).clamp_min(0)  # left padding, as generate() counts
    with torch.no_grad():
        full = model(input_ids=full_ids, attention_mask=full_mask, position_ids=position).logits
        first = model(input_ids=ids, attention_mask=mask, position_ids=position[:, :-1],
                      use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        cached = model(input_ids=step, attention_mask=full_mask, position_ids=position[:, -1:],
                       past_key_values=cache, use_cache=True).logits
    assert rel_err(cached[:, -1], full[:, -1]) <= 1e-4


def compiled_greedy(model: torch.nn.Module, ids: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """greedy() through generate(cache_implementation="static"), which compiles the forward
    where the device allows it; forced here on the CPU, with fullgraph=True so that any graph
    break fails."""
    config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    got = greedy(model, ids, mask, cache_implementation="static", compile_config=config)
    assert "_compiled_call" in model.__dict__  # the compiled path did run
    return got


@pytest.mark.slow
def test_compiled_static_cache_generate(ref_ops: dict[str, int]) -> None:
    model = tiny("llama3-rope")
    ids, mask = prompts()
    want = greedy(model, ids, mask)
    fusetune.patch(model)
    assert torch.equal(compiled_greedy(model, ids, mask), want)


@pytest.mark.slow
def test_compiled_static_cache_generate_moe() -> None:
    """compiled_greedy with the real ops, on a mixture-of-experts model (a sparse and a dense
    layer): the router and the custom op fusetune::moe in one graph."""
    model = tiny("qwen3-moe")
    ids, mask = prompts()
    want = greedy(model, ids, mask)
    fusetune.patch(model)
    assert torch.equal(compiled_greedy(model, ids, mask), want)


def test_output_attentions_still_reported(ref_ops: dict[str, int]) -> None:
    model = tiny("llama", _attn_implementation="eager")
    ids, mask = prompts()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        fusetune.patch(model)
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == model.config.num_hidden_layers
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= 1e-5


@pytest.mark.parametrize(("kind", "fmt"), [("qwen2", "e4m3"), ("qwen2", "e5m2"),
                                           ("qwen3", "e4m3"), ("gemma2", "e4m3"),
                                           ("phi3", "e4m3")])
def test_fp8_weights(kind: str, fmt: str, ref_ops: dict[str, int],
                     capsys: pytest.CaptureFixture) -> None:
    """FP8 projections match the model whose weights are the dequantized FP8 values (Phi-3's
    fused projections quantized whole: per-channel scales are per row of q, k, v alike)."""
    model = tiny(kind)
    dequantized = copy.deepcopy(model)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            if name.rsplit(".", 1)[-1] in projections:
                wq, scale = quantize_fp8(module.weight, fmt)
                module.weight.copy_(wq.float() * scale[:, None])
    ids, mask = prompts()
    fusetune.patch(model, weights=f"fp8-{fmt}")

    line = capsys.readouterr().out
    count = 8 if kind == "phi3" else 14
    assert f"{count} projection weights as fp8-{fmt}" in line and "MiB ->" in line
    q_proj = model.model.layers[0].self_attn.get_submodule("qkv_proj" if kind == "phi3"
                                                           else "q_proj")
    assert q_proj.weight.dtype == getattr(torch, {"e4m3": "float8_e4m3fn",
                                                  "e5m2": "float8_e5m2"}[fmt])
    assert q_proj.weight_scale.shape == (q_proj.out_features,)
    assert "weight" not in dict(q_proj.named_parameters())  # the 16-bit parameter is gone
    for layer in [] if kind == "phi3" else model.model.layers:  # FP8 weights, scales and
        # biases stacked as 16-bit ones
        lins = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")]
        for attr in ("weight", "weight_scale", "bias"):
            if getattr(lins[0], attr) is not None:
                assert _unfused.stacked(*(getattr(lin, attr) for lin in lins)) is not None
        lins = [layer.mlp.gate_proj, layer.mlp.up_proj]
        for attr in ("weight", "weight_scale"):
            assert _unfused.stacked(*(getattr(lin, attr) for lin in lins)) is not None
    assert rel_err(logits(model, ids, mask), logits(dequantized, ids, mask)) <= 1e-5
    with pytest.raises(RuntimeError, match="cannot be restored exactly; load the model again"):
        fusetune.unpatch(model)


def test_fp8_activations_only_when_asked(ref_ops: dict[str, int]) -> None:
    """FP8 weights are weight-only unless patch is asked for FP8 activations: then every
    projection's input is rounded to e4m3 per row (the reference ops do it as the kernels do),
    and the logits stay within a few percent of the weight-only model's."""
    weight_only = fusetune.patch(tiny("llama"), weights="fp8-e4m3")
    act = fusetune.patch(tiny("llama"), weights="fp8-e4m3", activations="fp8")
    ids, mask = prompts()
    a, b = logits(weight_only, ids, mask), logits(act, ids, mask)
    assert 0 < rel_err(b, a) <= 0.1
    with pytest.raises(ValueError, match=r"activations='fp8' needs FP8 weights"):
        fusetune.patch(tiny("llama"), activations="fp8")
    with pytest.raises(ValueError, match=r"activations='int8'; valid: None"):
        fusetune.patch(tiny("llama"), weights="fp8-e4m3", activations="int8")


def test_moe_router_outputs_are_the_models(ref_ops: dict[str, int]) -> None:
    """The patched sparse layers call the model's own router module: the router logits that
    output_router_logits returns, and the load-balancing loss made from them, are the model's."""
    model = tiny("qwen3-moe-unnormed")
    ids, mask = prompts()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        fusetune.patch(model)
        got = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        assert rel_err(g, w) <= 1e-5
    assert rel_err(got.aux_loss, want.aux_loss) <= 1e-5


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "qwen2-moe-dense", "qwen3-moe"])
def test_moe_fp8_weights(kind: str, ref_ops: dict[str, int],
                         capsys: pytest.CaptureFixture) -> None:
    """FP8 experts (a scale per expert and output channel) and projections match the model
    whose weights are the dequantized FP8 values; the dense layers and Qwen2-MoE's shared
    experts quantized as Llama's MLP; the routers and the shared experts' gates stay 16-bit; FP8
    activations are refused for the experts' weight-only kernel."""
    model = tiny(kind)
    dequantized = copy.deepcopy(model)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in dequantized.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in projections and isinstance(module, torch.nn.Linear):
                wq, scale = quantize_fp8(module.weight, "e4m3")
                module.weight.copy_(dequantize(wq, scale))
            elif leaf == "experts":
                for attr in ("gate_up_proj", "down_proj"):
                    w = getattr(module, attr)
                    w.copy_(dequantize(*quantize_fp8(w, "e4m3")))
    ids, mask = prompts()
    router = [layer.mlp.gate.weight.clone() for layer in model.model.layers
              if hasattr(layer.mlp, "experts")]
    fusetune.patch(model, weights="fp8-e4m3")
    sparse = [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    dense = model.config.num_hidden_layers - len(sparse)
    assert dense == (1 if kind in ("qwen3-moe", "qwen2-moe-dense") else 0)  # mlp_only_layers
    shared = len(sparse) if kind.startswith("qwen2-moe") else 0
    # 4 attention projections a layer, 3 of each dense MLP and shared expert, 2 of the experts
    count = 6 * len(sparse) + 7 * dense + 3 * shared
    assert f"{count} projection weights as fp8-e4m3" in capsys.readouterr().out
    for layer, weight in zip(sparse, router, strict=True):
        experts = layer.mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert experts.down_proj_scale.shape == experts.down_proj.shape[:2]
        assert torch.equal(layer.mlp.gate.weight, weight)  # the router as it was
        if shared:
            lins = [getattr(layer.mlp.shared_expert, n)
                    for n in ("gate_proj", "up_proj", "down_proj")]
            assert all(lin.weight.dtype == torch.float8_e4m3fn for lin in lins)
            assert _unfused.stacked(lins[0].weight, lins[1].weight) is not None
            assert layer.mlp.shared_expert_gate.weight.dtype == torch.float32
    assert rel_err(logits(model, ids, mask), logits(dequantized, ids, mask)) <= 1e-5
    assert ref_ops["moe"] > 0
    with pytest.raises(ValueError, match=r"activations='fp8'; the experts .* weight-only, so "
                                         r".* take activations=None"):
        fusetune.patch(tiny(kind), weights="fp8-e4m3", activations="fp8")


@pytest.mark.parametrize(("kind", "layer"), [("mixtral", r"MixtralDecoderLayer \(mixtral"),
                                             ("qwen2-moe", r"Qwen2MoeDecoderLayer \(qwen2_moe")])
def test_moe_gradients_refused(kind: str, layer: str, ref_ops: dict[str, int]) -> None:
    # fusetune.moe has no backward kernel: a sparse layer refuses gradients with a message
    # (and runs under no_grad as ever).
    model = fusetune.patch(tiny(kind))
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match=layer + r"\) has no backward pass \(its experts "
                                           r"\(fusetune.moe\) have no backward kernel\)"):
        model(input_ids=ids, attention_mask=mask, labels=ids)
    logits(model, ids, mask)


def test_moe_shared_expert_gate_matters(ref_ops: dict[str, int]) -> None:
    """Qwen2-MoE's shared expert counts by sigmoid(shared_expert_gate(h)): another gate weight
    changes the patched logits as it changes the model's own."""
    ids, mask = prompts()
    model = tiny("qwen2-moe")
    before = logits(model, ids, mask)
    fusetune.patch(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert_gate.weight.mul_(-3.0).add_(0.5)
    got = logits(model, ids, mask)
    fusetune.unpatch(model)
    want = logits(model, ids, mask)
    assert rel_err(want, before) > 1e-2
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize(("change", "message"), [
    (lambda mlp: setattr(mlp, "shared_expert_gate", torch.nn.Linear(64, 1)),
     r"layer 0: mlp.shared_expert_gate is a Linear \(weight \(1, 64\), bias True\); expected an "
     r"nn.Linear 64 -> 1 without bias"),
    (lambda mlp: setattr(mlp.shared_expert, "up_proj", torch.nn.Linear(64, 40, bias=False)),
     r"layer 0: mlp.shared_expert: up_proj is 40×64 Linear, expected an nn.Linear 48×64 "
     r"\(shared_expert_intermediate_size 48\)"),
    (lambda mlp: setattr(mlp.shared_expert, "down_proj", torch.nn.Linear(48, 64)),
     r"layer 0: shared_expert.down_proj with bias"),
    (lambda mlp: delattr(mlp, "shared_expert"),
     r"layer 0: mlp.shared_expert is a NoneType, expected the shared expert's MLP"),
])
def test_moe_unsupported_shared_expert(change: Callable, message: str,
                                       ref_ops: dict[str, int]) -> None:
    model = tiny("qwen2-moe")
    change(model.model.layers[0].mlp)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        fusetune.patch(model)
    assert_untouched(model, before)
    mixtral = tiny("mixtral")  # a block the family's layer does not run
    mixtral.model.layers[1].mlp.shared_expert = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"layer 1: the block has a shared expert; mixtral "
                                         r"blocks have none"):
        fusetune.patch(mixtral)


def test_moe_unsupported_experts(ref_ops: dict[str, int]) -> None:
    model = tiny("mixtral")
    model.model.layers[1].mlp.experts._is_expert_parallel = True  # ids past the local experts
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"layer 1: experts with _is_expert_parallel=True; "
                                         r"fusetune.moe takes .*_is_expert_parallel=False"):
        fusetune.patch(model)
    assert_untouched(model, before)


# --- (b) the real ops --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_real_ops_match_the_model(kind: str) -> None:
    model = tiny(kind)
    ids, mask = prompts()
    want_logits, want_tokens = logits(model, ids, mask), greedy(model, ids, mask)
    fusetune.patch(model)
    assert rel_err(logits(model, ids, mask), want_logits) <= 1e-4
    assert torch.equal(greedy(model, ids, mask), want_tokens)
    if kind in ("llama", "mistral", "qwen2", *MOE):
        assert torch.equal(greedy(model, ids, mask, cache_implementation="static"), want_tokens)
    fusetune.unpatch(model)
    assert torch.equal(logits(model, ids, mask), want_logits)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_real_ops_fp8_weights(kind: str) -> None:
    model = tiny(kind)
    ids, mask = prompts()
    want = logits(model, ids, mask)
    fusetune.patch(model, weights="fp8-e4m3")
    # e4m3 keeps 3 mantissa bits: a few percent, measured against the 16-bit model
    assert rel_err(logits(model, ids, mask), want) <= 0.1


# --- (c) what patch refuses --------------------------------------------------------------------


def assert_untouched(model: torch.nn.Module, before: tuple[dict, dict]) -> None:
    assert_restored(model, before)
    assert "_fusetune_patch" not in getattr(model, "model", model).__dict__


def test_unsupported_model_type(ref_ops: dict[str, int]) -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\) is not "
                                         r"supported; supported: llama .*mistral.*qwen2"):
        fusetune.patch(model)
    assert_untouched(model, before)


@pytest.mark.parametrize(("kind", "overrides", "message"), [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"attention_bias": True}, "q_proj has a bias"),
    ("llama", {"mlp_bias": True}, "gate_proj, up_proj, down_proj with bias"),
    ("mistral", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                     "rope_theta": 10000.0}},
     "rope type 'linear' is not one mistral models use; supported: default"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75}},
     "the rotary embedding covers 12 of head_dim 16"),
])
def test_unsupported_layer(kind: str, overrides: dict, message: str,
                           ref_ops: dict[str, int]) -> None:
    config = CONFIGS[kind]()
    for k, v in overrides.items():
        setattr(config, k, v)
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        fusetune.patch(model)
    assert_untouched(model, before)


def test_unsupported_dtype_and_device(ref_ops: dict[str, int],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("llama").double()
    with pytest.raises(ValueError, match=r"weights in float64; .*float16, bfloat16, float32"):
        fusetune.patch(model)
    model = tiny("llama")
    monkeypatch.delenv("TRITON_INTERPRET")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"is on cpu; .*TRITON_INTERPRET=1"):
        fusetune.patch(model)
    assert_untouched(model, before)


def test_bad_weights_value(ref_ops: dict[str, int]) -> None:
    model = tiny("llama")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"weights='fp8'; valid: None .*'fp8-e4m3', 'fp8-e5m2'"):
        fusetune.patch(model, weights="fp8")
    assert_untouched(model, before)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "phi3-dropout"])
def test_training_gradients_match_the_model(kind: str, ref_ops: dict[str, int]) -> None:
    """With gradients recorded the patched layers run ops with backward passes (the real
    kernels through the interpreter; never the fused inference ops) and every parameter's
    gradient is the unpatched model's; Phi-3's residual dropouts drop the same elements (they
    draw from the generator in the model's order)."""
    ids, mask = prompts()
    grads = []
    for patched in (False, True):
        model = (tiny("phi3", resid_pdrop=0.25) if kind == "phi3-dropout" else tiny(kind))
        model.train()
        model.config.attention_dropout = 0.0
        if patched:
            fusetune.patch(model)
            ref_ops.update(dict.fromkeys(ref_ops, 0))  # the self-check ran the fused ops
        torch.manual_seed(7)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert sum(ref_ops.values()) == 0
    want, got = grads
    assert want.keys() == got.keys()
    for name, g in want.items():
        assert got[name] is not None, name
        assert rel_err(got[name], g) <= 1e-4, name


def test_gemma_gradients_refused(ref_ops: dict[str, int]) -> None:
    # No backward kernel for the GeGLU gate: a patched Gemma refuses gradients with a message
    # (and runs under no_grad as ever).
    model = fusetune.patch(tiny("gemma2"))
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match=r"\(gemma2\) has no backward pass"):
        model(input_ids=ids, attention_mask=mask, labels=ids)
    logits(model, ids, mask)


def test_fp8_gradients_refused(ref_ops: dict[str, int]) -> None:
    model = fusetune.patch(tiny("llama"), weights="fp8-e4m3")
    ids, mask = prompts()
    embeds = model.get_input_embeddings()(ids).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"holds FP8 weights, which have no backward pass"):
        model(inputs_embeds=embeds, attention_mask=mask)
    with torch.inference_mode():
        model(inputs_embeds=embeds.detach(), attention_mask=mask)


def test_unpatch_unpatched_and_double_patch(ref_ops: dict[str, int]) -> None:
    model = tiny("mistral")
    with pytest.raises(ValueError, match=r"was not patched by fusetune.patch"):
        fusetune.unpatch(model)
    fusetune.patch(model)
    with pytest.raises(ValueError, match=r"patched already \(weights=None\); fusetune.unpatch"):
        fusetune.patch(model)
    with pytest.raises(ValueError, match="patched already"):
        fusetune.patch(model.model)  # the same layers, reached through the base model
    fusetune.unpatch(model)
    with pytest.raises(ValueError, match="was not patched"):
        fusetune.unpatch(model)


def test_failed_quantization_says_the_model_is_lost(ref_ops: dict[str, int]) -> None:
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"layer 1's mlp.up_proj .*non-finite.*12 of 14 "
                                           r"projections were converted already.*load it again"):
        fusetune.patch(model, weights="fp8-e5m2")


def test_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ImportError, match=r"pip install 'fusetune\[hf\]'"):
        fusetune.patch(torch.nn.Linear(2, 2))


# --- (d) the patch checks itself -----------------------------------------------------------------


def test_self_check_refuses_a_wrong_op(ref_ops: dict[str, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A patched forward that computes something else (here: linear's residual dropped) makes
    patch raise, naming what differed and the transformers version; the model stays as it was."""
    ops = importlib.import_module("fusetune.ops")
    right = ops.linear
    monkeypatch.setattr(ops, "linear", lambda x, w, residual=None, **kw: right(x, w, **kw))
    model = tiny("llama")
    before = snapshot(model)
    with pytest.raises(SelfCheckError, match=rf"transformers {transformers.__version__}, llama"
                                             r"\): layer 0 \(LlamaDecoderLayer\), 5 prompt "
                                             r"tokens: the patched output differs by .*left "
                                             r"unpatched"):
        fusetune.patch(model)
    assert_untouched(model, before)
    with pytest.raises(SelfCheckError):
        fusetune.patch(model, weights="fp8-e4m3")  # checked before the weights are replaced
    assert_untouched(model, before)
    assert fusetune.patch(model, verify=False) is model  # the caller's choice


def test_self_check_refuses_a_forward_that_misses_the_cache(
        ref_ops: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that never sees the KV cache (what a renamed keyword does) passes the prompt
    and fails the decode step."""
    monkeypatch.setattr(hf, "_take_cache", lambda past_key_values, kwargs: None)
    model = tiny("qwen2")
    before = snapshot(model)
    with pytest.raises(SelfCheckError, match=r"layer 0 \(Qwen2DecoderLayer\), a cached decode "
                                             r"step after 5 tokens: the patched (output differs|"
                                             r"forward raised)"):
        fusetune.patch(model)
    assert_untouched(model, before)


def test_self_check_covers_each_layer_kind(ref_ops: dict[str, int]) -> None:
    model = tiny("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=4,
                 max_window_layers=2,
                 layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    assert layer_kinds(model.model) == [0, 2]
    assert layer_kinds(tiny("llama").model) == [0]
    assert layer_kinds(tiny("qwen3-moe").model) == [0, 1]  # sparse, then dense
    assert layer_kinds(tiny("mixtral").model) == [0]
    assert layer_kinds(tiny("qwen2-moe-dense").model) == [0, 1]


@pytest.mark.parametrize(("kind", "name"), [("qwen3-moe", r"qwen3_moe\): layer 0 \(Qwen3Moe"),
                                           ("qwen2-moe", r"qwen2_moe\): layer 0 \(Qwen2Moe")])
def test_self_check_covers_the_experts(kind: str, name: str, ref_ops: dict[str, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts that ignore the router's weights fail the check of a sparse layer."""
    ops = importlib.import_module("fusetune.ops")
    right = ops.moe
    monkeypatch.setattr(ops, "moe", lambda x, gate_up, down, ids, weights, **scales: right(
        x, gate_up, down, ids, torch.ones_like(weights), **scales))
    model = tiny(kind)
    before = snapshot(model)
    with pytest.raises(SelfCheckError, match=name + r"DecoderLayer\), 5 prompt tokens: the "
                                                    r"patched output differs by"):
        fusetune.patch(model)
    assert_untouched(model, before)


def test_self_check_covers_the_shared_expert(ref_ops: dict[str, int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared expert whose gate is left out (ffn's output halved: about what sigmoid does to
    it) fails the check of a Qwen2-MoE sparse layer; the routed experts are as they should be."""
    ops = importlib.import_module("fusetune.ops")
    right = ops.ffn
    monkeypatch.setattr(ops, "ffn", lambda *args, **kw: 0.5 * right(*args, **kw))
    model = tiny("qwen2-moe")
    before = snapshot(model)
    with pytest.raises(SelfCheckError, match=r"qwen2_moe\): layer 0 \(Qwen2MoeDecoderLayer\), 5 "
                                             r"prompt tokens: the patched output differs by"):
        fusetune.patch(model)
    assert_untouched(model, before)


@pytest.mark.slow
def test_self_check_of_a_sparse_layer_takes_the_models_routing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16, a token whose 2nd and 3rd experts score within rounding of each other may be
    routed one way by the patched layer and the other by the model's own, both correct: the
    check runs what follows the router on the model's routing. This model (weights of seed 8)
    has such a token at the decode step: without the replay its check fails."""
    from fusetune.integrations import hf_check

    def bf16_model() -> torch.nn.Module:
        model = tiny("qwen3-moe-unnormed")
        torch.manual_seed(8)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                        else 0.15 * torch.randn_like(p))
        return model.to(torch.bfloat16)

    fusetune.patch(bf16_model())
    monkeypatch.setattr(hf_check._Routing, "replaying", lambda self: contextlib.nullcontext())
    with pytest.raises(SelfCheckError, match=r"a cached decode step .* differs by"):
        fusetune.patch(bf16_model())


def test_untested_transformers_warns(ref_ops: dict[str, int],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "_version", lambda: "5.99.0")
    with pytest.warns(fusetune.FusetuneWarning,
                      match=rf"transformers 5.99.0 is outside the tested range "
                            rf"transformers{hf.TESTED_TRANSFORMERS}"):
        fusetune.patch(tiny("llama"))


def test_the_hf_extra_and_ci_test_the_declared_range() -> None:
    """pyproject's hf extra declares the range patch was tested with, the test extra pins its
    oldest release, and the README's test command runs these tests again with the newest."""
    from packaging.specifiers import SpecifierSet

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    tested = SpecifierSet(hf.TESTED_TRANSFORMERS)
    assert extras["hf"] == [f"transformers{hf.TESTED_TRANSFORMERS}"]
    oldest = next(s.version for s in tested if s.operator == ">=")
    upper = next(s.version for s in tested if s.operator == "<")
    assert f"transformers=={oldest}.0" in extras["test"]
    readme = (root / "README.md").read_text()
    assert '--no-deps "transformers>=' in readme and f',<{upper}"' in readme
    assert "python -m pytest -q -n auto -m hf" in readme
    assert transformers.__version__ in tested
