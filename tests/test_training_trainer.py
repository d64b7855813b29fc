"""The train step: HF's gradient accumulation (sum of token losses / all supervised tokens), the loss
going down on the tiny model, and no recompilation across batches of the same bucket."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import assert_close
from flax import nnx
from test_training_labels import CONVERSATIONS, conversation_batch

from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor
from qwen3vl_jax.testing import make_tiny_dataset
from qwen3vl_jax.training import OptimConfig, SFTDataset, assistant_labels, causal_lm_loss
from qwen3vl_jax.training import trainer as trainer_lib
from qwen3vl_jax.training.trainer import Trainer


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def batch(processor):
    out = conversation_batch(processor, CONVERSATIONS, "left")
    out["labels"] = assistant_labels(out["input_ids"], out["attention_mask"], processor, CONVERSATIONS)
    return out


def rows(batch, row: int, media: str) -> dict:
    """Row `row` of `batch` alone, with its own media (row 0 holds the image, row 1 the video)."""
    out = {k: batch[k][row:row + 1] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "labels")}
    if media == "image":
        out.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    else:
        out.update(pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"])
    return out


def test_accumulation_is_hfs_token_mean(tiny_dir, batch):
    """Two one-row micro-batches give the gradient of the whole batch's mean over supervised tokens
    (HF's `num_items_in_batch`), not the mean of the two per-row means."""
    model = Qwen3VL.from_pretrained(tiny_dir)
    trainer = Trainer(model, OptimConfig(grad_accum_steps=2))
    micro = [rows(batch, 0, "image"), rows(batch, 1, "video")]
    counts = [int((m["labels"][:, 1:] != -100).sum()) for m in micro]
    assert counts[0] != counts[1], "the rows must differ in supervised tokens for the check to mean anything"
    loss, grads = trainer.gradients(micro)
    whole_loss, whole = trainer.gradients([batch])
    assert loss == pytest.approx(float(causal_lm_loss(model, batch)), rel=1e-5)
    assert loss == pytest.approx(whole_loss, rel=1e-5)
    means = [trainer.gradients([m])[1] for m in micro]
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    assert_close(flat(grads), flat(whole), "f32_logits", "accumulated gradient")
    mean_of_means = 0.5 * (flat(means[0]) + flat(means[1]))
    assert np.abs(mean_of_means - flat(whole)).max() > 1e-3


def test_steps_reduce_the_loss_without_recompiling(tiny_dir, processor, tmp_path):
    # one length and one vision bucket: two batch shapes here (text-only and with media), each compiled once
    data = SFTDataset(make_tiny_dataset(tmp_path, num_rows=8, seed=0), processor, batch_size=2, max_length=128,
                      length_buckets=(128,), vision_buckets=(16,))
    model = Qwen3VL.from_pretrained(tiny_dir)
    trainer = Trainer(model, OptimConfig(learning_rate=3e-3, warmup_steps=0, total_steps=100, freeze=("vision",)))
    assert not any(k.startswith("visual.blocks") for k in _paths(trainer.params))
    fixed = data.batch(0)
    before = float(causal_lm_loss(model, fixed))
    start = dict(trainer_lib.COMPILE_COUNTS)
    steps = 2 * data.batches_per_epoch
    for step in range(steps):
        trainer.step([data.batch(step)])
    traces = {k: trainer_lib.COMPILE_COUNTS[k] - start.get(k, 0) for k in ("step", "grad", "update")}
    # no accumulation: gradient and update are one program, compiled once per batch shape
    assert len(data.shapes()) == 2 and data.batches_per_epoch > len(data.shapes())
    assert traces == {"step": len(data.shapes()), "grad": 0, "update": 0}, (traces, data.shapes())
    after = float(causal_lm_loss(model, fixed))
    print(f"loss on batch 0: {before:.4f} -> {after:.4f} after {steps} steps; {traces}")
    assert after < before - 0.1


def _paths(state) -> list[str]:
    from qwen3vl_jax.training.optim import param_path

    return [param_path(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]]


def test_lora_steps_train_only_the_adapters(tiny_dir, batch):
    """With dropout on: the loss of the batch falls, the base weights do not move, and evaluation
    (dropout off) is deterministic."""
    from qwen3vl_jax.params import canonical_params
    from qwen3vl_jax.training.lora import LoRAConfig, LoRAWeight, add_lora

    model = Qwen3VL.from_pretrained(tiny_dir)
    add_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.1))
    base = {k: np.asarray(v) for k, v in canonical_params(model).items()}
    trainer = Trainer(model, OptimConfig(learning_rate=1e-2, total_steps=100), trainable=LoRAWeight)
    assert all(".lora_" in p for p in _paths(trainer.params))
    before = float(causal_lm_loss(model, batch))
    assert float(causal_lm_loss(model, batch)) == before
    losses = [trainer.step([batch])["loss"] for _ in range(4)]
    after = float(causal_lm_loss(model, batch))
    print(f"LoRA: eval loss {before:.4f} -> {after:.4f}; train losses {losses}")
    assert after < before - 0.05
    for k, v in canonical_params(model).items():
        np.testing.assert_array_equal(np.asarray(v), base[k], err_msg=k)


def test_bf16_compute_keeps_f32_master_weights(tiny_dir, batch):
    """bf16 compute keeps f32 parameters, gradients and optimizer state, with a loss near the f32 one.
    (That `remat` changes memory, not gradients: tests/test_layer_stacks.py.)"""
    import jax.numpy as jnp

    config = OptimConfig(learning_rate=1e-3, freeze=("vision",))
    loss = float(causal_lm_loss(Qwen3VL.from_pretrained(tiny_dir), batch))

    mixed = Qwen3VL.from_pretrained(tiny_dir, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    trainer = Trainer(mixed, config)
    bf16_loss, bf16_grads = trainer.gradients([batch])
    assert {x.dtype for x in jax.tree.leaves(bf16_grads)} == {np.dtype(np.float32)}
    assert bf16_loss == pytest.approx(loss, rel=0.02)
    trainer.step([batch])
    assert {x.dtype for x in jax.tree.leaves(trainer.state())} <= {np.dtype(np.float32), np.dtype(np.int32)}


@pytest.mark.slow  # (the fast tier keeps the accumulation against HF's token mean, above)
def test_one_program_step_equals_accumulate_then_update(tiny_dir, batch):
    """`step` with one micro-batch (gradient and AdamW in one jitted program) moves the parameters as
    the two-program path does: two copies of the batch, accumulated, have the same token mean."""
    config = dict(learning_rate=1e-3, warmup_steps=0, total_steps=10)
    whole = Trainer(Qwen3VL.from_pretrained(tiny_dir), OptimConfig(**config))
    split = Trainer(Qwen3VL.from_pretrained(tiny_dir), OptimConfig(grad_accum_steps=2, **config))
    start = dict(trainer_lib.COMPILE_COUNTS)
    for _ in range(2):
        one, two = whole.step([batch]), split.step([batch, batch])
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-6)
        assert 2 * one["tokens"] == two["tokens"]
        assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    traces = {k: trainer_lib.COMPILE_COUNTS[k] - start.get(k, 0) for k in ("step", "grad", "update")}
    assert traces == {"step": 1, "grad": 1, "update": 1}
    flat = lambda trainer: np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(trainer.params))])  # noqa: E731
    moved = np.abs(flat(whole) - flat(Trainer(Qwen3VL.from_pretrained(tiny_dir), OptimConfig(**config)))).max()
    assert moved > 1e-4  # the steps changed the parameters, so the comparison below means something
    assert_close(flat(whole), flat(split), "f32_logits", "parameters after two steps")
