"""The benchmarks' torch.compile column: every shape a run times is compiled, for its own
static shape."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from benchmarks import timing


def test_compile_static_compiles_each_shape_it_is_called_with() -> None:
    cfg = torch._dynamo.config
    before = cfg.recompile_limit
    # the limits compile_static raises, restored afterwards (config.patch: a config module's
    # attributes are not plain ones to monkeypatch)
    with cfg.patch(recompile_limit=cfg.recompile_limit,
                   accumulated_recompile_limit=cfg.accumulated_recompile_limit):
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
    assert cfg.recompile_limit == before  # restored
