"""The launchers' memo of their checks and lookup: a repeated call with the same tensors'
metadata skips to the launch and gives the same result; anything else is checked in full."""

from __future__ import annotations

import pytest
import torch

import fusetune
import fusetune.tables
from fusetune.kernels import linear as linear_mod
from fusetune.kernels import qkv as qkv_mod
from fusetune.kernels import rmsnorm as rmsnorm_mod
from fusetune.kernels.rope import rotary_tables

pytestmark = pytest.mark.filterwarnings("ignore::fusetune.FusetuneWarning")


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    pass


def test_repeated_call_uses_the_memo_and_the_same_config(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    with torch.no_grad():
        first = fusetune.rmsnorm(x, w, eps=1e-5)
        assert len(rmsnorm_mod._MEMO) == 1

        def no_lookup(*args: object, **kwargs: object) -> None:
            raise AssertionError("looked up again")

        monkeypatch.setattr("fusetune.runtime.cached_config", no_lookup)
        again = fusetune.rmsnorm(x + 1, w, eps=1e-5)  # other values, same metadata
    want = (x + 1) * torch.rsqrt((x + 1).pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(first, again)


def test_other_metadata_is_checked_in_full() -> None:
    x, w = torch.randn(3, 40), torch.rand(40) + 0.5
    with torch.no_grad():
        fusetune.rmsnorm(x, w, eps=1e-5)
        with pytest.raises(ValueError, match=r"weight has shape \(39,\)"):
            fusetune.rmsnorm(x, w[:39], eps=1e-5)
        with pytest.raises(ValueError, match="eps"):
            fusetune.rmsnorm(x, w, eps=-1.0)
        with pytest.raises(TypeError):
            fusetune.linear(x, torch.randn(8, 40, dtype=torch.float64))
    # with gradients enabled the memo is not used: the missing backward is refused
    with pytest.raises(RuntimeError, match="requires grad"):
        fusetune.linear(x.requires_grad_(), torch.randn(8, 40))


def test_qkv_memo_keeps_biases_scales_and_tables_per_call() -> None:
    torch.manual_seed(0)
    d, hd = 32, 8
    x = torch.randn(1, 3, d)
    g = torch.rand(d) + 0.5
    wq, wk, wv = torch.randn(d, d) / 6, torch.randn(16, d) / 6, torch.randn(16, d) / 6
    cos, sin = rotary_tables(torch.arange(3)[None], hd, theta=10000.0)
    outs = []
    with torch.no_grad():
        for bias_value in (0.0, 1.0):
            bq = torch.full((d,), bias_value)
            outs.append(fusetune.qkv(x, g, wq, wk, wv, cos, sin, eps=1e-5, head_dim=hd,
                                     interleaved=False, bq=bq))
    assert len(qkv_mod._MEMO) == 1  # one entry served both calls
    q0, k0, v0 = outs[0]
    q1, k1, v1 = outs[1]
    torch.testing.assert_close(k0, k1)  # bk and bv are zeros in both calls
    torch.testing.assert_close(v0, v1)
    assert not torch.allclose(q0, q1)


def test_memo_is_cleared_with_the_tables() -> None:
    with torch.no_grad():
        fusetune.linear(torch.randn(2, 16), torch.randn(8, 16))
    assert len(linear_mod._MEMO) == 1
    fusetune.tables.reset()
    assert len(linear_mod._MEMO) == 0
