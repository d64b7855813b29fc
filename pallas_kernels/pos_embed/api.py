"""The position-embedding interpolation op as the model calls it.

`implementation`: `"xla"` (the jnp spec), `"pallas"` (the Triton kernel; interpreted on a
non-GPU backend) or `"auto"` (Pallas on a GPU backend, XLA elsewhere).

Gradients: the kernel is forward-only; the Pallas path is a `jax.custom_vjp` whose backward is the
spec's (a scatter-add of the weighted cotangent rows into the table: the op is linear in the table).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._dispatch import IMPLEMENTATIONS, resolve
from . import kernel, reference

__all__ = ["interpolate_pos_embed", "interpolate_pos_embed_grid", "IMPLEMENTATIONS"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_interpolate(table, indices, weights, interpret):
    return kernel.interpolate_pos_embed(table, indices, weights, interpret=interpret)


def _pallas_forward(table, indices, weights, interpret):
    return _pallas_interpolate(table, indices, weights, interpret), (table, indices, weights)


def _pallas_backward(interpret, residuals, grad):
    table, indices, weights = residuals
    _, pullback = jax.vjp(lambda t, w: reference.interpolate_pos_embed(t, indices, w), table, weights)
    grad_table, grad_weights = pullback(grad)
    return grad_table, None, grad_weights


_pallas_interpolate.defvjp(_pallas_forward, _pallas_backward)


def interpolate_pos_embed(table, indices, weights, *, implementation: str = "auto"):
    """`[P, D]` float32 bilinear position embeddings from the `[side*side, D]` table.

    `indices` / `weights` (`[P, 4]`) come from `reference.interpolation_taps` on the host (the
    model jits on shapes only, so the data-dependent taps are computed outside the jit).
    """
    use_pallas, interpret = resolve(implementation)
    if use_pallas:
        return _pallas_interpolate(table, indices, weights, interpret)
    return reference.interpolate_pos_embed(table, indices, weights)


def interpolate_pos_embed_grid(table, grid_thw, merge_size: int, *, implementation: str = "auto"):
    """Convenience form: `[sum(t*h*w), D]` float32 for a host `grid_thw` (`[N, 3]`), in
    spatial-merge order and repeated over t. Same kernel / spec as `interpolate_pos_embed`."""
    side = int(round(table.shape[0] ** 0.5))
    if side * side != table.shape[0]:
        raise ValueError(f"position table has {table.shape[0]} rows, not a square grid")
    indices, weights = reference.interpolation_taps(grid_thw, side, merge_size)
    return interpolate_pos_embed(table, jnp.asarray(indices), jnp.asarray(weights), implementation=implementation)
