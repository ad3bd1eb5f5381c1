"""The benchmarks' torch.compile column: every shape a run times is compiled, for its own
static shape."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from benchmarks import timing


def test_compile_static_compiles_each_shape_it_is_called_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):  # restored afterwards
        monkeypatch.setattr(cfg, name, getattr(cfg, name))
    torch._dynamo.reset()
    counter = CompileCounter()

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    fn = timing.compile_static(f, backend=counter)
    for n in range(1, 13):
        x = torch.randn(n, 3)
        assert torch.equal(fn(x), x * 2 + 1)
    # Twelve shapes, twelve static compiles. With dynamo's defaults the second shape gives
    # one dynamic-shape version for every size (2 compiles), and past its recompile limit
    # (8) a function runs uncompiled.
    assert counter.frame_count == 12
    torch._dynamo.reset()
