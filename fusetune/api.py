"""fusetune's public kernel functions (`fusetune.rmsnorm`, `fusetune.qkv`, ...): each one the
launcher's signature and behaviour, traceable by torch.compile.

Called eagerly, each goes straight to its Triton launcher (fusetune.kernels.*): the custom-op
dispatcher would add its own CPU time to every call, and at decode sizes a launch's CPU time is
already more than its GPU time. Under torch.compile (or torch.export) dynamo cannot trace a
launcher (its memo keys on id() of Triton kernels, its lookup and launch are Python that no
graph holds), so there each function calls its kernel's custom op (`fusetune.ops`) instead,
one opaque node of the graph: no graph break. rmsnorm, rope and swiglu stay differentiable
there through their ops' autograd formulas, whose backward is the op of their backward kernel.

What the launchers check before a launch holds under compile too, where it cannot wait for the
op's run: an input that requires grad where the kernel has no backward, or RoPE tables that
require grad, raise as the launcher would. An explicit `config=` crosses the op as a string
(`ops.config_arg`), validated when the function is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import Tensor

from fusetune import ops
from fusetune.kernels import ffn as _ffn
from fusetune.kernels import linear as _linear
from fusetune.kernels import lola as _lola
from fusetune.kernels import moe as _moe
from fusetune.kernels import qkv as _qkv
from fusetune.kernels import rmsnorm as _rmsnorm
from fusetune.kernels import rmsnorm_bwd as _rmsnorm_bwd
from fusetune.kernels import rope as _rope
from fusetune.kernels import swiglu as _swiglu
from fusetune.spec import check_no_grad

__all__ = ["ffn", "linear", "lola", "moe", "qkv", "rmsnorm", "rmsnorm_bwd", "rope", "swiglu"]

_F = TypeVar("_F", bound=Callable[..., object])

_TRACED = """
    Under torch.compile the call is the custom op fusetune::{op} (see fusetune.api): one node
    of the graph, no graph break."""


def _documented_as(launcher: Callable[..., object], op: str) -> Callable[[_F], _F]:
    """The launcher's docstring on its public function (one text to keep), with what a
    compiled call does."""
    def decorate(fn: _F) -> _F:
        fn.__doc__ = (launcher.__doc__ or "").rstrip() + "\n" + _TRACED.format(op=op)
        return fn
    return decorate


@_documented_as(_rmsnorm.rmsnorm, "rmsnorm")
def rmsnorm(
    x: Tensor,
    weight: Tensor,
    *,
    eps: float,
    residual: Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        out = ops._rmsnorm_op(x, weight, eps, ops.config_arg(_rmsnorm.SPEC, config))
        return out if residual is None else residual + out
    return _rmsnorm.rmsnorm(x, weight, eps=eps, residual=residual, config=config)


@_documented_as(_rmsnorm_bwd.rmsnorm_bwd, "rmsnorm_bwd")
def rmsnorm_bwd(
    x: Tensor,
    weight: Tensor,
    dy: Tensor,
    *,
    eps: float,
    grad_x: bool = True,
    grad_weight: bool = True,
    config: Mapping[str, int] | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    if torch.compiler.is_compiling():
        check_no_grad("rmsnorm_bwd", x, weight, dy)
        if not (grad_x or grad_weight):
            return None, None
        dx, dw = ops._rmsnorm_bwd_op(x, weight, dy, eps, grad_x, grad_weight,
                                     ops.config_arg(_rmsnorm_bwd.SPEC, config))
        # The op returns an empty tensor for a gradient not asked for; the launcher, None.
        return (dx if grad_x else None), (dw if grad_weight else None)
    return _rmsnorm_bwd.rmsnorm_bwd(x, weight, dy, eps=eps, grad_x=grad_x,
                                    grad_weight=grad_weight, config=config)


@_documented_as(_rope.rope, "rope")
def rope(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    interleaved: bool,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            raise RuntimeError(ops.ROPE_TABLES_GRAD)
        return ops._rope_op(x, cos, sin, interleaved, ops.config_arg(_rope.SPEC, config))
    return _rope.rope(x, cos, sin, interleaved=interleaved, config=config)


@_documented_as(_swiglu.swiglu, "swiglu")
def swiglu(
    a: Tensor,
    b: Tensor,
    *,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        return ops._swiglu_op(a, b, ops.config_arg(_swiglu.SPEC, config))
    return _swiglu.swiglu(a, b, config=config)


@_documented_as(_qkv.qkv, "qkv")
def qkv(
    x: Tensor,
    rms_weight: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    eps: float,
    head_dim: int,
    interleaved: bool,
    bq: Tensor | None = None,
    bk: Tensor | None = None,
    bv: Tensor | None = None,
    wq_scale: Tensor | None = None,
    wk_scale: Tensor | None = None,
    wv_scale: Tensor | None = None,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    qk_eps: float | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    if torch.compiler.is_compiling():
        check_no_grad("qkv", x, rms_weight, wq, wk, wv, bq, bk, bv, q_norm, k_norm)
        q, k, v = ops._qkv_op(x, rms_weight, wq, wk, wv, cos, sin, eps, head_dim, bq, bk, bv,
                              wq_scale, wk_scale, wv_scale, fp8_activations, interleaved,
                              ops.config_arg(_qkv.SPEC, config), q_norm, k_norm, qk_eps)
        # The op's outputs are [batch, seq, heads·head_dim]; the launcher's, split by head.
        bsz, seq = x.shape[0], x.shape[1]
        return (q.view(bsz, seq, -1, head_dim), k.view(bsz, seq, -1, head_dim),
                v.view(bsz, seq, -1, head_dim))
    return _qkv.qkv(x, rms_weight, wq, wk, wv, cos, sin, eps=eps, head_dim=head_dim,
                    interleaved=interleaved, bq=bq, bk=bk, bv=bv, wq_scale=wq_scale,
                    wk_scale=wk_scale, wv_scale=wv_scale, q_norm=q_norm, k_norm=k_norm,
                    qk_eps=qk_eps, fp8_activations=fp8_activations, config=config)


@_documented_as(_ffn.ffn, "ffn")
def ffn(
    x: Tensor,
    rms_weight: Tensor,
    w1: Tensor,
    w3: Tensor,
    *,
    eps: float,
    w1_scale: Tensor | None = None,
    w3_scale: Tensor | None = None,
    activation: str = "silu",
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        check_no_grad("ffn", x, rms_weight, w1, w3)
        return ops._ffn_op(x, rms_weight, w1, w3, eps, w1_scale, w3_scale, fp8_activations,
                           ops.config_arg(_ffn.SPEC, config), activation)
    return _ffn.ffn(x, rms_weight, w1, w3, eps=eps, w1_scale=w1_scale, w3_scale=w3_scale,
                    activation=activation, fp8_activations=fp8_activations, config=config)


@_documented_as(_linear.linear, "linear")
def linear(
    x: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    weight_scale: Tensor | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        check_no_grad("linear", x, weight, bias, residual)
        return ops._linear_op(x, weight, bias, residual, weight_scale, fp8_activations,
                              ops.config_arg(_linear.SPEC, config))
    return _linear.linear(x, weight, bias=bias, residual=residual, weight_scale=weight_scale,
                          fp8_activations=fp8_activations, config=config)


@_documented_as(_lola.lola, "lola")
def lola(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    *,
    eps: float,
    weight_scale: Tensor | None = None,
    fp8_activations: bool = False,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        check_no_grad("lola", x, weight, bias)
        return ops._lola_op(x, weight, bias, eps, weight_scale, fp8_activations,
                            ops.config_arg(_lola.SPEC, config))
    return _lola.lola(x, weight, bias, eps=eps, weight_scale=weight_scale,
                      fp8_activations=fp8_activations, config=config)


@_documented_as(_moe.moe, "moe")
def moe(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    *,
    gate_up_scale: Tensor | None = None,
    down_scale: Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> Tensor:
    if torch.compiler.is_compiling():
        check_no_grad("moe", x, gate_up, down, topk_weights)
        return ops._moe_op(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale,
                           ops.config_arg(_moe.SPEC, config))
    return _moe.moe(x, gate_up, down, topk_ids, topk_weights, gate_up_scale=gate_up_scale,
                    down_scale=down_scale, config=config)
