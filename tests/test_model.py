"""Whole-model logits parity with HF's `Qwen3VLForConditionalGeneration` (f32), and mRoPE positions.

Inputs come from HF's own processor on the tiny checkpoint, so prompts carry exactly the layout HF
builds (per-frame timestamps for video, left padding for batches).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close, hf_processor_batch, user_prompt

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.mrope import get_rope_index
from qwen3vl_jax.testing import make_tiny_checkpoint


CASES = {
    "text_only": dict(prompts=[user_prompt("Hello, how are you today?")]),
    "one_image": dict(prompts=[user_prompt("image", "Describe this image.")], images=[(100, 150)]),
    "two_images": dict(prompts=[user_prompt("image", "and", "image", "compare them")], images=[(64, 64), (96, 200)]),
    "video_t3": dict(prompts=[user_prompt("video", "What happens?")], videos=[(6, 64, 96, 2.0)]),
    "image_and_video": dict(prompts=[user_prompt("image", "video", "both")], images=[(80, 80)], videos=[(5, 64, 64, 3.0)]),
    "batch_left_padding": dict(
        prompts=[user_prompt("image", "A long question about the picture here?"), user_prompt("Short.")],
        images=[(70, 90)],
    ),
}


def _hf_inputs(processor, case):
    return hf_processor_batch(processor, CASES[case])


@pytest.fixture(scope="module")
def processor(hf_processor):
    return hf_processor


def _model_inputs(batch):
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_parity(case, processor, hf_model, jax_model):
    batch = _model_inputs(_hf_inputs(processor, case))
    if case == "video_t3":
        assert int(batch["video_grid_thw"][0, 0]) >= 3
    with torch.no_grad():
        ref = hf_model(**batch).logits.numpy()
    ours = np.asarray(jax_model(**{k: v.numpy() for k, v in batch.items()}))
    real = batch["attention_mask"].numpy().astype(bool)  # HF's logits at padding positions are arbitrary
    assert_close(ours[real], ref[real], "f32_logits", case)


@pytest.mark.parametrize("case", [c for c in CASES if c != "text_only"])
def test_rope_index_parity(case, processor, hf_model):
    batch = _hf_inputs(processor, case)
    ref_pos, ref_delta = hf_model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch.get("image_grid_thw"), batch.get("video_grid_thw"),
        batch["attention_mask"],
    )
    pos, delta = get_rope_index(
        batch["input_ids"].numpy(), batch["mm_token_type_ids"].numpy(),
        None if "image_grid_thw" not in batch else batch["image_grid_thw"].numpy(),
        None if "video_grid_thw" not in batch else batch["video_grid_thw"].numpy(),
        batch["attention_mask"].numpy(), spatial_merge_size=2,
    )
    np.testing.assert_array_equal(pos, ref_pos.numpy())
    np.testing.assert_array_equal(delta, ref_delta.numpy())


@pytest.mark.parametrize("variant", ["tied_legacy_rope", "untied_v5_rope"])
def test_logits_parity_config_variants(variant, tmp_path, processor):
    from transformers import Qwen3VLForConditionalGeneration

    tied = variant.startswith("tied")
    d = make_tiny_checkpoint(tmp_path / variant, tie_word_embeddings=tied,
                             rope_form="legacy" if "legacy" in variant else "v5", seed=7)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(d).eval()
    assert hf.config.tie_word_embeddings is tied
    ours = Qwen3VL.from_pretrained(d)
    batch = _model_inputs(_hf_inputs(processor, "image_and_video"))
    with torch.no_grad():
        ref = hf(**batch).logits.numpy()
    assert_close(ours(**{k: v.numpy() for k, v in batch.items()}), ref, "f32_logits", variant)


def test_placeholder_mismatch_is_an_error(processor, jax_model):
    batch = {k: v.numpy() for k, v in _model_inputs(_hf_inputs(processor, "one_image")).items()}
    ids = batch["input_ids"].copy()
    ids[0, np.flatnonzero(ids[0] == jax_model.config.image_token_id)[0]] = 0  # drop one placeholder
    with pytest.raises(ValueError, match="image placeholders and image features do not match: the prompt has"):
        jax_model(ids, batch["attention_mask"], None, batch["pixel_values"], batch["image_grid_thw"])
    with pytest.raises(ValueError, match="pass both the image pixels and the image grid_thw"):
        jax_model(batch["input_ids"], batch["attention_mask"], None, batch["pixel_values"], None)


def test_hidden_states_hook(processor, hf_model, jax_model):
    batch = _model_inputs(_hf_inputs(processor, "one_image"))
    with torch.no_grad():
        ref = hf_model(**batch, output_hidden_states=True).hidden_states
    logits, layers = jax_model(**{k: v.numpy() for k, v in batch.items()}, return_hidden_states=True)
    assert len(layers) == jax_model.config.text.num_hidden_layers
    # HF's tuple: the embeddings, then each decoder layer's output (before its deepstack addition),
    # except that HF stores the last one after the final norm.
    assert len(ref) == len(layers) + 1
    for i, layer in enumerate(layers[:-1]):
        assert_close(layer, ref[i + 1].numpy(), "f32_logits", f"layer {i}")
