"""In-LLM token reduction (FastV, PyramidDrop) against a reference computed by hand.

The reference runs each prompt row alone (no padding, no compaction): the decoder layers one at a
time, and at a stage it takes the attention row of the last token at layer K-1 (averaged over the
heads), drops the `floor(r * n)` lowest-scored vision tokens with numpy, and carries on with the
rest at their positions, deepstack additions included. The model's batched, padded, statically
shaped run must drop the same tokens and give the same logits.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, random_image, random_video, user_prompt
from flax import nnx

from pallas_kernels.attention.mask import AttentionMask
from qwen3vl_jax import pruning
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.processing import Qwen3VLProcessor
from qwen3vl_jax.text import mrope_cos_sin


def _make_batch(tiny_dir, padding_side="left", **pruning_options):
    """An image row and a video row, padded (our processor: this file runs without torch)."""
    processor = Qwen3VLProcessor.from_pretrained(tiny_dir)
    prompts = [user_prompt("image", "Describe this."), user_prompt("video", "What happens in the video here?")]
    texts = [processor.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    out = processor(text=texts, images=[random_image(64, 96, 0)], videos=[random_video(4, 64, 64, 1)],
                    video_metadata=[{"fps": 2.0, "total_num_frames": 4}], padding=True, padding_side=padding_side,
                    return_tensors="np", **pruning_options)
    assert not out["attention_mask"].all()
    return {k: out[k] for k in MODEL_INPUTS if k in out}


@pytest.fixture(scope="module")
def batch(tiny_dir):
    return _make_batch(tiny_dir)


@nnx.jit
def _layer(layer, x, positions, level):
    """One decoder layer over a whole unpadded row, then its deepstack level; and its attention."""
    cos, sin = mrope_cos_sin(positions, layer.self_attn.config)
    n = x.shape[1]
    x, _, _, weights = layer(x, cos, sin, AttentionMask.causal(jnp.zeros(1), jnp.full(1, n), n), None, 0,
                          implementation="xla", return_weights=True)
    return x + level, weights


def reference(model, batch, stages, extra=None):
    """Per row: (kept input positions after each stage, logits `[kept, V]`), computed by hand.

    `extra [B, n]`: token ids appended after each row's prompt (what `generate` made), at positions
    last + 1 + t on all three axes, never dropped and without deepstack; the ranking stays the last
    prompt token's (causal: the tokens after it do not change its attention row), and the logits
    then cover the kept prompt tokens and the extra ones."""
    inputs = model.prepare_inputs(**batch)
    embeds, deepstack = model.embed(inputs)
    n_extra = 0 if extra is None else np.asarray(extra).shape[1]
    lm, cfg = model.language_model, model.config.text
    cut = {s.layer - 1: s.rate for s in stages}
    mask = np.asarray(inputs.attention_mask)
    results = []
    for b in range(mask.shape[0]):
        pos = np.flatnonzero(mask[b])  # input positions still present
        x = embeds[b:b + 1, pos]
        positions = inputs.positions[:, b:b + 1, pos]
        levels = deepstack[:, b:b + 1, pos]
        visual = np.asarray(inputs.visual_index)[b, pos] >= 0
        if n_extra:
            x = jnp.concatenate([x, lm.embed_tokens(jnp.asarray(extra)[b:b + 1])], axis=1)
            after = positions[:, :, -1:] + 1 + jnp.arange(n_extra)[None, None]
            positions = jnp.concatenate([positions, after], axis=2)
            levels = jnp.concatenate([levels, jnp.zeros(levels.shape[:2] + (n_extra,) + levels.shape[3:])], axis=2)
            visual = np.concatenate([visual, np.zeros(n_extra, bool)])
        kept = []
        for layer in range(cfg.num_hidden_layers):
            level = levels[layer] if layer < levels.shape[0] else jnp.zeros_like(x)
            x, weights = _layer(lm.layers[layer], x, positions, level)
            if layer in cut:
                score = np.asarray(weights[0, :, -1 - n_extra, :], np.float64).mean(axis=0)  # last prompt token
                candidates = np.flatnonzero(visual)
                drop = math.floor(cut[layer] * len(candidates))
                order = sorted(candidates, key=lambda i: (-score[i], i))  # best first, ties to the earlier
                keep = ~visual
                keep[order[:len(candidates) - drop]] = True
                x, positions, levels = x[:, keep], positions[:, :, keep], levels[:, :, keep]
                pos, visual = pos[keep[:len(keep) - n_extra]], visual[keep]
                kept.append(pos)
        results.append((kept, np.asarray(model.logits(lm.norm(x)))[0]))
    return results


def _check_against_reference(model, batch, spec):
    stages = pruning.validate_llm_pruning(spec)[1]
    logits, kept = model(**batch, llm_pruning=spec)
    assert len(kept) == len(stages)
    for b, (ref_kept, ref_logits) in enumerate(reference(model, batch, stages)):
        for s, (ours, theirs) in enumerate(zip(kept, ref_kept)):
            row = np.asarray(ours)[b]
            np.testing.assert_array_equal(row[row >= 0], theirs, err_msg=f"row {b}, stage {s}: kept tokens")
        last = np.asarray(kept[-1])[b]
        assert_close(np.asarray(logits)[b][last >= 0], ref_logits, "f32_logits", f"{spec} row {b}")
    return logits, kept


def test_fastv_equals_the_hand_reference(jax_model, batch):
    """Layer 1 < the last deepstack level: the addition after layer 1 reaches the kept tokens only."""
    logits, (kept,) = _check_against_reference(jax_model, batch, ("fastv", {"layer": 1, "rate": 0.5}))
    visual = np.asarray(jax_model.prepare_inputs(**batch, encode=False).visual_index) >= 0
    # the same tokens from the unpruned model's own attention at layer 0 (return_attentions, which
    # equals HF's eager output_attentions: test_attentions.py): the last token's row, mean over heads
    _, attentions = jax_model(**batch, return_attentions=0)
    for b in range(visual.shape[0]):
        n = int(visual[b].sum())
        row = np.asarray(kept)[b]
        assert int(visual[b][row[row >= 0]].sum()) == n - n // 2  # floor(0.5 n) dropped
        assert (np.diff(row[row >= 0]) > 0).all()  # order kept
        score = np.asarray(attentions[0][b, :, -1], np.float64).mean(axis=0)
        candidates = np.flatnonzero(visual[b])
        best = sorted(candidates, key=lambda i: (-score[i], i))[:n - n // 2]
        np.testing.assert_array_equal(np.intersect1d(row, candidates), np.sort(best), err_msg=f"row {b}")


def test_pyramiddrop_equals_the_hand_reference(jax_model, batch):
    _check_against_reference(jax_model, batch, ("pyramiddrop", {"layers": [1, 2], "rates": [0.5, 0.34]}))


def test_right_padded_rows_keep_their_start(tiny_dir, jax_model):
    """Right padding: each stage's kept tokens start where the row's real tokens did (the layout
    `right_aligned=False`), against the same hand reference."""
    batch = _make_batch(tiny_dir, "right")
    assert not batch["attention_mask"][:, -1].all()
    _check_against_reference(jax_model, batch, ("pyramiddrop", {"layers": [1, 2], "rates": [0.5, 0.34]}))


def test_with_video_and_image_pruning(tiny_dir, jax_model):
    """In-LLM stages rank what EVS and DivPrune kept; generate's first token is the forward's argmax."""
    kw = dict(video_pruning=("evs", 0.5), image_pruning=("divprune", 0.5))
    batch = _make_batch(tiny_dir, **kw)
    spec = ("fastv", {"layer": 1, "rate": 0.5})
    logits, (kept,) = jax_model(**batch, llm_pruning=spec, **kw)
    inputs = jax_model.prepare_inputs(**batch, encode=False, **kw)
    visual = np.asarray(inputs.visual_index) >= 0
    rows = np.asarray(kept)
    for b in range(visual.shape[0]):
        n = int(visual[b].sum())
        assert int(visual[b][rows[b][rows[b] >= 0]].sum()) == n - n // 2
    ids = jax_model.generate(**batch, llm_pruning=spec, max_new_tokens=1, eos_token_id=[], **kw)
    np.testing.assert_array_equal(ids[:, -1], np.asarray(logits)[:, -1].argmax(-1))


def test_keep_all_equals_the_unpruned_model(jax_model, batch):
    ref = np.asarray(jax_model(**batch))
    for spec in (("fastv", {"layer": 2, "rate": 0.0}), ("pyramiddrop", {"layers": (1, 2), "rate": 0}),):
        logits, kept = jax_model(**batch, llm_pruning=spec)
        real = batch["attention_mask"].astype(bool)
        for stage in kept:
            np.testing.assert_array_equal(np.asarray(stage), np.where(real, np.arange(real.shape[1]), -1))
        # another program than the plain forward (the scoring layer runs on its own): rounding only
        assert_close(np.asarray(logits)[real], ref[real], "f32_module", f"{spec}")


def test_stage_lengths_are_static_functions_of_the_kept_counts():
    mask = np.ones((2, 64), bool)
    mask[0, :20] = False  # left padding
    visual = np.zeros((2, 64), bool)
    visual[0, 30:50] = True  # 20 vision tokens of 44 real
    visual[1, 4:44] = True  # 40 of 64
    plan = pruning.plan_llm_pruning(mask, visual, "fastv", (pruning.Stage(2, 0.5),), num_layers=4)
    assert plan.right_aligned and plan.layers == (2,)
    np.testing.assert_array_equal(np.asarray(plan.keep), [[10, 20]])
    # the longest row keeps 24 text + 20 vision = 44 tokens; granularity 64 // 8 = 8 -> 48
    assert plan.lengths == (48,)
    plan = pruning.plan_llm_pruning(mask, visual, "pyramiddrop", (pruning.Stage(1, 0.5), pruning.Stage(3, 0.5)),
                                    num_layers=4, bucket=128)
    np.testing.assert_array_equal(np.asarray(plan.keep), [[10, 20], [5, 10]])
    assert plan.lengths == (48, 48)  # 44 and 34 rounded up to 16 (128 // 8)


def test_compaction_by_hand():
    scores = jnp.asarray([[0.0, 0.5, 0.1, 0.9, 0.1, 0.3, 0.0, 0.2]])
    visual = jnp.asarray([[False, True, True, True, True, True, False, False]])
    real = jnp.asarray([[False, True, True, True, True, True, True, True]])
    # vision 1..5 scored .5 .1 .9 .1 .3: keep 3 -> 3 (.9), 1 (.5), 5 (.3); tokens 2 and 4 tie at .1 and go
    rows = pruning.llm.compaction(scores, visual, real, jnp.asarray([3]), 6, True)
    np.testing.assert_array_equal(np.asarray(rows), [[-1, 1, 3, 5, 6, 7]])
    rows = pruning.llm.compaction(scores, visual, real, jnp.asarray([4]), 8, False)
    np.testing.assert_array_equal(np.asarray(rows), [[-1, 1, 2, 3, 5, 6, 7, -1]])  # the tie: the earlier stays


@pytest.mark.parametrize("spec, message", [
    (("fastv", {"layer": 3, "rate": 0.5}), r"'fastv' drops at layer 3, but the model has 3 decoder layers"),
    (("fastv", {"layer": 0, "rate": 0.5}), r"'fastv': layer must be an integer >= 1"),
    (("fastv", {"layer": 1, "rate": 1.0}), r"'fastv': rate must be in \[0, 1\), got 1.0"),
    (("fastv", {"layer": 1, "rate": -0.1}), r"'fastv': rate must be in \[0, 1\)"),
    (("fastv", {"layer": 1}), r"'fastv' needs both 'layer' and 'rate'"),
    (("fastv", {"layer": 1, "rate": 0.5, "k": 2}), r"'fastv': unknown options \['k'\]"),
    (("pyramiddrop", {"layers": [2, 1], "rate": 0.5}), r"layers must increase strictly"),
    (("pyramiddrop", {"layers": [1, 2], "rates": [0.5]}), r"one rate per layer"),
    (("evs", 0.5), r"pruning method 'evs' selects tokens from the encoder output, not inside the language model"),
    (("tome", {}), r"unknown in-LLM pruning method 'tome'; in-LLM methods: \['fastv', 'pyramiddrop'\]"),
    ("fastv", r"llm_pruning must be None or a \(method, options\) pair"),
])
def test_bad_in_llm_options_are_named(spec, message, jax_model, batch):
    with pytest.raises(ValueError, match=message):
        jax_model.prepare_inputs(**batch, encode=False, llm_pruning=spec)


def test_in_llm_method_as_video_pruning_is_refused():
    with pytest.raises(ValueError, match=r"'fastv' runs inside the language model.*llm_pruning="):
        pruning.validate_video_pruning(("fastv", 0.5))


def _generate(model, batch, spec, **kwargs):
    # no EOS: every step is an argmax the reference can check
    return model.generate(**batch, llm_pruning=spec, max_new_tokens=5, eos_token_id=[], **kwargs)


def test_generate_after_a_pruned_prefill_equals_a_cache_free_reference(jax_model, batch):
    """Bucketed (64 slots, stage lengths rounded to 8) and unbucketed (the prompt's own length) runs
    give the same ids, and each generated token is the argmax of the hand reference run without a
    cache over the prompt's kept tokens and the tokens before it."""
    spec = ("pyramiddrop", {"layers": [1, 2], "rate": 0.5})
    length = batch["input_ids"].shape[1]
    ids = _generate(jax_model, batch, spec)
    np.testing.assert_array_equal(_generate(jax_model, batch, spec, min_bucket=length), ids)
    made = ids[:, length:]
    assert len(np.unique(made)) > 2  # the tiny model does not just repeat one token
    stages = pruning.validate_llm_pruning(spec)[1]
    for b, (_, logits) in enumerate(reference(jax_model, batch, stages, extra=made)):
        np.testing.assert_array_equal(logits[-made.shape[1] - 1:-1].argmax(-1), made[b], err_msg=f"row {b}")


def test_bucketed_generate_compiles_once_per_bucket(tiny_dir, jax_model):
    """Two prompts in the 32 bucket (their kept tokens round to the same stage length) and one in the 64
    bucket: one prefill and one decode program per bucket (the cache length follows the bucket)."""
    from qwen3vl_jax.generate import COMPILE_COUNTS

    processor = Qwen3VLProcessor.from_pretrained(tiny_dir)
    spec = ("fastv", {"layer": 2, "rate": 0.5})
    before = dict(COMPILE_COUNTS)
    for question, (h, w) in [("Describe this.", (64, 96)), ("Hi", (32, 32)),
                             ("Describe this image in a few words, please.", (64, 96))]:
        text = processor.apply_chat_template(user_prompt("image", question), add_generation_prompt=True)
        out = processor(text=[text], images=[random_image(h, w, 3)], return_tensors="np")
        jax_model.generate(**{k: out[k] for k in MODEL_INPUTS if k in out}, llm_pruning=spec, max_new_tokens=2)
    delta = {k: COMPILE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode")}
    assert delta == {"prefill": 2, "decode": 2}
