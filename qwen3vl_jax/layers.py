"""Building blocks shared by the vision tower and the language model.

Numerics follow HF: LayerNorm statistics in float32 with the two-pass variance (Flax's default
fast variance E[x^2] - E[x]^2 loses digits that torch keeps); RMSNorm normalizes in float32,
casts back, then scales; rotary is applied by the callers in float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

__all__ = ["Linear", "LayerNorm", "RMSNorm", "rotate_half", "apply_rotary"]


Linear = nnx.Linear
"""`nnx.Linear`: kernel `[in, out]` (HF's weight transposed), optional bias."""

LayerNorm = functools.partial(nnx.LayerNorm, epsilon=1e-6, use_fast_variance=False)
"""LayerNorm with HF's epsilon (1e-6) and an exact two-pass variance."""


class RMSNorm(nnx.Module):
    """Qwen3's RMSNorm: `weight * (x / rms(x))`, normalized in float32 (`Qwen3VLTextRMSNorm`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x32 = x.astype(jnp.float32)
        normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return self.weight[...] * normed.astype(x.dtype)


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    """`[x1, x2] -> [-x2, x1]` over the last axis (the rotate-half rotary layout)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half rotary in float32, cast back to x's dtype; cos/sin broadcast against x."""
    x32 = x.astype(jnp.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)
