"""The train step: gradients of the trainable parameters only, HF's gradient accumulation, one jit.

    trainer = Trainer(model, OptimConfig(learning_rate=1e-4, grad_accum_steps=2))
    for step in range(n):
        metrics = trainer.step([data.batch(2 * step), data.batch(2 * step + 1)])

The model is split once (`nnx.split`) into the trainable parameters (a filter: the parts
`OptimConfig.freeze` leaves trained, or the LoRA parameters) and everything else. Only the first are
differentiated and only they carry optimizer state; the rest is passed to the jitted functions as a
constant argument. The jitted functions donate their state arguments, so the parameters, the
optimizer state and the gradient accumulator are updated in place.

Gradient accumulation follows HF's Trainer (`num_items_in_batch`): each micro-batch contributes the
gradient of its *sum* of per-token losses, and the update divides the sum over the K micro-batches by
the total number of supervised tokens. That is the gradient of the mean over all supervised tokens of
the accumulated batch, not the mean of K per-micro-batch means (which `optax.MultiSteps` would give,
and which weighs a token of a short micro-batch more). Clipping and AdamW then see exactly HF's
accumulated gradient. So the optimizer is built with `grad_accum_steps=1`; the accumulation lives here.

Shapes and compiles: `prepare_inputs(..., encode=False)` runs on the host before the jit, so the
vision tower runs inside the differentiated function. The pixels and the tower's metadata are padded
to a fixed patch budget per vision bucket (`batch_size * vision bucket` merged tokens, the bound
`SFTDataset` guarantees), padding in its own attention segment as `buckets.EncoderRunner` does; the
padded rows are never spliced in. So the micro-step compiles once per `(length bucket, vision
bucket)` and the update once; `COMPILE_COUNTS` counts the traces. Without accumulation
(`grad_accum_steps == 1`) `step` runs gradient and update as one program ("step"), compiled once per
bucket: no accumulator is zeroed and added to, and the update needs no second dispatch (7% faster
per step in `scripts/bench_train.py`'s configuration).

Precision: build the model with `param_dtype=jnp.float32, dtype=jnp.bfloat16` for f32 master weights
with bf16 compute (the gradients and AdamW run in f32 on the f32 parameters); `remat=True` on the
model recomputes each block in the backward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..checks import ArgumentError
from ..model import MODEL_INPUTS
from ..shapes import quarter_octave
from ..sharding import use_mesh
from .lora import LoRAKey, set_lora_training
from .loss import summed_token_loss
from .optim import OptimConfig, build_optimizer, is_frozen, learning_rate_schedule, param_part, param_path

__all__ = ["Trainer", "trainable_filter", "pad_vision", "COMPILE_COUNTS"]

COMPILE_COUNTS: collections.Counter = collections.Counter()
"""Traces of the jitted micro-step ("grad"), update ("update") and single-micro-batch step
("step"); incremented at trace time only."""


def trainable_filter(freeze: tuple[str, ...] = ()):
    """An nnx filter: the `nnx.Param`s of the model parts (`optim.PARTS`) not in `freeze`."""
    freeze = tuple(freeze)

    def keep(path, value) -> bool:
        if not isinstance(value, nnx.Param):
            return False
        name = ".".join(str(k) for k in path)
        return not is_frozen(param_part(name), freeze)

    return keep


def pad_vision(inputs, patches: int):
    """`inputs` with the pixels and the tower's metadata padded to `patches` rows (fixed shapes;
    `VisionMetadata.padded`)."""
    if inputs.pixel_values is None:
        return inputs
    vision = inputs.vision.padded(patches)
    pad = patches - inputs.pixel_values.shape[0]
    return dataclasses.replace(inputs, pixel_values=jnp.pad(inputs.pixel_values, ((0, pad), (0, 0))),
                               vision=vision)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


class Trainer:
    """Optimizer state and the jitted train step for a `Qwen3VL` (full fine-tuning or LoRA).

    Args:
      model: the model; its trainable parameters are updated in place by `step` (written back
        into its Variables after each update, so `model` always holds the current values).
      config: optimizer hyperparameters; `config.grad_accum_steps` is the number of micro-batches
        `step` expects.
      trainable: an nnx filter of the differentiated variables (default: `trainable_filter(
        config.freeze)`; LoRA runs pass `nnx.LoRAParam`).
      chunk_size: tokens per LM-head call in the loss (memory only).
      max_vision_tokens: merged vision tokens per micro-batch the pixels are padded to (default:
        the batch's `batch_size * vision bucket` when the batch carries a `bucket`, else the real count
        rounded up to `shapes.quarter_octave`: at most 25% padding, four sizes per doubling).
      router_aux_loss: MoE models: add the routers' load-balancing loss times the config's
        `router_aux_loss_coef` (HF's `output_router_logits=True`). A frozen router: `freeze`
        patterns or a `trainable` filter that leave out `mlp.gate`.
      seed: the dropout keys (LoRA dropout) of micro-batch k of update s are `fold_in(fold_in(seed,
        s), k)`: a pure function of the step, so a resumed run draws the same masks.
    """

    def __init__(self, model, config: OptimConfig, *, trainable=None, chunk_size: int = 1024,
                 max_vision_tokens: int | None = None, seed: int = 0, router_aux_loss: bool = False):
        self.model = model
        self.config = config
        self.chunk_size = chunk_size
        self.max_vision_tokens = max_vision_tokens
        self.trainable = trainable if trainable is not None else trainable_filter(config.freeze)
        # The step's graph has LoRA dropout on; the caller's model is left in evaluation mode.
        set_lora_training(model, True)
        self.graphdef, params, keys, self.rest = nnx.split(model, self.trainable, LoRAKey, ...)
        set_lora_training(model, False)
        self.seed = seed
        # The trainable values as a pure dict (what the jitted functions take and return) and the
        # model's Variables they are written back to after each update, in the same flat order.
        self._pure = nnx.to_pure_dict(params)
        self._keys = nnx.to_pure_dict(keys)
        if not jax.tree.leaves(self._pure):
            raise ArgumentError("no trainable parameters: the filter selects nothing")
        parts = {param_part(param_path(path)) for path, _ in jax.tree_util.tree_flatten_with_path(self._pure)[0]}
        if all(is_frozen(p, config.freeze) for p in parts):  # e.g. LoRA adapters only in frozen parts
            raise ArgumentError(f"nothing would train: every trainable variable is in a frozen part "
                                f"({', '.join(sorted(parts))}; freeze={list(config.freeze)})")
        self._targets = _variables_in_order(model, self.trainable, self._pure)
        self.tx = build_optimizer(dataclasses.replace(config, grad_accum_steps=1))
        self.opt_state = self.tx.init(self._pure)
        self.step_count = 0
        self._schedule = learning_rate_schedule(config.learning_rate, config)
        aux_coef = float(model.config.text.router_aux_loss_coef) if router_aux_loss else 0.0
        self._grad = jax.jit(functools.partial(micro_step, self.graphdef, chunk_size, aux_coef=aux_coef),
                             donate_argnums=(0,))
        self._update = jax.jit(functools.partial(apply_update, self.tx), donate_argnums=(0, 1))
        self._zeros = jax.jit(_zeros_like)
        self._whole = jax.jit(functools.partial(_whole_step, self.graphdef, chunk_size, self.tx, aux_coef=aux_coef),
                              donate_argnums=(0, 1))

    @property
    def params(self) -> nnx.State:
        """The trainable parameters (an `nnx.State` of the model's current values)."""
        return nnx.state(self.model, self.trainable)

    def _set_params(self, pure) -> None:
        """Make `pure` the trainable values, in the Trainer and in the model."""
        self._pure = pure
        for variable, value in zip(self._targets, jax.tree.leaves(pure)):
            variable.set_value(value)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """The trainable parameters (pure dict), the optimizer state and the step (for checkpoints)."""
        return {"params": self._pure, "opt_state": self.opt_state,
                "step": jnp.asarray(self.step_count, jnp.int32)}

    def load_state(self, state: dict[str, Any]) -> None:
        params = nnx.state(self.model, self.trainable)
        nnx.replace_by_pure_dict(params, state["params"])  # matched by path, whatever the key types
        self._set_params(nnx.to_pure_dict(params))
        self.opt_state = state["opt_state"]
        self.step_count = int(state["step"])

    # ------------------------------------------------------------------ stepping

    def prepare(self, batch: dict[str, Any]):
        """Host side of one micro-batch: `(inputs, labels)` with fixed shapes for its bucket."""
        if "labels" not in batch:
            raise ValueError("the batch has no 'labels'; build them with "
                             "qwen3vl_jax.training.assistant_labels")
        inputs = self.model.prepare_inputs(**{k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None},
                                           encode=False)
        if inputs.pixel_values is not None:
            unit = self.model.config.vision.merge_unit
            tokens = self.max_vision_tokens
            if tokens is None and "bucket" in batch:
                tokens = int(batch["input_ids"].shape[0]) * int(batch["bucket"][1])
            if tokens is None:
                tokens = quarter_octave(inputs.pixel_values.shape[0] // unit)
            inputs = pad_vision(inputs, tokens * unit)
        labels = jnp.asarray(batch["labels"], jnp.int32)
        if labels.shape != inputs.input_ids.shape:
            raise ValueError(f"labels shape {labels.shape} != input_ids shape {inputs.input_ids.shape}")
        return inputs, labels

    def _dropout_key(self, k: int):
        """The LoRA dropout key of micro-batch `k` of the current update."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.step_count), k)

    def accumulate(self, micro_batches):
        """`(grads, loss sum, supervised tokens)`: the summed-loss gradients of the trainable
        parameters (pure dict) over `micro_batches`, not yet divided by the token count."""
        grads, total, count = self._zeros((self._pure, jnp.float32(0), jnp.int32(0)))
        with use_mesh(self.model):  # a sharded model: its mesh's activation constraints and kernels
            for k, batch in enumerate(micro_batches):
                inputs, labels = self.prepare(batch)
                grads, total, count = self._grad((grads, total, count), self._pure, self._keys, self.rest,
                                                 inputs, labels, self._dropout_key(k))
        return grads, total, count

    def gradients(self, micro_batches):
        """`(loss, grads)`: the mean loss over all supervised tokens of `micro_batches` and its
        gradient, i.e. what the update sees (before clipping)."""
        grads, total, count = self.accumulate(micro_batches)
        scale = 1.0 / max(int(count), 1)
        return float(total) * scale, jax.tree.map(lambda g: g * scale, grads)

    def step(self, micro_batches) -> dict[str, float]:
        """One optimizer update from `config.grad_accum_steps` micro-batches (dicts as
        `SFTDataset.batch` returns). Returns loss (mean over the supervised tokens of all
        micro-batches), tokens (supervised), learning rate, grad norm and seconds."""
        micro_batches = list(micro_batches)
        if len(micro_batches) != self.config.grad_accum_steps:
            raise ValueError(f"expected {self.config.grad_accum_steps} micro-batches, "
                             f"got {len(micro_batches)}")
        start = time.perf_counter()
        lr = float(self._schedule(self.step_count))
        if len(micro_batches) == 1:  # no accumulation: gradient and update in one program
            with use_mesh(self.model):
                inputs, labels = self.prepare(micro_batches[0])
                params, self.opt_state, total, count, norm = self._whole(
                    self._pure, self.opt_state, self._keys, self.rest, inputs, labels, self._dropout_key(0))
        else:
            grads, total, count = self.accumulate(micro_batches)
            with use_mesh(self.model):
                params, self.opt_state, norm = self._update(self._pure, self.opt_state, grads, count)
        self._set_params(params)
        self.step_count += 1
        tokens = int(count)
        loss = float(total) / max(tokens, 1)
        return {"step": self.step_count, "loss": loss, "tokens": tokens, "learning_rate": lr,
                "grad_norm": float(norm), "seconds": time.perf_counter() - start}


def _variables_in_order(model, trainable, pure) -> list:
    """The model's Variables selected by `trainable`, in the flat order of `pure` (its pure dict)."""
    def key(path):
        return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)

    selected = nnx.filterlib.to_predicate(trainable)
    found = {tuple(path): node for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Variable) and selected(path, node)}
    paths = [key(path) for path, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
    missing = [p for p in paths if p not in found]
    if missing or len(found) != len(paths):
        raise RuntimeError(f"trainable variables and their values disagree: {missing[:3]}")
    return [found[p] for p in paths]


def _fresh_keys(keys, rng):
    """New raw key data for every LoRA dropout key (one per module, per block when stacked)."""
    leaves, treedef = jax.tree_util.tree_flatten(keys)
    fresh = []
    for i, leaf in enumerate(leaves):
        count = int(np.prod(leaf.shape[:-1]))
        data = jax.random.key_data(jax.random.split(jax.random.fold_in(rng, i), count))
        fresh.append(data.reshape(leaf.shape).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, fresh)


def _summed_loss_grads(graphdef, chunk_size, params, keys, rest, inputs, labels, rng, aux_coef=0.0):
    """`(grads, loss sum, token count)` of one micro-batch: the gradient of its summed token losses."""
    keys = nnx.State(_fresh_keys(keys, rng))

    def summed_loss(params):
        model = nnx.merge(graphdef, nnx.State(params), keys, rest)
        return summed_token_loss(model, inputs, labels, chunk_size, aux_coef)

    (total, n), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
    return grads, total, n.astype(jnp.int32)


def micro_step(graphdef, chunk_size, acc, params, keys, rest, inputs, labels, rng, *, aux_coef=0.0):
    """Add this micro-batch's gradient of the summed token losses, its loss sum and token count
    (`aux_coef`: the MoE routers' load-balancing loss, see `loss.summed_token_loss`)."""
    COMPILE_COUNTS["grad"] += 1
    grads, total, n = _summed_loss_grads(graphdef, chunk_size, params, keys, rest, inputs, labels, rng, aux_coef)
    acc_grads, acc_total, acc_count = acc
    return jax.tree.map(jnp.add, acc_grads, grads), acc_total + total, acc_count + n


def _whole_step(graphdef, chunk_size, tx, params, opt_state, keys, rest, inputs, labels, rng, *, aux_coef=0.0):
    """One update from a single micro-batch in one program: no accumulator to zero and add to,
    and no second dispatch for the clip + AdamW update."""
    COMPILE_COUNTS["step"] += 1
    grads, total, n = _summed_loss_grads(graphdef, chunk_size, params, keys, rest, inputs, labels, rng, aux_coef)
    params, opt_state, norm = _apply(tx, params, opt_state, grads, n)
    return params, opt_state, total, n, norm


def apply_update(tx, params, opt_state, grads, count):
    """Divide the accumulated gradient by the supervised-token count, then clip + AdamW."""
    COMPILE_COUNTS["update"] += 1
    return _apply(tx, params, opt_state, grads, count)


def _apply(tx, params, opt_state, grads, count):
    scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

