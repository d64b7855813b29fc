"""Content-blind baselines, registered like any method (docs/pruning.md §9).

Each keeps exactly `rate_count(tpf, T, rate) = max(1, int(N * (1 - rate)))` of the N = T * tpf
video tokens (the count the rate asks for, in the same double arithmetic as EVS and VidCom2, without
their per-frame floors), so accuracy-vs-rate curves compare selection rules at equal token counts:

  random        a seeded uniform draw of K tokens (the same video grid and seed give the same draw);
  spatial_grid  the same number of tokens in every frame (the remainder spread evenly over time),
                each frame keeping a regular sub-grid of its R x C cells;
  temporal      whole frames evenly spaced in time: `K // tpf` full frames and, when `tpf` does
                not divide K, a regular sub-grid of `K % tpf` cells in the last chosen frame.

None looks at the features, so they run on the host in numpy. All three prune images too (an
image is one frame: `temporal` then keeps a sub-grid, like `spatial_grid`).
"""

from __future__ import annotations

import zlib

import numpy as np

from ._common import merged_grid

__all__ = ["rate_count", "RandomSelection", "SpatialGrid", "TemporalSubsample", "sub_grid", "evenly_spaced"]


def rate_count(tokens_per_frame: int, num_frames: int, rate: float) -> int:
    """`min(N, max(1, int(N * (1 - rate))))` with `N = tpf * T` (0 for an empty video)."""
    total = int(tokens_per_frame) * int(num_frames)
    if total == 0:
        return 0
    return min(total, max(1, int(float(total) * (1.0 - float(rate)))))


def evenly_spaced(n: int, k: int) -> np.ndarray:
    """`k` distinct indices in `[0, n)` spread evenly (cell centres: `floor((i + 0.5) * n / k)`)."""
    if not 0 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n}")
    return np.floor((np.arange(k) + 0.5) * n / k).astype(np.int64) if k else np.zeros(0, np.int64)


def sub_grid(rows: int, cols: int, k: int) -> np.ndarray:
    """Bool `[rows * cols]` with `k` trues on a regular sub-grid of a `rows x cols` raster.

    The sub-grid has `a` evenly spaced rows and `b` evenly spaced columns: `a * b = k` with the
    aspect closest to the frame's when such a factorisation fits; otherwise `a * b > k` and the last
    sub-grid row is filled partly (its cells chosen evenly along the row).
    """
    if not 0 <= k <= rows * cols:
        raise ValueError(f"cannot keep {k} of a {rows}x{cols} grid")
    keep = np.zeros((rows, cols), bool)
    if k == 0:
        return keep.reshape(-1)
    # An exact a x b factorisation that fits, with the aspect closest to the frame's, when one exists.
    exact = [(a, k // a) for a in range(1, rows + 1) if k % a == 0 and k // a <= cols]
    if exact:
        a, b = min(exact, key=lambda ab: abs(np.log(ab[0] * cols / (ab[1] * rows))))
    else:
        a = int(np.clip(round(np.sqrt(k * rows / cols)), 1, rows))
        b = min(cols, -(-k // a))
        a = -(-k // b)  # enough rows for k cells (a <= rows since k <= rows * cols)
    grid_rows, grid_cols = evenly_spaced(rows, a), evenly_spaced(cols, b)
    full, rest = divmod(k, b)
    keep[np.ix_(grid_rows[:full], grid_cols)] = True
    if rest:
        keep[grid_rows[full], grid_cols[evenly_spaced(b, rest)]] = True
    return keep.reshape(-1)


class RandomSelection:
    """`K` tokens drawn uniformly without replacement, seeded by `seed` and the video's grid."""

    media = ("image", "video")

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return rate_count(tokens_per_frame, num_frames, rate)

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = merged_grid(grid_thw, spatial_merge_size)
        n, k = t * r * c, rate_count(r * c, t, rate)
        # A fixed mixing of (seed, grid): reproducible across processes (Python's hash() is salted).
        rng = np.random.default_rng([self.seed, zlib.crc32(f"{t},{r},{c}".encode())])
        mask = np.zeros(n, bool)
        mask[rng.choice(n, size=k, replace=False)] = True
        return mask


class SpatialGrid:
    """Every frame keeps a regular sub-grid; per-frame counts differ by at most one."""

    media = ("image", "video")

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return rate_count(tokens_per_frame, num_frames, rate)

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = merged_grid(grid_thw, spatial_merge_size)
        k = rate_count(r * c, t, rate)
        per_frame = np.full(t, k // t, np.int64)
        per_frame[evenly_spaced(t, k % t)] += 1  # the remainder spread over time, not piled at the start
        return np.concatenate([sub_grid(r, c, int(n)) for n in per_frame]) if t else np.zeros(0, bool)


class TemporalSubsample:
    """Whole frames evenly spaced in time (frame subsampling at the same token count)."""

    media = ("image", "video")

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return rate_count(tokens_per_frame, num_frames, rate)

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = merged_grid(grid_thw, spatial_merge_size)
        tpf = r * c
        k = rate_count(tpf, t, rate)
        if k == 0:
            return np.zeros(t * tpf, bool)
        full, rest = divmod(k, tpf)
        frames = evenly_spaced(t, full + (rest > 0))
        mask = np.zeros((t, tpf), bool)
        mask[frames[:full]] = True
        if rest:
            mask[frames[full]] = sub_grid(r, c, rest)
        return mask.reshape(-1)
