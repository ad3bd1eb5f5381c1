"""Command-line pieces the benchmark scripts share: their --help text, taken from their
docstrings, --cases (a subset of a script's named cases), and the check of --device."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence


def doc_summary(doc: str) -> str:
    """The first paragraph of a script's docstring as one line: its --help description (the
    first line alone often stops mid-sentence)."""
    return " ".join(doc.split("\n\n", 1)[0].split())


def add_cases_option(ap: argparse.ArgumentParser, named: Mapping[str, object],
                     default: Sequence[str], what: str = "cases") -> None:
    """--cases NAME,NAME,...: which of the script's `named` cases to time (default: `default`)."""
    ap.add_argument("--cases", help=f"comma-separated names of the {what} to time (default: "
                    f"{','.join(default)}; valid: {','.join(named)})")


def chosen_cases(ap: argparse.ArgumentParser, value: str | None, named: Mapping[str, object],
                 default: Sequence[str]) -> list[str]:
    """The names --cases gave (`value`), else `default`; an unknown name is a usage error that
    names the valid ones."""
    names = value.split(",") if value else list(default)
    bad = [n for n in names if n not in named]
    if bad:
        ap.error(f"unknown case(s) {','.join(bad)}; valid: {','.join(named)}")
    return names


def device_usable(device: str) -> bool:
    """Whether the scripts that run whole models can run on `device` ("cuda", or "cpu" through
    Triton's interpreter); where not, one line on stderr says why."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return False
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("--device cpu runs fusetune's kernels through Triton's interpreter: set "
              "TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return False
    return True
