"""KernelSpec helpers: the roofline floor, fitting a GPU's limits."""

from __future__ import annotations

from fusetune import gpus
from fusetune.kernels._spec import Cost, Resources, check_fits


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
