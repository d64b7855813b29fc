"""Image pruning through the registry (`image_pruning=(name, rate)`): VisionZip- and DivPrune-style
selection on cases worked by hand, and the model path (placeholder counts, kept rows, unpruned
positions, keep-all, the logits of a hand-built pruned sequence)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, random_image, user_prompt

from qwen3vl_jax import pruning
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.processing import Qwen3VLProcessor


# ---------------------------------------------------------------------- the methods, by hand


def test_visionzip_dominant_then_contextual_by_hand():
    """16 orthogonal rows (a 4 x 4 merged grid) of distinct norms: a row's attention from the others is
    1/Z_i, its own e_j/Z_j (e = exp(norm^2 / sqrt(D)), Z = e + N - 1), so the received attention ranks
    the rows by norm. K = int(16 * 0.8125) = 13: K_c = floor(130 / 64) = 2 contextual, K_d = 11
    dominant (the 11 largest norms). The 5 left, in index order, are rows 1, 3, 5, 8, 14 (norms .1 .2
    .3 .4 .5); VisionZip's centres step by 5 // 2 = 2: rows 1 and 5. Rows 3, 8, 14 are dropped."""
    norms = np.array([2.0, 0.1, 1.5, 0.2, 1.8, 0.3, 1.2, 1.1, 0.4, 1.9, 1.3, 1.7, 1.6, 1.4, 0.5, 1.0])
    rows = np.diag(norms)
    assert np.argsort(-pruning.visionzip.received_attention(rows), kind="stable")[:11].tolist() == \
        np.argsort(-norms, kind="stable")[:11].tolist()
    assert pruning.retained_count("visionzip", 16, 1, 0.1875) == 13
    mask = pruning.retention_mask("visionzip", rows, (1, 8, 8), 2, 0.1875)
    np.testing.assert_array_equal(np.flatnonzero(~mask), [3, 8, 14])
    # K = 4 (rate 0.75): 40 // 64 = 0 contextual, the 4 largest norms
    mask = pruning.retention_mask("visionzip", rows, (1, 8, 8), 2, 0.75)
    np.testing.assert_array_equal(np.flatnonzero(mask), [0, 4, 9, 11])


def test_divprune_max_min_diversity_by_hand():
    """Unit vectors at 0, 10, 90 and 180 degrees (a 2 x 2 merged grid). Cosine distances: d01 = 1 -
    cos 10 = .015, d02 = 1, d03 = 2, d12 = 1 - cos 80 = .826, d13 = 1 + cos 10 = 1.985, d23 = 1.
    Nearest-neighbour distances .015 .015 .826 1: the first pick is 3. Distances to {3}: 2, 1.985, 1
    -> 0. Min distances to {3, 0}: .015 (row 1), 1 (row 2) -> 2."""
    angles = np.deg2rad([0.0, 10.0, 90.0, 180.0])
    rows = np.stack([np.cos(angles), np.sin(angles)], axis=1) * np.array([[1.0], [3.0], [0.5], [2.0]])
    np.testing.assert_array_equal(pruning.divprune.max_min_diverse(pruning.divprune.cosine_distances(rows), 3),
                                  [3, 0, 2])
    for rate, kept in ((0.25, [0, 2, 3]), (0.5, [0, 3]), (0.75, [3])):
        mask = pruning.retention_mask("divprune", rows, (1, 4, 4), 2, rate)
        np.testing.assert_array_equal(np.flatnonzero(mask), kept, err_msg=f"rate {rate}")
    # exact duplicates: K distinct tokens all the same (the authors' loop could pick one twice)
    mask = pruning.retention_mask("divprune", np.ones((4, 3)), (1, 4, 4), 2, 0.25)
    assert mask.sum() == 3


def test_methods_declare_their_media():
    assert pruning.media("evs") == pruning.media("vidcom2") == {"video"}
    assert pruning.media("visionzip") == {"image"}
    for name in ("divprune", "random", "spatial_grid", "temporal"):
        assert pruning.media(name) == {"image", "video"}, name


@pytest.mark.parametrize("call, message", [
    (lambda: pruning.validate_video_pruning(("visionzip", 0.5)),
     r"pruning method 'visionzip' prunes images only, not videos; video methods: \[.*'divprune'"),
    (lambda: pruning.validate_image_pruning(("evs", 0.5)),
     r"pruning method 'evs' prunes videos only, not images; image methods: \['divprune', 'random'"),
    (lambda: pruning.validate_image_pruning(("fastv", 0.5)), r"'fastv' runs inside the language model"),
    (lambda: pruning.validate_image_pruning(("divprune", 1.0)), r"image pruning rate must be in \[0, 1\)"),
    (lambda: pruning.validate_image_pruning("divprune"), r"image_pruning must be None or a \(method, rate\) pair"),
    (lambda: pruning.validate_image_pruning(("tome", 0.5)), r"unknown pruning method 'tome'"),
    (lambda: pruning.register_method("x", pruning.baselines.SpatialGrid.__new__(type(
        "Bad", (pruning.baselines.SpatialGrid,), {"media": ("audio",)}))), r"'x': media must be"),
])
def test_bad_image_pruning_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert "x" not in pruning.PRUNING_METHODS


# ---------------------------------------------------------------------- through the model


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


def _batch(processor, image_pruning=None):
    """Three images in two left-padded rows (6, 12 and 4 merged tokens)."""
    texts = [processor.apply_chat_template(user_prompt("image", "Describe this.", "image"), add_generation_prompt=True),
             processor.apply_chat_template(user_prompt("Hi there", "image"), add_generation_prompt=True)]
    images = [random_image(64, 96, 0), random_image(96, 128, 1), random_image(64, 64, 2)]
    out = processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="np",
                    image_pruning=image_pruning)
    return {k: out[k] for k in MODEL_INPUTS if k in out}


class KeepAll:
    """Keeps every token at any rate: the pruning machinery with nothing to drop."""

    media = ("image",)

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return tokens_per_frame * num_frames

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        return np.ones(np.asarray(rows).shape[0], bool)


def test_keep_all_equals_unpruned(jax_model, processor):
    full = _batch(processor)
    ref = np.asarray(jax_model(**full))
    np.testing.assert_array_equal(np.asarray(jax_model(**full, image_pruning=("divprune", 0))), ref)  # rate 0: off
    pruning.register_method("keep_all_images", KeepAll())
    try:
        spec = ("keep_all_images", 0.5)
        batch = _batch(processor, spec)
        np.testing.assert_array_equal(batch["input_ids"], full["input_ids"])
        inputs = jax_model.prepare_inputs(**batch, image_pruning=spec)
        reference = jax_model.prepare_inputs(**full)
        for field in ("input_ids", "attention_mask", "positions", "visual_index"):
            np.testing.assert_array_equal(getattr(inputs, field), getattr(reference, field), err_msg=field)
        np.testing.assert_array_equal(np.asarray(jax_model(**batch, image_pruning=spec)), ref)
    finally:
        pruning.unregister_method("keep_all_images")


@pytest.mark.parametrize("method", ["divprune", "visionzip", "spatial_grid"])
def test_pruned_images_keep_their_positions(method, jax_model, processor):
    """Placeholder counts = kept counts = retained_count; the kept rows are the method's mask on the
    encoder output; every kept token (text too) has its unpruned position; the logits equal the
    unpruned model's forward over the unpruned inputs with the dropped image tokens deleted by hand."""
    spec = (method, 0.5)
    full, batch = _batch(processor), _batch(processor, spec)
    cfg = jax_model.config
    grids = full["image_grid_thw"]
    counts = [pruning.retained_count(method, int(g.prod()) // 4, 1, 0.5) for g in grids]
    assert (batch["input_ids"] == cfg.image_token_id).sum() == sum(counts)
    reference = jax_model.prepare_inputs(**full)
    inputs = jax_model.prepare_inputs(**batch, image_pruning=spec)
    # the method's masks on the unpruned encoder rows
    offsets = np.cumsum([0] + [int(g.prod()) // 4 for g in grids])
    rows = np.asarray(pruning.concat_levels(reference.features, reference.deepstack))
    masks = [pruning.retention_mask(method, rows[a:b], g, 2, 0.5) for a, b, g in zip(offsets, offsets[1:], grids)]
    assert [int(m.sum()) for m in masks] == counts
    kept_rows = np.concatenate([a + np.flatnonzero(m) for a, m in zip(offsets, masks)])
    visual = np.asarray(inputs.visual_index)
    np.testing.assert_array_equal(visual[visual >= 0], kept_rows)  # row-major: prompt order
    # hand-built pruned inputs: the unpruned ones with the dropped image tokens deleted, left-padded again
    ref_visual = np.asarray(reference.visual_index)
    ref_mask = np.asarray(reference.attention_mask)
    keep = ref_mask & ((ref_visual < 0) | np.isin(ref_visual, kept_rows))
    width = int(keep.sum(1).max())
    assert width == batch["input_ids"].shape[1]

    def squeeze(x, fill):
        x = np.asarray(x)
        out = np.full(x.shape[:-2] + (x.shape[-2], width), fill, x.dtype)
        for b in range(keep.shape[0]):
            row = x[..., b, keep[b]]
            out[..., b, width - row.shape[-1]:] = row
        return out

    hand = dataclasses.replace(
        reference, input_ids=jnp.asarray(squeeze(reference.input_ids, 0)),
        attention_mask=jnp.asarray(squeeze(ref_mask, False)), positions=jnp.asarray(squeeze(reference.positions, 0)),
        visual_index=jnp.asarray(squeeze(ref_visual, -1)))
    real = np.asarray(hand.attention_mask)
    np.testing.assert_array_equal(np.asarray(inputs.attention_mask), real)
    np.testing.assert_array_equal(np.asarray(inputs.input_ids)[real], np.asarray(hand.input_ids)[real])
    np.testing.assert_array_equal(np.asarray(inputs.positions)[:, real], np.asarray(hand.positions)[:, real])
    np.testing.assert_array_equal(visual, np.asarray(hand.visual_index))
    logits = np.asarray(jax_model(**batch, image_pruning=spec))
    assert_close(logits[real], np.asarray(jax_model.forward(hand))[real], "f32_logits", method)


def test_generate_and_video_protocol_with_image_pruning(jax_model, processor):
    """`generate` takes image_pruning (its first token is the pruned forward's argmax); a prompt sized
    without the option is refused naming the mismatch."""
    spec = ("divprune", 0.5)
    batch = _batch(processor, spec)
    ids = jax_model.generate(**batch, image_pruning=spec, max_new_tokens=1, eos_token_id=[])
    logits = np.asarray(jax_model(**batch, image_pruning=spec))
    np.testing.assert_array_equal(ids[:, -1], logits[:, -1].argmax(-1))
    with pytest.raises(ValueError, match=r"the prompt has 22 image tokens but the image inputs give 11 merged "
                                         r"tokens after divprune pruning at rate 0.5"):
        jax_model(**_batch(processor), image_pruning=spec)
