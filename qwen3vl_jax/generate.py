"""Autoregressive generation: bucketed prefill, a donated KV cache, greedy and sampled decoding.

Data path (DESIGN.md section 1, the last two stages):

```
Qwen3VL.prepare_inputs (host + vision jit)  -> MultimodalInputs, length L
  -> host: left-pad to a length bucket P (`prompt_buckets`: 32, 64, ... up to the context length),
     positions of the padding = 0
  -> jit _embed: token embeddings with visual features spliced in, deepstack additions
  -> jit _prefill(P): all decoder layers over P tokens, deepstack after layers 0..K-1, K/V written
     into a preallocated cache [layers, B, S, G, D], first token selected
  -> jit _decode_step (cache donated): one token per row at cache slot P + t, mRoPE position
     `last prompt position + 1 + t` on all three axes, next token selected
  -> host: EOS bookkeeping as HF's `GenerationMixin._sample` (finished rows emit the pad id)
```

Positions mirror HF v5 `generate` exactly, which is not what a plain forward uses: for text-only
prompts HF's `_prepare_position_ids_for_generation` uses `attention_mask.cumsum(-1) - 1` (padding at
0) on all axes and a zero rope delta; with visual inputs `get_rope_index` under the attention mask.
Each decode step then takes `position_ids[..., -1:] + 1` (`_update_model_kwargs_for_generation`),
i.e. the prompt's last position + 1 + t = (real tokens + rope delta) + t, on all three axes. With
left padding the last prompt column is always a real token, which is why batches must be
left-padded. (Rotary is relative, so a constant per-row shift of all positions only changes
rounding; what greedy parity really needs is that decode continues each row's own positions,
which the HF tests catch: an off-by-three start fails them.)

Compile discipline: prefill compiles once per (bucket, batch, cache length, with/without
deepstack), decode once per (batch, cache length). `COMPILE_COUNTS` counts traces (a trace precedes
every compile), so tests can assert that five prompts inside one bucket trace prefill and decode
once each. `warmup` traces every bucket ahead of time.

Axes: B batch, L prompt tokens, P bucketed prompt length, S cache slots, E hidden, H query heads,
G kv heads, D head dim, V vocabulary, N layers, K deepstack levels.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .buckets import Buckets
from .text import mrope_cos_sin

__all__ = [
    "generate",
    "GenerationConfig",
    "COMPILE_COUNTS",
    "bucket_length",
    "prompt_buckets",
    "cache_length",
    "warp_logits",
    "select_tokens",
    "warmup",
]

COMPILE_COUNTS: collections.Counter = collections.Counter()
"""Traces per jitted stage ("embed", "prefill", "decode"); incremented at trace time only."""

MIN_BUCKET = 32
CACHE_ROUND = 32  # decode slots are rounded up to this so nearby max_new_tokens share a compile


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
        with open(file) as f:
            raw = json.load(f)
        return cls(eos_token_ids=_as_ids(raw.get("eos_token_id")), pad_token_id=raw.get("pad_token_id"))


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(v) for v in value)


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


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "slots", "do_sample"))
def _prefill(graphdef, state, embeds, deepstack, positions, attention_mask, key, temperature, top_k, top_p, *,
             implementation, slots, do_sample):
    """Prompt pass over the bucket: (first tokens [B], logits [B, V], cache (k, v) [N, B, S, G, D])."""
    COMPILE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    lm = model.language_model
    b, length, _ = embeds.shape
    cos, sin = mrope_cos_sin(positions, lm.config)
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = causal[None] & attention_mask[:, None, :]
    x = embeds
    keys, values = [], []
    for index, layer in enumerate(lm.layers):
        q, k, v = layer.qkv(x, cos, sin)
        x = layer.finish(x, q, k, v, mask, implementation)
        keys.append(k)
        values.append(v)
        if deepstack is not None and index < deepstack.shape[0]:
            x = x + deepstack[index].astype(x.dtype)
    logits = model.logits(lm.norm(x[:, -1]))
    pad = ((0, 0), (0, 0), (0, slots - length), (0, 0), (0, 0))
    cache = (jnp.pad(jnp.stack(keys), pad), jnp.pad(jnp.stack(values), pad))
    tokens = select_tokens(logits, jax.random.fold_in(key, 0), temperature, top_k, top_p, do_sample=do_sample)
    return tokens, logits, cache


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "do_sample"),
                   donate_argnames=("cache",))
def _decode_step(graphdef, state, cache, tokens, positions, index, key_mask, key, step, temperature, top_k,
                 top_p, *, implementation, do_sample):
    """One token per row. tokens `[B]`, positions `[3, B]`, index: the cache slot written,
    key_mask `[B, S]` (prompt mask, True beyond the prompt). Returns (next tokens, logits, cache)."""
    COMPILE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    lm = model.language_model
    cache_k, cache_v = cache
    slots = cache_k.shape[2]
    x = lm.embed_tokens(tokens[:, None])
    cos, sin = mrope_cos_sin(positions[:, :, None], lm.config)
    mask = (key_mask & (jnp.arange(slots) <= index)[None])[:, None, :]  # [B, 1, S]
    for i, layer in enumerate(lm.layers):
        q, k, v = layer.qkv(x, cos, sin)
        # write the new slot into the stacked (donated) cache in place, then read this layer's keys
        cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), (i, 0, index, 0, 0))
        cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), (i, 0, index, 0, 0))
        x = layer.finish(x, q, cache_k[i], cache_v[i], mask, implementation)
    logits = model.logits(lm.norm(x[:, 0]))
    next_tokens = select_tokens(logits, jax.random.fold_in(key, step), temperature, top_k, top_p,
                                do_sample=do_sample)
    return next_tokens, logits, (cache_k, cache_v)


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
    timings: dict | None = None,
    video_pruning: tuple[str, float] | None = None,
    vision_encoder=None,
) -> np.ndarray:
    """Generate up to `max_new_tokens` per row, as HF's `generate` returns them.

    Args:
      model: a `Qwen3VL`.
      input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw, pixel_values_videos,
        video_grid_thw: as `Qwen3VL.__call__` (processor outputs). Batches must be left-padded.
      max_new_tokens: generated tokens per row at most.
      do_sample: False = greedy. Otherwise sample from `warp_logits(logits, temperature, top_k, top_p)`
        with `rng` (a `jax.random` key, required); the draw for token t uses `fold_in(rng, t)`, so a
        fixed key gives a fixed output.
      eos_token_id: int or ids that finish a row; default: `model.generation_config` if set
        (a `GenerationConfig` or its dict), else none. `GenerationConfig.from_pretrained(dir)` reads a
        checkpoint's `generation_config.json`.
      pad_token_id: emitted after a row has finished (HF's rule); default: the generation config's,
        else the first EOS id.
      callback: called as `callback(t, tokens [B])` for each generated position t (streaming);
        finished rows carry the pad id.
      min_bucket: the smallest prompt bucket.
      video_pruning, vision_encoder: as `Qwen3VL.prepare_inputs` (pruned video prompts; a bucketed encoder).
      timings: if a dict, filled with wall seconds per stage (each stage synchronized):
        "prepare" (host bookkeeping + vision encoder), "prefill", "decode", and "new_tokens".
    Returns:
      `[B, L + n]` int64 numpy: the prompt then n <= max_new_tokens generated tokens; n is shorter
      than max_new_tokens only when every row has hit an EOS id.
    """
    if do_sample and rng is None:
        raise ValueError("do_sample=True needs an explicit PRNG key: pass rng=jax.random.key(seed)")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length>0], got shape {ids.shape}")
    if not mask[:, -1].all():
        raise ValueError("batches must be left-padded: the last prompt column has padding "
                         "(use the processor's padding_side='left')")
    eos, pad_id = _resolve_ids(model, eos_token_id, pad_token_id)
    rng = jax.random.key(0) if rng is None else rng
    sampling = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))

    clock = _StageClock(timings)
    inputs = model.prepare_inputs(ids, mask, mm_token_type_ids, pixel_values, image_grid_thw,
                                  pixel_values_videos, video_grid_thw, video_pruning=video_pruning,
                                  vision_encoder=vision_encoder)
    clock.lap("prepare", inputs)
    inputs = _generation_positions(inputs)
    start = np.asarray(inputs.positions[:, :, -1], np.int32) + 1  # [3, B]: HF's position_ids[..., -1:] + 1
    bucket = bucket_length(ids.shape[1], model.config.text, min_bucket)
    inputs = _pad_left(inputs, bucket, pad_id)
    slots = cache_length(bucket, max_new_tokens)
    graphdef, state = nnx.split(model)
    impl = model.attention_implementation

    embeds, deepstack = _embed(graphdef, state, inputs)
    tokens, _, cache = _prefill(graphdef, state, embeds, deepstack, inputs.positions, inputs.attention_mask,
                                rng, *sampling, implementation=impl, slots=slots, do_sample=do_sample)
    key_mask = jnp.pad(inputs.attention_mask, ((0, 0), (0, slots - bucket)), constant_values=True)
    clock.lap("prefill", tokens)

    batch = ids.shape[0]
    eos_arr = np.asarray(eos, np.int64)
    unfinished = np.ones(batch, bool)
    generated = []
    fed = None  # the tokens the next decode step consumes (the previous step's output)
    for t in range(max_new_tokens):
        if t > 0:
            tokens, _, cache = _decode_step(
                graphdef, state, cache, jnp.asarray(fed, jnp.int32), jnp.asarray(start + (t - 1)),
                jnp.int32(bucket + t - 1), key_mask, rng, jnp.int32(t), *sampling,
                implementation=impl, do_sample=do_sample)
        new = np.asarray(tokens).astype(np.int64)
        new = np.where(unfinished, new, pad_id)  # HF: finished rows emit the pad id
        generated.append(new)
        if callback is not None:
            callback(t, new)
        unfinished &= ~np.isin(new, eos_arr)
        if not unfinished.any():
            break
        fed = new
    clock.lap("decode", None)  # the loop already synchronized on every step's tokens
    if timings is not None:
        timings["new_tokens"] = len(generated)
    return np.concatenate([ids.astype(np.int64), np.stack(generated, axis=1)], axis=1)


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
           max_new_tokens: int = 32, do_sample: bool = False, visual: bool = False) -> None:
    """Trace and compile prefill (text-only, or with deepstack when `visual`) and decode for each bucket."""
    graphdef, state = nnx.split(model)
    cfg = model.config.text
    impl = model.attention_implementation
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
        tokens, _, cache = _prefill(graphdef, state, embeds, deepstack, positions, mask, key, *sampling,
                                    implementation=impl, slots=slots, do_sample=do_sample)
        key_mask = jnp.ones((batch_size, slots), bool)
        _decode_step(graphdef, state, cache, tokens, positions[:, :, 0], jnp.int32(bucket), key_mask, key,
                     jnp.int32(1), *sampling, implementation=impl, do_sample=do_sample)
