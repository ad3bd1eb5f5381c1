"""The line above every benchmark's table says how each column was timed."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks import timing


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    return types.SimpleNamespace(name="h100")


def test_heading_names_the_plain_calls(gpu: types.SimpleNamespace) -> None:
    # A benchmark that times its copy in a graph and eager/compile as plain calls says so.
    head = timing.heading(gpu, "what", plain={"eager", "compile"})
    assert "CUDA-graph replays (compile, eager: plain calls)" in head
    assert "copy" not in head
    assert "CUDA-graph replays (copy: plain calls)" in timing.heading(gpu, "what")
    assert "CUDA-graph replays," in timing.heading(gpu, "what", plain=())
    no_graph = timing.heading(gpu, "what", graphs=False, plain={"eager"})
    assert "over plain calls (--no-graph" in no_graph and "replays" not in no_graph
