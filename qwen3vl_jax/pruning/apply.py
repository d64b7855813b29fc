"""Pruning orchestration: the one entry point the model calls (docs/pruning.md §5.8).

  plan_videos(video_grid_thw, spatial_merge_size, spec)      -> [VideoPlan]: grid, tpf, K per video
  placeholder_tokens(video_grid_thw, spatial_merge_size, spec) -> the video tokens the lumped prompt holds
  prune_video_tokens(ids, mask, types, grids, merged, deepstack, spec, config=..., embed_tokens=...)
      -> PrunedInputs: masks per video (checked against the protocol), the kept encoder rows (indices
         into the unpruned encoder output), and the prompt rebuilt per frame at unpruned positions
  retention_maps(merged, deepstack, video_grid_thw, spatial_merge_size, spec) -> bool [T, R, C] per video

`spec` is a validated `(method, rate)` pair (`validate_video_pruning`). The encoder output may come
from `Qwen3VL.encode_vision` or a bucketed `EncoderRunner`: pruning only reads its rows.

Axes: B batch, L (lumped) and S (pruned) prompt tokens, N merged visual rows (images first, then
videos), O out hidden, V deepstack levels; per video T frames and an R x C merged grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from ._common import concat_levels, merged_grid
from .prompt import VIDEO, VideoPlan, prune_prompt
from .registry import PromptText, retained_count, retention_mask, uses_text

__all__ = ["PrunedInputs", "plan_videos", "placeholder_tokens", "prune_video_tokens", "retention_maps",
           "prompt_text_tokens"]


@dataclasses.dataclass(frozen=True)
class PrunedInputs:
    """The prompt after pruning and the encoder rows it keeps (host arrays).

    The encoder output itself is not gathered: the model splices `kept_rows[j]` into the j-th visual
    position, so the same indices serve features computed here and features recomputed inside a
    differentiated forward.
    """

    input_ids: np.ndarray  # [B, S]
    attention_mask: np.ndarray  # [B, S] bool
    mm_token_type_ids: np.ndarray  # [B, S]
    positions: np.ndarray  # [3, B, S] unpruned positions of the kept tokens
    rope_deltas: np.ndarray  # [B, 1]
    kept_rows: np.ndarray  # [N'] int: the image rows, then the kept video rows, of the unpruned encoder output
    video_masks: list  # per video, bool [T*R*C] flat frame-major


def plan_videos(video_grid_thw, spatial_merge_size: int, spec: tuple[str, float]) -> list[VideoPlan]:
    """Per video: grid, merged tokens per frame and the retained count K under `spec`."""
    plans = []
    for grid in np.asarray(video_grid_thw).reshape(-1, 3):
        t, r, c = merged_grid(grid, spatial_merge_size)
        plans.append(VideoPlan(tuple(int(x) for x in grid), r * c, retained_count(spec[0], r * c, t, spec[1])))
    return plans


def placeholder_tokens(video_grid_thw, spatial_merge_size: int, spec: tuple[str, float]) -> int:
    """How many video tokens a prompt built by the processor with `video_pruning=spec` holds."""
    return sum(p.keep for p in plan_videos(video_grid_thw, spatial_merge_size, spec))


def prompt_text_tokens(ids, types, mask, vision_start_token_id: int, vision_end_token_id: int) -> np.ndarray:
    """Bool `[L]`: the row's text outside vision blocks (not markers, padding, or the timestamps
    between a lumped video's frames).

    In a lumped prompt every frame after the first is an empty block `<|vision_start|><|vision_end|>`
    after its timestamp, so the text whose next marker opens an empty block is a timestamp. The first
    frame's timestamp precedes the video's first block with nothing to tell it from the question
    (the prompt layout of HF transformers >= 5.25); it counts as text. Depth counting over the markers
    also handles the older layout's outer pair around a video's frames (its timestamps sit at depth 1).
    """
    ids, types, mask = np.asarray(ids), np.asarray(types), np.asarray(mask, bool)
    opens = (ids == vision_start_token_id) & mask
    closes = (ids == vision_end_token_id) & mask
    depth_before = np.cumsum(opens) - np.cumsum(closes) - opens + closes  # depth before each token's own marker
    # For each token, whether the next marker at or after it opens an empty block.
    markers = np.flatnonzero(opens | closes)
    empty_open = opens[markers] & np.append(closes[markers[1:]] & (np.diff(markers) == 1), False)
    following = np.searchsorted(markers, np.arange(ids.shape[0]))  # index into markers
    before_empty = np.append(empty_open, False)[following]
    return mask & (types == 0) & ~opens & ~closes & (depth_before == 0) & ~before_empty


def _videos_per_row(types, mask) -> list[int]:
    """In a lumped prompt each video is one run of video tokens (all K in frame 0)."""
    counts = []
    for row_types, row_mask in zip(np.asarray(types), np.asarray(mask, bool)):
        is_video = (row_types == VIDEO) & row_mask
        counts.append(int(np.sum(is_video[1:] & ~is_video[:-1]) + (is_video[0] if is_video.size else 0)))
    return counts


def _video_masks(merged, deepstack, plans: Sequence[VideoPlan], spatial_merge_size: int, spec,
                 texts: Sequence[PromptText | None]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-video masks over the videos' rows (`merged` / `deepstack` hold the videos back to back),
    and the kept rows (indices into those rows, in order)."""
    masks, kept, offset = [], [], 0
    for v, plan in enumerate(plans):
        n = plan.grid_thw[0] * plan.tokens_per_frame
        rows = concat_levels(merged[offset:offset + n], deepstack[:, offset:offset + n])
        keep = retention_mask(spec[0], rows, plan.grid_thw, spatial_merge_size, spec[1], text=texts[v])
        masks.append(keep)
        kept.append(offset + np.flatnonzero(keep))
        offset += n
    return masks, (np.concatenate(kept) if kept else np.zeros((0,), np.int64))


def prune_video_tokens(input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, merged,
                       deepstack, spec: tuple[str, float], *, config,
                       embed_tokens: Callable | None = None) -> PrunedInputs:
    """Prune every video of a lumped batch and rebuild the prompt (the model's one pruning call).

    Args:
      input_ids, attention_mask, mm_token_type_ids: `[B, L]` the lumped prompt (processor built with
        the same `video_pruning`).
      image_grid_thw, video_grid_thw: as the processor gives them.
      merged, deepstack: the encoder output for the images then the videos, `[N, O]` / `[V, N, O]`.
      spec: `(method, rate)`, validated.
      config: a `Qwen3VLConfig` (token ids, spatial merge size).
      embed_tokens: ids `[S]` -> embeddings `[S, E]`, required for text-guided methods.
    """
    merge = config.vision.spatial_merge_size
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    types = np.asarray(mm_token_type_ids)
    plans = plan_videos(video_grid_thw, merge, spec)
    n_image = 0 if image_grid_thw is None else int(np.asarray(image_grid_thw).prod(-1).sum()) // (merge**2)
    texts: list[PromptText | None] = [None] * len(plans)
    if uses_text(spec[0]):
        if embed_tokens is None:
            raise ValueError(f"pruning method {spec[0]!r} is text-guided: pass embed_tokens")
        texts = []
        for b, count in enumerate(_videos_per_row(types, mask)):
            row_text = ids[b, prompt_text_tokens(ids[b], types[b], mask[b], config.vision_start_token_id,
                                                 config.vision_end_token_id)]
            texts += [PromptText(row_text, embed_tokens(jnp.asarray(row_text, jnp.int32)))] * count
        if len(texts) != len(plans):
            raise ValueError(f"{len(plans)} videos given but the prompt holds {len(texts)} video placeholders")
    masks, rows = _video_masks(merged[n_image:], deepstack[:, n_image:], plans, merge, spec, texts)
    keep_rows = np.concatenate([np.arange(n_image), n_image + rows])
    pruned = prune_prompt(ids, mask, types, image_grid_thw, plans, masks, spatial_merge_size=merge,
                          vision_start_token_id=config.vision_start_token_id,
                          vision_end_token_id=config.vision_end_token_id, video_token_id=config.video_token_id)
    return PrunedInputs(pruned.input_ids, pruned.attention_mask, pruned.mm_token_type_ids, pruned.positions,
                        pruned.rope_deltas, keep_rows, masks)


def retention_maps(merged, deepstack, video_grid_thw, spatial_merge_size: int, spec: tuple[str, float] | None,
                   texts: Sequence[PromptText] | None = None) -> list[np.ndarray]:
    """Per video, the bool `[T, R, C]` map of the tokens `spec` keeps (all True when off).

    `merged` / `deepstack` hold exactly the videos' encoder rows; `texts` (one per video) only for
    text-guided methods.
    """
    grids = [merged_grid(g, spatial_merge_size) for g in np.asarray(video_grid_thw).reshape(-1, 3)]
    if spec is None:
        return [np.ones(g, bool) for g in grids]
    plans = plan_videos(video_grid_thw, spatial_merge_size, spec)
    masks, _ = _video_masks(merged, deepstack, plans, spatial_merge_size, spec, texts or [None] * len(plans))
    return [m.reshape(g) for m, g in zip(masks, grids)]
