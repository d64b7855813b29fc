"""Test oracles for video pruning: the closed form of the positions after pruning, and vLLM 0.33.0's
own bookkeeping reproduced for parity checks (docs/pruning.md §5).

The package itself rebuilds pruned prompts with `qwen3vl_jax.pruning.prompt.prune_prompt`; these
functions are independent formulations the tests compare it with:

  prune_positions(positions [3, L], keep [L])             -> (positions [3, S], delta), one row
  prune_batch(positions [3, B, L], keep, attention_mask)  -> PrunedBatch (gather index, mask, positions,
                                                             deltas) of a padded batch
  decode_positions(S, delta, steps)                       -> positions of the decode tokens

and vLLM's lumped prompt, 5-channel block metadata and `recompute_mrope_positions`, which equal the
closed form in the cases vLLM handles correctly (one media item per prefill call, no outer
`VS ... VE` wrapper).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qwen3vl_jax.mrope import get_rope_index
from qwen3vl_jax.pruning.prompt import IMAGE, TEXT, VIDEO

__all__ = ["prune_positions", "prune_batch", "PrunedBatch", "decode_positions", "compute_mrope_for_media",
           "image_block_metadata", "video_block_metadata", "lumped_initial_positions",
           "recompute_mrope_positions", "TEXT", "IMAGE", "VIDEO"]


def prune_positions(positions, keep) -> tuple[np.ndarray, int]:
    """Positions `[3, S]` of the kept tokens of one unpadded row, and its rope delta `max(P_U) + 1 - S`."""
    positions = np.asarray(positions)
    keep = np.asarray(keep, dtype=bool)
    if positions.ndim != 2 or positions.shape[0] != 3 or keep.shape != positions.shape[1:]:
        raise ValueError(f"positions must be [3, L] and keep [L], got {positions.shape} and {keep.shape}")
    kept = positions[:, keep]
    top = int(positions.max()) + 1 if positions.size else 0
    return kept, top - int(kept.shape[1])


@dataclass(frozen=True)
class PrunedBatch:
    """A pruned, re-padded batch. `index[b, s]` is the unpruned column of pruned slot s (0 on padding):
    gather `input_ids`, `mm_token_type_ids`, ... with `np.take_along_axis(x, index, 1)`."""

    index: np.ndarray           # int64 [B, S]
    attention_mask: np.ndarray  # int64 [B, S]
    positions: np.ndarray       # int64 [3, B, S], 0 on padding
    rope_deltas: np.ndarray     # int64 [B, 1], max(P_U row) + 1 - kept real tokens


def prune_batch(positions, keep, attention_mask=None, padding_side: str = "left") -> PrunedBatch:
    """Drop the unkept tokens of a padded batch and re-pad to the longest kept row.

    `positions` `[3, B, L]` and `attention_mask` `[B, L]` as from `get_rope_index` on the unpruned
    prompt; `keep` `[B, L]` from `sequence_keep_mask`. Deltas follow `get_rope_index`'s convention
    (per row, relative to the number of real tokens), so `delta = delta_unpruned + pruned tokens`.
    """
    positions = np.asarray(positions)
    keep = np.asarray(keep, dtype=bool)
    if positions.ndim != 3 or positions.shape[0] != 3 or keep.shape != positions.shape[1:]:
        raise ValueError(f"positions must be [3, B, L] and keep [B, L], got {positions.shape} and "
                         f"{keep.shape}")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    batch, length = keep.shape
    real = np.ones((batch, length), bool) if attention_mask is None else np.asarray(attention_mask) != 0
    rows = [np.flatnonzero(keep[b] & real[b]) for b in range(batch)]
    width = max((r.size for r in rows), default=0)
    index = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    out = np.zeros((3, batch, width), np.int64)
    deltas = np.zeros((batch, 1), np.int64)
    for b, cols in enumerate(rows):
        lo = width - cols.size if padding_side == "left" else 0
        sl = slice(lo, lo + cols.size)
        index[b, sl] = cols
        mask[b, sl] = 1
        out[:, b, sl] = positions[:, b, cols]
        top = int(positions[:, b, real[b]].max()) + 1 if real[b].any() else 0
        deltas[b, 0] = top - cols.size
    return PrunedBatch(index, mask, out, deltas)


def decode_positions(prompt_length: int, delta: int, steps: int) -> np.ndarray:
    """`[3, steps]` positions of the decode tokens after a (pruned) prompt of `prompt_length` tokens."""
    pos = np.arange(steps, dtype=np.int64) + int(prompt_length) + int(delta)
    return np.broadcast_to(pos, (3, steps)).copy()


# ----------------------------------------------------------------------------------------------
# vLLM 0.33.0's bookkeeping


def compute_mrope_for_media(grid_thw, spatial_merge_size: int, tokens_per_second: float = 1.0,
                            video_second_per_grid: float = 1.0) -> np.ndarray:
    """int64 `[T*R*C, 4]` rows `[int(t * tps * spg), r, c, C]` in flat order (vLLM's helper)."""
    t, h, w = (int(x) for x in np.asarray(grid_thw).reshape(-1))
    r, c = h // spatial_merge_size, w // spatial_merge_size
    tt, rr, cc = np.meshgrid(np.arange(t), np.arange(r), np.arange(c), indexing="ij")
    t_pos = np.trunc(tt.reshape(-1) * float(tokens_per_second) * float(video_second_per_grid))
    t_pos = t_pos.astype(np.int64)
    return np.stack([t_pos, rr.reshape(-1), cc.reshape(-1), np.full(t * r * c, c)], axis=1).astype(np.int64)


def image_block_metadata(grid_thw, spatial_merge_size: int) -> np.ndarray:
    """`[5, R*C]` metadata vLLM appends to an image's rows when pruning is on: `[0, r, c, C, 0]`."""
    meta = compute_mrope_for_media(grid_thw, spatial_merge_size)
    return np.concatenate([meta, np.zeros((meta.shape[0], 1), np.int64)], axis=1).T.copy()


def _unpruned_video_layout(timestamp_lengths: Sequence[int], tokens_per_frame: int) -> np.ndarray:
    """Token kinds of `concat_f(ts * n_f, VS, VID * tpf, VE)`: 0 text, 1 VS, 2 VID, 3 VE."""
    parts = []
    for n in timestamp_lengths:
        parts += [np.zeros(int(n), np.int64), [1], np.full(tokens_per_frame, 2), [3]]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0,), np.int64)


def video_block_metadata(timestamp_lengths: Sequence[int], rows: int, cols: int, mask) -> np.ndarray:
    """int64 `[5, len(B)]` metadata `[t, h, w, is_vision_start, is_video]` of one pruned video, in the
    per-frame embedding order `B = concat_f(timestamp_f, VS, VID * n_f, VE)`.

    `t, h, w` are the token's positions in the unpruned per-frame layout started at 0, so kept video
    tokens carry their unpruned relative positions (docs/pruning.md §5.3 step 4). `timestamp_lengths[f]` is the
    number of tokens of frame f's `<t.t seconds>` text; `mask` the flat frame-major keep mask.
    """
    tpf = int(rows) * int(cols)
    mask = np.asarray(mask, dtype=bool).reshape(-1)
    frames = len(timestamp_lengths)
    if mask.size != frames * tpf:
        raise ValueError(f"mask has {mask.size} entries; {frames} frames of {rows}x{cols} need "
                         f"{frames * tpf}")
    kinds = _unpruned_video_layout(timestamp_lengths, tpf)
    types = np.where(kinds == 2, VIDEO, TEXT)[None]
    pos, _ = get_rope_index(np.zeros_like(types), types, video_grid_thw=[[frames, rows, cols]],
                            spatial_merge_size=1)
    keep = np.ones(kinds.size, bool)
    keep[kinds == 2] = mask
    kinds = kinds[keep]
    return np.concatenate([pos[:, 0, keep], (kinds == 1)[None], (kinds == 2)[None]]).astype(np.int64)


def _grids(grid_thw) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [tuple(int(x) for x in g) for g in np.asarray(grid_thw).reshape(-1, 3)]


def lumped_initial_positions(mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                             spatial_merge_size: int = 2,
                             video_token_counts: Sequence[int] | None = None) -> tuple[np.ndarray, int]:
    """vLLM's initial positions `[3, L']` of one prompt row and its delta `max + 1 - L`.

    Each maximal run of video tokens is one frame slot of the current video; a video ends once its
    `video_token_counts[v]` tokens (default `T*R*C`, the unpruned layout) are consumed. A slot of n
    tokens: `n // tpf` full frame grids, then a partial grid of the first `n % tpf` raster cells;
    a slot with `0 < n < tpf` emits a full grid (vLLM's quirk, so `L' = L + tpf - n` can exceed L).
    After a (full or partial) grid placed at P the text cursor is `P + max(R, C)`.
    """
    types = np.asarray(mm_token_type_ids).reshape(-1)
    m = int(spatial_merge_size)
    images = _grids(image_grid_thw)
    videos = _grids(video_grid_thw)
    counts = [t * (h // m) * (w // m) for t, h, w in videos]
    if video_token_counts is not None:
        counts = [int(k) for k in video_token_counts]
    pieces, nxt = [], 0
    img_i, vid_i, vid_used = 0, 0, 0

    def grid(p, r, c, cells):
        rr, cc = np.divmod(np.arange(cells), c)
        return np.stack([np.full(cells, p), p + rr, p + cc])

    edges = np.flatnonzero(np.diff(types)) + 1 if types.size else np.zeros(0, int)
    bounds = np.concatenate([[0], edges, [types.size]]).astype(int)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        kind, n = int(types[begin]), int(end - begin)
        if kind == TEXT:
            pieces.append(np.broadcast_to(np.arange(n) + nxt, (3, n)))
            nxt += n
        elif kind == IMAGE:
            t, h, w = images[img_i]
            img_i += 1
            r, c = h // m, w // m
            pieces.append(grid(nxt, r, c, r * c))
            nxt += max(r, c)
        else:
            t, h, w = videos[vid_i]
            r, c = h // m, w // m
            tpf = r * c
            full, rest = divmod(n, tpf)
            if full == 0:
                full, rest = 1, 0  # the quirk: a short slot still emits a whole grid
            for _ in range(full):
                pieces.append(grid(nxt, r, c, tpf))
                nxt += max(r, c)
            if rest:
                pieces.append(grid(nxt, r, c, rest))
                nxt += max(r, c)
            vid_used += n
            if vid_used >= counts[vid_i]:
                vid_i, vid_used = vid_i + 1, 0
    pos = np.concatenate(pieces, axis=1).astype(np.int64) if pieces else np.zeros((3, 0), np.int64)
    return pos, (int(pos.max()) + 1 if pos.size else 0) - int(types.size)


def recompute_mrope_positions(input_ids, blocks: Sequence, positions, num_computed_tokens: int,
                              vision_start_token_id: int, image_token_id: int,
                              video_token_id: int) -> tuple[np.ndarray, int]:
    """vLLM 0.33.0's `recompute_mrope_positions`, quirks included.

    `blocks`: metadata arrays `[C, L_k]`, C in {4, 5}, in order; `positions` `[3, >= N]`.
    """
    ids = np.asarray(input_ids).reshape(-1)
    n = ids.size
    out = np.array(positions, dtype=np.int64, copy=True)
    media = (ids == image_token_id) | (ids == video_token_id)
    text = ~media
    if not blocks:
        return out, int(out.max()) + 1 - n
    nct = int(num_computed_tokens)
    total, seen = int(media.sum()), int(media[:nct].sum())
    if seen == total:
        return out, int(out.max()) + 1 - n
    vs = np.flatnonzero(ids == vision_start_token_id)
    for block in blocks:
        meta = np.asarray(block).astype(np.int64)
        chans, length = meta.shape
        has_vid = chans == 5 and length > 0 and bool(np.any(meta[4] != 0))
        nts = 0
        if has_vid:
            starts = np.flatnonzero(meta[3] == 1)
            nts = int(starts[0]) if starts.size else 0
        before_nct = vs[vs < nct]
        inside = False
        if before_nct.size:
            last = int(before_nct.max())
            before = int(media[:last].sum())
            inside = seen > before
            if not inside and has_vid and last < nct <= last + nts + 1:
                inside = True
        if inside:
            emb_seen, g = seen - before, last
        else:
            after = vs[vs >= nct]
            if not after.size:
                raise IndexError("no vision start token at or after the computed tokens")
            emb_seen, g = 0, int(after.min())
        if chans == 5 and emb_seen == 0 and has_vid:
            g -= nts
            base, start = int(out[2, g - 1]) + 1, g  # g - 1 may be -1: wraps to the last column, as in vLLM
        else:
            base, start = int(out[2, g]) + 1, g + 1 + emb_seen
        end = start + length
        out[:, start:end] = meta[:3] + base
        off = int(meta[:3].max()) + base + 1 if chans == 5 else int(meta[3, 0]) + base
        out[:, end:n] = np.cumsum(text[end:n]) + off - 1
        nct += length
    return out, int(out.max()) + 1 - n
