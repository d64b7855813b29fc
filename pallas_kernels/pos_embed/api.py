"""The position-embedding interpolation op as the model calls it.

`implementation="xla"` runs the pure-jnp spec. The Pallas kernel is a later addition; until it
exists, asking for it is an error rather than a silent fallback.
"""

from __future__ import annotations

from . import reference

__all__ = ["interpolate_pos_embed", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("xla", "auto")


def interpolate_pos_embed(table, indices, weights, *, implementation: str = "auto"):
    """`[P, D]` float32 bilinear position embeddings from the `[side*side, D]` table.

    `indices` / `weights` (`[P, 4]`) come from `reference.interpolation_taps` on the host.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    return reference.interpolate_pos_embed(table, indices, weights)
