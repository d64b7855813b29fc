"""Static shape ladders: the sizes jitted stages are compiled for.

A jitted function compiles once per input shape, so inputs of every size are padded up to one of a
few sizes: prompt lengths (`generate.prompt_buckets`) and vision-encoder token budgets
(`buckets.EncoderRunner`). Both use `Buckets`; this module imports nothing else from the package,
so text generation does not pull in the vision tower.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Buckets", "quarter_octave"]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """An ascending ladder of sizes; `fit(n)` is the smallest one that holds n."""

    sizes: tuple[int, ...]

    def __post_init__(self):
        sizes = tuple(sorted(set(int(s) for s in self.sizes)))
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"bucket sizes must be positive, got {self.sizes}")
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def doubling(cls, smallest: int, largest: int) -> "Buckets":
        """smallest, 2*smallest, 4*smallest, ... up to and including `largest`."""
        if largest < smallest:
            raise ValueError(f"largest bucket {largest} is below the smallest {smallest}")
        sizes, size = [], smallest
        while size < largest:
            sizes.append(size)
            size *= 2
        return cls(tuple(sizes) + (largest,))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fit(self, n: int) -> int:
        for size in self.sizes:
            if n <= size:
                return size
        raise ValueError(f"{n} exceeds the largest bucket {self.largest}")


def quarter_octave(n: int) -> int:
    """The smallest size >= n of the form m * 2**e with m in 4..7 (n itself below 8): four sizes per
    doubling, so at most 25% padding and a few compiles over any range (98 -> 112, 130 -> 160)."""
    n = int(n)
    if n < 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 3)  # n lies in [4 * step, 8 * step)
    return -(-n // step) * step
