"""The causal language-model loss, as HF's `Qwen3VLForConditionalGeneration(..., labels=...).loss`.

HF (`transformers.loss.loss_utils.ForCausalLMLoss`): logits in float32, labels shifted left by one
(the last position predicts nothing), cross-entropy summed over the labels that are not -100 and
divided by their count. The only difference: a batch without a single supervised token gives 0
here (HF gives NaN), so one empty batch cannot poison an accumulated gradient.

Memory: the full `[B, L, V]` logits are never materialized. The final hidden states go through the
LM head one chunk of `chunk_size` tokens at a time inside a `lax.scan`; each chunk's logits come out
in the model's compute dtype (bf16 logits for a bf16 model, exactly the values HF's bf16 model
computes before its `.float()`), are upcast to float32 for the log-sum-exp, and are reduced to one
number per token. The scan body is rematerialized (`jax.checkpoint`), so the backward pass
recomputes a chunk's logits instead of storing them: the largest float32 array is
`[chunk_size, V]`.

Shapes: the jitted part sees `[B, L]` token arrays and the visual features padded to a power of
two of rows (`[N', E]`, N' >= N merged visual tokens), so a data set with fixed length buckets
compiles once per (length bucket, N') pair; `COMPILE_COUNTS["loss"]` counts the traces, as
`qwen3vl_jax/generate.py` counts its own.

Axes: B batch, L tokens, E hidden, V vocabulary, N = B*L tokens, C chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels._shapes import pow2_at_least

from ..model import MODEL_INPUTS
from ..moe import load_balancing_loss
from .labels import IGNORE_INDEX

__all__ = ["causal_lm_loss", "shift_labels", "chunked_cross_entropy", "summed_token_loss", "COMPILE_COUNTS"]

COMPILE_COUNTS: collections.Counter = collections.Counter()
"""Traces of the jitted loss ("loss"); incremented at trace time only."""


def shift_labels(labels: jnp.ndarray) -> jnp.ndarray:
    """`[B, L]` targets per position: position i predicts labels[i + 1]; the last predicts nothing."""
    return jnp.concatenate([labels[:, 1:], jnp.full_like(labels[:, :1], IGNORE_INDEX)], axis=1)


def chunked_cross_entropy(hidden: jnp.ndarray, targets: jnp.ndarray, project, chunk_size: int = 1024):
    """`(sum of -log p(target), number of targets)` over the targets that are not -100.

    Args:
      hidden: `[B, L, E]` final hidden states.
      targets: `[B, L]` int, the token each position should predict (already shifted), -100 = none.
      project: `[C, E] -> [C, V]`, the LM head (e.g. `model.logits`).
      chunk_size: tokens per LM-head call; the last chunk is padded with ignored tokens.
    """
    b, length, e = hidden.shape
    n = b * length
    c = max(1, min(int(chunk_size), n))
    pad = -n % c
    h = jnp.pad(hidden.reshape(n, e), ((0, pad), (0, 0))).reshape(-1, c, e)
    y = jnp.pad(targets.reshape(n), (0, pad), constant_values=IGNORE_INDEX).reshape(-1, c)

    @jax.checkpoint
    def chunk(total, xs):
        hc, yc = xs
        logits = project(hc).astype(jnp.float32)  # [C, V]: the only float32 logits alive
        valid = yc != IGNORE_INDEX
        picked = jnp.take_along_axis(logits, jnp.where(valid, yc, 0)[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return total + jnp.sum(jnp.where(valid, nll, 0.0)), None

    total, _ = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (h, y))
    return total, jnp.sum(targets != IGNORE_INDEX)


def summed_token_loss(model, inputs, labels, chunk_size: int, router_aux_loss_coef: float = 0.0):
    """`(sum of the token losses, number of supervised tokens)` of prepared `inputs`.

    `router_aux_loss_coef > 0` (MoE models): the routers' load-balancing loss (`moe.load_balancing_loss`
    over the real tokens), times the coefficient, is added once per token, so that the mean is HF's
    `loss + router_aux_loss_coef * aux_loss` (`output_router_logits=True`).
    """
    aux = router_aux_loss_coef > 0 and model.config.text.is_moe
    out = model.forward_hidden(inputs, return_router_logits=aux)
    total, count = chunked_cross_entropy(out.hidden, shift_labels(labels), model.logits, chunk_size)
    if aux:
        balance = load_balancing_loss(out.router_logits, model.config.text.num_experts_per_tok,
                                      inputs.attention_mask.reshape(-1))
        total = total + router_aux_loss_coef * balance * count.astype(jnp.float32)
    return total, count


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "router_aux_loss_coef"))
def _loss_from_inputs(graphdef, state, inputs, labels, *, chunk_size, router_aux_loss_coef=0.0):
    COMPILE_COUNTS["loss"] += 1
    model = nnx.merge(graphdef, state)
    total, count = summed_token_loss(model, inputs, labels, chunk_size, router_aux_loss_coef)
    return total / jnp.maximum(count, 1).astype(jnp.float32)


def _pad_visual_rows(inputs):
    """Features and deepstack padded to a power of two of rows (never indexed: `visual_index` < N)."""
    if inputs.features is None:
        return inputs
    n = inputs.features.shape[0]
    pad = pow2_at_least(n) - n
    return dataclasses.replace(inputs, features=jnp.pad(inputs.features, ((0, pad), (0, 0))),
                               deepstack=jnp.pad(inputs.deepstack, ((0, 0), (0, pad), (0, 0))))


def causal_lm_loss(model, batch, chunk_size: int = 1024, vision_encoder=None, router_aux_loss: bool = False
                   ) -> jnp.ndarray:
    """Mean next-token cross-entropy over the supervised tokens, a float32 scalar.

    Args:
      model: a `Qwen3VL`.
      batch: the processor's outputs (the keys of `qwen3vl_jax.model.MODEL_INPUTS`; others are
        ignored) plus `labels [B, L]` (-100 = not supervised; see `training.labels`).
      chunk_size: tokens per LM-head call (memory, not numerics: any value gives the same loss).
      vision_encoder: as in `Qwen3VL.prepare_inputs`, e.g. `EncoderRunner(model, budgets=
        data.encoder_budgets()).encode` so the vision tower runs at a fixed set of budgets.
      router_aux_loss: MoE models: add `router_aux_loss_coef` x the routers' load-balancing loss
        (HF's loss with `output_router_logits=True`).
    A pure function of `(model, batch)`: the host-side bookkeeping (mRoPE positions, placeholder
    checks) reads only the batch, so `nnx.grad(causal_lm_loss)(model, batch)` differentiates the
    parameters.
    """
    if "labels" not in batch:
        raise ValueError("the batch has no 'labels'; build them with qwen3vl_jax.training.assistant_labels")
    labels = jnp.asarray(batch["labels"], jnp.int32)
    ids_shape = tuple(batch["input_ids"].shape)
    if labels.shape != ids_shape:
        raise ValueError(f"labels shape {labels.shape} != input_ids shape {ids_shape}")
    inputs = model.prepare_inputs(**{k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None},
                                  vision_encoder=vision_encoder)
    inputs = _pad_visual_rows(inputs)
    graphdef, state = nnx.split(model)
    coef = float(model.config.text.router_aux_loss_coef) if router_aux_loss else 0.0
    return _loss_from_inputs(graphdef, state, inputs, labels, chunk_size=chunk_size, router_aux_loss_coef=coef)
