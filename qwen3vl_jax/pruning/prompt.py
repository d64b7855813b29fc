"""From a lumped prompt to the pruned per-frame sequence the language model reads.

With pruning on, the processor sizes each video's placeholder for the K retained tokens and puts
all of them in frame 0 (`<t0><VS>` K pads `<VE>` `<t1><VS><VE>` ...), as vLLM does, because the
mask is only known after the encoder has run. Once it is known (`c_f` trues in frame f),
`prune_prompt` rebuilds each row (docs/pruning.md §5.6, §5.8):

1. the unpruned layout: every frame slot `<VS><VE>` refilled with all `R*C` video tokens;
2. its standard mRoPE positions (`get_rope_index`);
3. the pruned video tokens deleted (`sequence_keep_mask`), so frame f keeps `c_f` tokens in its own
   slot, between its own timestamp and markers, and every kept token keeps its unpruned position.
   With exactly K kept (every fixed-count method) the row's length is unchanged; an adaptive
   method keeping fewer shortens it, and the batch is re-padded on the side it was padded on. The
   rope delta grows by the number of pruned tokens.

Images (`image_pruning`) take the same path: the processor sizes an image's placeholder for its K
kept tokens (one frame, no lumping), the unpruned layout refills it with all `R*C` tokens, and the
pruned ones are deleted after the positions are computed.

Host-side numpy. Axes: B batch, L prompt tokens, U unpruned row length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..mrope import get_rope_index

__all__ = ["VideoPlan", "PrunedPrompt", "prune_prompt", "sequence_keep_mask", "TEXT", "IMAGE", "VIDEO"]

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values


def sequence_keep_mask(mm_token_type_ids, video_masks: Sequence, attention_mask=None,
                       image_masks: Sequence | None = None) -> np.ndarray:
    """Bool keep mask, same shape as `mm_token_type_ids` (`[L]` or `[B, L]`) of the UNPRUNED prompt.

    Text, timestamps, markers and padding are kept. The video tokens, in prompt order (row-major over
    a batch), take the per-video flat frame-major masks of `video_masks` in order; their total length
    must equal the video token count. Image tokens likewise take `image_masks` (None: all kept).
    """
    types = np.asarray(mm_token_type_ids)
    real = np.ones(types.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    keep = np.ones(types.shape, bool)
    for kind, code, masks in (("video", VIDEO, video_masks), ("image", IMAGE, image_masks)):
        if masks is None:
            continue
        present = (types == code) & real
        flat = [np.asarray(m, dtype=bool).reshape(-1) for m in masks]
        kept = np.concatenate(flat) if flat else np.zeros((0,), bool)
        if kept.size != int(present.sum()):
            raise ValueError(f"the {kind} masks cover {kept.size} tokens but the prompt holds "
                             f"{int(present.sum())} {kind} tokens (lay the prompt out unpruned)")
        keep[present] = kept  # boolean indexing walks row-major: prompt order
    return keep


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """One video under pruning: its grid in patches, merged tokens per frame and retained count K."""

    grid_thw: tuple[int, int, int]
    tokens_per_frame: int
    keep: int


@dataclasses.dataclass(frozen=True)
class PrunedPrompt:
    input_ids: np.ndarray  # [B, S] the per-frame pruned sequence (S = L unless an adaptive method kept fewer)
    attention_mask: np.ndarray  # [B, S] bool, padded on the side the lumped batch was
    mm_token_type_ids: np.ndarray  # [B, S]
    positions: np.ndarray  # [3, B, S] unpruned positions of the kept tokens, 0 on padding
    rope_deltas: np.ndarray  # [B, 1]


def _unpruned_row(ids, types, plans: Sequence[VideoPlan], first_video: int, vision_start: int,
                  vision_end: int, video_token: int, row: int, image_plans: Sequence[VideoPlan] = (),
                  first_image: int = 0):
    """The unpruned layout of one row's real tokens; returns (ids, types, videos consumed, images
    consumed). An image's run of `keep` tokens becomes its `tokens_per_frame` (all of them)."""
    out_ids, out_types = [], []
    video, image = first_video, first_image
    pending = 0  # empty frame slots still expected for the current video
    i = 0
    while i < len(ids):
        if types[i] == IMAGE:
            run = i
            while run < len(ids) and types[run] == IMAGE:
                run += 1
            if image >= len(image_plans):
                raise ValueError(f"row {row}: more image placeholders than images given ({len(image_plans)})")
            plan = image_plans[image]
            if run - i != plan.keep:
                raise ValueError(
                    f"image {image} (grid_thw {list(plan.grid_thw)}): its placeholder holds {run - i} tokens but "
                    f"pruning keeps {plan.keep}; build the prompt with the same image_pruning in the processor")
            out_ids += [ids[i]] * plan.tokens_per_frame
            out_types += [IMAGE] * plan.tokens_per_frame
            image += 1
            i = run
            continue
        if types[i] == VIDEO:
            if pending:
                raise ValueError(f"row {row}: video {video - 1} has video tokens after frame 0; with pruning "
                                 "the processor puts all retained tokens in frame 0")
            run = i
            while run < len(ids) and types[run] == VIDEO:
                run += 1
            if video >= len(plans):
                raise ValueError(f"row {row}: more video placeholders than videos given ({len(plans)})")
            plan = plans[video]
            if run - i != plan.keep:
                raise ValueError(
                    f"video {video} (grid_thw {list(plan.grid_thw)}): its placeholder holds {run - i} tokens but "
                    f"pruning keeps {plan.keep}; build the prompt with the same video_pruning in the processor"
                )
            out_ids += [video_token] * plan.tokens_per_frame
            out_types += [VIDEO] * plan.tokens_per_frame
            pending = plan.grid_thw[0] - 1
            video += 1
            i = run
            continue
        out_ids.append(ids[i])
        out_types.append(types[i])
        if pending and ids[i] == vision_start and i + 1 < len(ids) and ids[i + 1] == vision_end:
            plan = plans[video - 1]
            out_ids += [video_token] * plan.tokens_per_frame
            out_types += [VIDEO] * plan.tokens_per_frame
            pending -= 1
        i += 1
    if pending:
        raise ValueError(f"row {row}: video {video - 1} lacks {pending} of its empty frame slots "
                         "(<|vision_start|><|vision_end|> after each later timestamp)")
    return np.asarray(out_ids, np.int64), np.asarray(out_types, np.int64), video - first_video, image - first_image


def prune_prompt(input_ids, attention_mask, mm_token_type_ids, image_grid_thw, plans: Sequence[VideoPlan],
                 video_masks: Sequence[np.ndarray], *, spatial_merge_size: int, vision_start_token_id: int,
                 vision_end_token_id: int, video_token_id: int, image_plans: Sequence[VideoPlan] | None = None,
                 image_masks: Sequence[np.ndarray] | None = None) -> PrunedPrompt:
    """Rebuild a lumped batch into pruned per-frame rows with their positions (see module doc).

    `plans` and `video_masks` (bool `[T*R*C]`, at most K trues each) are per video in prompt order
    (row-major over the batch); `image_grid_thw` likewise for images, and with image pruning
    `image_plans` / `image_masks` (bool `[R*C]`) per image (None: every image whole).
    """
    ids = np.asarray(input_ids)
    types = np.asarray(mm_token_type_ids)
    mask = np.asarray(attention_mask).astype(bool)
    images = [] if image_grid_thw is None else [tuple(int(x) for x in g)
                                                 for g in np.asarray(image_grid_thw).reshape(-1, 3)]
    unit = spatial_merge_size**2
    if image_plans is None:  # images whole
        image_plans = [VideoPlan(g, int(np.prod(g)) // unit, int(np.prod(g)) // unit) for g in images]
    rows = []  # per row: (ids, types, positions [3, S_b], delta)
    video = image = 0
    for b in range(ids.shape[0]):
        real = np.flatnonzero(mask[b])
        u_ids, u_types, used, used_images = _unpruned_row(
            ids[b, real], types[b, real], plans, video, vision_start_token_id, vision_end_token_id,
            video_token_id, b, image_plans, image)
        row_images = [p.grid_thw for p in image_plans[image:image + used_images]]
        row_videos = [p.grid_thw for p in plans[video:video + used]]
        pos_u, _ = get_rope_index(u_ids[None], u_types[None], row_images or None, row_videos or None,
                                  spatial_merge_size=spatial_merge_size)
        keep = sequence_keep_mask(u_types, [video_masks[v] for v in range(video, video + used)],
                                  image_masks=None if image_masks is None else image_masks[image:image + used_images])
        rows.append((u_ids[keep], u_types[keep], pos_u[:, 0, keep], int(pos_u.max()) + 1 - int(keep.sum())))
        video += used
        image += used_images
    if video != len(plans):
        raise ValueError(f"{len(plans)} videos given but the prompt holds {video} video placeholders")
    if image != len(image_plans):
        raise ValueError(f"{len(image_plans)} images given but the prompt holds {image} image placeholders")
    # Re-pad on the lumped batch's side (left when every row ends with a real token); with exactly K
    # kept per video every row has its lumped length and this reproduces the lumped layout.
    width = max((r[0].size for r in rows), default=0)
    left = bool(mask[:, -1].all()) if mask.size else True
    pad_id = ids[~mask][0] if (~mask).any() else 0
    out_ids = np.full((ids.shape[0], width), pad_id, ids.dtype)
    out_types = np.zeros((ids.shape[0], width), types.dtype)
    out_mask = np.zeros((ids.shape[0], width), bool)
    positions = np.zeros((3, ids.shape[0], width), np.int64)
    deltas = np.zeros((ids.shape[0], 1), np.int64)
    for b, (r_ids, r_types, r_pos, delta) in enumerate(rows):
        cols = slice(width - r_ids.size, width) if left else slice(0, r_ids.size)
        out_ids[b, cols], out_types[b, cols], out_mask[b, cols], positions[:, b, cols] = r_ids, r_types, True, r_pos
        deltas[b, 0] = delta
    return PrunedPrompt(out_ids, out_mask, out_types, positions, deltas)
