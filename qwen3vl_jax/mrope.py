"""Multimodal rotary positions (mRoPE), computed on the host with numpy.

Rule (HF's `Qwen3VLModel.get_rope_index`): walk each sequence's non-padding tokens in runs of
equal `mm_token_type_ids` (0 text, 1 image, 2 video). A text run of n tokens takes positions
start .. start+n-1 on all three axes and advances start by n. A visual run whose grid after
merging is (1, H, W) takes t = start, h = start + row, w = start + col, and advances start by
max(H, W). A video of t temporal patches is t such runs, one per frame (the processor separates
frames with timestamp text). Padding positions are 0. The rope delta of a row is
max(position) + 1 - (number of non-padding tokens); decoding continues at cache length + delta.

Axes: B batch, L tokens; positions are `[3, B, L]` (t, h, w).
"""

from __future__ import annotations

import numpy as np

__all__ = ["get_rope_index", "visual_run_positions", "split_video_grids"]


def split_video_grids(video_grid_thw) -> np.ndarray:
    """Each video's (t, h, w) as t per-frame grids (1, h, w): frames are separate runs."""
    grid = np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
    frames = np.repeat(grid, grid[:, 0], axis=0)
    frames[:, 0] = 1
    return frames


def visual_run_positions(start: int, grid_thw, spatial_merge_size: int) -> np.ndarray:
    """`[3, t*H*W]` positions of one visual run whose merged grid is (t, H, W), starting at `start`."""
    t, h, w = (int(x) for x in grid_thw)
    h, w = h // spatial_merge_size, w // spatial_merge_size
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def _runs(types: np.ndarray):
    """(type, begin, end) of each run of equal values."""
    if types.size == 0:
        return
    edges = np.flatnonzero(np.diff(types)) + 1
    bounds = np.concatenate([[0], edges, [types.size]])
    for begin, end in zip(bounds[:-1], bounds[1:]):
        yield int(types[begin]), int(begin), int(end)


def get_rope_index(
    input_ids,
    mm_token_type_ids,
    image_grid_thw=None,
    video_grid_thw=None,
    attention_mask=None,
    spatial_merge_size: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """mRoPE positions `[3, B, L]` (int64) and rope deltas `[B, 1]`, equal to HF's `get_rope_index`.

    Raises ValueError if the visual runs and the grids disagree (more runs than grids, a run whose
    length is not the grid's token count, or grids left over).
    """
    input_ids = np.asarray(input_ids)
    types = np.asarray(mm_token_type_ids)
    batch, length = input_ids.shape
    if types.shape != input_ids.shape:
        raise ValueError(f"mm_token_type_ids shape {types.shape} != input_ids shape {input_ids.shape}")
    mask = np.ones_like(input_ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    grids = {
        1: [] if image_grid_thw is None else list(np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)),
        2: [] if video_grid_thw is None else list(split_video_grids(video_grid_thw)),
    }
    used = {1: 0, 2: 0}
    names = {1: "image", 2: "video frame"}
    positions = np.zeros((3, batch, length), dtype=np.int64)
    deltas = np.zeros((batch, 1), dtype=np.int64)
    for b in range(batch):
        row_types = types[b][mask[b]]
        pieces, start = [], 0
        for kind, begin, end in _runs(row_types):
            if kind == 0:
                pieces.append(np.broadcast_to(np.arange(end - begin) + start, (3, end - begin)))
                start += end - begin
                continue
            if kind not in grids:
                raise ValueError(f"mm_token_type_ids holds {kind}; only 0 (text), 1 (image), 2 (video) exist")
            if used[kind] >= len(grids[kind]):
                raise ValueError(f"row {b} has more {names[kind]} runs than {names[kind]} grids were given "
                                 f"({len(grids[kind])})")
            grid = grids[kind][used[kind]]
            used[kind] += 1
            run = visual_run_positions(start, grid, spatial_merge_size)
            if run.shape[1] != end - begin:
                raise ValueError(
                    f"row {b}: a run of {end - begin} {names[kind]} tokens at {begin} but its grid "
                    f"{grid.tolist()} gives {run.shape[1]} merged tokens"
                )
            pieces.append(run)
            start += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        row = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
        positions[:, b, mask[b]] = row
        deltas[b, 0] = (row.max() + 1 if row.size else 0) - row.shape[1]
    for kind in (1, 2):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {names[kind]} grids given but {used[kind]} {names[kind]} "
                             "runs found in the prompt")
    return positions, deltas
