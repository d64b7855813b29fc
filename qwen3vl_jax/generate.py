"""Autoregressive generation: bucketed prefill, a donated KV cache, decoding in on-device chunks.

Data path (DESIGN: the last two stages):

```
Qwen3VL.prepare_inputs (host + vision jit)  -> MultimodalInputs, length L
  -> host: left-pad to a length bucket P (`prompt_buckets`: 32, 64, ... up to the context length),
     positions of the padding = 0
  -> jit _embed: token embeddings with visual features spliced in, deepstack additions
  -> jit prefill(P): the decoder (`TextModel`, the model's one forward) over P tokens, writing a
     fresh cache [layers, B, S, G, D] from slot 0; first token selected
  -> jit _decode_chunk (cache donated): a `lax.while_loop` of up to `decode_chunk` steps on the
     device, each one token per row at cache slot P + t through the same `TextModel` forward, mRoPE
     position `last prompt position + 1 + t` on all three axes, next token selected, EOS handled
     (finished rows emit the pad id; the loop stops when every row has finished)
  -> host: one synchronization per chunk (streaming callbacks, the stop test)
```

Positions mirror HF v5 `generate` exactly, which is not what a plain forward uses: for text-only
prompts HF's `_prepare_position_ids_for_generation` uses `attention_mask.cumsum(-1) - 1` (padding at
0) on all axes and a zero rope delta; with visual inputs `get_rope_index` under the attention mask.
Each decode step then takes `position_ids[..., -1:] + 1` (`_update_model_kwargs_for_generation`),
i.e. the prompt's last position + 1 + t = (real tokens + rope delta) + t, on all three axes. With
left padding the last prompt column is always a real token, which is why batches must be
left-padded.

Compile discipline: prefill compiles once per (bucket, batch, cache length, with/without
deepstack), a decode chunk once per (batch, cache length, chunk size). `COMPILE_COUNTS` counts
traces (a trace precedes every compile), so tests can assert that five prompts inside one bucket
trace prefill and decode once each. `warmup` traces every bucket ahead of time.

Axes: B batch, L prompt tokens, P bucketed prompt length, S cache slots, E hidden, H query heads,
G kv heads, D head dim, V vocabulary, N layers, K deepstack levels, C tokens per decode chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import numbers
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.attention.mask import AttentionMask

from . import pruning as pruning_lib
from .shapes import Buckets
from .text import KVCache

__all__ = [
    "generate",
    "next_token_logits",
    "GenerationConfig",
    "COMPILE_COUNTS",
    "bucket_length",
    "prompt_buckets",
    "cache_length",
    "warp_logits",
    "select_tokens",
    "warmup",
    "decode_layout",
    "DECODE_CHUNK",
]

COMPILE_COUNTS: collections.Counter = collections.Counter()
"""Traces per jitted stage ("embed", "prefill", "decode"); incremented at trace time only."""

MIN_BUCKET = 32
CACHE_ROUND = 32  # decode slots are rounded up to this so nearby max_new_tokens share a compile
DECODE_CHUNK = 16  # decode steps per device call (one host synchronization each)
EOS_SLOTS = 8


def prompt_buckets(config, min_bucket: int = MIN_BUCKET) -> Buckets:
    """Prompt length buckets (the encoder budgets' mechanism): `min_bucket`, doubling, up to the
    model's context length `config.max_position_embeddings`."""
    return Buckets.doubling(int(min_bucket), max(int(min_bucket), config.max_position_embeddings))


def bucket_length(length: int, config, min_bucket: int = MIN_BUCKET) -> int:
    """The prompt bucket of a prompt of `length` tokens; ValueError beyond the context length."""
    buckets = prompt_buckets(config, min_bucket)
    if length > buckets.largest:
        raise ValueError(f"a prompt of {length} tokens exceeds the model's context length "
                         f"(max_position_embeddings = {config.max_position_embeddings})")
    return buckets.fit(max(int(length), 1))


def cache_length(bucket: int, max_new_tokens: int) -> int:
    """KV cache slots for a prompt bucket plus `max_new_tokens` (rounded up to CACHE_ROUND)."""
    return bucket + -(-max(int(max_new_tokens), 1) // CACHE_ROUND) * CACHE_ROUND


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The parts of HF's `generation_config.json` that generation reads."""

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read `generation_config.json` from a checkpoint directory (empty config if absent)."""
        file = os.path.join(os.fspath(path), "generation_config.json")
        if not os.path.exists(file):
            return cls()
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
        pad = raw.get("pad_token_id")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
            raise ValueError(f"{file}: pad_token_id must be an integer or null, got {pad!r}")
        return cls(eos_token_ids=_as_ids(raw.get("eos_token_id"), f"{file}: eos_token_id"), pad_token_id=pad)


def _as_ids(value, what: str = "eos_token_id") -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if not isinstance(value, (list, tuple)) else list(value)
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
        raise ValueError(f"{what} must be an integer or a list of integers, got {value!r}")
    return tuple(int(v) for v in values)


# ---------------------------------------------------------------------- sampling


def warp_logits(logits: jnp.ndarray, temperature, top_k, top_p) -> jnp.ndarray:
    """HF's warpers in HF's order: temperature, then top-k, then top-p; removed tokens get -inf.

    Args:
      logits: `[B, V]` (any float dtype; computed in float32).
      temperature: scalar > 0. top_k: scalar int, 0 = off. top_p: scalar in (0, 1], 1 = off.
    Returns:
      `[B, V]` float32 logits whose softmax is the sampling distribution. Ties at the top-k
      threshold are all kept (as `TopKLogitsWarper`); top-p keeps the smallest prefix of the
      sorted distribution whose mass reaches top_p, at least one token (`TopPLogitsWarper`).
    """
    x = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    vocab = x.shape[-1]
    ordered = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    k = jnp.asarray(top_k, jnp.int32)
    kth = jax.lax.dynamic_index_in_dim(ordered, jnp.clip(k - 1, 0, vocab - 1), axis=-1, keepdims=True)
    x = jnp.where((k > 0) & (x < kth), -jnp.inf, x)
    # top-p on the (top-k filtered) distribution: keep a token if the mass ranked strictly above it
    # is < top_p. Recompute the order after top-k so removed tokens carry zero mass.
    ordered = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = above < jnp.asarray(top_p, jnp.float32)
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # the smallest kept logit is the threshold (ties at the threshold are kept)
    threshold = jnp.min(jnp.where(keep_sorted, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < threshold, -jnp.inf, x)


def select_tokens(logits: jnp.ndarray, key, temperature, top_k, top_p, *, do_sample: bool) -> jnp.ndarray:
    """`[B, V]` logits -> `[B]` int32 tokens: argmax, or a draw from `warp_logits` with `key`."""
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    warped = warp_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, warped, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------- the decoder with a cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, state, inputs):
    COMPILE_COUNTS["embed"] += 1
    model = nnx.merge(graphdef, state)
    return model.embed(inputs)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "do_sample"))
def prefill(graphdef, state, embeds, deepstack, positions, attention_mask, key, temperature, top_k, top_p,
            pruning=None, *, slots, do_sample):
    """Prompt pass over the (left-padded) bucket: (first tokens [B], logits [B, V], a fresh KVCache).

    With an in-LLM pruning plan (`pruning.LLMPruning`, right-aligned), the layers of each stage write
    only its kept tokens, from slot 0 (`decode_layout` says where each layer's rows are)."""
    COMPILE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    lm = model.language_model
    b, length, _ = embeds.shape
    cache = KVCache.empty(lm.config, b, slots, embeds.dtype)
    starts = length - jnp.sum(attention_mask, axis=1, dtype=jnp.int32)  # left padding: real tokens end the row
    mask = AttentionMask.causal(starts, jnp.full((b,), length, jnp.int32), length)
    out = lm(embeds, positions, mask, deepstack, cache=cache, cache_index=0,
             implementation=model.attention_implementation, pruning=pruning)
    logits = model.logits(out.hidden[:, -1])
    tokens = select_tokens(logits, jax.random.fold_in(key, 0), temperature, top_k, top_p, do_sample=do_sample)
    return tokens, logits, out.cache


@dataclasses.dataclass(frozen=True)
class _DecodeState:
    """What a decode chunk carries: the cache, the last emitted tokens `[B]`, the tokens emitted so far
    `t`, and which rows are still unfinished `[B]`."""

    cache: KVCache
    tokens: jax.Array
    step: jax.Array
    unfinished: jax.Array


jax.tree_util.register_dataclass(_DecodeState, data_fields=["cache", "tokens", "step", "unfinished"],
                                 meta_fields=[])


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "do_sample"), donate_argnames=("decode",))
def _decode_chunk(graphdef, state, decode: _DecodeState, prompt_starts, bucket, first_position, limit, eos_ids,
                  pad_id, key, temperature, top_k, top_p, *, chunk, do_sample):
    """Up to `chunk` decode steps on the device, stopping early at `limit` tokens or when every row
    has finished. Step t feeds the token emitted at t - 1 into cache slot `bucket + t - 1` at position
    `first_position + t - 1` (`[3, B]`). After an in-LLM pruned prefill `prompt_starts` is `[N, B]`
    and `bucket` `[N]`, one per layer (`decode_layout`). Returns (state, tokens `[B, chunk]`, tokens made)."""
    COMPILE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    lm = model.language_model
    batch = decode.tokens.shape[0]

    def step(carry):
        decode, out, made = carry
        index = bucket + decode.step - 1
        x = lm.embed_tokens(decode.tokens[:, None])
        positions = (first_position + decode.step - 1)[:, :, None]  # [3, B, 1]
        if prompt_starts.ndim == 2:  # one cache layout per layer: [N, B, 1] fields, index [N]
            mask = AttentionMask(prompt_starts[:, :, None],
                                 jnp.broadcast_to((index + 1)[:, None, None], prompt_starts.shape + (1,)))
        else:
            mask = AttentionMask.causal(prompt_starts, jnp.full((batch,), index + 1, jnp.int32), 1, offset=index)
        result = lm(x, positions, mask, None, cache=decode.cache, cache_index=index,
                    implementation=model.attention_implementation)
        logits = model.logits(result.hidden[:, 0])
        new = select_tokens(logits, jax.random.fold_in(key, decode.step), temperature, top_k, top_p,
                            do_sample=do_sample)
        new = jnp.where(decode.unfinished, new, pad_id)  # HF: finished rows emit the pad id
        unfinished = decode.unfinished & ~jnp.isin(new, eos_ids)
        out = jax.lax.dynamic_update_index_in_dim(out, new, made, 1)
        return _DecodeState(result.cache, new, decode.step + 1, unfinished), out, made + 1

    def going(carry):
        decode, _, made = carry
        return (made < chunk) & (decode.step < limit) & jnp.any(decode.unfinished)

    out = jnp.zeros((batch, chunk), jnp.int32)
    return jax.lax.while_loop(going, step, (decode, out, jnp.int32(0)))


# ---------------------------------------------------------------------- host driver


def _pad_left(inputs, bucket: int, pad_id: int):
    """Left-pad a MultimodalInputs to `bucket` tokens (padding: pad id, masked, position 0, no visual)."""
    extra = bucket - inputs.input_ids.shape[1]
    if extra == 0:
        return inputs

    def pad(x, value, axis=-1):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (extra, 0)
        return jnp.pad(x, widths, constant_values=value)

    return dataclasses.replace(
        inputs,
        input_ids=pad(inputs.input_ids, pad_id),
        attention_mask=pad(inputs.attention_mask, False),
        positions=pad(inputs.positions, 0),
        visual_index=pad(inputs.visual_index, -1),
    )


def decode_layout(plan, real, num_layers: int, bucket: int):
    """Where each layer's prompt rows sit in the cache after an in-LLM pruned prefill (host numpy).

    Args:
      plan: the batch's `pruning.LLMPruning` (right-aligned). real: `[B]` real prompt tokens per row.
    Returns:
      `(starts [N, B], lengths [N])`: layer n's rows of row b occupy slots `[starts, lengths)`; layers
      before the first stage hold the whole bucket, a stage's layers its `lengths[s]` slots.
    """
    visual = np.asarray(plan.visual).sum(axis=1)
    keep = np.asarray(plan.keep)
    lengths = np.full(num_layers, bucket, np.int64)
    starts = np.broadcast_to(bucket - np.asarray(real), (num_layers, len(real))).copy()
    for s, layer in enumerate(plan.layers):
        lengths[layer:] = plan.lengths[s]
        starts[layer:] = plan.lengths[s] - (np.asarray(real) - visual + keep[s])
    return starts.astype(np.int32), lengths.astype(np.int32)


def _generation_positions(inputs):
    """HF generate's prefill positions: cumsum-1 of the mask for text-only prompts (see module doc)."""
    if inputs.features is not None:
        return inputs
    mask = np.asarray(inputs.attention_mask)
    text = np.where(mask, np.cumsum(mask, axis=-1) - 1, 0)
    positions = jnp.asarray(np.broadcast_to(text, (3, *mask.shape)), jnp.int32)
    return dataclasses.replace(inputs, positions=positions, rope_deltas=jnp.zeros_like(inputs.rope_deltas))


def _resolve_ids(model, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
    config = getattr(model, "generation_config", None)
    if isinstance(config, dict):
        config = GenerationConfig(_as_ids(config.get("eos_token_id")), config.get("pad_token_id"))
    eos = _as_ids(eos_token_id) if eos_token_id is not None else (config.eos_token_ids if config else ())
    if pad_token_id is None and config is not None:
        pad_token_id = config.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0  # HF falls back to the first EOS id
    return eos, int(pad_token_id)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _left_padded_prompt(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, mask)` as numpy for a non-empty, left-padded `[B, L]` prompt batch, or a ValueError."""
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    if not mask[:, -1].all():
        raise ValueError("batches must be left-padded: the last prompt column has padding "
                         "(use the processor's padding_side='left')")
    return ids, mask


def _check_arguments(max_new_tokens, do_sample, temperature, top_k, top_p, rng, decode_chunk) -> None:
    """Refuse bad generation arguments before any work is done (each error names the argument)."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not _is_int(decode_chunk) or decode_chunk < 1:
        raise ValueError(f"decode_chunk must be an integer >= 1, got {decode_chunk!r}")
    if not isinstance(do_sample, (bool, np.bool_)):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {top_p!r}")
    if do_sample and rng is None:
        raise ValueError("do_sample=True needs an explicit PRNG key: pass rng=jax.random.key(seed)")


def generate(
    model,
    input_ids,
    attention_mask=None,
    mm_token_type_ids=None,
    pixel_values=None,
    image_grid_thw=None,
    pixel_values_videos=None,
    video_grid_thw=None,
    *,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng=None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    callback: Callable[[int, np.ndarray], None] | None = None,
    min_bucket: int = MIN_BUCKET,
    decode_chunk: int = DECODE_CHUNK,
    timings: dict | None = None,
    video_pruning: tuple[str, float] | None = None,
    llm_pruning=None,
    image_pruning: tuple[str, float] | None = None,
    vision_encoder=None,
    video_timestamps=None,
    video_metadata=None,
) -> np.ndarray:
    """Generate up to `max_new_tokens` per row, as HF's `generate` returns them.

    Args:
      model: a `Qwen3VL`.
      input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw, pixel_values_videos,
        video_grid_thw: as `Qwen3VL.__call__` (processor outputs). Batches must be left-padded.
      max_new_tokens: generated tokens per row at most; prompt + max_new_tokens must fit the
        context length (`max_position_embeddings`).
      do_sample: False = greedy. Otherwise sample from `warp_logits(logits, temperature, top_k, top_p)`
        with `rng` (a `jax.random` key, required); the draw for token t uses `fold_in(rng, t)`, so a
        fixed key gives a fixed output.
      temperature: finite, > 0. top_k: integer >= 0 (0 = off). top_p: in (0, 1] (1 = off).
      eos_token_id: int or ids that finish a row; default: `model.generation_config` if set
        (a `GenerationConfig` or its dict), else none. `GenerationConfig.from_pretrained(dir)` reads a
        checkpoint's `generation_config.json`.
      pad_token_id: emitted after a row has finished (HF's rule); default: the generation config's,
        else the first EOS id.
      callback: called as `callback(t, tokens [B])` for each generated position t (streaming; the
        tokens of a decode chunk arrive together); finished rows carry the pad id.
      min_bucket: the smallest prompt bucket. decode_chunk: decode steps per device call.
      video_pruning, image_pruning, vision_encoder: as `Qwen3VL.prepare_inputs` (pruned video and image
        prompts; a bucketed encoder).
      llm_pruning: an in-LLM method, `("fastv", {"layer": 2, "rate": 0.5})` (docs/pruning.md §11):
        the prefill drops vision tokens at its layers and the later layers' cache holds only the kept
        ones; planned on the bucket, so prefill compiles once per (bucket, stage lengths).
      video_timestamps, video_metadata: processor outputs that generation does not need (accepted).
      timings: if a dict, filled with wall seconds per stage (each stage synchronized):
        "prepare" (host bookkeeping + vision encoder), "prefill", "decode", and "new_tokens".
    Returns:
      `[B, L + n]` int64 numpy: the prompt then n <= max_new_tokens generated tokens; n is shorter
      than max_new_tokens only when every row has hit an EOS id.
    """
    _check_arguments(max_new_tokens, do_sample, temperature, top_k, top_p, rng, decode_chunk)
    in_llm = pruning_lib.validate_llm_pruning(llm_pruning)
    ids, mask = _left_padded_prompt(input_ids, attention_mask)
    context = model.config.text.max_position_embeddings
    if ids.shape[1] + max_new_tokens > context:
        raise ValueError(f"a prompt of {ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                         f"model's context length (max_position_embeddings = {context})")
    eos, pad_id = _resolve_ids(model, eos_token_id, pad_token_id)
    rng = jax.random.key(0) if rng is None else rng
    sampling = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))

    clock = _StageClock(timings)
    inputs = model.prepare_inputs(ids, mask, mm_token_type_ids, pixel_values, image_grid_thw,
                                  pixel_values_videos, video_grid_thw, video_pruning=video_pruning,
                                  vision_encoder=vision_encoder, image_pruning=image_pruning)
    clock.lap("prepare", inputs)
    inputs = _generation_positions(inputs)
    first_position = jnp.asarray(inputs.positions[:, :, -1] + 1, jnp.int32)  # [3, B]: HF's position_ids[..., -1:] + 1
    bucket = bucket_length(ids.shape[1], model.config.text, min_bucket)
    inputs = _pad_left(inputs, bucket, pad_id)
    slots = cache_length(bucket, max_new_tokens)
    graphdef, state = nnx.split(model)
    plan, prompt_starts, cache_ends = None, jnp.asarray(bucket - mask.sum(axis=1), jnp.int32), jnp.int32(bucket)
    if in_llm is not None:
        plan = pruning_lib.plan_llm_pruning(inputs.attention_mask, np.asarray(inputs.visual_index) >= 0, *in_llm,
                                            model.config.text.num_hidden_layers, bucket=bucket)
        starts, ends = decode_layout(plan, mask.sum(axis=1), model.config.text.num_hidden_layers, bucket)
        prompt_starts, cache_ends = jnp.asarray(starts), jnp.asarray(ends)

    embeds, deepstack = _embed(graphdef, state, inputs)
    tokens, _, cache = prefill(graphdef, state, embeds, deepstack, inputs.positions, inputs.attention_mask,
                                rng, *sampling, plan, slots=slots, do_sample=do_sample)
    clock.lap("prefill", tokens)

    # A fixed number of EOS slots (-1 is no token id), so the EOS count does not change the compile.
    eos_ids = np.full(max(EOS_SLOTS, len(eos)), -1, np.int32)
    eos_ids[:len(eos)] = eos
    first = np.asarray(tokens).astype(np.int64)
    generated = [first]
    if callback is not None:
        callback(0, first)
    decode = _DecodeState(cache, jnp.asarray(first, jnp.int32), jnp.int32(1),
                          jnp.asarray(~np.isin(first, np.asarray(eos, np.int64))))
    while len(generated) < max_new_tokens and bool(np.asarray(decode.unfinished).any()):
        decode, chunk, made = _decode_chunk(
            graphdef, state, decode, prompt_starts, cache_ends, first_position, jnp.int32(max_new_tokens),
            eos_ids, jnp.int32(pad_id), rng, *sampling, chunk=decode_chunk, do_sample=do_sample)
        chunk = np.asarray(chunk)[:, :int(made)].astype(np.int64)  # the chunk's one synchronization
        for column in chunk.T:
            if callback is not None:
                callback(len(generated), column)
            generated.append(column)
    clock.lap("decode", None)  # the loop already synchronized on every chunk's tokens
    if timings is not None:
        timings["new_tokens"] = len(generated)
    return np.concatenate([ids.astype(np.int64), np.stack(generated, axis=1)], axis=1)


def next_token_logits(
    model,
    input_ids,
    attention_mask=None,
    mm_token_type_ids=None,
    pixel_values=None,
    image_grid_thw=None,
    pixel_values_videos=None,
    video_grid_thw=None,
    *,
    min_bucket: int = MIN_BUCKET,
    video_pruning: tuple[str, float] | None = None,
    image_pruning: tuple[str, float] | None = None,
    vision_encoder=None,
    video_timestamps=None,
    video_metadata=None,
) -> np.ndarray:
    """`[B, V]` float32 numpy: the logits of the token after each (left-padded) prompt, from the very
    prefill greedy `generate` runs (its prompt bucket, its positions), so scoring many prompts of
    different lengths compiles once per length bucket and shares the compile with `generate`; greedy
    `generate`'s first token is their argmax. Arguments as `generate`."""
    ids, mask = _left_padded_prompt(input_ids, attention_mask)
    _, pad_id = _resolve_ids(model, None, None)
    inputs = model.prepare_inputs(ids, mask, mm_token_type_ids, pixel_values, image_grid_thw,
                                  pixel_values_videos, video_grid_thw, video_pruning=video_pruning,
                                  vision_encoder=vision_encoder, image_pruning=image_pruning)
    inputs = _generation_positions(inputs)
    bucket = bucket_length(ids.shape[1], model.config.text, min_bucket)
    inputs = _pad_left(inputs, bucket, pad_id)
    graphdef, state = nnx.split(model)
    embeds, deepstack = _embed(graphdef, state, inputs)
    sampling = (jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
    # The cache size greedy generate uses for up to CACHE_ROUND new tokens: the same compile.
    _, logits, _ = prefill(graphdef, state, embeds, deepstack, inputs.positions, inputs.attention_mask,
                           jax.random.key(0), *sampling, slots=cache_length(bucket, 1), do_sample=False)
    return np.asarray(logits, np.float32)


class _StageClock:
    """Wall time between synchronization points, recorded into an optional dict."""

    def __init__(self, into: dict | None):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, name: str, result) -> None:
        if self.into is None:
            return
        if result is not None:
            jax.block_until_ready(result)
        now = time.perf_counter()
        self.into[name] = now - self.last
        self.last = now


def warmup(model, *, batch_size: int = 1, buckets: Sequence[int] = (32, 64, 128, 256, 512, 1024),
           max_new_tokens: int = 32, do_sample: bool = False, visual: bool = False,
           decode_chunk: int = DECODE_CHUNK) -> None:
    """Trace and compile prefill (text-only, or with deepstack when `visual`) and a decode chunk per bucket."""
    graphdef, state = nnx.split(model)
    cfg = model.config.text
    dtype = model.language_model.embed_tokens.embedding[...].dtype
    sampling = (jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
    key = jax.random.key(0)
    levels = len(model.config.vision.deepstack_visual_indexes) if visual else 0
    for bucket in buckets:
        slots = cache_length(bucket, max_new_tokens)
        embeds = jnp.zeros((batch_size, bucket, cfg.hidden_size), dtype)
        deepstack = jnp.zeros((levels, batch_size, bucket, cfg.hidden_size), dtype) if visual else None
        positions = jnp.zeros((3, batch_size, bucket), jnp.int32)
        mask = jnp.ones((batch_size, bucket), bool)
        tokens, _, cache = prefill(graphdef, state, embeds, deepstack, positions, mask, key, *sampling, None,
                                    slots=slots, do_sample=do_sample)  # as generate calls it
        decode = _DecodeState(cache, tokens, jnp.int32(1), jnp.ones((batch_size,), bool))
        _decode_chunk(graphdef, state, decode, jnp.zeros((batch_size,), jnp.int32), jnp.int32(bucket),
                      positions[:, :, 0], jnp.int32(2), jnp.full((EOS_SLOTS,), -1, jnp.int32), jnp.int32(0), key, *sampling,
                      chunk=decode_chunk, do_sample=do_sample)
