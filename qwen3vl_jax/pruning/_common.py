"""Helpers shared by the pruning methods: grids, the scored rows, mask -> static-shape indices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def merged_grid(grid_thw, spatial_merge_size: int) -> tuple[int, int, int]:
    """`(T, R, C)` of one video from its `(T, H, W)` grid in patch units."""
    thw = np.asarray(grid_thw).reshape(-1)
    if thw.shape != (3,):
        raise ValueError(f"grid_thw must be one (T, H, W) triple, got shape {np.shape(grid_thw)}")
    t, h, w = (int(x) for x in thw)
    m = int(spatial_merge_size)
    if m < 1 or h % m or w % m:
        raise ValueError(f"grid (H, W) = ({h}, {w}) is not divisible by spatial_merge_size {m}")
    return t, h // m, w // m


def concat_levels(merged, deepstack) -> jax.Array:
    """`[N, O*(1+L)]` rows `[merged | deepstack_0 | ... | deepstack_{L-1}]` from `merged` `[N, O]` and
    `deepstack` `[L, N, O]` (the rows both pruning methods score; L may be 0)."""
    merged = jnp.asarray(merged)
    deepstack = jnp.asarray(deepstack)
    if deepstack.ndim != 3 or deepstack.shape[1:] != merged.shape:
        raise ValueError(f"deepstack must be [L, N, O] with [N, O] = {merged.shape}, got {deepstack.shape}")
    levels = jnp.moveaxis(deepstack, 0, 1).reshape(merged.shape[0], -1).astype(merged.dtype)
    return jnp.concatenate([merged, levels], axis=-1)


def keep_indices_from_mask(mask: jax.Array, keep: int) -> jax.Array:
    """int32 `[keep]` ascending indices of the trues of a mask that holds exactly `keep` trues."""
    return jnp.nonzero(mask, size=keep, fill_value=0)[0].astype(jnp.int32)


def frame_counts(mask, num_frames: int) -> np.ndarray:
    """Per-frame kept counts `[T]` of a flat frame-major mask."""
    mask = np.asarray(mask, dtype=bool)
    if num_frames <= 0:
        return np.zeros((0,), np.int64)
    return mask.reshape(int(num_frames), -1).sum(axis=1).astype(np.int64)
