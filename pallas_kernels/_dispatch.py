"""The `implementation` switch shared by every op's `api.py`.

- `"xla"`: the pure-jnp spec in `reference.py`.
- `"pallas"`: the Pallas kernel; compiled for the GPU when the default backend is a GPU, run in
  the Pallas interpreter otherwise (so CPU tests and notebooks exercise the kernel itself).
- `"auto"`: Pallas on a GPU backend, XLA elsewhere.
"""

from __future__ import annotations

import contextlib

import jax

__all__ = ["IMPLEMENTATIONS", "resolve", "on_gpu", "lowering_for_gpu"]

IMPLEMENTATIONS = ("xla", "pallas", "auto")


_FORCE_GPU = False


def on_gpu() -> bool:
    return _FORCE_GPU or jax.default_backend() in ("gpu", "cuda", "rocm")


@contextlib.contextmanager
def lowering_for_gpu():
    """Trace as if the backend were a GPU ("auto" and "pallas" emit the compiled Triton kernel,
    not the interpreter), for `jax.export(..., platforms=["cuda"])` on a CPU-only machine."""
    global _FORCE_GPU
    previous, _FORCE_GPU = _FORCE_GPU, True
    try:
        yield
    finally:
        _FORCE_GPU = previous


def resolve(implementation: str) -> tuple[bool, bool]:
    """`(use_pallas, interpret)` for an implementation name; unknown names are an error."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    gpu = on_gpu()
    if implementation == "xla" or (implementation == "auto" and not gpu):
        return False, False
    return True, not gpu
