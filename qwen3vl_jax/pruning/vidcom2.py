"""VidCom2 (Video Compression Commander) as vLLM 0.33.0 runs it for Qwen3-VL (docs/pruning.md §4).

1. keep the half of the channels with the smallest population variance; 2. L2-normalise each token;
3. Gaussian-kernel similarity of each token to the video mean (`v`) and to its frame mean (`f`),
   `s = v + f` (high = redundant); 4. per-frame budgets from a sharp softmax of the frames'
   distinctiveness `-mean(v)`; 5. keep the `k_t` lowest-`s` tokens per frame; 6. reconcile to exactly
   `retained_count` tokens globally (drop the highest-`s` kept / add the lowest-`s` free).

Ties (implementation-defined in vLLM, which uses unsorted torch.topk): one total order, `s`
ascending then flat index ascending, decides every choice: per-frame keeps and adds take the earliest
tokens in that order, drops take the latest. Channel ties go to the lower channel index.

Axes: N = T * P tokens of one video in flat frame-major order, P = R * C tokens per frame, D the
scored row width, Dk the kept channels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._common import keep_indices_from_mask, merged_grid

__all__ = ["retained_count", "retention_mask", "keep_mask", "keep_indices", "scores", "select",
           "frame_budgets", "frame_scales", "ALPHAS", "CHANNEL_RATIO", "TEMPERATURE"]

ALPHAS = (0.125, 0.25, 0.5, 1.0, 2.0)
CHANNEL_RATIO = 0.5
TEMPERATURE = 0.01
NORM_EPS = 1e-12


def retained_count(tokens_per_frame: int, num_frames: int, q: float) -> int:
    """`max(T, min(int((tpf * T) * (1.0 - q)), tpf * T))` in IEEE double: at least one token per frame."""
    tokens_per_frame, num_frames = int(tokens_per_frame), int(num_frames)
    total = tokens_per_frame * num_frames
    kept = int(float(total) * (1.0 - float(q)))
    return max(num_frames, min(kept, total))


def _gaussian(z: jax.Array, mu: jax.Array) -> jax.Array:
    dist = jnp.sum(jnp.square(z - mu), axis=-1)
    total = jnp.exp(-dist / (2 * ALPHAS[0]))
    for alpha in ALPHAS[1:]:
        total = total + jnp.exp(-dist / (2 * alpha))
    return total


def scores(embeds: jax.Array, num_frames: int, tokens_per_frame: int) -> tuple[jax.Array, jax.Array]:
    """`(v, f)`, each `[T, P]` in the dtype of `embeds`: similarity to the video and to the frame mean."""
    x = embeds
    d = x.shape[-1]
    k_c = max(1, int(CHANNEL_RATIO * d))
    var = jnp.mean(jnp.square(x - jnp.mean(x, axis=0, keepdims=True)), axis=0)
    channels = jnp.argsort(var, stable=True)[:k_c]
    y = x[:, channels].reshape(num_frames, tokens_per_frame, k_c)
    norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=-1, keepdims=True))
    z = y / jnp.maximum(norm, NORM_EPS).astype(y.dtype)
    mu_video = jnp.mean(z.reshape(-1, k_c), axis=0)
    mu_frame = jnp.mean(z, axis=1, keepdims=True)
    return _gaussian(z, mu_video), _gaussian(z, mu_frame)


def _scales(v: jax.Array, retain) -> tuple[jax.Array, jax.Array]:
    u = -jnp.mean(v, axis=1)
    p = jax.nn.softmax((u - jnp.max(u)) / TEMPERATURE)
    grow = 1.0 + p - jnp.mean(p)
    # `retain` = 1 - q, formed in double on the host; multiplied in f32 and rounded, like torch's scalar op
    return p, jnp.minimum(1.0, (grow.astype(jnp.float32) * jnp.asarray(retain, jnp.float32)).astype(p.dtype))


def _budgets(v: jax.Array, retain) -> jax.Array:
    tpf = v.shape[1]
    _, scale = _scales(v, retain)
    return jnp.clip(jnp.round(scale * tpf), 1, tpf).astype(jnp.int32)


def frame_scales(v: jax.Array, q: float) -> tuple[jax.Array, jax.Array]:
    """`(p, scale)`, each `[T]`: the frame softmax of `(u - max u) / 0.01`, `u = -mean_j v`, and
    `scale_t = min(1, (1 - q) * (1 + p_t - mean(p)))`."""
    return _scales_jit(v, 1.0 - float(q))


def frame_budgets(v: jax.Array, q: float) -> jax.Array:
    """int32 `[T]` per-frame budgets `k_t = clip(round_half_even(scale_t * P), 1, P)` from `v` `[T, P]`."""
    return _budgets_jit(v, 1.0 - float(q))


def select(v: jax.Array, f: jax.Array, q: float, target) -> jax.Array:
    """Bool `[T*P]` from the scores (steps 5-7): per-frame budgets, lowest `s` per frame, reconcile to
    exactly `target`."""
    return _select_jit(v, f, 1.0 - float(q), target)


def _select(v: jax.Array, f: jax.Array, retain, target) -> jax.Array:
    num_frames, tpf = v.shape
    n = num_frames * tpf
    s = (v + f).reshape(-1)
    k = _budgets(v, retain)
    # one total order: s ascending, then flat index ascending; a stable per-frame sort is its restriction
    order = jnp.argsort(s, stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    in_frame = jnp.argsort(s.reshape(num_frames, tpf), axis=1, stable=True)
    frame_rank = jnp.zeros((num_frames, tpf), jnp.int32).at[jnp.arange(num_frames)[:, None], in_frame].set(
        jnp.arange(tpf, dtype=jnp.int32)[None, :])
    kept_sorted = (frame_rank < k[:, None]).reshape(-1)[order]
    cur = jnp.sum(k)
    excess = jnp.maximum(cur - target, 0)
    deficit = jnp.maximum(target - cur, 0)
    kept_i = kept_sorted.astype(jnp.int32)
    kept_after = jnp.cumsum(kept_i[::-1])[::-1] - kept_i                      # kept tokens later
    free_i = 1 - kept_i
    free_before = jnp.cumsum(free_i) - free_i                                 # free tokens earlier
    final_sorted = jnp.where(kept_sorted, kept_after >= excess, free_before < deficit)
    return final_sorted[rank]


_scales_jit, _budgets_jit, _select_jit = jax.jit(_scales), jax.jit(_budgets), jax.jit(_select)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def keep_mask(embeds: jax.Array, num_frames: int, rows: int, cols: int, keep, retain) -> jax.Array:
    """Bool `[N]` with exactly `keep` trues; `embeds` `[N, D]`. Pure jnp with static `(T, R, C)`.

    `keep` (K) and `retain` (= `1.0 - q`, formed in double on the host) may be Python numbers or
    traced scalars: the mask shape does not depend on them, so one compile serves every rate.
    """
    tpf = rows * cols
    n = num_frames * tpf
    if embeds.shape[0] != n:
        raise ValueError(f"embeds has {embeds.shape[0]} rows, the grid T={num_frames} R={rows} C={cols} "
                         f"gives {n}")
    if n == 0:
        return jnp.zeros((0,), bool)
    v, f = scores(embeds, num_frames, tpf)
    return _select(v, f, retain, keep)


def retention_mask(embeds, grid_thw, spatial_merge_size: int, q: float) -> jax.Array:
    """Bool `[N]` for ONE video: exactly `min(retained_count(R*C, T, q), N)` trues (a frame may keep 0).

    `embeds` `[N, D_tot]` are the full `[merged | deepstack...]` rows, `grid_thw` the video's `(T, H, W)`
    in patch units.
    """
    t, r, c = merged_grid(grid_thw, spatial_merge_size)
    k = min(retained_count(r * c, t, q), t * r * c)
    return keep_mask(jnp.asarray(embeds), t, r, c, k, jnp.float32(1.0 - float(q)))


def keep_indices(embeds, grid_thw, spatial_merge_size: int, q: float) -> jax.Array:
    """int32 `[K]`: the kept flat indices in ascending order (a static-shape gather index)."""
    t, r, c = merged_grid(grid_thw, spatial_merge_size)
    k = min(retained_count(r * c, t, q), t * r * c)
    return keep_indices_from_mask(keep_mask(jnp.asarray(embeds), t, r, c, k, jnp.float32(1.0 - float(q))), k)
