"""Where the model looks: a row of attention over a prompt's visual tokens, laid back on the grids.

`model(..., return_attentions=LAYERS)` gives probabilities `[B, H, L, S]` over the S tokens of the
sequence. The visual ones among them are merged tokens of the images and videos; each sits at one
cell of its item's merged grid `(T, R, C)` (T temporal steps of `temporal_patch_size` frames, R x C
cells of `spatial_merge_size * patch_size` pixels square):

    inputs = model.prepare_inputs(**batch, encode=False)       # visual_index: which token is where
    grids = attention_grids(weights[b, :, -1].mean(0), inputs.visual_index[b], batch["image_grid_thw"],
                            batch["video_grid_thw"], merge)    # per item [T, R, C] (NaN: not in the row)
    heat = to_pixels(grids[0], cell=merge * patch_size)          # [T, R * cell, C * cell]

`visual_index` is `MultimodalInputs.visual_index`: for each position the encoder row it holds (all
images, then all videos, in the processor's order; -1 for text). Pruned tokens (video or image
pruning) are never referenced, so their cells stay NaN, as are the cells of items in other rows.

Axes: L keys of one row; N merged visual rows; per item T steps, an R x C merged grid.
"""

from __future__ import annotations

import numpy as np

__all__ = ["item_offsets", "attention_grids", "to_pixels"]


def item_offsets(image_grid_thw, video_grid_thw, spatial_merge_size: int):
    """Per item (images then videos): `(first encoder row, (T, R, C))`."""
    items = []
    offset = 0
    for grids in (image_grid_thw, video_grid_thw):
        if grids is None:
            continue
        for t, h, w in np.asarray(grids, np.int64).reshape(-1, 3):
            if h % spatial_merge_size or w % spatial_merge_size:
                raise ValueError(f"grid_thw {[int(t), int(h), int(w)]} is not divisible by spatial_merge_size "
                                 f"{spatial_merge_size}")
            shape = (int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size)
            items.append((offset, shape))
            offset += int(np.prod(shape))
    return items


def attention_grids(weights, visual_index, image_grid_thw, video_grid_thw, spatial_merge_size: int):
    """Per item (images then videos), a float `[T, R, C]` map of `weights` over its tokens.

    Args:
      weights: `[L]` one attention row (e.g. a query's probabilities, averaged over heads) over the
        positions of one sequence.
      visual_index: `[L]` the encoder row of each position (`MultimodalInputs.visual_index[b]`), -1
        for text.
      image_grid_thw, video_grid_thw: the processor's grids (None when absent).
    Returns:
      A list with one `[T, R, C]` float64 array per item; cells no position of this row holds (pruned
      tokens, items of other rows) are NaN. ValueError if a position names a row no item has.
    """
    weights = np.asarray(weights, np.float64).reshape(-1)
    index = np.asarray(visual_index).reshape(-1)
    if weights.shape != index.shape:
        raise ValueError(f"weights cover {weights.shape[0]} positions but visual_index {index.shape[0]}")
    items = item_offsets(image_grid_thw, video_grid_thw, spatial_merge_size)
    total = sum(int(np.prod(shape)) for _, shape in items)
    flat = np.full(total, np.nan)
    visual = index >= 0
    if visual.any() and index[visual].max() >= total:
        raise ValueError(f"visual_index names encoder row {int(index[visual].max())} but the grids give "
                         f"{total} rows")
    flat[index[visual]] = weights[visual]
    return [flat[offset:offset + int(np.prod(shape))].reshape(shape) for offset, shape in items]


def to_pixels(grid_map, cell: int, frames_per_step: int = 1) -> np.ndarray:
    """`[T, R, C]` -> `[T * frames_per_step, R * cell, C * cell]`: each cell repeated over its pixels
    (and each temporal step over its frames), to lay over the resized image or video frames."""
    grid_map = np.asarray(grid_map)
    if grid_map.ndim != 3:
        raise ValueError(f"expected a [T, R, C] map, got shape {grid_map.shape}")
    return np.repeat(np.repeat(np.repeat(grid_map, frames_per_step, 0), cell, 1), cell, 2)
