"""RoPE's backward: dx = R(−angle)·dy, the inverse rotation of the output's gradient.

y = R(angle)·x pair by pair, and a rotation's transpose is its inverse, so the gradient of x is
dy rotated back by the same angles: the forward's kernel (`_rotary`) with sin negated
(INVERSE), reading the same cos/sin tables [batch or 1, seq, head_dim or head_dim/2] (per-token
positions), in either pairing (`interleaved`). float32 math, dx in dy's dtype. Nothing of the
forward's input or output is needed: the tables are all that autograd saves.

`fusetune.rope` launches it as its backward; `rope_bwd(dy, cos, sin, interleaved=...)` runs it
alone. It is a kernel of its own for the tuner and the tables (its own name, space, entries),
with rope's tunables: BLOCK_T (tokens per program), BLOCK_H (heads per program), num_warps.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fusetune.kernels import _rotary
from fusetune.spec import Config, KernelSpec, Point, Tensors, check_no_grad


def rope_bwd(
    dy: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """The gradient of rope's x from its output's gradient dy [batch, seq, heads, head_dim]:
    dy rotated by −angle with the forward's tables cos and sin [batch or 1, seq, head_dim or
    head_dim/2] and pairing `interleaved`; a new tensor of dy's dtype. The config (BLOCK_T,
    BLOCK_H, num_warps) comes from rope_bwd's lookup entries unless `config` is given."""
    _rotary.check_x(dy, interleaved, "rope_bwd", what="dy")
    bsz, seq, _, d = dy.shape
    cos, sin = _rotary.check_tables(cos, sin, bsz, seq, d, dy.device, "rope_bwd")
    check_no_grad("rope_bwd", dy, cos, sin)
    cfg = None if config is None else SPEC.validate_config(config)
    return _rotary.rotate(dy, cos, sin, interleaved, True, cfg, SPEC)


# ---- what the tuner needs -------------------------------------------------------------------


def _make_inputs(point: Point, device: torch.device | str) -> Tensors:
    dy, cos, sin = _rotary.make_tensor_and_tables(point, device)
    return {"dy": dy, "cos": cos, "sin": sin, "interleaved": bool(point.dim["interleaved"])}


def _make_outputs(inputs: Tensors) -> Tensors:
    return {"dx": torch.empty_like(inputs["dy"])}


def _reference(inputs: Tensors) -> Tensors:
    return {"dx": _rotary.rotated(inputs["dy"], inputs["cos"], -inputs["sin"],
                                  inputs["interleaved"])}


def _launch(inputs: Tensors, outputs: Tensors, config: Config) -> None:
    _rotary.launch_rotation(inputs["dy"], outputs["dx"], inputs["cos"], inputs["sin"],
                            inputs["interleaved"], True, config)


SPEC = KernelSpec(
    name="rope_bwd",
    description="RoPE backward: dy rotated back by the cos/sin tables' angles (dx)",
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
