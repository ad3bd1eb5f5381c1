"""fusetune.nn.RMSNorm: Hugging Face's LlamaRMSNorm interface on fusetune's kernels (Triton
interpreter on CPU), trained through rmsnorm_bwd."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusetune

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


@pytest.fixture(autouse=True)
def _tables(fresh_tables: None) -> None:
    warnings.simplefilter("ignore", fusetune.FusetuneWarning)


def hf_norm(d: int, seed: int = 0) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(d, eps=EPS).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(d, generator=g))
    return norm


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def test_reachable_after_import_fusetune() -> None:
    import fusetune.nn as nn_mod

    assert fusetune.nn is nn_mod and fusetune.nn.RMSNorm is nn_mod.RMSNorm


def test_interface_of_llama_rmsnorm() -> None:
    norm = fusetune.nn.RMSNorm(64, eps=EPS)
    assert isinstance(norm.weight, torch.nn.Parameter) and torch.equal(norm.weight,
                                                                       torch.ones(64))
    assert norm.variance_epsilon == EPS
    assert fusetune.nn.RMSNorm(8).variance_epsilon == 1e-6  # HF's default
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert repr(norm) == f"RMSNorm((64,), eps={EPS})" == repr(hf_norm(64)).replace("Llama", "")


def test_from_hf_shares_the_weight_and_eps() -> None:
    hf = hf_norm(64)
    norm = fusetune.nn.RMSNorm.from_hf(hf)
    assert norm.weight is hf.weight and norm.variance_epsilon == hf.variance_epsilon
    with torch.no_grad():
        hf.weight.mul_(2.0)  # an update to one is seen by the other
    assert torch.equal(norm.weight, hf.weight)
    with torch.no_grad():
        norm.weight.add_(1.0)
    assert torch.equal(norm.weight, hf.weight)


def test_matches_hf_forward_and_backward_in_float32() -> None:
    hf = hf_norm(300, seed=1)
    norm = fusetune.nn.RMSNorm.from_hf(hf)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 300, generator=g).to(DEVICE)
    dy = torch.randn(2, 5, 300, generator=g).to(DEVICE)
    x_hf, x_ft = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_hf = hf(x_hf)
    y_hf.backward(dy)
    dw_hf = hf.weight.grad.clone()
    hf.weight.grad = None  # the Parameter is shared: its gradient too
    y_ft = norm(x_ft)
    y_ft.backward(dy)
    assert y_ft.dtype == y_hf.dtype == torch.float32
    assert rel_err(y_ft, y_hf) <= 1e-6
    assert rel_err(x_ft.grad, x_hf.grad) <= 1e-5
    assert rel_err(norm.weight.grad, dw_hf) <= 1e-5


def test_an_optimizer_step_through_the_module() -> None:
    norm = fusetune.nn.RMSNorm(64, eps=EPS)
    opt = torch.optim.SGD(norm.parameters(), lr=0.1)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    before = norm.weight.detach().clone()
    norm(x).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(norm.weight, before)


def test_no_grad_still_works() -> None:
    hf = hf_norm(64, seed=4)
    norm = fusetune.nn.RMSNorm.from_hf(hf)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        y = norm(x)
        ref = hf(x)
    assert not y.requires_grad and rel_err(y, ref) <= 1e-6


def test_from_hf_refuses_other_norms() -> None:
    class GemmaStyle(torch.nn.Module):  # epsilon as `eps`, a (1 + weight) formula
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.eps = 1e-6

    with pytest.raises(ValueError, match=r"GemmaStyle\.variance_epsilon is None"):
        fusetune.nn.RMSNorm.from_hf(GemmaStyle())
    with pytest.raises(ValueError, match="no 1-D weight Parameter"):
        fusetune.nn.RMSNorm.from_hf(torch.nn.ReLU())


def test_bad_eps_raises_naming_the_value() -> None:
    norm = fusetune.nn.RMSNorm(64, eps=0.0)
    with pytest.raises(ValueError, match=r"eps=0\.0"):
        norm(torch.randn(2, 64, device=DEVICE))
