"""Pruning orchestration: the one entry point the model calls (docs/pruning.md §5.8).

  plan_videos(video_grid_thw, spatial_merge_size, spec)      -> [VideoPlan]: grid, tpf, K per video
  placeholder_tokens(video_grid_thw, spatial_merge_size, spec) -> the video tokens the lumped prompt holds
  prune_video_tokens(ids, mask, types, grids, merged, deepstack, spec, config=..., embed_tokens=...,
                     image_spec=...)
      -> PrunedInputs: masks per video (and per image with `image_spec`; checked against the
         protocol), the kept encoder rows (indices into the unpruned encoder output), and the prompt
         rebuilt per frame at unpruned positions
  (images: `plan_videos` / `placeholder_tokens` of `image_grid_thw`, each image a one-frame grid)
  retention_maps(merged, deepstack, video_grid_thw, spatial_merge_size, spec) -> bool [T, R, C] per video

`spec` is a validated `(method, rate)` pair (`validate_video_pruning`, `validate_image_pruning`), or
None (that modality whole). The encoder output may come
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
from .prompt import IMAGE, VIDEO, VideoPlan, prune_prompt
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
    kept_rows: np.ndarray  # [N'] int: the kept image rows, then the kept video rows, of the unpruned encoder output
    video_masks: list  # per video, bool [T*R*C] flat frame-major
    image_masks: list | None = None  # per image, bool [R*C] raster (None: images not pruned)


def plan_videos(video_grid_thw, spatial_merge_size: int, spec: tuple[str, float] | None) -> list[VideoPlan]:
    """Per video (or image: T = 1): grid, merged tokens per frame and the retained count K under
    `spec` (all of them when None)."""
    plans = []
    for grid in np.asarray(video_grid_thw).reshape(-1, 3):
        t, r, c = merged_grid(grid, spatial_merge_size)
        keep = t * r * c if spec is None else retained_count(spec[0], r * c, t, spec[1])
        plans.append(VideoPlan(tuple(int(x) for x in grid), r * c, keep))
    return plans


def placeholder_tokens(video_grid_thw, spatial_merge_size: int, spec: tuple[str, float] | None) -> int:
    """How many video (or image) tokens a prompt built by the processor with `video_pruning=spec`
    (`image_pruning=spec`) holds."""
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


def _items_per_row(types, mask, code: int = VIDEO) -> list[int]:
    """In a lumped prompt each video (code VIDEO) is one run of video tokens (all K in frame 0); each
    image (code IMAGE) one run of image tokens (images are separated by their markers)."""
    counts = []
    for row_types, row_mask in zip(np.asarray(types), np.asarray(mask, bool)):
        present = (row_types == code) & row_mask
        counts.append(int(np.sum(present[1:] & ~present[:-1]) + (present[0] if present.size else 0)))
    return counts


def _prompt_texts(ids, types, mask, config, embed_tokens, code: int, count: int, method: str) -> list:
    """One `PromptText` per item (code VIDEO or IMAGE) in prompt order: its row's text."""
    if embed_tokens is None:
        raise ValueError(f"pruning method {method!r} is text-guided: pass embed_tokens")
    texts = []
    for b, items in enumerate(_items_per_row(types, mask, code)):
        row_text = ids[b, prompt_text_tokens(ids[b], types[b], mask[b], config.vision_start_token_id,
                                             config.vision_end_token_id)]
        texts += [PromptText(row_text, embed_tokens(jnp.asarray(row_text, jnp.int32)))] * items
    if len(texts) != count:
        kind = "video" if code == VIDEO else "image"
        raise ValueError(f"{count} {kind}s given but the prompt holds {len(texts)} {kind} placeholders")
    return texts


def _video_masks(merged, deepstack, plans: Sequence[VideoPlan], spatial_merge_size: int, spec,
                 texts: Sequence[PromptText | None]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-video (or per-image) masks over the items' rows (`merged` / `deepstack` hold them back to
    back), and the kept rows (indices into those rows, in order)."""
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
                       deepstack, spec: tuple[str, float] | None, *, config,
                       embed_tokens: Callable | None = None, image_spec: tuple[str, float] | None = None
                       ) -> PrunedInputs:
    """Prune every video (and, with `image_spec`, every image) of a lumped batch and rebuild the
    prompt (the model's one pruning call).

    Args:
      input_ids, attention_mask, mm_token_type_ids: `[B, L]` the lumped prompt (processor built with
        the same `video_pruning`).
      image_grid_thw, video_grid_thw: as the processor gives them.
      merged, deepstack: the encoder output for the images then the videos, `[N, O]` / `[V, N, O]`.
      spec: `(method, rate)`, validated, or None (videos whole).
      config: a `Qwen3VLConfig` (token ids, spatial merge size).
      image_spec: `(method, rate)` for the images (`validate_image_pruning`), or None (images whole).
      embed_tokens: ids `[S]` -> embeddings `[S, E]`, required for text-guided methods.
    """
    merge = config.vision.spatial_merge_size
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    types = np.asarray(mm_token_type_ids)
    empty = np.zeros((0, 3), np.int64)
    plans = plan_videos(empty if video_grid_thw is None else video_grid_thw, merge, spec)
    image_plans = plan_videos(empty if image_grid_thw is None else image_grid_thw, merge, image_spec)
    n_image = sum(p.tokens_per_frame for p in image_plans)

    def select(offset, items, item_spec, code):
        """(masks, kept rows) of one modality whose rows start at `offset` of the encoder output."""
        n = sum(p.grid_thw[0] * p.tokens_per_frame for p in items)
        if item_spec is None:
            return [np.ones(p.grid_thw[0] * p.tokens_per_frame, bool) for p in items], offset + np.arange(n)
        texts: list[PromptText | None] = [None] * len(items)
        if uses_text(item_spec[0]):
            texts = _prompt_texts(ids, types, mask, config, embed_tokens, code, len(items), item_spec[0])
        masks, rows = _video_masks(merged[offset:offset + n], deepstack[:, offset:offset + n], items, merge,
                                   item_spec, texts)
        return masks, offset + rows

    image_masks, image_rows = select(0, image_plans, image_spec, IMAGE)
    masks, video_rows = select(n_image, plans, spec, VIDEO)
    pruned = prune_prompt(ids, mask, types, image_grid_thw, plans, masks, spatial_merge_size=merge,
                          vision_start_token_id=config.vision_start_token_id,
                          vision_end_token_id=config.vision_end_token_id, video_token_id=config.video_token_id,
                          image_plans=image_plans, image_masks=image_masks if image_spec is not None else None)
    return PrunedInputs(pruned.input_ids, pruned.attention_mask, pruned.mm_token_type_ids, pruned.positions,
                        pruned.rope_deltas, np.concatenate([image_rows, video_rows]).astype(np.int64), masks,
                        image_masks if image_spec is not None else None)


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
