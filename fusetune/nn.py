"""torch.nn modules on fusetune's kernels, for training as well as inference.

    norm = fusetune.nn.RMSNorm(4096, eps=1e-5)       # a new norm, weight of ones
    norm = fusetune.nn.RMSNorm.from_hf(layer.input_layernorm)   # shares the HF norm's weight
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fusetune import ops


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension on fusetune's kernels: rmsnorm forward, rmsnorm_bwd for
    the gradients, each launched with the config the lookup tables give for the GPU and shape.

    The interface of Hugging Face's LlamaRMSNorm (Qwen2's and Mistral's are the same):
    `RMSNorm(hidden_size, eps=1e-6)`, the Parameter `weight` (ones), the attribute
    `variance_epsilon`, `forward(hidden_states)`. Traceable by torch.compile (through
    `fusetune.ops`), differentiable in x and weight.

    Numerics: fusetune normalizes and multiplies by the weight in float32 and rounds once, to
    the input's dtype. Hugging Face rounds the normalized x to the input's dtype first and then
    multiplies by the weight, so in float16 and bfloat16 the two differ by that one rounding;
    in float32 they agree. (HF's output takes the promoted dtype of weight and input; here it
    is always the input's.)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    @classmethod
    def from_hf(cls, module: Any) -> RMSNorm:
        """An RMSNorm that shares `module`'s weight Parameter (the same object: an update to
        one is an update to the other, and an optimizer of either trains both) and its
        epsilon (`variance_epsilon`), for a Hugging Face LlamaRMSNorm, Qwen2RMSNorm or
        MistralRMSNorm. ValueError for a module without them (a norm of another formula,
        such as Gemma's (1 + weight), keeps its epsilon as `eps`)."""
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.ndim != 1:
            raise ValueError(f"RMSNorm.from_hf: {name} has no 1-D weight Parameter (got "
                             f"{type(weight).__name__})")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(f"RMSNorm.from_hf: {name}.variance_epsilon is {eps!r}; expected a "
                             "positive number (Hugging Face's LlamaRMSNorm, Qwen2RMSNorm and "
                             "MistralRMSNorm have it)")
        norm = cls(weight.shape[0], eps, device="meta")  # its own weight is replaced below
        norm.weight = weight
        return norm
