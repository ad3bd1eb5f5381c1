"""fusetune: fused Triton kernels for LLM inference, launched with configs tuned offline.

    y = fusetune.rmsnorm(x, weight)          # config looked up for this GPU, shape and dtype
    norm = fusetune.nn.RMSNorm(4096, eps=1e-5)   # a trainable module (rmsnorm + rmsnorm_bwd)
    fusetune.load_tables("tables.yaml")      # tables from `fusetune export` (or FUSETUNE_TABLES)
    fusetune.lookup("rmsnorm", {"dim": 4096}, "float16", rows=16)
    w1q, s1 = fusetune.quantize_fp8(w1)      # FP8 weights + per-channel scales, once per model
    fusetune.patch(model)                    # a transformers Llama, Qwen2, Phi-3, ...
    @fusetune.autotune(space=..., key=[...])  # your own @triton.jit kernel, tuned offline

Importing fusetune loads the kernels lazily and never imports optuna or sqlalchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Cost", "FusetuneWarning", "KernelSpec", "NotTunedError", "Point", "Resources",
           "SelfCheckError", "TableError", "TunedKernel", "autotune", "ffn", "linear",
           "load_tables", "lola", "lookup", "moe", "nn", "patch", "qkv", "quantize_fp8", "resolve",
           "rmsnorm", "rmsnorm_bwd", "rope", "swiglu", "unpatch"]

# The kernels' public functions are fusetune.api's: the launchers when called eagerly, their
# custom ops under torch.compile.
_LAZY = {
    "rmsnorm": ("fusetune.api", "rmsnorm"),
    "rmsnorm_bwd": ("fusetune.api", "rmsnorm_bwd"),
    "ffn": ("fusetune.api", "ffn"),
    "lola": ("fusetune.api", "lola"),
    "linear": ("fusetune.api", "linear"),
    "qkv": ("fusetune.api", "qkv"),
    "rope": ("fusetune.api", "rope"),
    "swiglu": ("fusetune.api", "swiglu"),
    "moe": ("fusetune.api", "moe"),
    "quantize_fp8": ("fusetune.kernels.fp8", "quantize_fp8"),
    "load_tables": ("fusetune.tables", "load_tables"),
    "lookup": ("fusetune.tables", "lookup"),
    "resolve": ("fusetune.tables", "resolve"),
    "TableError": ("fusetune.tables", "TableError"),
    "FusetuneWarning": ("fusetune.tables", "FusetuneWarning"),
    "SelfCheckError": ("fusetune.integrations.hf_check", "SelfCheckError"),
    "patch": ("fusetune.integrations.hf", "patch"),
    "unpatch": ("fusetune.integrations.hf", "unpatch"),
    "nn": ("fusetune.nn", ""),  # the module itself
    "autotune": ("fusetune.autotuned", "autotune"),
    "TunedKernel": ("fusetune.autotuned", "TunedKernel"),
    "NotTunedError": ("fusetune.autotuned", "NotTunedError"),
    "KernelSpec": ("fusetune.spec", "KernelSpec"),
    "Point": ("fusetune.spec", "Point"),
    "Resources": ("fusetune.spec", "Resources"),
    "Cost": ("fusetune.spec", "Cost"),
}

if TYPE_CHECKING:
    from fusetune import nn
    from fusetune.api import ffn, linear, lola, moe, qkv, rmsnorm, rmsnorm_bwd, rope, swiglu
    from fusetune.autotuned import NotTunedError, TunedKernel, autotune
    from fusetune.integrations.hf_check import SelfCheckError
    from fusetune.kernels.fp8 import quantize_fp8
    from fusetune.spec import Cost, KernelSpec, Point, Resources
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
