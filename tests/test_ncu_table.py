"""benchmarks/ncu_table.py on a stored Nsight Compute run (H100, FP8-weight decode kernels)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.ncu_table import read_rows, steps, table

RUN = Path(__file__).parent.parent / "benchmarks/results/gemv_experiments_h100/profile_fp8"


def test_table_pairs_profiled_kernels_with_the_steps_and_shows_stalls_and_pipes() -> None:
    rows, units = read_rows(RUN / "ncu.csv")
    lines = table(rows, units, steps(RUN / "ncu.log")).splitlines()
    assert lines[0].endswith("| top stalls (warps per issue) | busiest pipes (% of peak) |")
    body = lines[2:]
    # The last launch of each of six names: three fused kernels, each with its read-only twin.
    assert [line.split(" | ")[1] for line in body] == [
        "_ffn_kernel", "_read_kernel", "_qkv_kernel", "_read_kernel", "_lola_kernel",
        "_read_kernel"]
    ffn = [c.strip() for c in body[0].strip("|").split("|")]
    assert ffn[2] == "38.6"  # µs
    assert ffn[7] == "159"  # registers a thread
    assert ffn[-2].startswith("long_scoreboard 4.5")
    assert ffn[-1] == "fma 19.4, fma_type_fp16 18.2, alu 17.1"
    read = [c.strip() for c in body[1].strip("|").split("|")]
    assert read[-1].startswith("lsu 30.8")
