"""The tiny checkpoint factory and the strict HF converter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.convert import CheckpointError
from qwen3vl_jax.testing import SPECIAL_TOKENS, make_tiny_checkpoint


def test_hf_loads_tiny_checkpoint_completely(tiny_dir):
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model, info = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    processor = AutoProcessor.from_pretrained(tiny_dir)
    tok = processor.tokenizer
    for token in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(token) < model.config.text_config.vocab_size
    assert processor.image_token_id == model.config.image_token_id
    assert processor.video_token_id == model.config.video_token_id
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox" and len(ids) < len("The quick brown fox")  # real merges


def test_tiny_checkpoint_is_deterministic_and_needs_no_torch(tmp_path, tiny_dir):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any torch import now fails
        "from qwen3vl_jax.testing import make_tiny_checkpoint\n"
        f"make_tiny_checkpoint({str(tmp_path / 'b')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    a = load_file(os.path.join(tiny_dir, "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _copy_with(tiny_dir, dst, edit):
    os.makedirs(dst)
    for name in os.listdir(tiny_dir):
        if name != "model.safetensors":
            with open(os.path.join(tiny_dir, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_all_problems_reported_together(tiny_dir, tmp_path):
    def edit(t):
        del t["model.visual.blocks.1.attn.qkv.weight"]
        t["model.visual.blocks.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
        t["model.visual.merger.linear_fc2.weight"] = np.zeros((3, 3), np.float32)
        t["something.else"] = np.zeros((1,), np.float32)

    bad = _copy_with(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        Qwen3VL.from_pretrained(bad)
    msg = str(e.value)
    assert "4 problem(s)" in msg
    assert "missing tensor model.visual.blocks.1.attn.qkv.weight" in msg
    assert "unexpected tensor model.visual.blocks.0.mlp.extra.weight" in msg
    assert "shape mismatch for model.visual.merger.linear_fc2.weight" in msg
    assert "unexpected tensor something.else [1] (no conversion rule)" in msg


def test_no_safetensors_is_an_error(tmp_path, tiny_dir):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(tiny_dir, "config.json")).read())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Qwen3VL.from_pretrained(d)


def test_sharded_and_bf16_tied_legacy_variants(tmp_path, hf_model):
    """Variants of the factory load in HF and in ours, with the same vision weights as the default."""
    from transformers import Qwen3VLForConditionalGeneration

    d = make_tiny_checkpoint(tmp_path / "v", dtype="bfloat16", tie_word_embeddings=True, rope_form="legacy",
                             max_shard_bytes=200_000)
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert "rope_scaling" in cfg["text_config"] and cfg["tie_word_embeddings"] is True
    hf, info = Qwen3VLForConditionalGeneration.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = Qwen3VL.from_pretrained(d)
    assert not hasattr(ours, "lm_head")
    ref = hf_model.model.visual.blocks[0].attn.qkv.weight.detach().numpy()
    got = np.asarray(ours.visual.blocks[0].attn.qkv.kernel[...]).T
    np.testing.assert_allclose(got, ref, rtol=2**-8)  # bf16 storage of the same seed's weights


def test_raw_tokenizer_json_agrees_with_hf(tiny_dir):
    """tokenizer.json carries Qwen's own pipeline, so any loader (not only HF's class) gets the same ids."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    for text in ("12345 apples", "Hello, world!\n\n  It's  fine", "ünïcödé Ω ≈ 3.14", "<|im_start|>user\nhi"):
        assert raw.encode(text).ids == hf(text)["input_ids"], text


def test_mesh_given_as_a_string(tiny_dir, jax_model):
    """`from_pretrained(path, mesh="AXIS=SIZE,...")` builds the mesh (`sharding.make_mesh`)."""
    import jax

    from qwen3vl_jax.sharding import ShardingError

    model = Qwen3VL.from_pretrained(tiny_dir, mesh="data=1")
    placed = model.language_model.embed_tokens.embedding[...].sharding
    assert isinstance(placed, jax.sharding.NamedSharding)
    assert dict(placed.mesh.shape) == {"data": 1, "expert": 1, "fsdp": 1, "tensor": 1}
    np.testing.assert_array_equal(np.asarray(model.language_model.embed_tokens.embedding[...]),
                                  np.asarray(jax_model.language_model.embed_tokens.embedding[...]))
    with pytest.raises(ShardingError, match="needs 8 devices, but 1"):
        Qwen3VL.from_pretrained(tiny_dir, mesh="data=4,tensor=2")
    with pytest.raises(ShardingError, match="unknown mesh axis"):
        Qwen3VL.from_pretrained(tiny_dir, mesh="model=2")
