"""Vision tower parity with HF's `Qwen3VLVisionModel` on the same weights, module by module."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from flax import nnx

from pallas_kernels.attention.mask import AttentionMask
from pallas_kernels.pos_embed import reference as pos_ref
from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.vision import vision_metadata, vision_rotary_cos_sin, vision_rotary_inv_freq

GRIDS = {
    "one_image": [[1, 6, 10]],
    "several_images": [[1, 6, 10], [1, 4, 4], [1, 8, 2]],
    "video_t3": [[3, 4, 6]],
    "image_and_video": [[1, 2, 4], [4, 4, 4]],
    "non_square": [[1, 2, 14]],
    "smallest": [[1, 2, 2]],
    "large_64x80": [[1, 64, 80]],
}


def _pixels(grid, width, seed=0):
    rows = int(np.prod(np.asarray(grid), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def _hf_inputs(hf_visual, grid):
    """HF's own host-side metadata for a grid (cu_seqlens, rotary position ids, interpolation taps)."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    g = torch.tensor(grid)
    cfg = hf_visual.config
    idx, w = get_vision_interpolation_indices_and_weights(
        g, num_grid_per_side=hf_visual.num_grid_per_side, mode="bilinear", align_corners=True,
        spatial_merge_size=cfg.spatial_merge_size,
    )
    return g, get_vision_cu_seqlens(g), get_vision_position_ids(g, cfg.spatial_merge_size), idx, w


# ---------------------------------------------------------------------- per module


def test_patch_embed(hf_model, jax_model):
    pix = _pixels([[1, 4, 6]], jax_model.config.vision.patch_dim)
    with torch.no_grad():
        ref = hf_model.model.visual.patch_embed(torch.from_numpy(pix)).numpy()
    assert_close(jax_model.visual.patch_embed(jnp.asarray(pix)), ref, "f32_module", "patch embed")


@pytest.mark.parametrize("grid", [[[1, 6, 10]], [[2, 2, 4], [1, 32, 20]], [[1, 2, 2]]])
def test_interpolation_taps_equal_hf(hf_model, jax_model, grid):
    _, _, _, idx, w = _hf_inputs(hf_model.model.visual, grid)
    meta = vision_metadata(np.asarray(grid), jax_model.config.vision)
    np.testing.assert_array_equal(meta.pos_indices, idx.numpy())
    np.testing.assert_array_equal(meta.pos_weights, w.numpy())


@pytest.mark.parametrize("h,w", [(6, 10), (16, 16), (32, 20), (2, 2), (40, 64)])
def test_interpolation_is_align_corners_bilinear(jax_model, h, w):
    """Against the definition: F.interpolate(bilinear, align_corners=True) of the table, merge-ordered."""
    cfg = jax_model.config.vision
    table = np.asarray(jax_model.visual.pos_embed.embedding[...])
    side = cfg.num_grid_per_side
    grid_img = torch.from_numpy(table.copy()).reshape(side, side, -1).permute(2, 0, 1)[None]
    resized = F.interpolate(grid_img, size=(h, w), mode="bilinear", align_corners=True)[0]  # [E, h, w]
    rows, cols = pos_ref.merge_order_rows_cols(h, w, cfg.spatial_merge_size)
    ref = resized[:, rows, cols].T.numpy()
    idx, wt = pos_ref.interpolation_taps([[1, h, w]], side, cfg.spatial_merge_size)
    ours = pos_ref.interpolate_pos_embed(jnp.asarray(table), jnp.asarray(idx), jnp.asarray(wt))
    assert_close(ours, ref, "f32_module", f"interpolation {h}x{w}")


def test_rotary_tables(hf_model, jax_model):
    grid = [[2, 4, 6], [1, 8, 2]]
    _, _, pos_ids, _, _ = _hf_inputs(hf_model.model.visual, grid)
    dummy = torch.zeros(1)
    with torch.no_grad():
        cos_ref, sin_ref = hf_model.model.visual.rotary_pos_emb(dummy, pos_ids)
    meta = vision_metadata(np.asarray(grid), jax_model.config.vision)
    np.testing.assert_array_equal(meta.rotary_ids, pos_ids.numpy())
    cos, sin = vision_rotary_cos_sin(jnp.asarray(meta.rotary_ids),
                                     jnp.asarray(vision_rotary_inv_freq(jax_model.config.vision)))
    assert_close(cos, cos_ref.numpy(), "f32_module", "rotary cos")
    assert_close(sin, sin_ref.numpy(), "f32_module", "rotary sin")


def test_block(hf_model, jax_model):
    grid = [[2, 4, 6], [1, 2, 4]]
    g, cu, pos_ids, _, _ = _hf_inputs(hf_model.model.visual, grid)
    hidden = np.random.default_rng(1).standard_normal((int(g.prod(1).sum()), 64)).astype(np.float32)
    hf_visual = hf_model.model.visual
    with torch.no_grad():
        pe = hf_visual.rotary_pos_emb(torch.zeros(1), pos_ids)
        ref = hf_visual.blocks[1](torch.from_numpy(hidden), cu_seqlens=cu, position_embeddings=pe).numpy()
    meta = vision_metadata(np.asarray(grid), jax_model.config.vision)
    cos, sin = vision_rotary_cos_sin(jnp.asarray(meta.rotary_ids),
                                     jnp.asarray(vision_rotary_inv_freq(jax_model.config.vision)))
    mask = AttentionMask.segments(jnp.asarray(meta.segment_ids))  # one run of keys per frame
    ours = jax_model.visual.blocks[1](jnp.asarray(hidden), cos, sin, mask)
    assert_close(ours, ref, "f32_module", "vision block")


@pytest.mark.parametrize("which", ["merger", "deepstack_0", "deepstack_1"])
def test_mergers(hf_model, jax_model, which):
    hidden = np.random.default_rng(2).standard_normal((48, 64)).astype(np.float32)
    if which == "merger":
        hf_mod, ours_mod = hf_model.model.visual.merger, jax_model.visual.merger
    else:
        j = int(which[-1])
        hf_mod, ours_mod = hf_model.model.visual.deepstack_merger_list[j], jax_model.visual.deepstack_merger_list[j]
    with torch.no_grad():
        ref = hf_mod(torch.from_numpy(hidden)).numpy()
    assert_close(ours_mod(jnp.asarray(hidden)), ref, "f32_module", which)


# ---------------------------------------------------------------------- whole tower


@pytest.mark.parametrize("case", list(GRIDS))
def test_tower(hf_model, jax_model, case):
    grid = np.asarray(GRIDS[case])
    pix = _pixels(grid, jax_model.config.vision.patch_dim, seed=3)
    with torch.no_grad():
        out = hf_model.model.visual(torch.from_numpy(pix), torch.from_numpy(grid))
    merged, deepstack = jax_model.encode_vision(pix, grid)
    assert merged.shape == tuple(out.pooler_output.shape)
    assert deepstack.shape == (len(out.deepstack_features), *merged.shape)
    assert_close(merged, out.pooler_output.numpy(), "f32_tower", f"{case}: merged")
    for level, ref in enumerate(out.deepstack_features):
        assert_close(deepstack[level], ref.numpy(), "f32_tower", f"{case}: deepstack {level}")


def test_metadata_frame_rows_hint(jax_model):
    """Frames of one size give attention the `frame_rows` hint; mixed sizes and padded calls (which
    serve any sizes under one compile) give none. Padding rows are their own segment, -1."""
    config = jax_model.config.vision
    assert vision_metadata(np.asarray([[2, 4, 6], [1, 6, 4]]), config).frame_rows == 24
    mixed = vision_metadata(np.asarray([[1, 4, 4], [1, 4, 6]]), config)
    assert mixed.frame_rows == 0
    padded = vision_metadata(np.asarray([[2, 4, 6]]), config).padded(64)
    assert padded.frame_rows == 0 and padded.segment_ids.shape == (64,)
    np.testing.assert_array_equal(padded.segment_ids[48:], -1)
    with pytest.raises(ValueError, match="exceed the vision budget"):
        mixed.padded(8)


def test_tower_accepts_jax_inputs_and_matches_numpy(jax_model):
    grid = np.asarray([[1, 4, 4]])
    pix = _pixels(grid, jax_model.config.vision.patch_dim, seed=4)
    a = jax_model.encode_vision(pix, grid)
    b = jax_model.encode_vision(jnp.asarray(pix), jnp.asarray(grid))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_hidden_states_hook(hf_model, jax_model):
    grid = np.asarray([[2, 4, 4]])
    pix = _pixels(grid, jax_model.config.vision.patch_dim, seed=5)
    with torch.no_grad():
        out = hf_model.model.visual(torch.from_numpy(pix), torch.from_numpy(grid), output_hidden_states=True)
    ours = jax_model.encode_vision(pix, grid, return_hidden_states=True)
    assert len(ours.hidden_states) == jax_model.config.vision.depth
    # HF records each block's output (its hidden_states tuple has one entry per block).
    ref_hidden = out.hidden_states[-len(ours.hidden_states):]
    for i, (a, b) in enumerate(zip(ours.hidden_states, ref_hidden)):
        assert_close(a, b.numpy(), "f32_tower", f"block {i} output")


def test_bf16_tower(tiny_dir, hf_model):
    model = Qwen3VL.from_pretrained(tiny_dir, dtype=jnp.bfloat16)
    assert model.visual.blocks[0].attn.qkv.kernel.dtype == jnp.bfloat16
    grid = np.asarray([[1, 6, 10], [2, 4, 4]])
    pix = _pixels(grid, model.config.vision.patch_dim, seed=6)
    merged, deepstack = model.encode_vision(pix, grid)
    assert merged.dtype == jnp.bfloat16 and deepstack.dtype == jnp.bfloat16
    with torch.no_grad():
        out = hf_model.model.visual(torch.from_numpy(pix), torch.from_numpy(grid))
    assert_close(merged, out.pooler_output.numpy(), "bf16_tower", "bf16 merged")
    for level, ref in enumerate(out.deepstack_features):
        assert_close(deepstack[level], ref.numpy(), "bf16_tower", f"bf16 deepstack {level}")


# ---------------------------------------------------------------------- bad input


def test_bad_inputs_name_the_item(jax_model):
    width = jax_model.config.vision.patch_dim
    with pytest.raises(ValueError, match=r"pixel_values has 10 rows but grid_thw describes 24 patches"):
        jax_model.encode_vision(np.zeros((10, width), np.float32), [[1, 4, 4], [2, 2, 2]])
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \[1, 3, 4\].*divisible by the spatial merge size 2"):
        jax_model.encode_vision(np.zeros((28, width), np.float32), [[1, 4, 4], [1, 3, 4]])
    with pytest.raises(ValueError, match=r"rows have width 100, expected C\*T\*p\*p = 3\*2\*16\*16 = 1536"):
        jax_model.encode_vision(np.zeros((16, 100), np.float32), [[1, 4, 4]])
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \[0, 4, 4\] has a non-positive entry"):
        jax_model.encode_vision(np.zeros((0, width), np.float32), [[0, 4, 4]])
    with pytest.raises(ValueError, match=r"grid_thw must have shape \[num_items, 3\]"):
        jax_model.encode_vision(np.zeros((16, width), np.float32), [1, 4, 4])


def test_module_tree_mirrors_hf_names(jax_model, hf_model):
    """Every HF vision tensor name maps to one of our parameters and back (the converter's premise)."""
    from qwen3vl_jax.params import hf_to_ours_name, ours_to_hf_name
    from qwen3vl_jax.params import param_shapes

    ours = param_shapes(nnx.state(jax_model, nnx.Param))
    hf_names = [n for n in hf_model.state_dict() if n.startswith("model.visual.")]
    mapped = {hf_to_ours_name(n)[0] for n in hf_names}
    assert mapped == {p for p in ours if p.startswith("visual.")}
    assert all(ours_to_hf_name(hf_to_ours_name(n)[0])[0] == n for n in hf_names)
