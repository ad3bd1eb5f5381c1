"""Command-line pieces the benchmark scripts share: their --help text, taken from their
docstrings, and --cases (a subset of a script's named cases)."""

from __future__ import annotations

import argparse
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
