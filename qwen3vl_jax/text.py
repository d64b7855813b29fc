"""The Qwen3 decoder of Qwen3-VL in Flax NNX, with interleaved multimodal rotary (mRoPE).

Each layer: RMSNorm -> GQA attention (q/k RMSNorm over head_dim before rotary) -> residual ->
RMSNorm -> SwiGLU MLP -> residual. Rotary angles come from three position streams (t, h, w); of
the head_dim/2 frequency channels, h takes channels 1, 4, 7, ... and w takes 2, 5, 8, ...
(`mrope_section[1]` and `[2]` of them), t takes the rest (HF's interleaved layout).

Axes: B batch, L query tokens, S key tokens, E hidden, H query heads, G kv heads, D head dim,
V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.attention import api as attention_api

from .config import TextConfig
from .layers import Linear, RMSNorm, apply_rotary

__all__ = ["TextModel", "mrope_channel_axes", "mrope_cos_sin"]


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


class TextAttention(nnx.Module):
    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config = config
        e, h, g, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        kw = dict(use_bias=config.attention_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(e, h * d, **kw)
        self.k_proj = Linear(e, g * d, **kw)
        self.v_proj = Linear(e, g * d, **kw)
        self.o_proj = Linear(h * d, e, **kw)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)

    def project(self, x, cos, sin):
        """Rotated q `[B, L, H, D]`, rotated k and v `[B, L, G, D]` (q/k RMSNorm before rotary)."""
        b, length, _ = x.shape
        d = self.config.head_dim
        q = self.q_norm(self.q_proj(x).reshape(b, length, -1, d))
        k = self.k_norm(self.k_proj(x).reshape(b, length, -1, d))
        v = self.v_proj(x).reshape(b, length, -1, d)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, L, 1, D]: shared by the heads
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q, keys, values, mask, implementation: str):
        """Attention of q over `keys`/`values` `[B, S, G, D]` (this call's or a cache's), then o_proj."""
        b, length = q.shape[:2]
        out = attention_api.masked_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask,
                                             implementation=implementation)
        return self.o_proj(out.reshape(b, length, -1))

    def __call__(self, x, cos, sin, mask, implementation: str):
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v, mask, implementation)


class TextMLP(nnx.Module):
    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = TextAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.mlp = TextMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def qkv(self, x, cos, sin):
        """The layer's q, k, v for the residual stream x (what a KV cache stores is k and v)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def finish(self, x, q, keys, values, mask, implementation: str = "xla"):
        """The rest of the layer given the keys and values to attend over (this call's or cached)."""
        x = x + self.self_attn.attend(q, keys, values, mask, implementation)
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, cos, sin, mask, implementation: str = "xla"):
        q, k, v = self.qkv(x, cos, sin)
        return self.finish(x, q, k, v, mask, implementation)


class TextModel(nnx.Module):
    """`Qwen3VLTextModel`: embeddings in, final-norm hidden states out.

    `deepstack` (`[K, B, L, E]`, zero away from visual positions) is added to the hidden states
    after decoder layer k for k < K.
    """

    def __init__(self, config: TextConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
             for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, embeds, positions, mask, deepstack=None, *, implementation: str = "xla",
                 return_hidden_states: bool = False):
        cos, sin = mrope_cos_sin(positions, self.config)
        x = embeds
        hidden = []
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, implementation)
            if return_hidden_states:
                hidden.append(x)  # the layer's own output, before deepstack (what HF records)
            if deepstack is not None and index < deepstack.shape[0]:
                x = x + deepstack[index].astype(x.dtype)
        x = self.norm(x)
        return (x, tuple(hidden)) if return_hidden_states else x
