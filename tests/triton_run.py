"""Triton's own launch path for a test that needs it (tests/fake_jit.py wraps it)."""

from __future__ import annotations

import sys

import pytest
from triton.runtime.jit import JITFunction


def genuine_triton_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's own JITFunction.run for the test: tests/fake_jit.py, imported wherever the
    suite collects a test that uses it, wraps it for the whole process, and a wrapped run sends
    every launch down Triton's path."""
    fake_jit = sys.modules.get("fake_jit")
    if fake_jit is not None:
        monkeypatch.setattr(JITFunction, "run", fake_jit.TRITON_RUN)
