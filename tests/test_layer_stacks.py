"""The two parameter layouts (`scan_layers`): a list of blocks, or stacked blocks under `lax.scan`.

Both hold the same numbers (loaded from the same checkpoint, exported to the same HF tensors) and
compute the same logits, hidden states, generated ids and gradients; `remat` changes nothing but
memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, random_image, random_video, user_prompt
from flax import nnx
from safetensors.numpy import load_file

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.model import MODEL_INPUTS, canonical_params, count_params
from qwen3vl_jax.processing import Qwen3VLProcessor


@pytest.fixture(scope="module")
def scanned(tiny_dir):
    return Qwen3VL.from_pretrained(tiny_dir, scan_layers=True)


@pytest.fixture(scope="module")
def inputs(tiny_dir):
    """Images + video + left padding, from our processor (this file runs in the torch-free lane too)."""
    processor = Qwen3VLProcessor.from_pretrained(tiny_dir)
    prompts = [user_prompt("image", "video", "both"), user_prompt("Short.")]
    texts = [processor.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    batch = processor(text=texts, images=[random_image(64, 64, 0)], videos=[random_video(4, 64, 64, 1)],
                      video_metadata=[{"fps": 2.0, "total_num_frames": 4}], padding=True, padding_side="left",
                      return_tensors="np")
    assert not batch["attention_mask"].all()  # row 1 is left-padded
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def test_layouts_hold_the_same_parameters(scanned, jax_model):
    assert scanned.language_model.scan_layers and scanned.visual.scan_layers
    assert not jax_model.language_model.scan_layers and not jax_model.visual.scan_layers
    kernel = scanned.language_model.layers.self_attn.q_proj.kernel[...]
    assert kernel.shape[0] == scanned.config.text.num_hidden_layers  # stacked along a leading axis
    a, b = canonical_params(scanned), canonical_params(jax_model)
    assert a.keys() == b.keys() and count_params(scanned) == count_params(jax_model)
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=path)


def test_scanned_logits_and_hidden_states_equal_the_list(scanned, jax_model, inputs):
    logits, hidden = scanned(**inputs, return_hidden_states=True)
    ref_logits, ref_hidden = jax_model(**inputs, return_hidden_states=True)
    real = inputs["attention_mask"].astype(bool)
    assert_close(np.asarray(logits)[real], np.asarray(ref_logits)[real], "f32_logits", "scanned logits")
    assert hidden.shape == ref_hidden.shape
    assert_close(np.asarray(hidden)[:, real], np.asarray(ref_hidden)[:, real], "f32_logits", "hidden states")
    vision = scanned.encode_vision(inputs["pixel_values"], inputs["image_grid_thw"], return_hidden_states=True)
    ref_vision = jax_model.encode_vision(inputs["pixel_values"], inputs["image_grid_thw"], return_hidden_states=True)
    assert_close(vision.deepstack, ref_vision.deepstack, "f32_tower", "deepstack taps")
    assert_close(vision.hidden_states, ref_vision.hidden_states, "f32_tower", "vision hidden states")


def test_scanned_generate_ids_equal_the_list(scanned, jax_model, inputs):
    a = scanned.generate(**inputs, max_new_tokens=12, eos_token_id=[])
    b = jax_model.generate(**inputs, max_new_tokens=12, eos_token_id=[])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options", [
    dict(scan_layers=True, remat=True),
    pytest.param(dict(scan_layers=False, remat=True), marks=pytest.mark.slow),  # the suite's budget
], ids=["scan+remat", "list+remat"])
def test_remat_and_scan_give_the_same_gradients(tiny_dir, jax_model, inputs, options):
    probe = jnp.asarray(np.random.default_rng(0).standard_normal(
        (*inputs["input_ids"].shape, jax_model.config.text.vocab_size)).astype(np.float32))
    probe = probe * jnp.asarray(inputs["attention_mask"], jnp.float32)[..., None]

    def grads(model):
        return canonical_params(nnx.grad(lambda m: jnp.sum(m(**inputs) * probe))(model))

    ref = grads(jax_model)
    got = grads(Qwen3VL.from_pretrained(tiny_dir, **options))
    for path in ref:
        scale = float(np.abs(ref[path]).max())
        err = float(np.abs(np.asarray(got[path]) - np.asarray(ref[path])).max())
        assert err <= 1e-5 * scale + 1e-9, f"{options} {path}: {err:.3g} vs {scale:.3g}"


def test_checkpoints_cross_layouts(scanned, tiny_dir, tmp_path, inputs):
    """Orbax and HF exports of a scanned model are the canonical per-block checkpoint: they load into
    either layout, and the HF tensors equal the source checkpoint's."""
    scanned.save_orbax(tmp_path / "orbax")
    as_list = Qwen3VL.from_pretrained(tmp_path / "orbax", scan_layers=False)
    as_scan = Qwen3VL.from_pretrained(tmp_path / "orbax", scan_layers=True)
    np.testing.assert_array_equal(np.asarray(as_scan(**inputs)), np.asarray(scanned(**inputs)))
    for path, value in canonical_params(as_list).items():  # the same numbers in the other layout
        np.testing.assert_array_equal(np.asarray(value), np.asarray(canonical_params(scanned)[path]), err_msg=path)
    scanned.save_hf(tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    source = load_file(f"{tiny_dir}/model.safetensors")
    assert exported.keys() == source.keys()
    for name in source:
        np.testing.assert_array_equal(exported[name], source[name], err_msg=name)


def test_bad_scan_option_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="scan_layers"):
        Qwen3VL.from_pretrained(tiny_dir, scan_layers="yes")
