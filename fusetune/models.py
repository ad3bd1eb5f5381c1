"""Model presets: the dimensions that decide each kernel's shapes (`--model llama-2-7b`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    name: str
    dim: int  # hidden size (the RMSNorm / LayerNorm width)
    hidden: int  # feed-forward width
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-2-7b", dim=4096, hidden=11008, n_heads=32, n_kv_heads=32, head_dim=128),
        ModelPreset("llama-2-13b", dim=5120, hidden=13824, n_heads=40, n_kv_heads=40, head_dim=128),
        ModelPreset("llama-2-70b", dim=8192, hidden=28672, n_heads=64, n_kv_heads=8, head_dim=128),
        ModelPreset("llama-3-8b", dim=4096, hidden=14336, n_heads=32, n_kv_heads=8, head_dim=128),
        ModelPreset("mistral-7b", dim=4096, hidden=14336, n_heads=32, n_kv_heads=8, head_dim=128),
        ModelPreset("gpt2", dim=768, hidden=3072, n_heads=12, n_kv_heads=12, head_dim=64),
        # Small enough for Triton's CPU interpreter (the default grid without a GPU).
        ModelPreset("tiny", dim=256, hidden=688, n_heads=4, n_kv_heads=2, head_dim=64),
    )
}


def preset(name: str) -> ModelPreset:
    """The preset called `name` (case-insensitive); ValueError listing the valid names."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[key]
