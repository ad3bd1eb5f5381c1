"""benchmarks/bench_moe.py's read-only kernel on Triton's interpreter: it reads exactly the
routed experts' weights (each byte once), whatever its block and the slabs' sizes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_decode import READ_SHAPES
from benchmarks.bench_moe import read_experts, read_grid


@pytest.mark.parametrize(("block", "dtype"), [(64, torch.float32), (128, torch.float16),
                                              (32, torch.float8_e4m3fn)])
def test_read_only_kernel_reads_the_routed_experts_bytes(block: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    e, h, d = 5, 6, 20  # slabs of 240 and 120 elements: blocks straddle the two
    gate_up = torch.randn(e, 2 * h, d).to(dtype)
    down = torch.randn(e, d, h).to(dtype)
    used = torch.tensor([4, 1], dtype=torch.int32)
    sums = read_experts(gate_up, down, used, block, 4, True)
    per_expert = sums.view(2, -1).sum(1).double()
    want = torch.stack([gate_up[i].double().sum() + down[i].double().sum() for i in (4, 1)])
    assert torch.allclose(per_expert, want, rtol=1e-5, atol=1e-4)


def test_read_only_grid_fits_the_launch_limits_at_mixtrals_experts() -> None:
    # an expert of Mixtral-8x7B is 3·14336·4096 elements: at the smallest block its blocks
    # (over 85,000) must lie on grid axis 0, the only one not limited to 65535
    blocks, experts = read_grid(2, 3 * 14336 * 4096, min(b for b, _, _ in READ_SHAPES))
    assert blocks > 65535 and blocks < 2**31 and experts == 2


@pytest.mark.hf
def test_transformers_experts_are_every_one_the_installed_release_registers(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Each name transformers' ExpertsInterface holds becomes a column; the ones that run here
    # give the experts' result, the others (hub kernels that do not load on this machine) are
    # left out with a note that says why.
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from benchmarks.bench_moe import IMPLS, hf_experts, hf_impl_names
    from fusetune.kernels.moe import SPEC, _reference
    from fusetune.spec import Point

    names = hf_impl_names()
    assert names[0] == "eager" and set(names[1:]) == set(ALL_EXPERTS_FUNCTIONS.valid_keys())
    assert {"batched_mm", "grouped_mm"} <= set(names)
    assert [f"hf-{n}" for n in names] == [i for i in IMPLS if i.startswith("hf-")]
    point = Point.make("moe", {"dim": 32, "experts": 4, "hidden": 16, "top_k": 2}, 1, 5,
                       "float32")
    inputs = SPEC.make_inputs(point, "cpu")
    fns = hf_experts(inputs)
    assert set(fns) == {f"hf-{n}" for n in names}
    assert fns["hf-eager"] is not None
    want = _reference(inputs)["out"]
    for name, fn in fns.items():
        if fn is not None:
            assert torch.allclose(fn(), want, rtol=1e-4, atol=1e-5), name
    noted = capsys.readouterr().err
    for name, fn in fns.items():
        assert (fn is None) == (f"note: transformers' {name[3:]} experts left out" in noted), name


def test_layers_run_one_after_the_other_in_one_call() -> None:
    # --layers: each implementation's call runs every layer's in turn (one graph, as in a
    # model); one implementation missing at any layer leaves it out at all of them.
    from benchmarks.bench_moe import chained

    order: list[int] = []
    call = chained([lambda i=i: order.append(i) or i for i in range(3)])
    assert call is not None and call() == 2 and order == [0, 1, 2]
    assert chained([lambda: 0, None]) is None
