"""The Qwen3 decoder of Qwen3-VL in Flax NNX, with interleaved multimodal rotary (mRoPE).

Each layer: RMSNorm -> GQA attention (q/k RMSNorm over head_dim before rotary) -> residual ->
RMSNorm -> SwiGLU MLP (or, in the MoE models' sparse layers, the routed experts of `moe.MoEBlock`)
-> residual. Rotary angles come from three position streams (t, h, w); of
the head_dim/2 frequency channels, h takes channels 1, 4, 7, ... and w takes 2, 5, 8, ...
(`mrope_section[1]` and `[2]` of them), t takes the rest (HF's interleaved layout).

One forward serves three uses: the plain forward (no cache; each layer attends over this call's
keys), prefill (a fresh cache of S slots written from slot 0) and decoding (the cache read and
written at an index). Attention is described by an `AttentionMask` (per query row, one run of
keys), never by a dense mask. The layers are a list or a scanned stack (`layers.make_stack`).

Axes: B batch, L query tokens, S key tokens (this call's, or the cache's slots), E hidden, H query
heads, G kv heads, D head dim, V vocabulary, N layers, K deepstack levels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention.mask import AttentionMask

from .config import TextConfig
from .layers import RMSNorm, apply_rotary, check_layers, make_stack, run_stack, segment_edges
from .moe import MoEBlock
from .quant import QuantSpec, make_linear
from .pruning.llm import LLMPruning, compaction, gather_rows
from .pruning.registry import get_method
from .sharding import constrain

__all__ = ["TextModel", "TextOutput", "KVCache", "DecoderLayer", "mrope_channel_axes", "mrope_cos_sin"]


def mrope_channel_axes(config: TextConfig) -> np.ndarray:
    """`[D/2]` int32: which position stream (0 = t, 1 = h, 2 = w) drives each frequency channel.

    Mirrors `Qwen3VLTextRotaryEmbedding.recomposition_frequencies` slice for slice.
    """
    half = config.head_dim // 2
    axes = np.zeros(half, np.int32)
    for axis, offset in ((1, 1), (2, 2)):
        axes[slice(offset, config.mrope_section[axis] * 3, 3)] = axis
    return axes


def text_rotary_inv_freq(config: TextConfig) -> np.ndarray:
    exponent = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    return (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(np.float32)


def mrope_cos_sin(positions: jnp.ndarray, config: TextConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions `[3, B, L]` -> cos, sin `[B, L, D]` float32."""
    inv_freq = jnp.asarray(text_rotary_inv_freq(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [3, B, L, D/2]
    axes = jnp.asarray(mrope_channel_axes(config))
    picked = jnp.take_along_axis(freqs, axes[None, None, None, :], axis=0)[0]  # [B, L, D/2]
    full = jnp.concatenate([picked, picked], axis=-1)
    return jnp.cos(full), jnp.sin(full)


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, `[N, B, S, G, D]` each (a pytree; donate it to decode in place)."""

    keys: jax.Array
    values: jax.Array

    @classmethod
    def empty(cls, config: TextConfig, batch: int, slots: int, dtype) -> "KVCache":
        shape = (config.num_hidden_layers, batch, slots, config.num_key_value_heads, config.head_dim)
        # Under a mesh: batch over data x fsdp, kv heads over tensor (`sharding.constrain`).
        return cls(*(constrain(jnp.zeros(shape, dtype), None, "batch", None, "tensor", None) for _ in range(2)))

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


jax.tree_util.register_dataclass(KVCache, data_fields=["keys", "values"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """hidden: final-norm `[B, L, E]`; cache: the updated `KVCache` (or None); hidden_states:
    `[N, B, L, E]` each layer's output before its deepstack addition (HF's record), when asked;
    attentions: `{layer: [B, H, L, S]}` the attention probabilities of the layers asked for;
    kept: with in-LLM pruning, per stage `[B, L_s]` the input position of each row of the stage's
    layout (-1: padding); the last is the layout of `hidden`; router_logits: `[sparse layers, B*L,
    experts]` the MoE routers' logits (HF's `output_router_logits`), when asked."""

    hidden: jax.Array
    cache: KVCache | None = None
    hidden_states: jax.Array | None = None
    router_logits: jax.Array | None = None
    attentions: dict | None = None
    kept: tuple | None = None


jax.tree_util.register_dataclass(TextOutput, data_fields=["hidden", "cache", "hidden_states", "router_logits",
                                                          "attentions", "kept"],
                                 meta_fields=[])


_LAYER = "language_model.layers.*."  # the kind of a decoder layer's module (`quant.module_kind`)


class TextAttention(nnx.Module):
    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        self.config = config
        e, h, g, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        kw = dict(use_bias=config.attention_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.q_proj = make_linear(e, h * d, path=_LAYER + "self_attn.q_proj", **kw)
        self.k_proj = make_linear(e, g * d, path=_LAYER + "self_attn.k_proj", **kw)
        self.v_proj = make_linear(e, g * d, path=_LAYER + "self_attn.v_proj", **kw)
        self.o_proj = make_linear(h * d, e, path=_LAYER + "self_attn.o_proj", **kw)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, mask: AttentionMask, cache=None, index=0, *, implementation: str,
                 return_weights: bool = False, weight_rows=None):
        """Attention output `[B, L, E]`, the layer's updated `(keys, values)` cache (or None), and the
        softmax probabilities `[B, H, L, S]` when `return_weights` (else None); with `weight_rows`
        (`[B]` int) only those query rows' `[B, H, 1, S]`.

        Without a cache, q attends over this call's keys; with one (`[B, S, G, D]` each), this
        call's keys and values are written at slots `[index, index + L)` and q attends over the cache.
        """
        b, length, _ = x.shape
        d = self.config.head_dim
        q = self.q_norm(self.q_proj(x).reshape(b, length, -1, d))  # q/k RMSNorm before rotary
        k = self.k_norm(self.k_proj(x).reshape(b, length, -1, d))
        v = self.v_proj(x).reshape(b, length, -1, d)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, L, 1, D]: shared by the heads
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            keys, values = cache
            start = (0, index, 0, 0)
            keys = lax.dynamic_update_slice(keys, k.astype(keys.dtype), start)
            values = lax.dynamic_update_slice(values, v.astype(values.dtype), start)
            k, v, cache = keys, values, (keys, values)
        out = attention_api.attention(q, k, v, mask, implementation=implementation)
        weights = None
        if return_weights and weight_rows is not None:
            pick = lambda a: jnp.take_along_axis(a, weight_rows.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)  # noqa: E731
            weights = attention_api.attention_weights(pick(q), k, AttentionMask(pick(mask.kv_start),
                                                                              pick(mask.kv_end)))
        elif return_weights:
            weights = attention_api.attention_weights(q, k, mask)
        return self.o_proj(out.reshape(b, length, -1)), cache, weights


class TextMLP(nnx.Module):
    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.gate_proj = make_linear(config.hidden_size, config.intermediate_size, path=_LAYER + "mlp.gate_proj", **kw)
        self.up_proj = make_linear(config.hidden_size, config.intermediate_size, path=_LAYER + "mlp.up_proj", **kw)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, path=_LAYER + "mlp.down_proj",
                                     **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """One decoder layer; `sparse`: routed experts (`moe.MoEBlock`) in place of the dense MLP."""

    def __init__(self, config: TextConfig, *, sparse: bool = False, moe_implementation: str = "auto", dtype,
                 param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = TextAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.sparse = sparse
        self.moe_implementation = moe_implementation
        block = MoEBlock if sparse else TextMLP
        self.mlp = block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)

    def __call__(self, x, cos, sin, mask: AttentionMask, cache=None, index=0, *, implementation: str = "xla",
                 return_weights: bool = False, weight_rows=None):
        """`(x, cache, router logits)`: the layer's output, its updated `(keys, values)` (None without
        a cache) and, in a sparse layer, its router's logits `[B*L, experts]` (else None); with
        `return_weights`, `(x, cache, router logits, weights)`: the attention probabilities `[B, H,
        L, S]`, or `[B, H, 1, S]` of the query rows `weight_rows [B]`."""
        attended, cache, weights = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, index,
                                                  implementation=implementation, return_weights=return_weights,
                                                  weight_rows=weight_rows)
        x = x + attended
        normed = self.post_attention_layernorm(x)
        router_logits = None
        if self.sparse:
            out, router_logits = self.mlp(normed, implementation=self.moe_implementation)
        else:
            out = self.mlp(normed)
        x = x + out
        return (x, cache, router_logits, weights) if return_weights else (x, cache, router_logits)


def _at(x, index):
    """`x[index]` along the leading axis, for a static or a traced index."""
    return x[index] if isinstance(index, int) else lax.dynamic_index_in_dim(x, index, keepdims=False)


def _level(deepstack, index):
    """Deepstack addition after layer `index` (static int or traced), or None when there is none."""
    if deepstack is None or deepstack.shape[0] == 0:
        return None
    levels = deepstack.shape[0]
    if isinstance(index, int):
        return deepstack[index] if index < levels else None
    level = lax.dynamic_index_in_dim(deepstack, jnp.minimum(index, levels - 1), keepdims=False)
    return jnp.where(index < levels, level, jnp.zeros_like(level))


class TextModel(nnx.Module):
    """`Qwen3VLTextModel`: embeddings in, final-norm hidden states out.

    `deepstack` (`[K, B, L, E]`, zero away from visual positions) is added to the hidden states
    after decoder layer k for k < K. `scan_layers` stacks the layers' parameters and runs them under
    `lax.scan` (all layers must then be of one kind: all dense or all sparse); `remat` recomputes
    each layer in the backward pass. `moe_implementation`: the experts' grouped matmul
    (`moe.MOE_IMPLEMENTATIONS`). `quant`: which linears / experts hold quantized weights
    (`quant.QuantSpec`; the same kinds in every layer, so the layers still stack).
    """

    def __init__(self, config: TextConfig, *, dtype=jnp.float32, param_dtype=None, scan_layers: bool = False,
                 remat: bool = False, moe_implementation: str = "auto", rngs: nnx.Rngs,
                 quant: QuantSpec | None = None):
        param_dtype = param_dtype or dtype
        self.config = config
        self.scan_layers = scan_layers
        self.remat = remat
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        kw = dict(moe_implementation=moe_implementation, dtype=dtype, param_dtype=param_dtype, quant=quant)
        if scan_layers:
            if not config.uniform_layers:
                raise ValueError(
                    f"scan_layers=True needs decoder layers of one kind, but layers {list(config.sparse_layers)} "
                    f"of {config.num_hidden_layers} are sparse (mlp_only_layers={list(config.mlp_only_layers)}, "
                    f"decoder_sparse_step={config.decoder_sparse_step}); use scan_layers=False")
            self.layers = make_stack(lambda r: DecoderLayer(config, sparse=config.is_moe, rngs=r, **kw),
                                     config.num_hidden_layers, True, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(config, sparse=config.is_sparse_layer(i), rngs=rngs, **kw)
                                    for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, embeds, positions, mask: AttentionMask, deepstack=None, *, cache: KVCache | None = None,
                 cache_index=0, implementation: str = "xla", return_hidden_states: bool = False,
                 return_attentions: tuple[int, ...] = (), pruning: LLMPruning | None = None,
                 return_router_logits: bool = False) -> TextOutput:
        """The decoder over `embeds [B, L, E]` at mRoPE `positions [3, B, L]`.

        Args:
          mask: the `AttentionMask` of the L query rows (over this call's keys, or the cache's slots);
            or, for a cache whose layers hold different lengths (decoding after in-LLM pruning), one
            per layer (fields `[N, B, L]`) with `cache_index` `[N]`.
          deepstack: `[K, B, L, E]` additions after layers 0..K-1, or None.
          cache: a `KVCache` to write at slots `[cache_index, cache_index + L)` and attend over.
          return_attentions: layer indices (static) whose attention probabilities `[B, H, L, S]` to
            return (`TextOutput.attentions`). Each such layer runs on its own with a static index (a
            scanned stack is scanned around it); the other layers, and a call that asks for none,
            run exactly as without the option.
          pruning: an in-LLM pruning plan (`pruning.llm.LLMPruning`): at each of its layers K, the
            vision tokens are ranked by the attention the last real token pays them at layer K-1 and
            the rest of the stack (and its cache, from slot 0) holds only the kept tokens, at their
            positions; later deepstack additions follow the kept tokens (docs/pruning.md §11).
            `TextOutput.kept` then gives each stage's rows as positions of the input.
          return_router_logits: collect the sparse layers' router logits (for the aux loss).
        """
        config = self.config
        return_router_logits = return_router_logits and config.is_moe
        count = self.config.num_hidden_layers
        attend = check_layers(return_attentions, count)
        boundaries = () if pruning is None else pruning.layers
        if pruning is not None:
            if return_hidden_states or return_router_logits:
                raise ValueError("return_hidden_states and return_router_logits cannot be combined with in-LLM "
                                 "pruning (the layers hold different numbers of tokens); use return_attentions or "
                                 "the stages' kept rows")
            if any(not 1 <= k < count for k in boundaries):
                raise ValueError(f"in-LLM pruning method {pruning.method!r} drops at layers {list(boundaries)}, "
                                 f"but the model has {count} decoder layers (layers 1 .. {count - 1} can be pruned)")
        scored = {k - 1: s for s, k in enumerate(boundaries)}
        ctx = dict(mask=mask, deepstack=deepstack, rows=None)
        ctx["cos"], ctx["sin"] = mrope_cos_sin(positions, self.config)
        if pruning is not None:
            real = mask.kv_end > mask.kv_start
            ctx["rows"] = embeds.shape[1] - 1 - jnp.argmax(real[:, ::-1], axis=1).astype(jnp.int32)  # last real
            ctx.update(real=real, visual=pruning.visual, origin=jnp.where(
                real, jnp.arange(embeds.shape[1], dtype=jnp.int32)[None], -1), positions=positions)

        def step(layer, carry, index):
            x, keys, values = carry
            layer_mask, slot = ctx["mask"], cache_index
            if layer_mask.kv_start.ndim == 3:  # one mask and one cache slot per layer
                layer_mask = AttentionMask(_at(layer_mask.kv_start, index), _at(layer_mask.kv_end, index))
                slot = _at(cache_index, index)
            layer_cache = None
            if keys is not None:
                layer_cache = (_at(keys, index), _at(values, index))
            static = isinstance(index, int)
            want = static and (index in attend or index in scored)
            rows = ctx["rows"] if static and index in scored and index not in attend else None
            x, layer_cache, router_logits, *weights = layer(x, ctx["cos"], ctx["sin"], layer_mask, layer_cache,
                                                            slot, implementation=implementation,
                                                            return_weights=want, weight_rows=rows)
            x = constrain(x, "batch", None, None)  # the block boundary: batch over data x fsdp
            if keys is not None:
                keys = lax.dynamic_update_index_in_dim(keys, layer_cache[0], index, 0)
                values = lax.dynamic_update_index_in_dim(values, layer_cache[1], index, 0)
            if return_router_logits and router_logits is None:  # a dense layer: dropped below
                router_logits = jnp.zeros((x.shape[0] * x.shape[1], config.num_experts), x.dtype)
            out = (x if return_hidden_states else None, router_logits if return_router_logits else None)
            level = _level(ctx["deepstack"], index)
            if level is not None:
                x = x + level.astype(x.dtype)
            return (x, keys, values), (out, weights[0] if weights else None)

        carry = (embeds, None, None) if cache is None else (embeds, cache.keys, cache.values)
        hidden, routers, attentions, kept = [], [], {}, []
        for start, stop in segment_edges(count, tuple(sorted(set(attend) | set(scored)))):
            carry, outs = run_stack(self.layers, step, carry, scan=self.scan_layers, remat=self.remat,
                                    collect=return_hidden_states or return_router_logits or start in attend
                                    or start in scored,
                                    start=start, stop=stop)
            if outs is not None:
                hidden.append(outs[0][0])
                routers.append(outs[0][1])
                if start in attend:
                    attentions[start] = outs[1][0]
            if start in scored:
                weights = outs[1][0]
                if start in attend:  # the full rows: take the last real token's
                    weights = jnp.take_along_axis(weights, ctx["rows"][:, None, None, None], axis=2)
                carry = self._prune(carry, weights[:, :, 0], ctx, pruning, scored[start])
                kept.append(ctx["origin"])
        x, keys, values = carry
        hidden = jnp.concatenate(hidden) if return_hidden_states else None
        router_logits = jnp.concatenate(routers) if return_router_logits else None
        if router_logits is not None and len(config.sparse_layers) < config.num_hidden_layers:
            router_logits = router_logits[np.asarray(config.sparse_layers)]
        return TextOutput(self.norm(x), None if cache is None else KVCache(keys, values), hidden,
                          router_logits=router_logits, attentions=attentions if attend else None,
                          kept=tuple(kept) if pruning is not None else None)

    def _prune(self, carry, weights, ctx: dict, pruning: LLMPruning, stage: int):
        """Keep the stage's tokens: `carry`'s hidden states and `ctx`'s per-token arrays move to the next
        stage's layout (`pruning.llm.compaction`), its mask is rebuilt over that layout from slot 0."""
        x, keys, values = carry
        length = pruning.lengths[stage]
        current = ctx["real"].shape[1]
        scores = get_method(pruning.method).score(weights[..., :current])
        rows = compaction(scores, ctx["visual"], ctx["real"], pruning.keep[stage], length, pruning.right_aligned)
        real = rows >= 0
        positions = gather_rows(ctx["positions"], rows, 2)
        cos, sin = mrope_cos_sin(positions, self.config)
        counts = jnp.sum(real, axis=1, dtype=jnp.int32)
        starts = jnp.where(jnp.any(real, axis=1), jnp.argmax(real, axis=1), 0).astype(jnp.int32)
        ends = starts + counts
        deepstack = ctx["deepstack"]
        ctx.update(real=real, positions=positions, cos=cos, sin=sin, rows=jnp.maximum(ends - 1, 0),
                   visual=gather_rows(ctx["visual"], rows, 1, False), origin=gather_rows(ctx["origin"], rows, 1, -1),
                   mask=AttentionMask.causal(starts, ends, length),
                   deepstack=None if deepstack is None else gather_rows(deepstack, rows, 2))
        return constrain(gather_rows(x, rows, 1), "batch", None, None), keys, values

