"""Bilinear resampling of the learned square position-embedding table to each image's patch grid.

The spec, in two halves:

- `interpolation_taps` (host, numpy): for every patch of every item in `grid_thw`, the four table
  rows it reads and their weights. Align-corners bilinear on the `side x side` table, exactly the
  float32 arithmetic of HF's `get_vision_interpolation_indices_and_weights` (which reproduces
  `F.interpolate(mode="bilinear", align_corners=True)`). Patches are emitted in spatial-merge
  order (2x2 blocks of neighbouring patches are contiguous) and repeated for each temporal slice,
  the order in which the patch embedder sees them.
- `interpolate_pos_embed` (device, jnp): the weighted sum of the gathered rows, in float32.

Axes: P patches (sum of t*h*w), D hidden, K = 4 taps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["interpolation_taps", "interpolate_pos_embed", "merge_order_rows_cols"]


def merge_order_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of an h x w grid, listed in spatial-merge-block order.

    Block (br, bc) of `merge x merge` patches is contiguous; blocks run in raster order.
    """
    if h % merge or w % merge:
        raise ValueError(f"grid {h}x{w} is not divisible by the spatial merge size {merge}")
    rows = np.arange(h).reshape(h // merge, merge, 1, 1)
    cols = np.arange(w).reshape(1, 1, w // merge, merge)
    rows = np.broadcast_to(rows, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
    cols = np.broadcast_to(cols, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3).reshape(-1)
    return rows, cols


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    # float32 throughout, in HF's order of operations: src = index * (side - 1) / max(size - 1, 1).
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    distance = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
    weights = np.clip(np.float32(1) - distance, 0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1), weights


def interpolation_taps(grid_thw, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Table rows `[P, 4]` (int32) and weights `[P, 4]` (float32) for every patch in `grid_thw`."""
    indices, weights = [], []
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3):
        rows, cols = merge_order_rows_cols(int(h), int(w), merge)
        row_taps, row_w = _axis_taps(rows, int(h), side)
        col_taps, col_w = _axis_taps(cols, int(w), side)
        idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        wgt = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(idx, (int(t), 1)))
        weights.append(np.tile(wgt, (int(t), 1)))
    if not indices:
        return np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32)
    return np.concatenate(indices).astype(np.int32), np.concatenate(weights).astype(np.float32)


def interpolate_pos_embed(table: jnp.ndarray, indices: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """`[P, D]` float32: sum over the 4 taps of `table[indices] * weights`."""
    rows = jnp.take(table, indices, axis=0).astype(jnp.float32)  # [P, K, D]
    return jnp.sum(rows * weights.astype(jnp.float32)[:, :, None], axis=1)
