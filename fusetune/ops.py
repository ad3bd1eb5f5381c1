"""The fused kernels as torch custom ops (`torch.library`), for models run under torch.compile.

torch.compile cannot trace into a Triton launcher's Python (the table lookup, the checks, the
launch): registered as custom ops with fake implementations (output shapes and dtypes only),
the kernels are opaque nodes of the graph, so a compiled forward has no graph break at them,
and CUDA graphs capture their launches (the lookup runs once, when the graph is recorded;
every input, the RoPE tables included, is a device tensor that a replay reads anew).

Called eagerly, the functions here go straight to the launchers: the custom-op dispatcher
would add its own CPU time to every call, and at decode sizes a launch's CPU time is already
more than its GPU time. fusetune's public functions (`fusetune.rmsnorm`, ..., in
`fusetune.api`) dispatch the same way, with the launchers' own signatures.

rmsnorm, rope and swiglu are differentiable: each op's backward is the op of its backward
kernel (`fusetune::rmsnorm_bwd`, `fusetune::rope_bwd`, `fusetune::swiglu_bwd`), so a compiled
training step keeps both as graph nodes. The other ops have no backward.

An explicit launch config crosses an op as a string, "KEY=value,..." (`config_arg`; "" for
the tables' config): a custom op's arguments are tensors, numbers, bools and strings, never
a mapping. It sets the forward's launch only, as the launchers' `config=` does.

    from fusetune import ops
    y = ops.rmsnorm(x, weight, eps)
    q, k, v = ops.qkv(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim)
    h = ops.ffn(x, rms_weight, w_gate, w_up, eps)
    y = ops.linear(x, weight, residual=r)
    y = ops.moe(x, gate_up, down, topk_ids, topk_weights)

The RoPE pairing of `ops.qkv` is Hugging Face's rotate_half (pairs i, i + head_dim/2) with the
model's own cos/sin tables; q, k, v come back as [batch, seq, heads·head_dim].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fusetune.kernels import ffn as _ffn
from fusetune.kernels import linear as _linear
from fusetune.kernels import lola as _lola
from fusetune.kernels import moe as _moe
from fusetune.kernels import qkv as _qkv
from fusetune.kernels import rmsnorm as _rmsnorm
from fusetune.kernels import rmsnorm_bwd as _rmsnorm_bwd
from fusetune.kernels import rope as _rope
from fusetune.kernels import rope_bwd as _rope_bwd
from fusetune.kernels import swiglu as _swiglu
from fusetune.kernels import swiglu_bwd as _swiglu_bwd
from fusetune.spec import KernelSpec

_lowered = False


def lower_as_fallbacks() -> None:
    """Registers fusetune's custom ops with Inductor as fallback kernels (calls of the op as
    it is, what Inductor does with them anyway), before torch.compile meets them.

    Without it, Inductor of torch releases before 2.13 formats each op's inputs for a log
    line whether or not it is logged, and a decoder stack's residual stream reaches every op
    through every earlier one: the string, and the compile time, grow with 2^layers.
    fusetune.patch calls this; call it before compiling a model of your own that uses these
    ops. Imports Inductor (a second or so), once."""
    global _lowered
    if _lowered:
        return
    from torch._inductor import lowering

    for op in OPS:
        overload = op._opoverload
        if overload in lowering.lowerings:
            continue
        constraint = None
        if hasattr(lowering, "get_layout_constraint_tag") and hasattr(
                lowering, "tag_to_layout_constraint"):  # as an implicit fallback gets it
            tag = lowering.get_layout_constraint_tag(overload, with_default=True)
            constraint = lowering.tag_to_layout_constraint(tag)
        lowering.make_fallback(overload, layout_constraint=constraint, warn=False)
    _lowered = True


# ---- an explicit config, across an op -------------------------------------------------------


def config_arg(spec: KernelSpec, config: Mapping[str, int] | None) -> str:
    """`config` as an op's string argument, "KEY=value,..." ("" for None), checked against
    `spec` first so that a bad config fails where it is given (as the launcher's would), not
    inside a graph's run."""
    if config is None:
        return ""
    return ",".join(f"{k}={v}" for k, v in spec.validate_config(config).items())


def _config(arg: str) -> dict[str, int] | None:
    """An op's config string as the launchers take it (None: the tables' config)."""
    if not arg:
        return None
    pairs = (item.split("=") for item in arg.split(","))
    return {k: int(v) for k, v in pairs}


# ---- rmsnorm --------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::rmsnorm", mutates_args=())
def _rmsnorm_op(x: Tensor, weight: Tensor, eps: float, config: str = "") -> Tensor:
    return _rmsnorm.rmsnorm(x, weight, eps=eps, config=_config(config))


@_rmsnorm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float, config: str = "") -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("fusetune::rmsnorm_bwd", mutates_args=())
def _rmsnorm_bwd_op(x: Tensor, weight: Tensor, dy: Tensor, eps: float, grad_x: bool,
                    grad_weight: bool, config: str = "") -> tuple[Tensor, Tensor]:
    with torch.no_grad():  # x and weight are the forward's, which may require grad
        dx, dw = _rmsnorm_bwd.rmsnorm_bwd(x, weight, dy, eps=eps, grad_x=grad_x,
                                          grad_weight=grad_weight, config=_config(config))
    # An op returns tensors: a gradient not asked for comes back empty.
    return (x.new_empty(0) if dx is None else dx), (weight.new_empty(0) if dw is None else dw)


@_rmsnorm_bwd_op.register_fake
def _(x: Tensor, weight: Tensor, dy: Tensor, eps: float, grad_x: bool, grad_weight: bool,
      config: str = "") -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape if grad_x else (0,)),
            weight.new_empty(weight.shape if grad_weight else (0,)))


def _rmsnorm_setup_context(ctx: torch.autograd.function.FunctionCtx,
                           inputs: tuple[Tensor, Tensor, float, str], output: Tensor) -> None:
    x, weight, eps, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rmsnorm_backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor
                      ) -> tuple[Tensor | None, Tensor | None, None, None]:
    # needs_input_grad covers the arguments the call gave: the dispatcher drops those equal
    # to their defaults (config=""), which is why the formulas index it and never unpack it.
    # The gradients returned past those arguments are None, which autograd allows.
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _rmsnorm_bwd_op(x, weight, dy, ctx.eps, grad_x, grad_weight)
    return (dx if grad_x else None), (dw if grad_weight else None), None, None


_rmsnorm_op.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup_context)


@torch.library.custom_op("fusetune::rmsnorm_add", mutates_args=())
def _rmsnorm_add_op(x: Tensor, weight: Tensor, residual: Tensor, eps: float, config: str = ""
                    ) -> Tensor:
    return _rmsnorm.rmsnorm(x, weight, eps=eps, residual=residual, config=_config(config))


@_rmsnorm_add_op.register_fake
def _(x: Tensor, weight: Tensor, residual: Tensor, eps: float, config: str = "") -> Tensor:
    return torch.empty_like(x)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """fusetune.rmsnorm(x, weight, eps=eps[, residual=...]), traceable by torch.compile;
    differentiable without a residual (with one: an inference op)."""
    if torch.compiler.is_compiling():
        if residual is None:
            return _rmsnorm_op(x, weight, eps)
        return _rmsnorm_add_op(x, weight, residual, eps)
    return _rmsnorm.rmsnorm(x, weight, eps=eps, residual=residual)


# ---- rope -----------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::rope", mutates_args=())
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, config: str = ""
             ) -> Tensor:
    return _rope.rope(x, cos, sin, interleaved=interleaved, config=_config(config))


@_rope_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, config: str = "") -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("fusetune::rope_bwd", mutates_args=())
def _rope_bwd_op(dy: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, config: str = ""
                 ) -> Tensor:
    with torch.no_grad():  # dy may require grad, where the backward is recorded
        return _rope_bwd.rope_bwd(dy, cos, sin, interleaved=interleaved, config=_config(config))


@_rope_bwd_op.register_fake
def _(dy: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, config: str = "") -> Tensor:
    return dy.new_empty(dy.shape)


# The error of rope (the launcher's words) where the tables would need a gradient.
ROPE_TABLES_GRAD = (
    "rope: cos or sin requires grad, but fusetune's rope computes the gradient of x only (the "
    "backward rotates dy back by the same angles); the tables' gradient would be missing. Pass "
    "detached tables (a rotary embedding's have no parameters: build them under "
    "torch.no_grad()).")


def _rope_setup_context(ctx: torch.autograd.function.FunctionCtx,
                        inputs: tuple[Tensor, Tensor, Tensor, bool, str], output: Tensor
                        ) -> None:
    _, cos, sin, interleaved, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved


def _rope_backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor
                   ) -> tuple[Tensor | None, None, None, None, None]:
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError(ROPE_TABLES_GRAD)
    cos, sin = ctx.saved_tensors
    dx = _rope_bwd_op(dy, cos, sin, ctx.interleaved) if ctx.needs_input_grad[0] else None
    return dx, None, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


# ---- swiglu ---------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::swiglu", mutates_args=())
def _swiglu_op(a: Tensor, b: Tensor, config: str = "") -> Tensor:
    return _swiglu.swiglu(a, b, config=_config(config))


@_swiglu_op.register_fake
def _(a: Tensor, b: Tensor, config: str = "") -> Tensor:
    return a.new_empty(a.shape)


@torch.library.custom_op("fusetune::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(a: Tensor, b: Tensor, dy: Tensor, config: str = ""
                   ) -> tuple[Tensor, Tensor]:
    with torch.no_grad():  # a and b are the forward's, which may require grad
        return _swiglu_bwd.swiglu_bwd(a, b, dy, config=_config(config))


@_swiglu_bwd_op.register_fake
def _(a: Tensor, b: Tensor, dy: Tensor, config: str = "") -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), a.new_empty(a.shape)


def _swiglu_setup_context(ctx: torch.autograd.function.FunctionCtx,
                          inputs: tuple[Tensor, Tensor, str], output: Tensor) -> None:
    a, b, _ = inputs
    ctx.save_for_backward(a, b)


def _swiglu_backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor
                     ) -> tuple[Tensor | None, Tensor | None, None]:
    a, b = ctx.saved_tensors
    da, db = _swiglu_bwd_op(a, b, dy)  # one kernel writes both
    need_a, need_b = ctx.needs_input_grad[:2]
    return (da if need_a else None), (db if need_b else None), None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


# ---- qkv ------------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::qkv", mutates_args=())
def _qkv_op(x: Tensor, rms_weight: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor,
            sin: Tensor, eps: float, head_dim: int, bq: Tensor | None, bk: Tensor | None,
            bv: Tensor | None, wq_scale: Tensor | None, wk_scale: Tensor | None,
            wv_scale: Tensor | None, fp8_activations: bool, interleaved: bool = False,
            config: str = "", q_norm: Tensor | None = None, k_norm: Tensor | None = None,
            qk_eps: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return _qkv_eager(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, bq, bk, bv, wq_scale,
                      wk_scale, wv_scale, fp8_activations, interleaved, _config(config),
                      q_norm, k_norm, qk_eps)


@_qkv_op.register_fake
def _(x: Tensor, rms_weight: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor,
      sin: Tensor, eps: float, head_dim: int, bq: Tensor | None, bk: Tensor | None,
      bv: Tensor | None, wq_scale: Tensor | None, wk_scale: Tensor | None,
      wv_scale: Tensor | None, fp8_activations: bool, interleaved: bool = False,
      config: str = "", q_norm: Tensor | None = None, k_norm: Tensor | None = None,
      qk_eps: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    b, s = x.shape[0], x.shape[1]
    return (x.new_empty(b, s, wq.shape[0]), x.new_empty(b, s, wk.shape[0]),
            x.new_empty(b, s, wv.shape[0]))


def _qkv_eager(x: Tensor, rms_weight: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor,
               sin: Tensor, eps: float, head_dim: int, bq: Tensor | None, bk: Tensor | None,
               bv: Tensor | None, wq_scale: Tensor | None, wk_scale: Tensor | None,
               wv_scale: Tensor | None, fp8_activations: bool, interleaved: bool = False,
               config: Mapping[str, int] | None = None, q_norm: Tensor | None = None,
               k_norm: Tensor | None = None, qk_eps: float | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _qkv.qkv(x, rms_weight, wq, wk, wv, cos, sin, eps=eps, head_dim=head_dim,
                       interleaved=interleaved, bq=bq, bk=bk, bv=bv, wq_scale=wq_scale,
                       wk_scale=wk_scale, wv_scale=wv_scale, q_norm=q_norm, k_norm=k_norm,
                       qk_eps=qk_eps, fp8_activations=fp8_activations, config=config)
    b, s = x.shape[0], x.shape[1]
    return q.view(b, s, -1), k.view(b, s, -1), v.view(b, s, -1)


def qkv(x: Tensor, rms_weight: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, cos: Tensor,
        sin: Tensor, eps: float, head_dim: int, *, bq: Tensor | None = None,
        bk: Tensor | None = None, bv: Tensor | None = None, wq_scale: Tensor | None = None,
        wk_scale: Tensor | None = None, wv_scale: Tensor | None = None,
        q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float | None = None,
        fp8_activations: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """fusetune.qkv with Hugging Face's pairing (interleaved=False) and its cos/sin tables
    [batch or 1, seq, head_dim]; q, k, v as [batch, seq, heads·head_dim], contiguous."""
    if torch.compiler.is_compiling():
        return _qkv_op(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, bq, bk, bv, wq_scale,
                       wk_scale, wv_scale, fp8_activations, False, "", q_norm, k_norm, qk_eps)
    return _qkv_eager(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, bq, bk, bv, wq_scale,
                      wk_scale, wv_scale, fp8_activations, False, None, q_norm, k_norm, qk_eps)


# ---- ffn ------------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::ffn", mutates_args=())
def _ffn_op(x: Tensor, rms_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float,
            gate_scale: Tensor | None, up_scale: Tensor | None, fp8_activations: bool,
            config: str = "", activation: str = "silu") -> Tensor:
    return _ffn.ffn(x, rms_weight, w_gate, w_up, eps=eps, w1_scale=gate_scale,
                    w3_scale=up_scale, activation=activation, fp8_activations=fp8_activations,
                    config=_config(config))


@_ffn_op.register_fake
def _(x: Tensor, rms_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float,
      gate_scale: Tensor | None, up_scale: Tensor | None, fp8_activations: bool,
      config: str = "", activation: str = "silu") -> Tensor:
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


def ffn(x: Tensor, rms_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float, *,
        gate_scale: Tensor | None = None, up_scale: Tensor | None = None,
        activation: str = "silu", fp8_activations: bool = False) -> Tensor:
    """fusetune.ffn: act(n·W_gateᵀ) · (n·W_upᵀ), n = rmsnorm(x), act silu or gelu_tanh."""
    if torch.compiler.is_compiling():
        return _ffn_op(x, rms_weight, w_gate, w_up, eps, gate_scale, up_scale, fp8_activations,
                       "", activation)
    return _ffn.ffn(x, rms_weight, w_gate, w_up, eps=eps, w1_scale=gate_scale,
                    w3_scale=up_scale, activation=activation, fp8_activations=fp8_activations)


# ---- linear ---------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
               weight_scale: Tensor | None, fp8_activations: bool, config: str = "") -> Tensor:
    return _linear.linear(x, weight, bias=bias, residual=residual, weight_scale=weight_scale,
                          fp8_activations=fp8_activations, config=_config(config))


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
      weight_scale: Tensor | None, fp8_activations: bool, config: str = "") -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           residual: Tensor | None = None, weight_scale: Tensor | None = None, *,
           fp8_activations: bool = False) -> Tensor:
    """fusetune.linear: x·Wᵀ (· scale) + bias + residual."""
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, bias, residual, weight_scale, fp8_activations)
    return _linear.linear(x, weight, bias=bias, residual=residual, weight_scale=weight_scale,
                          fp8_activations=fp8_activations)


# ---- lola -----------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::lola", mutates_args=())
def _lola_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float, weight_scale: Tensor | None,
             fp8_activations: bool, config: str = "") -> Tensor:
    return _lola.lola(x, weight, bias, eps=eps, weight_scale=weight_scale,
                      fp8_activations=fp8_activations, config=_config(config))


@_lola_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float, weight_scale: Tensor | None,
      fp8_activations: bool, config: str = "") -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- moe ------------------------------------------------------------------------------------


@torch.library.custom_op("fusetune::moe", mutates_args=())
def _moe_op(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
            gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
            config: str = "") -> Tensor:
    return _moe.moe(x, gate_up, down, topk_ids, topk_weights, gate_up_scale=gate_up_scale,
                    down_scale=down_scale, config=_config(config))


@_moe_op.register_fake
def _(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
      gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
      config: str = "") -> Tensor:
    return x.new_empty(x.shape)


def moe(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor, *,
        gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """fusetune.moe: Σ_j w[t, j] · down[e] · (silu(gate[e]·x[t]) ⊙ up[e]·x[t]), e = the
    router's topk_ids[t, j]; x [..., dim] -> [..., dim] in x's dtype; FP8 experts with their
    scales [experts, 2·hidden] and [experts, dim]."""
    if torch.compiler.is_compiling():
        return _moe_op(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale)
    return _moe.moe(x, gate_up, down, topk_ids, topk_weights, gate_up_scale=gate_up_scale,
                    down_scale=down_scale)


# Every op this module registers: what `lower_as_fallbacks` hands to Inductor.
OPS = (_rmsnorm_op, _rmsnorm_bwd_op, _rope_op, _rope_bwd_op, _swiglu_op, _swiglu_bwd_op,
       _qkv_op, _ffn_op, _linear_op, _lola_op, _rmsnorm_add_op, _moe_op)
