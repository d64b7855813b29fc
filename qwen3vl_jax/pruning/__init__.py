"""Video token pruning for Qwen3-VL: EVS and VidCom2 with vLLM 0.33.0's counts, masks and tie rules.

Spec: notes/video-pruning.md. Each method module exposes

  retained_count(tokens_per_frame, num_frames, q) -> int      the K the prompt placeholder is sized for
  retention_mask(embeds [N, D_tot], grid_thw, spatial_merge_size, q) -> bool [N]   (one video, K trues)
  keep_indices(embeds, grid_thw, spatial_merge_size, q) -> int32 [K]               (ascending flat indices)
  keep_mask(embeds, T, R, C, K[, 1 - q]) -> bool [N]  the jitted core: static (T, R, C); K (and VidCom2's
                                                      retention 1 - q) static or traced

`embeds` are the full rows `[merged | deepstack_0 | ...]` (`concat_levels`) in flat frame-major order
`t*R*C + r*C + c`. Rate 0 (or None) means pruning is off; `validate_video_pruning` says so.
Positions after pruning: `qwen3vl_jax.pruning.positions`.
"""

from __future__ import annotations

import math
from types import ModuleType

from . import evs, prompt, vidcom2
from ._common import concat_levels, frame_counts, merged_grid

__all__ = [
    "PRUNING_METHODS",
    "DEFAULT_METHOD",
    "validate_video_pruning",
    "get_method",
    "retained_count",
    "retention_mask",
    "keep_indices",
    "concat_levels",
    "frame_counts",
    "merged_grid",
    "evs",
    "vidcom2",
    "prompt",
]

PRUNING_METHODS: dict[str, ModuleType] = {"evs": evs, "vidcom2": vidcom2}
DEFAULT_METHOD = "evs"


def get_method(method: str) -> ModuleType:
    """The module of a pruning method; ValueError naming the known ones otherwise."""
    if not isinstance(method, str) or method not in PRUNING_METHODS:
        raise ValueError(f"unknown video pruning method {method!r}; known methods: {sorted(PRUNING_METHODS)}")
    return PRUNING_METHODS[method]


def validate_video_pruning(method: str | None = DEFAULT_METHOD, rate: float | None = None):
    """`(method, float(rate))` when pruning is on, `None` when off (rate None or 0, like vLLM's spec).

    Raises ValueError for an unknown method (even when off, so typos surface early) or a rate outside
    [0, 1) (NaN, bools and non-numbers included).
    """
    if method is None:
        method = DEFAULT_METHOD
    get_method(method)
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) and not hasattr(rate, "__float__"):
        raise ValueError(f"video pruning rate must be a number in [0, 1), got {rate!r}")
    rate = float(rate)
    if math.isnan(rate) or not 0.0 <= rate < 1.0:
        raise ValueError(f"video pruning rate must be in [0, 1) (0 = off), got {rate}")
    if rate == 0.0:
        return None
    return method, rate


def retained_count(method: str, tokens_per_frame: int, num_frames: int, q: float) -> int:
    """K of `method` for a video of `num_frames` frames of `tokens_per_frame` merged tokens."""
    return get_method(method).retained_count(tokens_per_frame, num_frames, q)


def retention_mask(method: str, embeds, grid_thw, spatial_merge_size: int, q: float):
    """Bool `[N]` keep mask of one video under `method` (see the method modules)."""
    return get_method(method).retention_mask(embeds, grid_thw, spatial_merge_size, q)


def keep_indices(method: str, embeds, grid_thw, spatial_merge_size: int, q: float):
    """int32 `[K]` ascending kept flat indices of one video under `method`."""
    return get_method(method).keep_indices(embeds, grid_thw, spatial_merge_size, q)
