"""Integrations with model libraries: `hf` patches Hugging Face transformers causal LMs
(`fusetune.patch` / `fusetune.unpatch`). Nothing is imported here, so that fusetune works
without those libraries installed."""
