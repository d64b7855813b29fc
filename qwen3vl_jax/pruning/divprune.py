"""DivPrune (Alvar et al., CVPR 2025, "DivPrune: Diversity-based Visual Token Pruning for Large
Multimodal Models"): keep the most diverse subset, a greedy Max-Min Diversity Problem
(docs/pruning.md §12.2).

For N merged tokens with rows `X [N, D_tot]` (full encoder rows, float64), keeping
`K = rate_count(tpf, T, rate)` (the baselines' count):

1. Distances `d(i, j) = 1 - cos(x_i, x_j)` (a zero row counts as norm 1e-8, as torch's cosine).
2. The first token: the one whose nearest other token is farthest, `argmax_j` of the second
   smallest `d(., j)` in column j (the smallest is its own 0), as the authors' code
   (`topk(2, largest=False).values[1]`).
3. Then, K - 1 times: the token farthest from the chosen set, `argmax_j min_{s in S} d(s, j)`.
   Ties: the lowest index (torch's argmax). The authors' code could pick a chosen token again when
   exact duplicates leave every distance 0; here chosen tokens are excluded, so K distinct tokens
   are always kept.

Images and videos (`media`): a video's tokens are one set over all frames, as in the paper's video runs.
"""

from __future__ import annotations

import numpy as np

from ._common import merged_grid
from .baselines import rate_count

__all__ = ["DivPrune", "cosine_distances", "max_min_diverse"]


def cosine_distances(rows) -> np.ndarray:
    """`[N, N]` float64 `1 - cos` between the rows."""
    x = np.asarray(rows, np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
    return 1.0 - x @ x.T


def max_min_diverse(distances, k: int) -> np.ndarray:
    """The DivPrune greedy selection of `k` indices from an `[N, N]` distance matrix, in pick order."""
    d = np.asarray(distances, np.float64)
    n = d.shape[0]
    if k <= 0:
        return np.zeros(0, np.int64)
    chosen = np.zeros(n, bool)
    picks = []
    for i in range(k):
        if i == 0:
            scores = np.sort(d, axis=0)[1] if n > 1 else np.zeros(1)
        else:
            scores = d[picks].min(axis=0)
        scores = np.where(chosen, -np.inf, scores)
        pick = int(np.argmax(scores))  # the first of equal maxima
        picks.append(pick)
        chosen[pick] = True
    return np.asarray(picks, np.int64)


class DivPrune:
    """The max-min diverse subset of the tokens (cosine distance)."""

    media = ("image", "video")

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return rate_count(tokens_per_frame, num_frames, rate)

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = merged_grid(grid_thw, spatial_merge_size)
        mask = np.zeros(t * r * c, bool)
        mask[max_min_diverse(cosine_distances(rows), rate_count(r * c, t, rate))] = True
        return mask
