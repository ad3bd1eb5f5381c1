"""fusetune: fused Triton kernels for LLM inference, launched with configs tuned offline.

    y = fusetune.rmsnorm(x, weight)          # config looked up for this GPU, shape and dtype
    norm = fusetune.nn.RMSNorm(4096, eps=1e-5)   # a trainable module (rmsnorm + rmsnorm_bwd)
    fusetune.load_tables("tables.yaml")      # tables from `fusetune export` (or FUSETUNE_TABLES)
    fusetune.lookup("rmsnorm", {"dim": 4096}, "float16", rows=16)
    w1q, s1 = fusetune.quantize_fp8(w1)      # FP8 weights + per-channel scales, once per model
    fusetune.patch(model)                    # a transformers Llama/Mistral/Qwen2 on the fused ops

Importing fusetune loads the kernels lazily and never imports optuna or sqlalchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["FusetuneWarning", "TableError", "ffn", "linear", "load_tables", "lola", "lookup",
           "nn", "patch", "qkv", "quantize_fp8", "resolve", "rmsnorm", "rmsnorm_bwd", "rope",
           "swiglu", "unpatch"]

_LAZY = {
    "rmsnorm": ("fusetune.kernels.rmsnorm", "rmsnorm"),
    "rmsnorm_bwd": ("fusetune.kernels.rmsnorm_bwd", "rmsnorm_bwd"),
    "ffn": ("fusetune.kernels.ffn", "ffn"),
    "lola": ("fusetune.kernels.lola", "lola"),
    "linear": ("fusetune.kernels.linear", "linear"),
    "qkv": ("fusetune.kernels.qkv", "qkv"),
    "rope": ("fusetune.kernels.rope", "rope"),
    "swiglu": ("fusetune.kernels.swiglu", "swiglu"),
    "quantize_fp8": ("fusetune.kernels.fp8", "quantize_fp8"),
    "load_tables": ("fusetune.tables", "load_tables"),
    "lookup": ("fusetune.tables", "lookup"),
    "resolve": ("fusetune.tables", "resolve"),
    "TableError": ("fusetune.tables", "TableError"),
    "FusetuneWarning": ("fusetune.tables", "FusetuneWarning"),
    "patch": ("fusetune.integrations.hf", "patch"),
    "unpatch": ("fusetune.integrations.hf", "unpatch"),
    "nn": ("fusetune.nn", ""),  # the module itself
}

if TYPE_CHECKING:
    from fusetune import nn
    from fusetune.kernels.ffn import ffn
    from fusetune.kernels.fp8 import quantize_fp8
    from fusetune.kernels.linear import linear
    from fusetune.kernels.lola import lola
    from fusetune.kernels.qkv import qkv
    from fusetune.kernels.rmsnorm import rmsnorm
    from fusetune.kernels.rmsnorm_bwd import rmsnorm_bwd
    from fusetune.kernels.rope import rope
    from fusetune.kernels.swiglu import swiglu
    from fusetune.tables import FusetuneWarning, TableError, load_tables, lookup, resolve


def __getattr__(name: str) -> Any:
    # Lazy so that `import fusetune` (and the CLI) can set TRITON_INTERPRET before Triton loads.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        if attr:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fusetune' has no attribute {name!r}")
