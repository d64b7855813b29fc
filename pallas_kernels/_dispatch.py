"""The `implementation` switch shared by every op's `api.py`.

- `"xla"`: the pure-jnp spec in `reference.py`.
- `"pallas"`: the Pallas kernel; compiled for the GPU when the default backend is a GPU, run in
  the Pallas interpreter otherwise (so CPU tests and notebooks exercise the kernel itself).
- `"auto"`: Pallas on a GPU backend, XLA elsewhere.
"""

from __future__ import annotations

import jax

__all__ = ["IMPLEMENTATIONS", "resolve", "on_gpu"]

IMPLEMENTATIONS = ("xla", "pallas", "auto")


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def resolve(implementation: str) -> tuple[bool, bool]:
    """`(use_pallas, interpret)` for an implementation name; unknown names are an error."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    gpu = on_gpu()
    if implementation == "xla" or (implementation == "auto" and not gpu):
        return False, False
    return True, not gpu
