"""Bad input at the model and generation boundary: each is a clear ValueError naming the item, raised
before any device work; never a hang, NaN logits or a silently wrong answer."""

from __future__ import annotations

import numpy as np
import pytest

from qwen3vl_jax.generate import COMPILE_COUNTS
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.processing import Qwen3VLProcessor


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


def _image_batch(processor, images):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe."}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=images, return_tensors="np")


IDS = np.array([[5, 6, 7, 8]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=10**8), "exceeds the model's context length"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(top_p=1.5), "top_p must be"),
    (dict(top_k=-1), "top_k must be"),
    (dict(top_k=2.5), "top_k must be"),
    (dict(temperature=float("inf")), "temperature must be"),
    (dict(temperature=0.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(decode_chunk=0), "decode_chunk must be"),
])
def test_generate_arguments_are_checked_before_any_work(jax_model, kwargs, match):
    before = dict(COMPILE_COUNTS)
    with pytest.raises(ValueError, match=match):
        jax_model.generate(IDS, **kwargs)
    assert dict(COMPILE_COUNTS) == before  # refused before prefill, not after


def test_prompt_plus_new_tokens_beyond_the_context_is_refused(jax_model):
    context = jax_model.config.text.max_position_embeddings
    ids = np.full((1, context - 3), 5)
    with pytest.raises(ValueError, match=f"a prompt of {context - 3} tokens plus max_new_tokens=4 exceeds"):
        jax_model.generate(ids, max_new_tokens=4)


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_token_ids_outside_the_vocabulary_are_refused(jax_model, bad):
    ids = np.array([[5, 6, bad, 8]])
    for call in (jax_model, jax_model.generate):
        with pytest.raises(ValueError, match=rf"input_ids\[0, 2\] = {bad} is outside the vocabulary"):
            call(ids)


def test_empty_text_is_refused(jax_model):
    for call in (jax_model, jax_model.generate):
        with pytest.raises(ValueError, match="non-empty"):
            call(np.zeros((1, 0), np.int64))


def test_an_empty_grid_is_no_images(jax_model):
    patch_dim = jax_model.config.vision.patch_dim
    a = np.asarray(jax_model(IDS, pixel_values=np.zeros((0, patch_dim), np.float32),
                             image_grid_thw=np.zeros((0, 3), np.int64)))
    np.testing.assert_array_equal(a, np.asarray(jax_model(IDS)))


def test_a_non_finite_pixel_is_refused_naming_its_item(jax_model, processor):
    rng = np.random.default_rng(0)
    images = [(rng.random((64, 64, 3)) * 255).astype(np.uint8) for _ in range(3)]
    batch = _image_batch(processor, images)
    pixels = batch["pixel_values"].copy()
    per_item = np.prod(batch["image_grid_thw"], axis=1)
    pixels[per_item[0] + 3, 7] = np.nan  # in image 1
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    inputs["pixel_values"] = pixels
    with pytest.raises(ValueError, match=r"image 1 \(grid_thw \[1, 4, 4\]\) has non-finite pixel values"):
        jax_model(**inputs)
    with pytest.raises(ValueError, match=r"item 1 \(grid_thw \[1, 4, 4\]\) has non-finite"):
        jax_model.encode_vision(pixels, batch["image_grid_thw"])


def test_padding_between_real_tokens_is_refused(jax_model):
    with pytest.raises(ValueError, match="attention_mask row 0 has padding between real tokens"):
        jax_model(IDS, np.array([[1, 0, 1, 1]]))


def test_the_model_takes_what_the_processor_returns(jax_model, processor):
    """`model(**processor(...))`, the README's pattern, with a video (the processor adds `video_timestamps`)."""
    frames = (np.random.default_rng(1).random((4, 64, 64, 3)) * 255).astype(np.uint8)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        add_generation_prompt=True)
    batch = processor(text=[text], videos=[frames], video_metadata=[{"fps": 2.0, "total_num_frames": 4}],
                      return_tensors="np")
    assert "video_timestamps" in batch
    logits = np.asarray(jax_model(**batch))
    assert logits.shape[:2] == batch["input_ids"].shape and np.isfinite(logits).all()
    out = jax_model.generate(**batch, max_new_tokens=2)
    assert out.shape == (1, batch["input_ids"].shape[1] + 2)


@pytest.mark.parametrize("text,match", [
    ("{not json", "generation_config.json is not valid JSON"),
    ("[1, 2]", "generation_config.json must hold a JSON object"),
    ('{"eos_token_id": "2"}', "eos_token_id must be an integer or a list of integers"),
    ('{"eos_token_id": [1, 2.5]}', "eos_token_id must be an integer or a list of integers"),
    ('{"pad_token_id": true}', "pad_token_id must be an integer or null"),
])
def test_corrupt_generation_config_names_the_file(tmp_path, text, match):
    from qwen3vl_jax.generate import GenerationConfig

    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        GenerationConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(info.value)
