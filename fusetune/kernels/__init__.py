"""The fused kernels. `REGISTRY` maps each kernel's name to its `KernelSpec`."""

from __future__ import annotations

from fusetune import registry
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

REGISTRY: dict[str, KernelSpec] = {
    _rmsnorm.SPEC.name: _rmsnorm.SPEC,
    _rmsnorm_bwd.SPEC.name: _rmsnorm_bwd.SPEC,
    _ffn.SPEC.name: _ffn.SPEC,
    _lola.SPEC.name: _lola.SPEC,
    _qkv.SPEC.name: _qkv.SPEC,
    _rope.SPEC.name: _rope.SPEC,
    _linear.SPEC.name: _linear.SPEC,
    _rope_bwd.SPEC.name: _rope_bwd.SPEC,
    _swiglu.SPEC.name: _swiglu.SPEC,
    _swiglu_bwd.SPEC.name: _swiglu_bwd.SPEC,
    _moe.SPEC.name: _moe.SPEC,
}


def get_spec(name: str) -> KernelSpec:
    """The spec of kernel `name`: fusetune's own, one declared with fusetune.autotune in this
    process, one an installed package registers (entry-point group `fusetune.kernels`), or
    "package.module:attribute" of a kernel declared with fusetune.autotune. ValueError naming
    the valid kernels."""
    if name in REGISTRY:
        return REGISTRY[name]
    spec = registry.find(name)
    if spec is None:
        others = registry.registered()
        raise ValueError(
            f"unknown kernel {name!r}; valid: {', '.join(sorted(REGISTRY))}"
            + (f"; registered by installed packages: {', '.join(others)}" if others else "")
            + "; or package.module:name of a kernel declared with @fusetune.autotune")
    return spec
