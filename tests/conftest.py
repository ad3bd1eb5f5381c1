"""Shared fixtures. Without CUDA, kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any fusetune.kernels module is imported (triton.jit reads it
when a kernel is decorated), so it is set here, at conftest import time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import fusetune.tables  # noqa: E402  (after TRITON_INTERPRET on purpose)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none is available)")
    for item in items:
        # the marker, not item.keywords: keywords also hold parametrize ids such as "gpu"
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No user tables, no FUSETUNE_TABLES, no cached lookups or warnings, before and after."""
    monkeypatch.delenv(fusetune.tables.ENV_VAR, raising=False)
    fusetune.tables.reset()
    yield
    fusetune.tables.reset()


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/ft.db"
