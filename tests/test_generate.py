"""Generation: greedy ids equal HF's `generate`, EOS / padding rules, compile discipline, sampling.

Inputs come from HF's own processor on the tiny checkpoint (the same prompt layouts as
test_model.py). Parity runs in float32 at the highest matmul precision (conftest), so greedy ids
can only differ on near-ties; the smallest top-1 / top-2 logit margin on these prompts is ~1e-3,
far above the ~1e-6 rounding difference between the two implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_processor_batch, user_prompt
from scipy import stats

from qwen3vl_jax import generate as gen
from qwen3vl_jax.generate import COMPILE_COUNTS, GenerationConfig, select_tokens, warp_logits
from qwen3vl_jax.model import MODEL_INPUTS

NEW = 32


CASES = {
    "text_only": dict(prompts=[user_prompt("Hello, how are you today?")]),
    "one_image": dict(prompts=[user_prompt("image", "Describe this image.")], images=[(100, 150)]),
    "video": dict(prompts=[user_prompt("video", "What happens?")], videos=[(6, 64, 96, 2.0)]),
    "batch_left_padding": dict(
        prompts=[user_prompt("image", "A long question about the picture here?"), user_prompt("Short.")],
        images=[(70, 90)],
    ),
    "text_batch_left_padding": dict(prompts=[user_prompt("A much longer text-only question, padded less?"),
                                             user_prompt("Hi.")]),
}


@pytest.fixture(scope="module")
def processor(hf_processor):
    return hf_processor


@pytest.fixture(scope="module")
def gen_config(tiny_dir):
    return GenerationConfig.from_pretrained(tiny_dir)


def _inputs(processor, case):
    batch = hf_processor_batch(processor, CASES[case])
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def _np(batch):
    return {k: v.numpy() for k, v in batch.items()}


def test_generation_config_reads_eos_list(gen_config, tiny_dir):
    assert len(gen_config.eos_token_ids) == 2 and gen_config.pad_token_id in gen_config.eos_token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(case, processor, hf_model, jax_model, gen_config):
    batch = _inputs(processor, case)
    if case == "video":
        assert int(batch["video_grid_thw"][0, 0]) >= 3
    with torch.no_grad():
        ref = hf_model.generate(**batch, do_sample=False, max_new_tokens=NEW,
                                eos_token_id=list(gen_config.eos_token_ids),
                                pad_token_id=gen_config.pad_token_id)
    ours = jax_model.generate(**_np(batch), max_new_tokens=NEW, eos_token_id=gen_config.eos_token_ids,
                              pad_token_id=gen_config.pad_token_id)
    length = batch["input_ids"].shape[1]
    assert ours.shape == (batch["input_ids"].shape[0], length + NEW)  # no EOS on random weights: all 32 made
    np.testing.assert_array_equal(ours, ref.numpy(), err_msg=case)


def test_eos_finishes_rows_and_pads_like_hf(processor, hf_model, jax_model, gen_config):
    batch = _inputs(processor, "batch_left_padding")
    length = batch["input_ids"].shape[1]
    free = jax_model.generate(**_np(batch), max_new_tokens=12, eos_token_id=[])
    row0, row1 = free[0, length:], free[1, length:]
    # an "EOS" that row 0 emits at step >= 2 and row 1 emits later or never
    step = next(t for t in range(2, 12) if row0[t] not in row0[:t] and row0[t] not in row1[:t + 1])
    eos, pad = int(row0[step]), gen_config.pad_token_id
    with torch.no_grad():
        ref = hf_model.generate(**batch, do_sample=False, max_new_tokens=12, eos_token_id=eos,
                                pad_token_id=pad)
    ours = jax_model.generate(**_np(batch), max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    np.testing.assert_array_equal(ours, ref.numpy())
    assert ours[0, length + step] == eos and (ours[0, length + step + 1:] == pad).all()

    # every row finishes: the output stops there, as HF's does
    single = {k: v[:1] for k, v in _np(batch).items() if k not in ("pixel_values", "image_grid_thw")}
    single.update(pixel_values=batch["pixel_values"].numpy(), image_grid_thw=batch["image_grid_thw"].numpy())
    short = jax_model.generate(**single, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    assert short.shape == (1, length + step + 1) and short[0, -1] == eos


def test_streaming_callback(jax_model):
    ids = np.array([[5, 6, 7, 8, 9]])
    seen = []
    out = jax_model.generate(ids, max_new_tokens=6, callback=lambda t, tok: seen.append((t, tok.copy())))
    assert [t for t, _ in seen] == list(range(6))
    np.testing.assert_array_equal(np.stack([tok for _, tok in seen], axis=1), out[:, 5:])


def test_one_compile_per_bucket(jax_model):
    jax.clear_caches()
    rng = np.random.default_rng(0)
    before = dict(COMPILE_COUNTS)
    for length in (5, 9, 14, 20, 27):  # all in the 32 bucket
        jax_model.generate(rng.integers(10, 400, (1, length)), max_new_tokens=5, eos_token_id=[])
    delta = {k: COMPILE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode")}
    assert delta == {"prefill": 1, "decode": 1}, delta
    jax_model.generate(rng.integers(10, 400, (1, 40)), max_new_tokens=5, eos_token_id=[])  # the 64 bucket
    assert COMPILE_COUNTS["prefill"] - before.get("prefill", 0) == 2


def test_warmup_compiles_ahead(jax_model):
    jax.clear_caches()
    gen.warmup(jax_model, buckets=(32,), max_new_tokens=7)
    before = dict(COMPILE_COUNTS)
    jax_model.generate(np.arange(10, 22)[None], max_new_tokens=7, eos_token_id=[])
    assert {k: COMPILE_COUNTS[k] - before[k] for k in ("prefill", "decode")} == {"prefill": 0, "decode": 0}


def test_next_token_logits_are_the_forward_and_the_prefill(processor, jax_model):
    """The scoring entry point: on a padded batch with an image, the logits equal the plain forward's
    last-position logits of each row, their argmax is greedy generate's first token, and the prompt
    lengths of one bucket share the prefill compile."""
    batch = _np(_inputs(processor, "batch_left_padding"))
    logits = gen.next_token_logits(jax_model, **batch)
    assert logits.shape == (2, jax_model.config.text.vocab_size) and logits.dtype == np.float32
    length = batch["input_ids"].shape[1]
    first = jax_model.generate(**batch, max_new_tokens=1, eos_token_id=[])[:, length]
    np.testing.assert_array_equal(logits.argmax(-1), first)
    single = {k: v[1:] for k, v in _np(_inputs(processor, "text_batch_left_padding")).items()}
    real = single["attention_mask"][0].astype(bool)
    forward = np.asarray(jax_model(input_ids=single["input_ids"][:, real]))[0, -1]
    np.testing.assert_allclose(gen.next_token_logits(jax_model, **single)[0], forward, atol=1e-4, rtol=1e-4)
    before = COMPILE_COUNTS["prefill"]
    for n in (5, 9, 14):
        gen.next_token_logits(jax_model, np.arange(10, 10 + n)[None])
    assert COMPILE_COUNTS["prefill"] - before <= 1
    with pytest.raises(ValueError, match="left-padded"):
        gen.next_token_logits(jax_model, np.array([[5, 6, 0]]), np.array([[1, 1, 0]]))


def test_right_padding_is_refused(jax_model):
    with pytest.raises(ValueError, match="left-padded"):
        jax_model.generate(np.array([[5, 6, 0]]), np.array([[1, 1, 0]]), max_new_tokens=2)


# ---------------------------------------------------------------------- sampling


def test_sampling_reproducible_for_a_fixed_key(processor, jax_model):
    batch = _np(_inputs(processor, "batch_left_padding"))
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, eos_token_id=[])
    a = jax_model.generate(**batch, rng=jax.random.key(3), **kw)
    b = jax_model.generate(**batch, rng=jax.random.key(3), **kw)
    c = jax_model.generate(**batch, rng=jax.random.key(4), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="PRNG key"):
        jax_model.generate(**batch, max_new_tokens=2, do_sample=True)


def test_top_k_one_sampling_is_greedy(processor, jax_model):
    batch = _np(_inputs(processor, "one_image"))
    greedy = jax_model.generate(**batch, max_new_tokens=8, eos_token_id=[])
    sampled = jax_model.generate(**batch, max_new_tokens=8, do_sample=True, top_k=1, temperature=2.0,
                                 rng=jax.random.key(1), eos_token_id=[])
    np.testing.assert_array_equal(sampled, greedy)


def _expected_distribution(logits, temperature, top_k, top_p):
    """HF's warpers written out in numpy: temperature, top-k, then top-p over the sorted distribution."""
    x = logits / temperature
    if top_k:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)  # smallest prefix with mass >= top_p
    out = np.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]]
    return out / out.sum()


LOGITS = np.array([1.3, -0.4, 2.1, 0.2, 0.9, -1.5, 1.7, 0.05], np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.7, 5, 0.9), (1.3, 6, 0.55),
])
def test_sampling_follows_configured_distribution(temperature, top_k, top_p):
    expected = _expected_distribution(LOGITS.astype(np.float64), temperature, top_k, top_p)
    warped = warp_logits(jnp.asarray(LOGITS)[None], temperature, top_k, top_p)[0]
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(warped)), expected, rtol=1e-5, atol=1e-7)
    draws = 40_000
    keys = jax.random.split(jax.random.key(17), draws)
    batch = jnp.broadcast_to(jnp.asarray(LOGITS), (1, LOGITS.size))
    draw = jax.jit(jax.vmap(lambda k: select_tokens(batch, k, temperature, top_k, top_p, do_sample=True)[0]))
    counts = np.bincount(np.asarray(draw(keys)), minlength=LOGITS.size)
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled removed tokens: {counts}, expected {expected}"
    chi2, p = stats.chisquare(counts[support], draws * expected[support])
    assert p > 1e-3, f"chi-square {chi2:.1f} p={p:.2e}: counts {counts} vs expected {draws * expected}"


def test_warpers_match_hf():
    """Our warpers against HF's logits processors on random logits (support and probabilities)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32) * 3
    for temperature, top_k, top_p in [(0.7, 20, 0.9), (1.5, 0, 0.5), (1.0, 7, 1.0), (0.3, 0, 0.95)]:
        ref = torch.from_numpy(logits)
        ref = TemperatureLogitsWarper(temperature)(None, ref)
        if top_k:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = TopPLogitsWarper(top_p)(None, ref)
        ours = np.asarray(warp_logits(jnp.asarray(logits), temperature, top_k, top_p))
        np.testing.assert_array_equal(np.isfinite(ours), torch.isfinite(ref).numpy())
        np.testing.assert_allclose(jax.nn.softmax(ours, -1), torch.softmax(ref, -1).numpy(), atol=1e-6)


def test_eos_and_pad_resolution():
    """Explicit ids win, else the model's `generation_config` (object or dict); pad falls back to EOS[0]."""
    from types import SimpleNamespace

    from qwen3vl_jax.generate import _resolve_ids

    bare = SimpleNamespace()
    assert _resolve_ids(bare, None, None) == ((), 0)
    assert _resolve_ids(bare, 7, None) == ((7,), 7)
    configured = SimpleNamespace(generation_config=GenerationConfig((3, 4), 9))
    assert _resolve_ids(configured, None, None) == ((3, 4), 9)
    assert _resolve_ids(configured, [5], 1) == ((5,), 1)
    as_dict = SimpleNamespace(generation_config={"eos_token_id": 11})
    assert _resolve_ids(as_dict, None, None) == ((11,), 11)


def test_prompt_buckets_share_the_encoder_mechanism(jax_model):
    from qwen3vl_jax.buckets import Buckets

    cfg = jax_model.config.text
    buckets = gen.prompt_buckets(cfg)
    assert isinstance(buckets, Buckets) and buckets.sizes[:3] == (32, 64, 128)
    assert buckets.largest == cfg.max_position_embeddings
    assert gen.bucket_length(5, cfg) == 32 and gen.bucket_length(33, cfg) == 64
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        gen.bucket_length(cfg.max_position_embeddings + 1, cfg)
