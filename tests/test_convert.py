"""HF -> Orbax -> HF round trips through the real CLI, sharded checkpoints, and strict errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import assert_close

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.cli import main as cli
from qwen3vl_jax.convert import CheckpointError
from qwen3vl_jax.testing import make_tiny_checkpoint


def _text_inputs(vocab):
    ids = np.random.default_rng(0).integers(0, 400, size=(2, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def _vision_batch(model):
    grid = np.asarray([[1, 4, 6]])
    pix = np.random.default_rng(1).standard_normal((24, model.config.vision.patch_dim)).astype(np.float32)
    return pix, grid


def test_round_trip_hf_orbax_hf(tiny_dir, tmp_path, hf_model):
    from transformers import Qwen3VLForConditionalGeneration

    orbax_dir, hf_dir = tmp_path / "orbax", tmp_path / "hf"
    cli(["convert", str(tiny_dir), str(orbax_dir), "--dtype", "float32"])
    assert os.path.isdir(orbax_dir / "orbax") and os.path.isfile(orbax_dir / "tokenizer.json")
    restored = Qwen3VL.from_pretrained(orbax_dir)
    cli(["convert", str(orbax_dir), str(hf_dir), "--to", "hf", "--dtype", "float32", "--max-shard-bytes", "400000"])
    assert os.path.isfile(hf_dir / "model.safetensors.index.json")  # sharded on the way back
    hf_back, info = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    ids, mask = _text_inputs(hf_model.config.text_config.vocab_size)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
        back = hf_back.eval()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_array_equal(back, ref)  # the same f32 weights went around the loop exactly
    real = mask.astype(bool)
    assert_close(np.asarray(restored(ids, mask))[real], ref[real], "f32_logits", "orbax-restored logits")
    pix, grid = _vision_batch(restored)
    with torch.no_grad():
        vis = hf_back.model.visual(torch.from_numpy(pix), torch.from_numpy(grid)).pooler_output.numpy()
    assert_close(restored.encode_vision(pix, grid)[0], vis, "f32_tower", "orbax-restored vision")


def test_orbax_bf16_restores_bf16(tiny_dir, tmp_path):
    import jax.numpy as jnp

    cli(["convert", str(tiny_dir), str(tmp_path / "o"), "--dtype", "bfloat16"])
    model = Qwen3VL.from_pretrained(tmp_path / "o", dtype=jnp.bfloat16)
    assert model.language_model.layers[0].mlp.up_proj.kernel.dtype == jnp.bfloat16


def test_orbax_checkpoint_of_another_architecture_is_refused(tiny_dir, tmp_path):
    cli(["convert", str(tiny_dir), str(tmp_path / "o"), "--dtype", "float32"])
    stored = tmp_path / "o" / "orbax" / "0" / "config" / "metadata"
    config = json.loads(stored.read_text())
    config["text_config"]["intermediate_size"] = 96  # the params no longer fit the stated architecture
    stored.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match the model"):
        Qwen3VL.from_pretrained(tmp_path / "o")


def test_sharded_checkpoint_and_missing_shard(tmp_path, hf_model, jax_model):
    d = make_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=300_000)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    model = Qwen3VL.from_pretrained(d)
    ids, mask = _text_inputs(None)
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), np.asarray(jax_model(ids, mask)))
    os.remove(os.path.join(d, shards[1]))
    with pytest.raises(CheckpointError, match=rf"shards named in model.safetensors.index.json are missing: \['{shards[1]}'\]"):
        Qwen3VL.from_pretrained(d)
