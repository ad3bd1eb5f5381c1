"""Lookup tables shipped with fusetune (YAML, same format as `fusetune export`)."""
