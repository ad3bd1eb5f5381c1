"""`patch` / `unpatch`: fusetune's fused ops inside a Hugging Face transformers causal LM.

    model = fusetune.patch(model)                       # in place; returns the model
    model = fusetune.patch(model, weights="fp8-e4m3")   # projections stored in FP8, once
    model = fusetune.patch(model, weights="fp8-e4m3", activations="fp8")  # FP8 products too
    fusetune.unpatch(model)                             # the model's own forwards again

What is swapped, per family (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3, Mixtral,
Qwen2-MoE, Qwen3-MoE): the `forward` of module *instances* (never of the classes, so other
models of the same family in the process stay as they are), bound with `types.MethodType`; no
module and no parameter is replaced (unless weights are FP8):

- each attention module: input_layernorm + q/k/v (+ the Qwen2 biases; Qwen3's per-head q_norm
  and k_norm; Phi-3's one qkv_proj as views of its row blocks) + RoPE -> `ops.qkv`, with
  the cos/sin the model's rotary embedding computed (so every rope_scaling type comes out as the
  model computes it); then the model's own KV cache update and attention function, chosen as the
  module chooses it; o_proj + the residual add that follows it -> `ops.linear`. It therefore
  takes the layer's input (before the norm) and returns that input plus the attention block's
  output, with the attention weights beside it as before (so `output_attentions` still works
  through the model's hooks on the attention modules);
- each decoder layer: the attention module as above, then post_attention_layernorm + gate/up
  (Phi-3's gate_up_proj as views of its halves) + SiLU·mul -> `ops.ffn`, down_proj + the
  residual add -> `ops.linear` (Phi-3's residual dropouts, where they drop, before the add);
  a mixture-of-experts layer's post_attention_layernorm -> `ops.rmsnorm`, the block's own
  router module (the model's softmax, top-k and normalization: its ids and weights as they
  are), the experts -> `ops.moe`, then the residual add (FP8 experts weight-only; no training
  path: fusetune.moe has no backward); Qwen2-MoE's shared expert -> `ops.ffn` (on the layer's
  input, the norm folded in) and `ops.linear`, times the sigmoid of its gate (the model's
  shared_expert_gate, a torch matmul), added to the experts' output; the MoE families' dense
  layers as Llama's;
- the final norm -> `ops.rmsnorm`.

With gradients recorded, each patched layer runs its training path instead: fusetune.rmsnorm,
the projections as torch matmuls, fusetune.rope and fusetune.swiglu, all with backward passes.

`unpatch` deletes those instance attributes, so that each module's class `forward` is found
again: same modules, same parameters, same forward functions. A model whose projections were
quantized to FP8 cannot get its 16-bit weights back; `unpatch` refuses it.

transformers moves: its layers take the KV cache as `cache` from 5.24 and as `past_key_values`
before (CacheApi), and each release the patched forwards follow is one of TESTED_TRANSFORMERS;
before `patch` returns, the patched layers check themselves against the model's own forwards on
the installed release (hf_check.self_check).

The ops are looked up in `fusetune.ops` at every call (`from fusetune import ops`), so that a
substitute module or function can stand in for them.
"""

from __future__ import annotations

import importlib
import inspect
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# the training path's ops: the public functions, which torch.compile traces as custom ops
from fusetune.api import rmsnorm, rope, swiglu
from fusetune.integrations.hf_check import self_check
from fusetune.spec import DTYPES, WEIGHT_FORMATS

_STATE = "_fusetune_patch"  # attribute of the patched base model (LlamaModel, ...)
# the transformers releases whose model forwards the patched ones were checked against; the
# `hf` extra of pyproject.toml allows the same range
TESTED_TRANSFORMERS = ">=5.17,<5.25"
ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
GELU_TANH = ("gelu_pytorch_tanh",)  # Gemma's GeGLU gate: ACT2FN's gelu, tanh form
_PLUS_ONE = "_fusetune_plus_one"  # a Gemma norm's (1 + weight) in float32, kept on the norm


@dataclass(frozen=True)
class Family:
    """What differs between the supported model families, for the replacement forwards.

    `sliding_window`: what the family's attention passes to the attention function as
    `sliding_window` (read from the attention module at each call, as the model does); None
    where the family passes nothing.
    """

    name: str  # transformers' module name: transformers.models.<name>.modeling_<name>
    prefix: str  # class name prefix: <prefix>ForCausalLM, <prefix>Model, <prefix>DecoderLayer
    qkv_bias: bool
    rope_types: tuple[str, ...]
    sliding_window: Callable[[nn.Module], int | None] | None = None
    # Phi-3: one qkv_proj (q, k, v rows in that order) and one gate_up_proj (gate rows first),
    # whose row blocks the fused ops take as views; dropout on each block's output before its
    # residual add (resid_attn_dropout, resid_mlp_dropout on the decoder layer)
    fused: bool = False
    # Qwen3: an RMSNorm of each q head and each k head (q_norm, k_norm) before RoPE
    qk_norm: bool = False
    # Gemma 2: norms that apply (1 + weight) in float32 (eps as `eps`); the attention's and the
    # MLP's outputs normalized again (post_attention_layernorm, post_feedforward_layernorm)
    # before their residual adds, the MLP's input by pre_feedforward_layernorm; the GeGLU gate
    # (hidden_activation); the attention's logit soft-capping passed on as the model does
    gemma: bool = False
    base: str = "Model"  # the base model's class: <prefix><base> (Gemma 3's text model)
    # Mixtral, Qwen2-MoE, Qwen3-MoE: a mixture-of-experts MLP (<prefix>SparseMoeBlock: the
    # router `gate`, the `experts` with 3-D gate_up_proj and down_proj) on the layers that have
    # one; the others (Qwen2/3-MoE's mlp_only_layers) a dense MLP as Llama's
    moe: bool = False
    # Qwen2-MoE: the block adds a shared expert (`shared_expert`: an MLP as the dense ones, on
    # every token) times sigmoid(shared_expert_gate(h)) (`shared_expert_gate`: dim -> 1)
    shared_expert: bool = False

    @property
    def attn_projections(self) -> tuple[str, ...]:
        """The attention's input projections, in the order of their rows in q, k, v."""
        return ("qkv_proj",) if self.fused else ("q_proj", "k_proj", "v_proj")

    @property
    def mlp_projections(self) -> tuple[str, ...]:
        return ("gate_up_proj",) if self.fused else ("gate_proj", "up_proj")

    def sparse(self, layer: nn.Module) -> bool:
        """Whether `layer`'s MLP is the family's mixture-of-experts block."""
        return self.moe and isinstance(layer.mlp, self.cls("SparseMoeBlock"))

    def gated_mlp(self, layer: nn.Module) -> str | None:
        """The path under `layer` of its gated MLP with gate/up/down nn.Linear projections: the
        dense MLP, a sparse layer's shared expert, or None (a sparse layer without one)."""
        if not self.sparse(layer):
            return "mlp"
        return "mlp.shared_expert" if self.shared_expert else None

    def projections(self, layer: nn.Module) -> tuple[tuple[str, str], ...]:
        """(parent, name) of every projection of `layer` as nn.Linear modules (parent: the path
        of their module under the layer): what FP8 weights quantize. A sparse layer's experts
        are not among them; its shared expert is."""
        mlp = self.gated_mlp(layer)
        return (*(("self_attn", n) for n in self.attn_projections), ("self_attn", "o_proj"),
                *(() if mlp is None else
                  (*((mlp, n) for n in self.mlp_projections), (mlp, "down_proj"))))

    def modeling(self) -> types.ModuleType:
        return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")

    def cls(self, suffix: str) -> type:
        return getattr(self.modeling(), f"{self.prefix}{suffix}")

    @property
    def classes(self) -> str:
        return f"{self.prefix}ForCausalLM, {self.prefix}{self.base}"


FAMILIES: tuple[Family, ...] = (
    # Llama 2 (and its linear / dynamic scaled fine-tunes), Llama 3, 3.1/3.2 (rope type llama3)
    Family("llama", "Llama", qkv_bias=False, rope_types=("default", "linear", "dynamic", "llama3")),
    Family("mistral", "Mistral", qkv_bias=False, rope_types=("default",),
           sliding_window=lambda attn: getattr(attn.config, "sliding_window", None)),
    # Qwen2.5's long-context configs add YaRN scaling
    Family("qwen2", "Qwen2", qkv_bias=True, rope_types=("default", "yarn"),
           sliding_window=lambda attn: attn.sliding_window),
    Family("gemma2", "Gemma2", qkv_bias=False, rope_types=("default",),
           sliding_window=lambda attn: attn.sliding_window, gemma=True),
    # Gemma 3 (text): Gemma 2's layer with Qwen3's q/k norms, (1 + w) like its other norms, and
    # a rotary embedding per layer type (linear scaling on the global layers)
    Family("gemma3", "Gemma3", qkv_bias=False, rope_types=("default", "linear"),
           sliding_window=lambda attn: attn.sliding_window, qk_norm=True, gemma=True,
           base="TextModel"),
    Family("qwen3", "Qwen3", qkv_bias=False, rope_types=("default", "yarn"),
           sliding_window=lambda attn: attn.sliding_window, qk_norm=True),
    # Phi-3 and 3.5 mini / medium; the 128K-context configs scale by LongRoPE
    Family("phi3", "Phi3", qkv_bias=False, rope_types=("default", "longrope"),
           sliding_window=lambda attn: getattr(attn.config, "sliding_window", None), fused=True),
    # Mixtral 8x7B, 8x22B: Mistral's attention, 8 experts, top 2
    Family("mixtral", "Mixtral", qkv_bias=False, rope_types=("default",),
           sliding_window=lambda attn: getattr(attn.config, "sliding_window", None), moe=True),
    # Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: Qwen2's attention (which passes no sliding window to
    # the attention function), 60 or 64 experts, top 4 or 8, a shared expert
    Family("qwen2_moe", "Qwen2Moe", qkv_bias=True, rope_types=("default", "yarn"), moe=True,
           shared_expert=True),
    # Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, 128 experts, top 8
    Family("qwen3_moe", "Qwen3Moe", qkv_bias=False, rope_types=("default", "yarn"),
           sliding_window=lambda attn: attn.sliding_window, qk_norm=True, moe=True),
)


@dataclass(frozen=True)
class CacheApi:
    """How the installed transformers hands the KV cache to a layer and its attention module:
    the keyword (`past_key_values` up to 5.23; `cache` from 5.24, where the old name still works
    through a deprecation shim on the model's own forwards, which the patched ones replace), and
    whether the attention passes its keyword arguments on to `Cache.update` (from 5.24)."""

    name: str
    update_kwargs: bool

    @classmethod
    def of(cls, family: Family) -> CacheApi:
        params = inspect.signature(family.cls("Attention").forward).parameters
        if "cache" in params:
            return cls("cache", update_kwargs=True)
        if "past_key_values" in params:
            return cls("past_key_values", update_kwargs=False)
        raise ValueError(
            f"fusetune.patch ({family.name}): {family.prefix}Attention.forward takes the KV cache "
            f"by neither `cache` nor `past_key_values` (transformers {_version()}); tested: "
            f"transformers{TESTED_TRANSFORMERS}")


def _take_cache(past_key_values: Any, kwargs: dict[str, Any]) -> Any:
    """The KV cache, given under either keyword (CacheApi); removes `cache` from kwargs."""
    cache = kwargs.pop("cache", None)
    if cache is None:
        return past_key_values
    if past_key_values is not None and past_key_values is not cache:
        raise TypeError("fusetune: a patched forward got two KV caches, as `cache` and as "
                        "`past_key_values`; pass one")
    return cache


@dataclass
class PatchState:
    """What `patch` did to one model, kept on its base model for `unpatch`."""

    family: str
    weights: str  # "" (the model's own weights) or an FP8 format
    activations: str = ""  # "" (the model's dtype) or "fp8"
    forwards: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (module, bound fwd)
    stacked: bool = False  # each layer's q/k/v and gate/up weights are views of one matrix


def patch(model: nn.Module, *, weights: str | None = None, activations: str | None = None,
          verify: bool = True) -> nn.Module:
    """Runs the transformers causal LM `model` (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3,
    Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE families; also their base models, e.g. LlamaModel) through
    fusetune's fused ops, in place; returns `model`.

    weights: None keeps the model's weights; "fp8-e4m3" or "fp8-e5m2" quantizes every
    projection (q, k, v, o, gate, up, down) once, with one float32 scale per output channel
    (`fusetune.quantize_fp8`), frees the 16-bit copies and prints the memory before and after.
    The experts of Mixtral, Qwen2-MoE and Qwen3-MoE are quantized per expert and output channel
    too; Qwen2-MoE's shared expert as a dense MLP (its gate and the routers stay 16-bit).

    activations: None keeps the activations in the model's dtype: FP8 weights are then
    weight-only, and every projection matches the dequantized weights within the 16-bit
    tolerance. "fp8" (with FP8 weights, on GPUs with FP8 tensor cores) rounds each
    projection's input to e4m3 per row as well: faster products at prefill, a few percent of
    error per projection. Only the caller chooses it; no table or tuned config can. The
    mixture-of-experts families take None only (the experts' kernel is weight-only; ValueError).

    Everything is checked before anything changes: an unsupported model raises ValueError and is
    left as it was.

    verify: before returning, the patched forwards check themselves against the model's own
    (`fusetune.integrations.hf_check.self_check`: one layer of each kind on a few tokens, then
    one cached decode step, and the final norm); a difference beyond the dtype's tolerance
    raises SelfCheckError (a RuntimeError) naming what differed and the transformers version,
    and leaves the model unpatched. With FP8 weights the check runs before the weights are
    quantized (the same forwards on the 16-bit weights). It costs a few small launches (and
    compiling their kernels once). `verify=False` skips it. A transformers release outside
    TESTED_TRANSFORMERS gives a FusetuneWarning first.

    Training: where autograd records a layer (gradients enabled and a parameter or input that
    requires grad), it runs ops that have backward passes instead of the fused inference
    kernels: fusetune.rmsnorm, the projections as torch matmuls (cuBLAS), fusetune.rope and
    fusetune.swiglu, so that `loss.backward()` gives the unpatched model's gradients. Under
    torch.no_grad() or torch.inference_mode() (generate() runs there) the fused kernels run. A
    model patched with FP8 weights, Gemma's GeGLU and the experts of a mixture-of-experts layer
    have no backward pass: they raise RuntimeError there.
    """
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"fusetune.patch: weights={weights!r}; valid: None (the model's own "
                         f"weights), {', '.join(repr(w) for w in WEIGHT_FORMATS)}")
    if activations not in (None, "fp8"):
        raise ValueError(f"fusetune.patch: activations={activations!r}; valid: None (the "
                         "model's dtype), 'fp8' (with FP8 weights)")
    if activations and not weights:
        raise ValueError("fusetune.patch: activations='fp8' needs FP8 weights: pass "
                         f"weights={WEIGHT_FORMATS[0]!r} (or {WEIGHT_FORMATS[1]!r}) too")
    family, base = _recognise(model, "fusetune.patch")
    if getattr(base, _STATE, None) is not None:
        state: PatchState = getattr(base, _STATE)
        raise ValueError(f"fusetune.patch: this {type(model).__name__} is patched already "
                         f"(weights={state.weights or None!r}); fusetune.unpatch(model) first")
    if activations and family.moe:
        raise ValueError(f"fusetune.patch ({family.name}): activations={activations!r}; the "
                         f"experts of a mixture-of-experts layer (fusetune.moe) take FP8 weights "
                         f"weight-only, so {family.name} models take activations=None")
    _check(family, base)
    from fusetune import ops  # fails here, not in the first forward, if missing

    if activations:
        from fusetune.kernels import fp8 as fp8_kernels

        fp8_kernels.check_fp8_activations("fusetune.patch", weights or "",
                                          next(base.parameters()).device)
    if next(base.parameters()).device.type == "cuda":
        ops.lower_as_fallbacks()  # for generate(cache_implementation="static"), which compiles
    _warn_if_untested()
    api = CacheApi.of(family)
    state = PatchState(family.name, weights or "", activations or "")
    if verify:
        # FP8 weights replace the 16-bit ones for good: the forwards are checked on the 16-bit
        # weights first (the same forwards, with scales added), so that a failed check can
        # leave the model as it was
        _bind_all(state, base, family, api, fp8=False, act=False)
        try:
            self_check(base, [fwd for _, fwd in state.forwards], family.name, api.name)
        finally:
            _unbind_all(state)
    if weights:
        _quantize(base, family, weights.removeprefix("fp8-"))
    state.stacked = _stack_projections(base, family)
    _bind_all(state, base, family, api, fp8=bool(weights), act=bool(activations))
    setattr(base, _STATE, state)
    _drop_compiled(model)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undoes `patch(model)`: every module gets its class's forward back. Returns `model`.

    ValueError if `model` was not patched; RuntimeError if it was patched with FP8 weights
    (their 16-bit values are gone: load the model again instead).
    """
    _, base = _recognise(model, "fusetune.unpatch")
    state: PatchState | None = getattr(base, _STATE, None)
    if state is None:
        raise ValueError(f"fusetune.unpatch: this {type(model).__name__} was not patched by "
                         "fusetune.patch; there is nothing to restore")
    if state.weights:
        raise RuntimeError(
            f"fusetune.unpatch: this {type(model).__name__} was patched with "
            f"weights={state.weights!r}: its projections hold FP8 values and the 16-bit weights "
            "were freed, so they cannot be restored exactly; load the model again instead")
    changed = [type(m).__name__ for m, fwd in state.forwards
               if m.__dict__.get("forward") is not fwd]
    if changed:
        raise RuntimeError(f"fusetune.unpatch: the forward of {', '.join(sorted(set(changed)))} "
                           "was replaced again after fusetune.patch; remove that replacement "
                           "first (unpatch would drop it)")
    _unbind_all(state)
    if state.stacked:
        _unstack_projections(base, _family_named(state.family))
    delattr(base, _STATE)
    _drop_compiled(model)
    return model


# --- recognising and checking a model ------------------------------------------------------------


def _version() -> str:
    import transformers

    return transformers.__version__


def _warn_if_untested() -> None:
    from packaging.specifiers import SpecifierSet

    from fusetune.tables import FusetuneWarning

    version = _version()
    if not SpecifierSet(TESTED_TRANSFORMERS).contains(version, prereleases=True):
        warnings.warn(
            f"fusetune.patch: transformers {version} is outside the tested range "
            f"transformers{TESTED_TRANSFORMERS}; patch's self-check (verify=True) compares "
            "the patched layers with the model's own before it returns, but the other paths "
            "(training, the static cache) were not tested with this release", FusetuneWarning,
            stacklevel=3)


def _family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def _recognise(model: nn.Module, who: str) -> tuple[Family, nn.Module]:
    """The model's family and its base model (the module holding `layers` and `norm`)."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{who} needs transformers: pip install 'fusetune[hf]'") from e
    for family in FAMILIES:
        if isinstance(model, family.cls("ForCausalLM")):
            return family, model.model
        if isinstance(model, family.cls(family.base)):
            return family, model
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    raise ValueError(
        f"{who}: {type(model).__name__} (model_type {model_type!r}) is not supported; "
        "supported: " + "; ".join(f"{f.name} ({f.classes})" for f in FAMILIES))


def _check(family: Family, base: nn.Module) -> None:
    """Every assumption the replacement forwards make, checked against the model itself; a
    ValueError naming what differs. Changes nothing."""
    config = base.config
    where = f"fusetune.patch ({family.name})"
    _gate_activation(family, config, where)
    rotary = base.rotary_emb
    rope_type = getattr(rotary, "rope_type", None)
    # (Gemma 3: one rotary embedding per layer type, local and global)
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
        if kind not in family.rope_types:
            raise ValueError(f"{where}: rope type {kind!r} is not one {family.name} models use; "
                             f"supported: {', '.join(family.rope_types)}")
    layer_cls = family.cls("DecoderLayer")
    layers = list(base.layers)
    if not layers:
        raise ValueError(f"{where}: the model has no decoder layers")
    for i, layer in enumerate(layers):
        at = f"{where}: layer {i}"
        if not isinstance(layer, layer_cls):
            raise ValueError(f"{at} is a {type(layer).__name__}, expected {layer_cls.__name__}")
        _check_layer(family, layer, at, rotary)
    _check_norm(base.norm, f"{where}: the final norm")
    modules = [base.norm, *layers, *(layer.self_attn for layer in layers)]
    owned = [type(m).__name__ for m in modules if "forward" in m.__dict__]
    if owned:
        raise ValueError(f"{where}: {', '.join(sorted(set(owned)))} already has its own forward "
                         "on the instance (hooks of another library, or another patch); "
                         "fusetune.patch would replace it")
    _check_tensors(where, base, [(f"layer {i}", layer) for i, layer in enumerate(layers)])


def _check_layer(family: Family, layer: nn.Module, at: str, rotary: nn.Module) -> None:
    config = layer.self_attn.config
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{at}: head_dim={head_dim!r}; RoPE needs a positive even head_dim")
    rows = {"q_proj": n_heads * head_dim, "k_proj": n_kv * head_dim, "v_proj": n_kv * head_dim,
            "qkv_proj": (n_heads + 2 * n_kv) * head_dim}
    for name in family.attn_projections:
        lin, out = getattr(attn, name), rows[name]
        if lin.out_features != out or lin.in_features != config.hidden_size:
            raise ValueError(f"{at}: {name} is {lin.out_features}×{lin.in_features}, expected "
                             f"{out}×{config.hidden_size} (heads {n_heads}/{n_kv}, head_dim "
                             f"{head_dim}, hidden_size {config.hidden_size})")
    sparse = family.sparse(layer)
    if sparse:
        _check_experts(family, mlp, at, config.hidden_size)
    else:
        _check_mlp(family, mlp, at, config.hidden_size, config.intermediate_size,
                   "intermediate_size")
    inv_freq = getattr(rotary, f"{getattr(attn, 'layer_type', None)}_inv_freq", None)
    rotary_dim = 2 * (rotary.inv_freq if inv_freq is None else inv_freq).numel()
    if rotary_dim != head_dim:
        raise ValueError(f"{at}: the rotary embedding covers {rotary_dim} of head_dim {head_dim}; "
                         "the fused qkv rotates the whole head (partial_rotary_factor 1)")
    for name in family.attn_projections:
        if (getattr(attn, name).bias is not None) != family.qkv_bias:
            has = "has" if family.qkv_bias is False else "lacks"
            raise ValueError(f"{at}: {name} {has} a bias; {family.name} q/k/v projections are "
                             f"{'with' if family.qkv_bias else 'without'} bias "
                             "(attention_bias is not supported)")
    biased = [n if p in ("self_attn", "mlp") else f"{p.removeprefix('mlp.')}.{n}"
              for p, n in family.projections(layer) if n not in family.attn_projections
              and layer.get_submodule(p).get_submodule(n).bias is not None]
    if biased:
        raise ValueError(f"{at}: {', '.join(biased)} with bias (attention_bias / mlp_bias); "
                         "supported: o_proj and the MLP projections without bias")
    if family.qk_norm:
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name, None)
            w = getattr(norm, "weight", None)
            if not isinstance(w, torch.Tensor) or w.shape != (head_dim,):
                raise ValueError(f"{at}: {name} must be an RMSNorm of head_dim {head_dim} "
                                 f"(weight {None if w is None else tuple(w.shape)})")
            _check_norm(norm, f"{at}: {name}")
        if _eps(attn.q_norm) != _eps(attn.k_norm):
            raise ValueError(f"{at}: q_norm's eps {_eps(attn.q_norm)} and k_norm's "
                             f"{_eps(attn.k_norm)} differ; the fused qkv takes one")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in norms:
        _check_norm(getattr(layer, name), f"{at}: {name}")


def _check_mlp(family: Family, mlp: nn.Module, at: str, dim: int, hidden: int,
               what: str) -> None:
    """A gated MLP's projections (a dense layer's MLP, Qwen2-MoE's shared expert `at`) of
    `hidden` columns (the config's `what`) as nn.Linear modules of the family's names."""
    for name in (*family.mlp_projections, "down_proj"):
        lin = getattr(mlp, name, None)
        out = 2 * hidden if name == "gate_up_proj" else hidden
        want = (dim, hidden) if name == "down_proj" else (out, dim)
        got = (getattr(lin, "out_features", None), getattr(lin, "in_features", None))
        if not isinstance(lin, nn.Linear) or got != want:
            raise ValueError(f"{at}: {name} is {'×'.join(map(str, got))} "
                             f"{type(lin).__name__}, expected an nn.Linear "
                             f"{want[0]}×{want[1]} ({what} {hidden})")


# The experts' layout fusetune.moe takes, as transformers' experts decorator
# (integrations/moe.py: use_experts_implementation) records it on the module: gated, no bias,
# [experts, 2·hidden, dim] with each expert's gate rows before its up rows, no norm after each
# expert, every expert in this process (no expert-parallel sentinel ids)
EXPERTS_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False,
                  "is_concatenated": True, "has_post_expert_norm": False,
                  "_is_expert_parallel": False}


def _check_experts(family: Family, mlp: nn.Module, at: str, dim: int) -> None:
    """A mixture-of-experts block as the patched layer runs it: the family's router module
    (whose top-k ids and weights it takes as they are), experts as fusetune.moe takes them."""
    router_cls = family.cls("TopKRouter")
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if not isinstance(router, router_cls):
        raise ValueError(f"{at}: mlp.gate is a {type(router).__name__}, expected "
                         f"{router_cls.__name__} (the router, whose top-k experts and weights "
                         "the patched layer takes)")
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    shapes = [None if t is None else tuple(t.shape) for t in (gate_up, down)]
    if (gate_up is None or down is None or gate_up.ndim != 3 or gate_up.shape[2] != dim
            or gate_up.shape[1] % 2
            or down.shape != (gate_up.shape[0], dim, gate_up.shape[1] // 2)):
        raise ValueError(f"{at}: the experts' gate_up_proj {shapes[0]} and down_proj "
                         f"{shapes[1]}; expected [experts, 2·hidden, {dim}] and [experts, {dim}, "
                         "hidden] (transformers' fused experts layout)")
    if router.num_experts != gate_up.shape[0] or not 0 < router.top_k <= router.num_experts:
        raise ValueError(f"{at}: the router picks {router.top_k} of {router.num_experts} "
                         f"experts, and the layer has {gate_up.shape[0]}")
    differ = [f"{k}={getattr(experts, k)!r}" for k, v in EXPERTS_LAYOUT.items()
              if getattr(experts, k, v) != v]
    extra = sorted({n for n, _ in experts.named_parameters()} - {"gate_up_proj", "down_proj"})
    if differ or extra:
        raise ValueError(f"{at}: experts with {', '.join(differ + extra)}; fusetune.moe takes "
                         "gated experts without bias, gate rows then up rows, every expert in "
                         f"this process ({', '.join(f'{k}={v}' for k, v in EXPERTS_LAYOUT.items())}"
                         ", parameters gate_up_proj and down_proj)")
    shared, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    if not family.shared_expert:
        if shared is not None or gate is not None:
            raise ValueError(f"{at}: the block has a shared expert; {family.name} blocks have "
                             "none, and the patched layer would leave it out")
        return
    if not isinstance(shared, nn.Module):
        raise ValueError(f"{at}: mlp.shared_expert is a {type(shared).__name__}, expected the "
                         f"shared expert's MLP ({family.prefix}MLP)")
    _check_mlp(family, shared, f"{at}: mlp.shared_expert", dim,
               getattr(shared.down_proj, "in_features", 0), "shared_expert_intermediate_size")
    if (not isinstance(gate, nn.Linear) or gate.weight.shape != (1, dim)
            or gate.bias is not None):
        shape = tuple(gate.weight.shape) if isinstance(gate, nn.Linear) else None
        bias = getattr(gate, "bias", None) is not None
        raise ValueError(f"{at}: mlp.shared_expert_gate is a {type(gate).__name__} (weight "
                         f"{shape}, bias {bias}); expected an nn.Linear {dim} -> 1 without bias "
                         "(the sigmoid gate of the shared expert)")


def _gate_activation(family: Family, config: Any, where: str) -> str:
    """The MLP gate's activation as fusetune.ffn takes it; ValueError for one it does not."""
    if family.gemma:
        act = getattr(config, "hidden_activation", None)
        if act not in GELU_TANH:
            raise ValueError(f"{where}: hidden_activation={act!r}; the fused ffn computes "
                             f"gelu(gate)·up in its tanh form: one of {GELU_TANH}")
        return "gelu_tanh"
    act = getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act={act!r}; the fused ffn computes silu(gate)·up, "
                         f"so hidden_act must be one of {ACTIVATIONS}")
    return "silu"


def _eps(norm: nn.Module) -> Any:
    """A norm's epsilon: `variance_epsilon` (Llama's RMSNorm and its copies) or `eps` (Gemma's)."""
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", None) if eps is None else eps


def _norm_weight(norm: nn.Module, family: Family) -> torch.Tensor:
    """What the fused ops multiply a norm's rows by: its weight, or for Gemma's norms (1 +
    weight) in float32, as they apply it (made once per version of the weight; traced as the
    sum where torch.compile traces the forward)."""
    w = norm.weight
    if not family.gemma:
        return w
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and w.requires_grad):
        return 1.0 + w.float()
    key = (w._version, w.data_ptr(), w.device)
    kept = norm.__dict__.get(_PLUS_ONE)
    if kept is None or kept[0] != key:
        kept = norm.__dict__[_PLUS_ONE] = (key, 1.0 + w.detach().float())
    return kept[1]


def _check_norm(norm: nn.Module, at: str) -> None:
    eps = _eps(norm)
    if isinstance(eps, bool) or not isinstance(eps, float | int) or not eps > 0:
        raise ValueError(f"{at}: eps {eps!r} (from the config's rms_norm_eps) must be a positive "
                         "number")


def _check_tensors(where: str, base: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """One dtype among float16/bfloat16/float32 for every patched weight, and one device per
    layer: CUDA, or the CPU under Triton's interpreter (as the kernels require)."""
    from fusetune.spec import interpreting

    dtypes = {p.dtype for _, m in [*layers, ("norm", base.norm)] for p in m.parameters()}
    if len(dtypes) != 1 or str(next(iter(dtypes))).removeprefix("torch.") not in DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ValueError(f"{where}: weights in {names}; the fused ops take one dtype of "
                         f"{', '.join(DTYPES)} for all of a model's layers")
    for name, module in [*layers, ("the final norm", base.norm)]:
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ValueError(f"{where}: {name} has weights on {sorted(map(str, devices))}; one "
                             "device per layer")
        device = next(iter(devices))
        if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
            raise ValueError(
                f"{where}: {name} is on {device}; fusetune's kernels run on CUDA tensors (or on "
                "CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 before "
                "importing fusetune)")


# --- changing the model --------------------------------------------------------------------------


def _bind(state: PatchState, module: nn.Module, fn: Callable[..., Any]) -> None:
    bound = types.MethodType(fn, module)
    module.forward = bound
    state.forwards.append((module, bound))


def _bind_all(state: PatchState, base: nn.Module, family: Family, api: CacheApi, *, fp8: bool,
              act: bool) -> None:
    eager = family.modeling().eager_attention_forward
    gate_act = _gate_activation(family, base.config, f"fusetune.patch ({family.name})")
    for layer in base.layers:
        _bind(state, layer.self_attn, _attention_forward(
            layer.input_layernorm, family, eager, api, fp8, act,
            getattr(layer, "resid_attn_dropout", None),
            layer.post_attention_layernorm if family.gemma else None))
        _bind(state, layer, _layer_forward(family, api, fp8, act,
                                           getattr(layer, "resid_mlp_dropout", None),
                                           sparse=family.sparse(layer), gate_act=gate_act))
    _bind(state, base.norm, _norm_forward(family))


def _unbind_all(state: PatchState) -> None:
    for module, _ in state.forwards:
        module.__dict__.pop("forward", None)
        for m in module.modules():
            m.__dict__.pop(_PLUS_ONE, None)
    state.forwards.clear()


def _drop_compiled(model: nn.Module) -> None:
    # generate() keeps its torch.compile'd __call__ on the model; one traced through the other
    # forwards must not be reused
    model.__dict__.pop("_compiled_call", None)


def _stacked_groups(family: Family, layer: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The projections of `layer` that read the same input, in separate modules: where the
    tables choose the unfused form (UNFUSED = 1), one GEMM multiplies by each group's stacked
    matrix (a family's fused projections are one matrix already, and so are the experts')."""
    path = family.gated_mlp(layer)
    mlp = () if path is None else ((path, family.mlp_projections),)
    return tuple((parent, names) for parent, names in (("self_attn", family.attn_projections),
                                                       *mlp)
                 if len(names) > 1)


@torch.no_grad()
def _stack_projections(base: nn.Module, family: Family) -> bool:
    """Each layer's q, k, v weights become consecutive rows of one matrix, its gate and up
    weights likewise (one copy made a group at a time; the separate tensors are freed); FP8
    scales and biases (where every projection of the group has one) the same way. False where
    the tensors are not all on one device as ordinary tensors (offloaded or meta): left as they
    are."""
    from fusetune.kernels import _unfused

    groups = [[layer.get_submodule(parent).get_submodule(n) for n in names]
              for layer in base.layers for parent, names in _stacked_groups(family, layer)]
    todo: list[list[tuple[nn.Module, str]]] = []
    for lins in groups:
        for attr in ("weight", "weight_scale", "bias"):
            ts = [getattr(lin, attr, None) for lin in lins]
            if all(t is None for t in ts):
                continue
            if any(t is None for t in ts):
                if attr == "bias":
                    continue  # a bias on some only: added per projection
                return False
            first = ts[0]
            if any(t.shape[1:] != first.shape[1:] or t.dtype != first.dtype
                   or t.device != first.device or t.device.type == "meta" for t in ts):
                return False
            todo.append([(lin, attr) for lin in lins])
    for members in todo:
        ts = [getattr(lin, attr) for lin, attr in members]
        if _unfused.stacked(*ts) is not None:
            continue
        whole = torch.cat([t.detach() for t in ts])
        start = 0
        for (lin, attr), t in zip(members, ts, strict=True):
            view = whole[start:start + t.shape[0]]
            start += t.shape[0]
            if isinstance(t, nn.Parameter):
                t.data = view
            else:
                setattr(lin, attr, view)  # a buffer (FP8 weights, their scales)
    return True


@torch.no_grad()
def _unstack_projections(base: nn.Module, family: Family) -> None:
    """Undoes _stack_projections for 16-bit weights: each tensor one of its own again (state
    dicts with shared storage are refused by safetensors' save)."""
    for layer in base.layers:
        for parent, names in _stacked_groups(family, layer):
            for n in names:
                lin = layer.get_submodule(parent).get_submodule(n)
                for p in (lin.weight, lin.bias):
                    if p is not None:
                        p.data = p.data.clone()


@torch.no_grad()
def _quantize(base: nn.Module, family: Family, fmt: str) -> None:
    """Every projection's weight -> buffers `weight` (FP8) and `weight_scale` (float32 [out]);
    a mixture-of-experts layer's experts -> buffers `gate_up_proj`, `down_proj` (FP8) and
    `gate_up_proj_scale`, `down_proj_scale` (float32, per expert and output channel). One
    tensor at a time, so that the extra memory is one tensor's."""
    from fusetune.kernels.fp8 import quantize_fp8

    targets = []  # (where, module, attribute, name of its scale)
    for i, layer in enumerate(base.layers):
        for parent, name in family.projections(layer):
            lin = layer.get_submodule(parent).get_submodule(name)
            targets.append((f"layer {i}'s {parent}.{name}", lin, "weight", "weight_scale"))
        if family.sparse(layer):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                targets.append((f"layer {i}'s mlp.experts.{name}", experts, name,
                                f"{name}_scale"))
    before = after = count = 0
    for where, module, attr, scale_attr in targets:
        w = getattr(module, attr)
        try:
            wq, scale = quantize_fp8(w, fmt)
        except (ValueError, TypeError, RuntimeError) as e:
            raise RuntimeError(
                f"fusetune.patch: quantizing {where} to fp8-{fmt} failed ({e}); {count} of "
                f"{len(targets)} projections were converted already, so the model is neither "
                "patched nor as it was: load it again") from e
        before += w.numel() * w.element_size()
        after += wq.numel() * wq.element_size() + scale.numel() * scale.element_size()
        delattr(module, attr)
        del w  # the Parameter: nothing else holds the 16-bit tensor now
        module.register_buffer(attr, wq)
        module.register_buffer(scale_attr, scale)
        count += 1
    print(f"fusetune.patch: {count} projection weights as fp8-{fmt}: {before / 2**20:.1f} MiB "
          f"-> {after / 2**20:.1f} MiB (FP8 values and one float32 scale per output channel)")


# --- the replacement forwards --------------------------------------------------------------------


def _wants_grad(module: nn.Module, x: torch.Tensor, fp8: bool,
                extra: Iterable[torch.Tensor] = ()) -> bool:
    """Whether autograd records this call (gradients enabled and an input or parameter that
    requires grad): then the layer runs its training path, whose ops have backward passes.
    A model with FP8 weights has none (RuntimeError)."""
    if not torch.is_grad_enabled() or not (
            x.requires_grad or any(p.requires_grad for p in module.parameters())
            or any(t.requires_grad for t in extra)):
        return False
    if fp8:
        raise RuntimeError(
            f"fusetune: the patched {type(module).__name__} holds FP8 weights, which have no "
            "backward pass, and gradients are enabled with an input or parameter that requires "
            "grad; run it under torch.no_grad() or torch.inference_mode() (generate() does), "
            "or patch the 16-bit model (fusetune.patch(model) without weights=) to train it")
    return True


def _scale(lin: nn.Module, fp8: bool) -> torch.Tensor | None:
    return lin.weight_scale if fp8 else None


def _rows(lins: list[nn.Module], attr: str, sizes: tuple[int, ...]) -> list[Any]:
    """Each of q, k, v's (or gate's and up's) `attr` tensor (weight, weight_scale, bias; None
    where absent): the modules' own, or for one fused module, views of its row blocks."""
    if len(lins) == len(sizes):
        return [getattr(lin, attr, None) for lin in lins]
    t = getattr(lins[0], attr, None)
    if t is None:
        return [None] * len(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [t[a:a + n] for a, n in zip(starts, sizes, strict=True)]


def _qkv_tensors(attn: nn.Module, family: Family, fp8: bool
                 ) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
    """(weights, FP8 scales or Nones, biases or Nones) of q, k and v."""
    lins = [getattr(attn, n) for n in family.attn_projections]
    kv = attn.config.num_key_value_heads * attn.head_dim
    sizes = (attn.config.num_attention_heads * attn.head_dim, kv, kv)
    scales = _rows(lins, "weight_scale", sizes) if fp8 else [None] * 3
    return _rows(lins, "weight", sizes), scales, _rows(lins, "bias", sizes)


def _gate_up_tensors(mlp: nn.Module, family: Family, fp8: bool
                     ) -> tuple[list[torch.Tensor], list[Any]]:
    """(weights, FP8 scales or Nones) of the gate and up projections."""
    lins = [getattr(mlp, n) for n in family.mlp_projections]
    hidden = lins[-1].out_features // (2 if family.fused else 1)
    scales = _rows(lins, "weight_scale", (hidden, hidden)) if fp8 else [None] * 2
    return _rows(lins, "weight", (hidden, hidden)), scales


def _dropping(drop: nn.Module | None) -> bool:
    """Whether a residual dropout module (Phi-3's) drops anything in this call."""
    return drop is not None and drop.training and drop.p > 0


def _no_backward(family: Family, module: nn.Module, sparse: bool = False) -> None:
    """RuntimeError where the patched `module` has no backward pass: Gemma's GeGLU gate, and
    the experts of a mixture-of-experts layer (`sparse`), have no backward kernels."""
    why = ("its experts (fusetune.moe) have no backward kernel" if sparse
           else "its GeGLU gate has no backward kernel" if family.gemma else "")
    if why:
        raise RuntimeError(
            f"fusetune: the patched {type(module).__name__} ({family.name}) has no backward "
            f"pass ({why}), and gradients are enabled with an input or parameter that requires "
            "grad; run it under torch.no_grad() or torch.inference_mode() (generate() does), "
            "or unpatch the model to train it")


def _attention_forward(norm: nn.Module, family: Family, eager: Callable[..., Any],
                       api: CacheApi, fp8: bool, act: bool = False,
                       drop: nn.Module | None = None, post_norm: nn.Module | None = None
                       ) -> Callable[..., Any]:
    """The attention module's forward (signature of LlamaAttention.forward; the KV cache comes
    as `cache` or `past_key_values`, see CacheApi), with the layer's input norm folded in and
    the residual add after o_proj (after the layer's dropout `drop` of the block's output,
    where the family has one, or its norm `post_norm`, Gemma's post_attention_layernorm)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sliding_window = family.sliding_window

    def forward(self: nn.Module, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        from fusetune import ops

        cache = _take_cache(past_key_values, kwargs)
        train = _wants_grad(self, hidden_states, fp8, (norm.weight,))
        if train:
            _no_backward(family, self)
        g, eps = _norm_weight(norm, family), _eps(norm)
        input_shape = hidden_states.shape[:-1]
        head_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        (wq, wk, wv), (sq, sk, sv), (bq, bk, bv) = _qkv_tensors(self, family, fp8)
        qn = kn = qk_eps = None
        if family.qk_norm:
            qn, kn = _norm_weight(self.q_norm, family), _norm_weight(self.k_norm, family)
            qk_eps = _eps(self.q_norm)
        if train:
            # ops with backward passes; the projections are cuBLAS matmuls
            h = rmsnorm(hidden_states, g, eps=eps)
            q, k, v = (F.linear(h, w, b).view(head_shape)
                       for w, b in ((wq, bq), (wk, bk), (wv, bv)))
            if qn is not None:
                q, k = rmsnorm(q, qn, eps=qk_eps), rmsnorm(k, kn, eps=qk_eps)
            q = rope(q, cos, sin, interleaved=False)
            k = rope(k, cos, sin, interleaved=False)
        else:
            q, k, v = ops.qkv(hidden_states, g, wq, wk, wv, cos, sin, eps, self.head_dim,
                              bq=bq, bk=bk, bv=bv,
                              wq_scale=sq, wk_scale=sk, wv_scale=sv, q_norm=qn, k_norm=kn,
                              qk_eps=qk_eps, fp8_activations=act)
        query_states = q.view(head_shape).transpose(1, 2)
        key_states = k.view(head_shape).transpose(1, 2)
        value_states = v.view(head_shape).transpose(1, 2)

        if cache is not None:
            # as the model's own forward calls it: transformers 5.24 and later hand the
            # attention's keyword arguments to the cache too
            extra = {"kwargs": kwargs} if api.update_kwargs else {}
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                    **extra)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager)
        if sliding_window is not None:
            kwargs = {"sliding_window": sliding_window(self), **kwargs}
        if family.gemma:
            kwargs = {"softcap": self.attn_logit_softcapping, **kwargs}
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        o_proj = self.o_proj
        if train:
            out = F.linear(attn_output, o_proj.weight)
            return hidden_states + (drop(out) if drop is not None else out), attn_weights
        if post_norm is not None:
            out = ops.linear(attn_output, o_proj.weight, weight_scale=_scale(o_proj, fp8),
                             fp8_activations=act)
            return ops.rmsnorm(out, _norm_weight(post_norm, family), _eps(post_norm),
                               residual=hidden_states), attn_weights
        if _dropping(drop):
            out = ops.linear(attn_output, o_proj.weight, weight_scale=_scale(o_proj, fp8),
                             fp8_activations=act)
            return hidden_states + drop(out), attn_weights
        out = ops.linear(attn_output, o_proj.weight, residual=hidden_states,
                         weight_scale=_scale(o_proj, fp8), fp8_activations=act)
        return out, attn_weights

    return forward


def _layer_forward(family: Family, api: CacheApi, fp8: bool, act: bool = False,
                   drop: nn.Module | None = None, sparse: bool = False, gate_act: str = "silu"
                   ) -> Callable[..., Any]:
    """The decoder layer's forward (signature and return convention of LlamaDecoderLayer.forward:
    the new hidden states alone; the KV cache as `cache` or `past_key_values`); `drop`: the
    layer's dropout of the MLP's output before its residual add, where the family has one;
    `sparse`: the layer's MLP is a mixture-of-experts block (`_experts`); `gate_act`: the
    MLP gate's activation as ops.ffn takes it (`_gate_activation`)."""

    def forward(self: nn.Module, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs: Any) -> torch.Tensor:
        from fusetune import ops

        kwargs[api.name] = _take_cache(past_key_values, kwargs)
        # the patched attention returns the layer input + the attention block's output
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            position_ids=position_ids, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs)
        norm = self.pre_feedforward_layernorm if family.gemma else self.post_attention_layernorm
        if sparse:
            if _wants_grad(self, hidden_states, fp8):
                _no_backward(family, self, sparse=True)
            g = _norm_weight(norm, family)
            h = ops.rmsnorm(hidden_states, g, _eps(norm))
            out = _experts(self.mlp, h, fp8)
            if family.shared_expert:
                out = out + _shared_expert(family, self.mlp, hidden_states, h, g, _eps(norm), fp8)
            return hidden_states + out
        down = self.mlp.down_proj
        (gate, up), (s_gate, s_up) = _gate_up_tensors(self.mlp, family, fp8)
        if _wants_grad(self, hidden_states, fp8):
            _no_backward(family, self)
            h = rmsnorm(hidden_states, norm.weight, eps=_eps(norm))
            out = F.linear(swiglu(F.linear(h, gate), F.linear(h, up)), down.weight)
            return hidden_states + (drop(out) if drop is not None else out)
        h = ops.ffn(hidden_states, _norm_weight(norm, family), gate, up, _eps(norm),
                    gate_scale=s_gate, up_scale=s_up, activation=gate_act,
                    fp8_activations=act)
        if family.gemma:  # the MLP's output normalized, then added
            post = self.post_feedforward_layernorm
            out = ops.linear(h, down.weight, weight_scale=_scale(down, fp8), fp8_activations=act)
            return ops.rmsnorm(out, _norm_weight(post, family), _eps(post),
                               residual=hidden_states)
        if _dropping(drop):
            return hidden_states + drop(ops.linear(h, down.weight,
                                                   weight_scale=_scale(down, fp8),
                                                   fp8_activations=act))
        return ops.linear(h, down.weight, residual=hidden_states,
                          weight_scale=_scale(down, fp8), fp8_activations=act)

    return forward


def _experts(mlp: nn.Module, h: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """A mixture-of-experts block (<prefix>SparseMoeBlock) on its normalized input `h`: the
    block's own router module picks each token's experts and weights (its softmax, top-k and
    normalization, as the installed transformers computes them; its output recorded as the
    model records it, for output_router_logits), then the experts through `ops.moe` (`fp8`:
    their FP8 weights with the scales `_quantize` stored beside them)."""
    from fusetune import ops

    shape = h.shape
    jitter = getattr(mlp, "jitter_noise", 0)
    if mlp.training and jitter > 0:  # Mixtral's router jitter, drawn as its block draws it
        h = h * torch.empty_like(h).uniform_(1.0 - jitter, 1.0 + jitter)
    h = h.view(-1, shape[-1])
    _, weights, ids = mlp.gate(h)
    experts = mlp.experts
    scales = ((experts.gate_up_proj_scale, experts.down_proj_scale) if fp8 else (None, None))
    return ops.moe(h, experts.gate_up_proj, experts.down_proj, ids, weights,
                   gate_up_scale=scales[0], down_scale=scales[1]).view(shape)


def _shared_expert(family: Family, mlp: nn.Module, x: torch.Tensor, h: torch.Tensor,
                   g: torch.Tensor, eps: Any, fp8: bool) -> torch.Tensor:
    """Qwen2-MoE's shared expert: its MLP on the normalized `h` (the fused ffn normalizes the
    layer's input `x` by the norm's weight `g` itself, then down_proj), times
    sigmoid(shared_expert_gate(h)), the gate in the model's dtype as the block computes it."""
    from fusetune import ops

    shared = mlp.shared_expert
    (gate, up), (s_gate, s_up) = _gate_up_tensors(shared, family, fp8)
    down = shared.down_proj
    y = ops.ffn(x, g, gate, up, eps, gate_scale=s_gate, up_scale=s_up)
    y = ops.linear(y, down.weight, weight_scale=_scale(down, fp8))
    return torch.sigmoid(F.linear(h, mlp.shared_expert_gate.weight)) * y


def _norm_forward(family: Family) -> Callable[..., Any]:
    """The final norm's forward."""

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        from fusetune import ops

        if torch.is_grad_enabled():  # fusetune.rmsnorm has its backward pass
            return rmsnorm(hidden_states, _norm_weight(self, family), eps=_eps(self))
        return ops.rmsnorm(hidden_states, _norm_weight(self, family), _eps(self))

    return forward
