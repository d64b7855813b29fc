"""Video pruning end to end on the tiny checkpoint: lumped prompts, rebuilt per-frame sequences,
positions kept from the unpruned layout, generation, buckets; built-in, baseline and outside methods
(registered in this file), including the adaptive and text-guided protocol extensions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention import reference as attention_ref
from qwen3vl_jax import pruning
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


class LargestNorm:
    """A method registered from outside the package: keep the K rows of largest L2 norm (ties to the
    lower index), K = max(1, int(N (1 - rate)))."""

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return max(1, int(tokens_per_frame * num_frames * (1 - rate)))

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = pruning.merged_grid(grid_thw, spatial_merge_size)
        norms = np.linalg.norm(np.asarray(rows, np.float64), axis=1)
        mask = np.zeros(t * r * c, bool)
        mask[np.argsort(-norms, kind="stable")[: self.retained_count(r * c, t, rate)]] = True
        return mask


class KeepAll(LargestNorm):
    def retained_count(self, tokens_per_frame, num_frames, rate):
        return tokens_per_frame * num_frames


@pytest.fixture(scope="module", autouse=True)
def outside_methods():
    pruning.register_method("largest_norm", LargestNorm(), replace=True)
    pruning.register_method("keep_all", KeepAll(), replace=True)
    yield
    pruning.unregister_method("largest_norm")
    pruning.unregister_method("keep_all")


def _own_mask(model, batch, method, rate, text=None):
    """The method's own mask on the (single) video's encoder rows, computed outside the model."""
    merged, deepstack = model.encode_vision(batch["pixel_values_videos"], batch["video_grid_thw"])
    rows = np.asarray(pruning.concat_levels(merged, deepstack))
    kw = {} if text is None else {"text": text}
    return np.asarray(pruning.get_method(method).retention_mask(rows, batch["video_grid_thw"][0], 2, rate, **kw))


def check_pruned_equals_masked_unpruned(model, processor, method, rate, own=None, text=None):
    """The pruned run is the unpruned one minus the tokens the method's own mask drops, at their
    unpruned positions: same tokens, positions, features, deltas, and the same logits as the
    unpruned prompt with those tokens masked out as keys. Returns the own mask as `[T, R*C]`."""
    videos = [_video(8, 64, 64, 1, static=True)]
    rows = [["video", "What moves?"]]
    full = _inputs(processor, rows, videos=videos)
    lumped = _inputs(processor, rows, videos=videos, pruning=(method, rate))
    grid = full["video_grid_thw"][0]
    tpf = int(grid[1] * grid[2]) // 4
    k = retained_count(method, tpf, int(grid[0]), rate)
    assert int((lumped["input_ids"] == model.config.video_token_id).sum()) == k  # the processor path

    pruned = model.prepare_inputs(**_model_kwargs(lumped), video_pruning=(method, rate))
    unpruned = model.prepare_inputs(**_model_kwargs(full))
    own = _own_mask(model, full, method, rate, text) if own is None else own
    if not pruning.uses_text(method):  # the retention maps path
        maps = model.video_retention_masks(full["pixel_values_videos"], full["video_grid_thw"], (method, rate))
        np.testing.assert_array_equal(maps[0].reshape(-1), own)
    # The pruned prompt splices exactly the kept rows of the same (unpruned) encoder output.
    np.testing.assert_array_equal(np.asarray(pruned.features), np.asarray(unpruned.features))
    pruned_index = np.asarray(pruned.visual_index[0])
    np.testing.assert_array_equal(pruned_index[pruned_index >= 0], np.flatnonzero(own))
    video_pos = np.flatnonzero(np.asarray(unpruned.visual_index[0]) >= 0)
    keep = np.ones(unpruned.input_ids.shape[1], bool)
    keep[video_pos[~own]] = False
    real = np.asarray(pruned.attention_mask[0])
    assert keep.sum() == real.sum()
    # Same tokens in the same order, same positions; delta grows by the pruned count.
    np.testing.assert_array_equal(np.asarray(pruned.input_ids[0])[real], np.asarray(unpruned.input_ids[0])[keep])
    np.testing.assert_array_equal(np.asarray(pruned.positions)[:, 0, real],
                                  np.asarray(unpruned.positions)[:, 0, keep])
    assert int(pruned.rope_deltas[0, 0]) == int(unpruned.rope_deltas[0, 0]) + int((~keep).sum())

    # Oracle: the unpruned prompt with the pruned tokens removed as keys only (a dense mask; the model's
    # own description cannot hold such holes, so the oracle swaps in the dense reference).
    def keys_kept(q, k, v, mask, implementation):
        return attention_ref.masked_attention(q, k, v, mask.dense(k.shape[1]) & keep[None, None, :])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_api, "attention", keys_kept)
        ref = model.forward(unpruned)
    ours = model.forward(pruned)
    assert_close(np.asarray(ours)[0, real], np.asarray(ref)[0, keep], "f32_logits", f"{method} @ {rate}")
    return own.reshape(int(grid[0]), tpf)


@pytest.mark.parametrize("method,rate", [  # two of the six EVS / VidCom2 rates in the slow tier (the suite's budget)
    pytest.param(m, r, marks=pytest.mark.slow) if (m, r) in (("evs", 0.5), ("vidcom2", 0.75)) else (m, r)
    for m in ("evs", "vidcom2") for r in (0.25, 0.5, 0.75)] + [(m, 0.5) for m in ("largest_norm", "random", "spatial_grid", "temporal")])
def test_pruned_prompt_equals_unpruned_prompt_with_pruned_tokens_masked(method, rate, processor, jax_model):
    own = check_pruned_equals_masked_unpruned(jax_model, processor, method, rate)
    if method == "evs":
        assert own[0].all()  # EVS keeps all of frame 0


def test_a_method_keeping_everything_gives_the_unpruned_logits(processor, jax_model):
    videos = [_video(6, 64, 96, 2)]
    full = _inputs(processor, [["video", "hi"]], videos=videos)
    lumped = _inputs(processor, [["video", "hi"]], videos=videos, pruning=("keep_all", 0.5))
    a = np.asarray(jax_model(**_model_kwargs(full)))
    b = np.asarray(jax_model(**_model_kwargs(lumped), video_pruning=("keep_all", 0.5)))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec", [{"evs": 0.5}, ("evs",), "evs"])
def test_malformed_pruning_specs_are_refused_everywhere(spec, processor, jax_model):
    batch = _inputs(processor, [["video", "hi"]], videos=[_video(4, 64, 64, 7)])
    with pytest.raises(ValueError, match="video_pruning must be"):
        jax_model.prepare_inputs(**_model_kwargs(batch), video_pruning=spec)
    with pytest.raises(ValueError, match="video_pruning must be"):
        jax_model.video_retention_masks(batch["pixel_values_videos"], batch["video_grid_thw"], spec)
    with pytest.raises(ValueError, match="video_pruning must be"):
        jax_model.generate(**_model_kwargs(batch), max_new_tokens=1, video_pruning=spec)
    with pytest.raises(ValueError, match="video_pruning must be"):
        _inputs(processor, [["video", "hi"]], videos=[_video(4, 64, 64, 7)], pruning=spec)


def test_rate_zero_is_off(processor, jax_model):
    videos = [_video(6, 64, 96, 2)]
    full = _inputs(processor, [["video", "hi"]], videos=videos)
    off = _inputs(processor, [["video", "hi"]], videos=videos, pruning=("vidcom2", 0.0))
    np.testing.assert_array_equal(full["input_ids"], off["input_ids"])
    a = np.asarray(jax_model(**_model_kwargs(full)))
    b = np.asarray(jax_model(**_model_kwargs(off), video_pruning=("vidcom2", 0.0)))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["evs", "vidcom2", "largest_norm"])
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
    with pytest.raises(ValueError, match=r"unknown pruning method 'EVS'; registered methods: \[.*'evs'"):
        jax_model.prepare_inputs(**_model_kwargs(full), video_pruning=("EVS", 0.5))


def test_retention_maps_match_the_prompt_rebuild(processor, jax_model):
    videos = [_video(8, 64, 64, 1, static=True)]
    batch = _inputs(processor, [["video", "x"]], videos=videos)
    maps = jax_model.video_retention_masks(batch["pixel_values_videos"], batch["video_grid_thw"], ("evs", 0.5))
    t, h, w = batch["video_grid_thw"][0]
    assert maps[0].shape == (t, h // 2, w // 2) and maps[0][0].all()
    assert maps[0].sum() == retained_count("evs", int(h * w) // 4, int(t), 0.5)


# ---------------------------------------------------------------------------------------------- extended protocol


class MotionBudget(LargestNorm):
    """Content-adaptive: within the rate's budget, keep frame 0 and only the later tokens that
    changed more than the median one (EVS dissimilarity), so the count depends on the features."""

    adaptive = True

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = pruning.merged_grid(grid_thw, spatial_merge_size)
        dis = np.asarray(pruning.evs.dissimilarity(jnp.asarray(rows, jnp.float32), t, r, c))
        threshold = np.median(dis[r * c:]) if t > 1 else -np.inf
        mask = np.zeros(t * r * c, bool)
        top = np.argsort(-dis, kind="stable")[: self.retained_count(r * c, t, rate)]
        mask[top[dis[top] > threshold]] = True
        return mask


class QuestionSimilarity(LargestNorm):
    """Text-guided: keep the K tokens whose merged feature is most cosine-similar to the mean text
    embedding of the prompt; records the prompt text it was given."""

    uses_text = True

    def __init__(self):
        self.seen = []

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate, *, text):
        self.seen.append(text)
        t, r, c = pruning.merged_grid(grid_thw, spatial_merge_size)
        query = np.asarray(text.embeds, np.float64).mean(0)
        feats = np.asarray(rows, np.float64)[:, : query.size]
        score = feats @ query / (np.linalg.norm(feats, axis=1) * np.linalg.norm(query) + 1e-12)
        mask = np.zeros(t * r * c, bool)
        mask[np.argsort(-score, kind="stable")[: self.retained_count(r * c, t, rate)]] = True
        return mask


def test_adaptive_method_keeps_fewer_and_stays_exact(processor, jax_model):
    pruning.register_method("motion_budget", MotionBudget(), replace=True)
    try:
        own = check_pruned_equals_masked_unpruned(jax_model, processor, "motion_budget", 0.1)
        budget = retained_count("motion_budget", own.shape[1], own.shape[0], 0.1)
        assert own[0].all() and own.sum() < budget  # fewer than the placeholder holds
        # A padded batch: rows shrink by different amounts and are re-padded on the left; the first
        # generated token is the forward pass's argmax at the last (real) position.
        videos = [_video(8, 64, 64, 1, static=True), _video(6, 64, 96, 4)]
        batch = _model_kwargs(_inputs(processor, [["video", "a"], ["video", "b"]], videos=videos,
                                      pruning=("motion_budget", 0.1)))
        inputs = jax_model.prepare_inputs(**batch, video_pruning=("motion_budget", 0.1))
        assert inputs.input_ids.shape[1] < batch["input_ids"].shape[1]
        assert np.asarray(inputs.attention_mask[:, -1]).all()
        logits = np.asarray(jax_model(**batch, video_pruning=("motion_budget", 0.1)))
        out = jax_model.generate(**batch, max_new_tokens=1, video_pruning=("motion_budget", 0.1))
        np.testing.assert_array_equal(out[:, -1], logits[:, -1].argmax(-1))
    finally:
        pruning.unregister_method("motion_budget")


def test_text_guided_method_sees_the_question(processor, jax_model):
    method = QuestionSimilarity()
    pruning.register_method("question_similarity", method, replace=True)
    try:
        lumped = _inputs(processor, [["video", "What moves?"]], videos=[_video(8, 64, 64, 1, static=True)],
                         pruning=("question_similarity", 0.5))
        jax_model.prepare_inputs(**_model_kwargs(lumped), video_pruning=("question_similarity", 0.5))
        text = method.seen[-1]
        ids = lumped["input_ids"][0]
        starts = np.flatnonzero(ids == jax_model.config.vision_start_token_id)
        ends = np.flatnonzero(ids == jax_model.config.vision_end_token_id)
        # Everything outside the video's <|vision_start|> ... <|vision_end|> span, nothing inside it.
        np.testing.assert_array_equal(text.ids, np.concatenate([ids[: starts[0]], ids[ends[-1] + 1:]]))
        question = processor.tokenizer.encode("What moves?", add_special_tokens=False).ids
        assert any(list(text.ids[i:i + len(question)]) == question for i in range(len(text.ids)))
        np.testing.assert_array_equal(np.asarray(text.embeds),
                                      np.asarray(jax_model.language_model.embed_tokens.embedding[...])[text.ids])
        check_pruned_equals_masked_unpruned(jax_model, processor, "question_similarity", 0.5, text=text)
        with pytest.raises(ValueError, match="text-guided"):
            jax_model.video_retention_masks(lumped["pixel_values_videos"], lumped["video_grid_thw"],
                                            ("question_similarity", 0.5))
    finally:
        pruning.unregister_method("question_similarity")
