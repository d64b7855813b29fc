"""EVS (Efficient Video Sampling) as vLLM 0.33.0 runs it for Qwen3-VL (docs/pruning.md §3).

Score every video token by its cosine dissimilarity with the same merged cell of the previous frame
(frame 0 scores 255, so it always survives), and keep the global top-K, ties to the earlier flat index.

Axes: N video tokens of one video in flat frame-major order (t, r, c); D the scored row width
(`out_hidden * (1 + L)`: merger output and the L deepstack levels); T frames (temporal grid steps),
R x C the merged grid of a frame.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._common import keep_indices_from_mask, merged_grid

__all__ = ["retained_count", "retention_mask", "keep_mask", "keep_indices", "dissimilarity",
           "FIRST_FRAME_SCORE", "COSINE_EPS"]

FIRST_FRAME_SCORE = 255.0
COSINE_EPS = 1e-8


def retained_count(tokens_per_frame: int, num_frames: int, q: float) -> int:
    """`max(tpf, int((tpf * T) * (1 - q)))` in IEEE double, in this order (100 tokens at q=0.9 keep 9)."""
    tokens_per_frame, num_frames = int(tokens_per_frame), int(num_frames)
    total = tokens_per_frame * num_frames
    kept = int(float(total) * (1.0 - float(q)))
    return max(tokens_per_frame, kept)


def _rounded(x, dtype):
    """One torch-style op result: computed wider, rounded back to the input dtype (a no-op in f32)."""
    return x.astype(dtype)


def dissimilarity(embeds: jax.Array, num_frames: int, rows: int, cols: int) -> jax.Array:
    """`[N]` scores: 255 on frame 0, `1 - cos(x[t], x[t-1])` elsewhere, in the dtype of `embeds`.

    Cosine with torch's definition: each vector is divided by `max(||x||, 1e-8)` first, then the
    elementwise product is summed (a zero vector scores similarity 0). Each op is rounded to the input
    dtype like torch does in bf16 (norms and sums accumulate in f32).
    """
    dtype = embeds.dtype
    x = embeds.reshape(num_frames, rows * cols, -1)
    wide = jnp.promote_types(dtype, jnp.float32)
    norm = _rounded(jnp.sqrt(jnp.sum(jnp.square(x.astype(wide)), axis=-1, keepdims=True)), dtype)
    unit = _rounded(x.astype(wide) / jnp.maximum(norm, COSINE_EPS).astype(wide), dtype)
    prod = _rounded(unit[1:].astype(wide) * unit[:-1].astype(wide), dtype)
    sim = _rounded(jnp.sum(prod.astype(wide), axis=-1), dtype)
    dis = _rounded(1.0 - sim.astype(wide), dtype)
    first = jnp.full((1, rows * cols), FIRST_FRAME_SCORE, dtype)
    return jnp.concatenate([first, dis], axis=0).reshape(-1)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def keep_mask(embeds: jax.Array, num_frames: int, rows: int, cols: int, keep) -> jax.Array:
    """Bool `[N]`: the `keep` most dissimilar tokens (stable descending sort, ties to the lower index).

    Pure jnp; `(T, R, C)` static, `keep` a Python int (static K) or a traced int32 scalar (the mask
    shape does not depend on it, so one compile serves every rate). `embeds` is `[T*R*C, D]` in flat
    frame-major order.
    """
    n = num_frames * rows * cols
    if embeds.shape[0] != n:
        raise ValueError(f"embeds has {embeds.shape[0]} rows, the grid T={num_frames} R={rows} C={cols} "
                         f"gives {n}")
    if n == 0:
        return jnp.zeros((0,), bool)
    dis = dissimilarity(embeds, num_frames, rows, cols)
    order = jnp.argsort(dis, descending=True, stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return rank < keep


def retention_mask(embeds, grid_thw, spatial_merge_size: int, q: float) -> jax.Array:
    """Bool `[N]` for ONE video: exactly `retained_count(R*C, T, q)` trues, all of frame 0 among them.

    `embeds` `[N, D_tot]` are the full `[merged | deepstack...]` rows (see `concat_levels`), `grid_thw`
    the video's `(T, H, W)` in patch units. q = 0 keeps everything.
    """
    t, r, c = merged_grid(grid_thw, spatial_merge_size)
    k = min(retained_count(r * c, t, q), t * r * c)
    return keep_mask(jnp.asarray(embeds), t, r, c, k)


def keep_indices(embeds, grid_thw, spatial_merge_size: int, q: float) -> jax.Array:
    """int32 `[K]`: the kept flat indices in ascending order (a static-shape gather index)."""
    t, r, c = merged_grid(grid_thw, spatial_merge_size)
    k = min(retained_count(r * c, t, q), t * r * c)
    return keep_indices_from_mask(keep_mask(jnp.asarray(embeds), t, r, c, k), k)

