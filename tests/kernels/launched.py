"""What the launchers made while a test ran: the compiled kernels of one @triton.jit function
(their metadata hold the shared memory the compiler allocated) and the TMA descriptors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton.runtime.jit import JITFunction

from fusetune.kernels import _matmul


def compiled_kernels(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """A list that collects, from now on, the compiled kernel of every launch of the jit
    function named `name`."""
    compiled: list[Any] = []
    real_run = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        kern = real_run(self, *args, **kwargs)
        if self.fn.__name__ == name:
            compiled.append(kern)
        return kern

    monkeypatch.setattr(JITFunction, "run", run)
    return compiled


def descriptors_made(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """A list that collects, from now on, the tensor of every TMA descriptor the matmul
    launchers make (x first, then the weights, per launch)."""
    made: list[torch.Tensor] = []
    real = _matmul.TensorDescriptor.from_tensor

    def from_tensor(tensor: torch.Tensor, block_shape: list[int], *args: Any,
                    **kwargs: Any) -> Any:
        made.append(tensor)
        return real(tensor, block_shape, *args, **kwargs)

    monkeypatch.setattr(_matmul.TensorDescriptor, "from_tensor", staticmethod(from_tensor))
    return made
