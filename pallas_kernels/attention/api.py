"""Attention ops as the model calls them.

`implementation="xla"` runs the pure-jnp specs in `reference.py`. Pallas kernels are a later
addition; until they exist, asking for one is an error rather than a silent fallback.
"""

from __future__ import annotations

from . import reference

__all__ = ["varlen_attention", "masked_attention", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("xla", "auto")


def _check(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose from {IMPLEMENTATIONS}")


def varlen_attention(q, k, v, segment_ids, *, implementation: str = "auto"):
    """Non-causal attention within contiguous segments; q, k, v `[S, H, D]`, `segment_ids [S]`."""
    _check(implementation)
    return reference.varlen_attention(q, k, v, segment_ids)


def masked_attention(q, k, v, mask, *, implementation: str = "auto"):
    """Grouped-query attention under a boolean mask; q `[B, L, H, D]`, k/v `[B, S, G, D]`, mask `[B, L, S]`."""
    _check(implementation)
    return reference.masked_attention(q, k, v, mask)
