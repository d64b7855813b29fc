"""Kernels for qwen3vl-jax. Each op: `reference.py` (pure jnp, the spec), `api.py` (the switch)."""
