"""Shape helpers shared by the specs and the kernels."""

from __future__ import annotations

__all__ = ["pow2_at_least"]


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
