"""Kernels besides fusetune's own: declared in this process (`fusetune.autotune`), registered
by an installed package under the entry-point group `fusetune.kernels`, or named
"package.module:attribute". `fusetune.kernels.get_spec` asks here for any name that is not a
built-in kernel's.

Light on purpose: declaring a kernel imports this, not fusetune's own kernels.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from typing import Any

from fusetune.spec import KernelSpec

ENTRY_POINT_GROUP = "fusetune.kernels"
# fusetune's own kernels (fusetune.kernels.REGISTRY; a test keeps the two the same) and the
# words `fusetune search --kernel` takes for groups of them: no other kernel may take these.
BUILTIN = ("ffn", "linear", "lola", "moe", "qkv", "rmsnorm", "rmsnorm_bwd", "rope",
           "rope_bwd", "swiglu", "swiglu_bwd")
RESERVED = ("all", "training")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")

_declared: dict[str, KernelSpec] = {}


def check_name(name: str) -> None:
    """ValueError unless `name` may name a kernel of one's own."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"kernel name {name!r}: letters, digits, '_', '.', '-', not starting "
                         "with a digit")
    if name in BUILTIN or name in RESERVED:
        raise ValueError(f"kernel name {name!r} is taken by fusetune ({', '.join(BUILTIN)}, "
                         f"{', '.join(RESERVED)}): give the kernel another name=")


def declare(spec: KernelSpec) -> None:
    """Makes `spec` known by its name in this process (tables and `--points` files name it).
    ValueError where another kernel of that name is known (their table entries would mix)."""
    check_name(spec.name)
    known = _declared.get(spec.name)
    if known is not None and known.search_ref != spec.search_ref:
        raise ValueError(f"two kernels are named {spec.name!r}: {known.search_ref} and "
                         f"{spec.search_ref}; their table entries would mix: give one "
                         "another name=")
    _declared[spec.name] = spec  # the same kernel declared again (a module reloaded): newest


def _as_spec(obj: Any, ref: str) -> KernelSpec:
    spec = getattr(obj, "spec", obj)
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"{ref} is a {type(obj).__name__}, not a kernel: name a function "
                         "decorated with @fusetune.autotune (or a fusetune.spec.KernelSpec)")
    return spec


def registered() -> list[str]:
    """The names of the kernels installed packages register (entry points)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def find(ref: str) -> KernelSpec | None:
    """The kernel `ref` names (declared, "module:attribute", or an entry point), or None.
    ValueError where `ref` points at something that is not a kernel or cannot be imported."""
    if ref in _declared:
        return _declared[ref]
    if ":" in ref:
        module, _, attr = ref.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"kernel {ref!r}: cannot import it ({type(e).__name__}: {e})"
                             ) from None
        spec = _as_spec(obj, ref)
        declare(spec)
        return spec
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == ref:
            spec = _as_spec(ep.load(), f"entry point {ref!r} ({ep.value})")
            if spec.name != ref:
                raise ValueError(f"entry point {ref!r} ({ep.value}) is the kernel "
                                 f"{spec.name!r}: an entry point is named as its kernel")
            declare(spec)
            return spec
    return None
