"""Video pruning end to end on the tiny checkpoint: lumped prompts, rebuilt per-frame sequences,
positions kept from the unpruned layout, generation, buckets."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention import reference as attention_ref
from qwen3vl_jax.buckets import EncoderRunner
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.processing import Qwen3VLProcessor
from qwen3vl_jax.pruning import retained_count


def _video(frames, h, w, seed, static=False):
    rng = np.random.default_rng(seed)
    if static:  # a still background with one moving square: EVS has ties and clear motion
        base = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        video = np.repeat(base[None], frames, axis=0)
        for t in range(frames):
            video[t, 8:24, 4 * t : 4 * t + 16] = 255
        return video
    return (rng.random((frames, h, w, 3)) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


def _inputs(processor, parts_per_row, images=(), videos=(), pruning=None):
    texts = []
    for parts in parts_per_row:
        content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True))
    meta = [{"fps": 4.0, "total_num_frames": len(v)} for v in videos]
    return processor(text=texts, images=list(images) or None, videos=list(videos) or None,
                     video_metadata=meta or None, return_tensors="np", padding=True, padding_side="left",
                     video_pruning=pruning)


def _model_kwargs(batch):
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


@pytest.mark.parametrize("method", ["evs", "vidcom2"])
@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75])
def test_pruned_prompt_equals_unpruned_prompt_with_pruned_tokens_masked(method, rate, processor, jax_model):
    """The pruned sequence is the unpruned one minus the pruned tokens, at their unpruned positions.

    Running the language model on the unpruned prompt with the pruned video tokens masked out as keys
    (positions untouched) must give the same logits at every kept token.
    """
    videos = [_video(8, 64, 64, 1, static=True)]
    rows = [["video", "What moves?"]]
    full = _inputs(processor, rows, videos=videos)
    lumped = _inputs(processor, rows, videos=videos, pruning=(method, rate))
    grid = full["video_grid_thw"][0]
    tpf = int(grid[1] * grid[2]) // 4
    k = retained_count(method, tpf, int(grid[0]), rate)
    assert int((lumped["input_ids"] == jax_model.config.video_token_id).sum()) == k

    pruned = jax_model.prepare_inputs(**_model_kwargs(lumped), video_pruning=(method, rate))
    unpruned = jax_model.prepare_inputs(**_model_kwargs(full))
    # Which unpruned tokens survive: the encoder rows the pruned prompt splices in (same encoder output).
    np.testing.assert_array_equal(np.asarray(pruned.features), np.asarray(unpruned.features))
    video_pos = np.flatnonzero(np.asarray(unpruned.visual_index[0]) >= 0)
    pruned_index = np.asarray(pruned.visual_index[0])
    kept_rows = [int(r) for r in pruned_index[pruned_index >= 0]]
    keep = np.ones(unpruned.input_ids.shape[1], bool)
    keep[np.setdiff1d(video_pos, video_pos[kept_rows])] = False
    assert keep.sum() == pruned.input_ids.shape[1]
    # Same tokens in the same order, same positions; delta grows by the pruned count.
    np.testing.assert_array_equal(np.asarray(pruned.input_ids[0]), np.asarray(unpruned.input_ids[0])[keep])
    np.testing.assert_array_equal(np.asarray(pruned.positions)[:, 0], np.asarray(unpruned.positions)[:, 0, keep])
    pruned_count = int((~keep).sum())
    assert int(pruned.rope_deltas[0, 0]) == int(unpruned.rope_deltas[0, 0]) + pruned_count
    if method == "evs":
        assert kept_rows[:tpf] == list(range(tpf))  # EVS keeps all of frame 0

    # Oracle: the unpruned prompt with the pruned tokens removed as keys only (a dense mask; the model's
    # own description cannot hold such holes, so the oracle swaps in the dense reference).
    def keys_kept(q, k, v, mask, implementation):
        return attention_ref.masked_attention(q, k, v, mask.dense(k.shape[1]) & keep[None, None, :])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_api, "attention", keys_kept)
        ref = jax_model.forward(unpruned)
    ours = jax_model.forward(pruned)
    assert_close(np.asarray(ours)[0], np.asarray(ref)[0, keep], "f32_logits", f"{method} @ {rate}")


def test_rate_zero_is_off(processor, jax_model):
    videos = [_video(6, 64, 96, 2)]
    full = _inputs(processor, [["video", "hi"]], videos=videos)
    off = _inputs(processor, [["video", "hi"]], videos=videos, pruning=("vidcom2", 0.0))
    np.testing.assert_array_equal(full["input_ids"], off["input_ids"])
    a = np.asarray(jax_model(**_model_kwargs(full)))
    b = np.asarray(jax_model(**_model_kwargs(off), video_pruning=("vidcom2", 0.0)))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_generation_with_images_and_several_videos_in_a_padded_batch(method, processor, jax_model):
    images = [(np.random.default_rng(5).random((64, 96, 3)) * 255).astype(np.uint8)]
    videos = [_video(8, 64, 64, 3, static=True), _video(6, 64, 96, 4), _video(4, 32, 64, 6)]
    rows = [["image", "video", "compare", "video"], ["video", "short"]]
    pruning = (method, 0.5)
    lumped = _inputs(processor, rows, images=images, videos=videos, pruning=pruning)
    out = jax_model.generate(**_model_kwargs(lumped), max_new_tokens=8, video_pruning=pruning)
    assert out.shape == (2, lumped["input_ids"].shape[1] + 8)
    # The bucketed encoder (compiled ahead of time) gives the same continuation.
    runner = EncoderRunner(jax_model, budgets=(16, 32, 64)).warmup()
    compiles = runner.num_compiles
    again = jax_model.generate(**_model_kwargs(lumped), max_new_tokens=8, video_pruning=pruning,
                               vision_encoder=runner.encode)
    np.testing.assert_array_equal(out, again)
    assert runner.num_compiles == compiles


def test_a_prompt_built_without_pruning_is_refused(processor, jax_model):
    full = _inputs(processor, [["video", "hi"]], videos=[_video(4, 64, 64, 7)])
    with pytest.raises(ValueError, match="video placeholders and video features do not match.*after evs pruning"):
        jax_model.prepare_inputs(**_model_kwargs(full), video_pruning=("evs", 0.5))
    with pytest.raises(ValueError, match="unknown video pruning method 'EVS'"):
        jax_model.prepare_inputs(**_model_kwargs(full), video_pruning=("EVS", 0.5))


def test_retention_maps_match_the_prompt_rebuild(processor, jax_model):
    videos = [_video(8, 64, 64, 1, static=True)]
    batch = _inputs(processor, [["video", "x"]], videos=videos)
    maps = jax_model.video_retention_masks(batch["pixel_values_videos"], batch["video_grid_thw"], ("evs", 0.5))
    t, h, w = batch["video_grid_thw"][0]
    assert maps[0].shape == (t, h // 2, w // 2) and maps[0][0].all()
    assert maps[0].sum() == retained_count("evs", int(h * w) // 4, int(t), 0.5)
