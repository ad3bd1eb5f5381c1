"""Rotary position embedding: rotates each pair i of x's heads by its token's angle for pair i.

The angles come as the caller's tables, as Hugging Face's rotary embeddings return them: cos and
sin [batch or 1, seq, head_dim] (or head_dim/2), column i < head_dim/2 for pair i. So the
model's own positions (per token), inverse frequencies, rope scaling and attention scaling are
what the kernel applies. `rotary_tables` builds the tables of the plain (unscaled) rotary
embedding. interleaved=True pairs (2i, 2i+1) as in the original Llama code; interleaved=False
pairs (i, i + head_dim/2) as in Hugging Face's rotate_half. The rotation is computed in
float32; the output has x's dtype.

Differentiable in x: where autograd records the call, the backward is `rope_bwd` (the inverse
rotation, a kernel tuned of its own); cos and sin get no gradient, so tables that require grad
are refused. The kernel is in `_rotary` (shared with rope_bwd through its INVERSE flag).

Tunables (search_spaces/rope.yaml): BLOCK_T (tokens per program), BLOCK_H (heads per program),
num_warps. There is no loop, so no num_stages. The layout is a dim of the point (`interleaved`
1 or 0): the two layouts are different kernels and are tuned separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fusetune.kernels import _rotary
from fusetune.kernels._rotary import check_tables, check_x, rotary_tables, rotate, rotated
from fusetune.kernels.rope_bwd import rope_bwd
from fusetune.spec import Config, KernelSpec, Point, Tensors

__all__ = ["SPEC", "check_tables", "rope", "rotary_tables", "rotated"]


class _Rope(torch.autograd.Function):
    """y = rope(x) with dx = rope_bwd(dy): the tables are saved, nothing of x or y."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                interleaved: bool, config: Config | None) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return rotate(x, cos, sin, interleaved, False, config, SPEC)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return rope_bwd(dy, cos, sin, interleaved=ctx.interleaved), None, None, None, None


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Rotary embedding of x [batch, seq, heads, head_dim] by the tables cos and sin [batch or
    1, seq, head_dim or head_dim/2] (column i < head_dim/2 for pair i: a rotary embedding's
    output, or `rotary_tables`); returns a new tensor of x's dtype.

    `interleaved` is the caller's layout, never guessed: True pairs (2i, 2i+1), False pairs
    (i, i + head_dim/2) as Hugging Face's rotate_half. The config (BLOCK_T, BLOCK_H,
    num_warps) comes from the lookup tables for this GPU and shape unless `config` is given
    (it sets the forward's; the backward's comes from rope_bwd's entries).

    Where x requires grad (and grad mode is on) the call is recorded for autograd, with
    `rope_bwd` as its backward; tables that require grad raise RuntimeError (their gradient is
    not computed).
    """
    check_x(x, interleaved, "rope")
    bsz, seq, _, d = x.shape
    cos, sin = check_tables(cos, sin, bsz, seq, d, x.device, "rope")
    cfg = None if config is None else SPEC.validate_config(config)
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        if cos.requires_grad or sin.requires_grad:
            raise RuntimeError(
                "rope: cos or sin requires grad, but fusetune's rope computes the gradient of "
                "x only (the backward rotates dy back by the same angles); the tables' "
                "gradient would be missing. Pass detached tables (a rotary embedding's have no "
                "parameters: build them under torch.no_grad()).")
        return _Rope.apply(x, cos, sin, interleaved, cfg)
    return rotate(x, cos, sin, interleaved, False, cfg, SPEC)


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    x, cos, sin = _rotary.make_tensor_and_tables(point, device)
    return {"x": x, "cos": cos, "sin": sin, "interleaved": bool(point.dim["interleaved"])}


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"y": torch.empty_like(inputs["x"])}


def _reference(inputs: Tensors) -> Tensors:
    return {"y": rotated(inputs["x"], inputs["cos"], inputs["sin"], inputs["interleaved"])}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    _rotary.launch_rotation(inputs["x"], outputs["y"], inputs["cos"], inputs["sin"],
                            inputs["interleaved"], False, config)


SPEC = KernelSpec(
    name="rope",
    description="rotary position embedding on [batch, seq, heads, head_dim], cos/sin tables",
    dim_names=_rotary.DIM_NAMES,
    config_keys=_rotary.CONFIG_KEYS,
    pow2_keys=_rotary.CONFIG_KEYS,
    make_inputs=_make_inputs,
    make_outputs=_make_outputs,
    reference=_reference,
    launch=_launch,
    default_config=_rotary.default_config,
    resources=_rotary.resources,
    cost=_rotary.cost,
    canonical=_rotary.canonical,
    dims_from_model=_rotary.dims_from_model,
    source_objects=_rotary.SOURCES,
    dim_choices={"interleaved": _rotary.PAIRING},
    check_dims=_rotary.head_dim_problem,
)
