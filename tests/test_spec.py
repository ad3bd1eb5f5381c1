"""KernelSpec helpers: the roofline floor, fitting a GPU's limits."""

from __future__ import annotations

import dataclasses

from fusetune import gpus
from fusetune.spec import Cost, Resources, check_fits


def test_floor_is_the_larger_of_bytes_and_flops_time() -> None:
    c = Cost(bytes=3_000_000, flops=2_000_000_000)
    assert c.floor_us(3000.0, None) == 1.0  # 3 MB at 3 TB/s
    assert c.floor_us(3000.0, 1000.0) == 2.0  # 2 GFLOP at 1 PFLOP/s dominates
    assert c.floor_us(None, None) is None  # a GPU outside the catalogue: unknown rates


def test_check_fits_names_the_limit() -> None:
    h100, rtx = gpus.resolve("h100"), gpus.resolve("3090")
    ok = Resources(smem_bytes=150_000, regs_per_thread=128, threads=256)
    assert check_fits(ok, h100) is None
    assert check_fits(ok, rtx).startswith("shared-memory: 150000 B > 101376 B")
    assert check_fits(Resources(0, 300, 128), h100).startswith("registers")
    assert check_fits(Resources(0, 32, 2048), h100).startswith("threads")


def test_spillable_registers_count_only_up_to_what_the_block_leaves() -> None:
    h100 = gpus.resolve("h100")  # 65536 registers a block
    # 512 threads: 128 registers each. 128 that must stay and 64 that may spill: fits.
    assert check_fits(Resources(0, 192, 512, spill_regs=64), h100) is None
    assert check_fits(Resources(0, 192, 512), h100).startswith("registers: ~192×512")
    # What must stay in registers counts in full.
    assert check_fits(Resources(0, 192, 512, spill_regs=32), h100).startswith(
        "registers: ~160×512")
    # The cap is the GPU's own: half the register file leaves 64 a thread.
    half = dataclasses.replace(h100, regs_per_block=32768)
    assert check_fits(Resources(0, 96, 512, spill_regs=32), half) is None
    assert check_fits(Resources(0, 96, 512, spill_regs=16), half).startswith("registers")


def test_dims_problem_sizes_choices_and_dims_together() -> None:
    from fusetune.kernels import get_spec

    ffn, moe = get_spec("ffn"), get_spec("moe")
    assert ffn.dims_problem({"dim": 64, "hidden": 96}) is None
    assert ffn.dims_problem({"dim": 64, "hidden": 96, "act": 1}) is None
    assert "act=2 is none of ffn's choices" in str(ffn.dims_problem({"dim": 64, "hidden": 96,
                                                                        "act": 2}))
    assert "hidden=0 must be a positive integer" in str(ffn.dims_problem({"dim": 64,
                                                                          "hidden": 0}))
    assert "hidden=1.5 must be an integer" in str(ffn.dims_problem({"dim": 64, "hidden": 1.5}))
    assert "must be an integer" in str(ffn.dims_problem({"dim": True, "hidden": 8}))
    assert moe.dims_problem({"dim": 8, "experts": 4, "hidden": 8, "top_k": 4}) is None
    assert "top_k=5 must be at most experts=4" in str(
        moe.dims_problem({"dim": 8, "experts": 4, "hidden": 8, "top_k": 5}))
    # a kernel of one's own keys on its arguments as they are: 0 is a value, -1 is not
    own = dataclasses.replace(ffn, ref="pkg.mod:kernel", dim_choices={})
    assert own.dims_problem({"dim": 0, "hidden": 96}) is None
    assert "dim=-1 must be a non-negative integer" in str(own.dims_problem({"dim": -1,
                                                                            "hidden": 96}))
