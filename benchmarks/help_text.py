"""The --help text of the benchmark scripts, taken from their docstrings."""

from __future__ import annotations


def doc_summary(doc: str) -> str:
    """The first paragraph of a script's docstring as one line: its --help description (the
    first line alone often stops mid-sentence)."""
    return " ".join(doc.split("\n\n", 1)[0].split())
