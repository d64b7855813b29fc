"""VisionZip-style selection (Yang et al., CVPR 2025, "VisionZip: Longer is Better but Not Necessary"):
dominant tokens by the attention they receive, plus contextual tokens spread over the rest
(docs/pruning.md §12.1).

For one image (grid `(1, H, W)`; T = 1) of N merged tokens with rows `X [N, D_tot]` (the full
encoder rows, deepstack channels included, in float64), keeping `K = rate_count(N, 1, rate)` (the
baselines' count, so curves compare at equal token counts):

1. Split K as VisionZip's default budget 54 + 10 of 64: `K_c = floor(10 K / 64)` contextual,
   `K_d = K - K_c` dominant.
2. Attention received: `a_j = mean_i softmax_j(x_i . x_j / sqrt(D))`, a single-head self-attention
   over the rows themselves. (VisionZip reads the [CLS] token's attention in the vision tower's
   penultimate layer; the Qwen3-VL tower has no [CLS] and the protocol sees the encoder output, so
   every token's attention stands in for it.)
3. Dominant: the `K_d` tokens of largest `a` (ties: the earlier index).
4. Contextual: of the remaining `R = N - K_d` tokens in index order, VisionZip's centres
   `remaining[0 :: max(1, R // K_c)][:K_c]`. VisionZip then merges every other remaining token
   into its most similar centre (an average); a selection mask cannot carry merged features, so the
   centres are kept as they are.

Images only (`media`): the paper's budget is per image.
"""

from __future__ import annotations

import numpy as np

from ._common import merged_grid
from .baselines import rate_count

__all__ = ["VisionZip", "DOMINANT", "CONTEXTUAL"]

DOMINANT, CONTEXTUAL = 54, 10  # VisionZip's default split of a 64-token budget


def received_attention(rows) -> np.ndarray:
    """`[N]` float64: the mean over queries of a softmax self-attention over `rows [N, D]`."""
    x = np.asarray(rows, np.float64)
    scores = x @ x.T / np.sqrt(x.shape[1])
    scores -= scores.max(axis=1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.mean(axis=0)


class VisionZip:
    """Dominant (most attended) plus contextual (evenly spread) tokens."""

    media = ("image",)

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return rate_count(tokens_per_frame, num_frames, rate)

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = merged_grid(grid_thw, spatial_merge_size)
        n = t * r * c
        k = rate_count(r * c, t, rate)
        contextual = k * CONTEXTUAL // (DOMINANT + CONTEXTUAL)
        dominant = k - contextual
        score = received_attention(rows)
        order = np.argsort(-score, kind="stable")  # largest first, ties to the earlier index
        mask = np.zeros(n, bool)
        mask[order[:dominant]] = True
        if contextual:
            remaining = np.flatnonzero(~mask)
            step = max(1, remaining.size // contextual)
            mask[remaining[::step][:contextual]] = True
        return mask
