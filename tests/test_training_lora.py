"""LoRA against HF + PEFT on the same weights: an adapter saved here loads in `PeftModel` with the same
logits, an adapter made with PEFT loads here with the same logits (list and stacked layouts), the
merged export loads in plain HF with the same logits, and targets that match nothing are an error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close
from flax import nnx
from test_training_labels import CONVERSATIONS, conversation_batch

from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.training.lora import (LoRAConfig, LoRAWeight, VISION_TARGETS, add_lora, export_merged,
                                       lora_modules, save_adapter)


@pytest.fixture(scope="module")
def batch(tiny_dir):
    return conversation_batch(Qwen3VLProcessor.from_pretrained(tiny_dir), CONVERSATIONS, "left")


def fresh_hf(path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, batch) -> np.ndarray:
    inputs = {k: torch.from_numpy(np.asarray(batch[k])) for k in MODEL_INPUTS if k in batch}
    with torch.no_grad():
        return model(**inputs).logits.numpy()


def real_logits(logits, batch) -> np.ndarray:
    return np.asarray(logits)[np.asarray(batch["attention_mask"]).astype(bool)]


def randomize(model, seed: int) -> None:
    """Non-zero adapters (B starts at zero, which would make every comparison trivial)."""
    state = nnx.state(model, LoRAWeight)
    rng = np.random.default_rng(seed)
    nnx.update(model, jax_map(lambda x: (0.2 * rng.standard_normal(x.shape)).astype(np.float32), state))


def jax_map(fn, state):
    import jax

    return jax.tree.map(fn, state)


def test_adapter_saved_here_loads_in_peft_and_merges(tiny_dir, batch, tmp_path):
    from peft import PeftModel

    model = Qwen3VL.from_pretrained(tiny_dir)
    base = real_logits(model(**{k: batch[k] for k in MODEL_INPUTS}), batch)
    adapted = add_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *VISION_TARGETS)))
    assert any(p.startswith("visual.blocks") for p in adapted)
    randomize(model, 0)
    ours = real_logits(model(**{k: batch[k] for k in MODEL_INPUTS}), batch)
    assert np.abs(ours - base).max() > 1e-2, "the adapter must change the logits for the test to mean anything"
    directory = save_adapter(model, tmp_path / "adapter")

    peft_model = PeftModel.from_pretrained(fresh_hf(tiny_dir), directory).eval()
    assert_close(ours, real_logits(hf_logits(peft_model, batch), batch), "f32_logits", "ours vs PEFT")

    merged = export_merged(model, tmp_path / "merged")
    assert_close(ours, real_logits(hf_logits(fresh_hf(merged), batch), batch), "f32_logits", "merged in HF")
    export_merged(model, tmp_path / "merged_orbax", to="orbax")
    reloaded = Qwen3VL.from_pretrained(tmp_path / "merged_orbax")
    assert not lora_modules(reloaded)
    assert_close(real_logits(reloaded(**{k: batch[k] for k in MODEL_INPUTS}), batch), ours, "f32_logits",
                 "merged Orbax")


@pytest.mark.parametrize("scan_layers", [False, True])
def test_adapter_made_with_peft_loads_here(tiny_dir, batch, tmp_path, scan_layers):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(fresh_hf(tiny_dir), LoraConfig(
        r=4, lora_alpha=16, lora_dropout=0.1, use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj", "attn.qkv", "mlp.linear_fc2"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ref = real_logits(hf_logits(peft_model, batch), batch)
    with peft_model.disable_adapter():
        assert np.abs(ref - real_logits(hf_logits(peft_model, batch), batch)).max() > 1e-2

    model = Qwen3VL.from_pretrained(tiny_dir, scan_layers=scan_layers, adapter=tmp_path / "peft")
    assert len(lora_modules(model)) == (5 if scan_layers else
                                        3 * model.config.text.num_hidden_layers + 2 * model.config.vision.depth)
    ours = real_logits(model(**{k: batch[k] for k in MODEL_INPUTS}), batch)
    assert_close(ours, ref, "f32_logits", f"PEFT adapter here (scan_layers={scan_layers})")
    # Saved back from either layout: PEFT's own tensors, name for name.
    from safetensors.numpy import load_file

    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    again = load_file(save_adapter(model, tmp_path / "again") + "/adapter_model.safetensors")
    assert sorted(again) == sorted(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)


def test_targets_that_match_nothing_are_an_error(tiny_dir):
    model = Qwen3VL.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match=r"\['qproj'\] match no linear layer"):
        add_lora(model, LoRAConfig(target_modules=("q_proj", "qproj")))
    assert not lora_modules(model), "a failed add_lora must leave the model unchanged"
