"""Attention ops as the model calls them.

`implementation`: `"xla"` (the pure-jnp specs in `reference.py`), `"pallas"` (the Triton kernels
in `kernel.py`; run in the Pallas interpreter on a non-GPU backend) or `"auto"` (Pallas on a GPU
backend, XLA elsewhere). Unknown names are an error, and `"pallas"` never falls back silently.

head_dim is padded inside this module to the kernel's power-of-two width (64 -> 64, 72 -> 128,
128 -> 128) with zeros: zero columns change neither q.k nor the kept output columns, and the
softmax scale stays 1/sqrt(original head_dim).
"""

from __future__ import annotations

import jax.numpy as jnp

from .._dispatch import IMPLEMENTATIONS, resolve
from .._shapes import pow2_at_least
from . import kernel, reference

__all__ = [
    "varlen_attention",
    "masked_attention",
    "causal_attention",
    "decode_attention",
    "mask_intervals",
    "IMPLEMENTATIONS",
]


def _kernel_dim(dim: int) -> int:
    return max(16, pow2_at_least(dim))


def _pad_dim(x, width: int):
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _flash(q, k, v, lo, hi, interpret, block_q, block_k):
    """q `[B, L, Hq, D]`, k/v `[B, S, G, D]`, intervals `[B, L]` -> `[B, L, Hq, D]`."""
    dim = q.shape[-1]
    width = _kernel_dim(dim)
    out = kernel.flash_attention(
        _pad_dim(q, width), _pad_dim(k, width), _pad_dim(v, width), lo, hi,
        scale=dim**-0.5, block_q=block_q, block_k=block_k, precision=kernel.dot_precision(q.dtype),
        interpret=interpret,
    )
    return out[..., :dim]


def _decode(q, k_cache, v_cache, lo, hi, interpret, block_k, num_splits):
    """q `[B, Hq, D]`, caches `[B, S, G, D]`, intervals `[B]` -> `[B, Hq, D]`."""
    b, dim = q.shape[0], q.shape[-1]
    kv_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        # Enough programs to fill a GPU (~2 per SM on an H200), each split at least 256 keys.
        num_splits = max(1, min(-(-264 // (b * kv_heads)), -(-kv_len // 256)))
    width = _kernel_dim(dim)
    out = kernel.decode_attention(
        _pad_dim(q, width), _pad_dim(k_cache, width), _pad_dim(v_cache, width), lo, hi,
        scale=dim**-0.5, block_k=block_k, num_splits=num_splits, precision=kernel.dot_precision(q.dtype),
        interpret=interpret,
    )
    return out[..., :dim]


def varlen_attention(q, k, v, segment_ids, *, implementation: str = "auto", block_q: int = 64,
                     block_k: int = 64):
    """Non-causal attention within contiguous segments; q, k, v `[S, H, D]`, `segment_ids [S]`.

    Negative ids are padding (never attended; zero output). The Pallas kernel visits only the key
    blocks that overlap each query block's segments.
    """
    use_pallas, interpret = resolve(implementation)
    if not use_pallas:
        return reference.varlen_attention(q, k, v, segment_ids)
    lo, hi = kernel.segment_intervals(segment_ids.astype(jnp.int32))
    return _flash(q[None], k[None], v[None], lo[None], hi[None], interpret, block_q, block_k)[0]


def causal_attention(q, k, v, lengths, *, starts=None, implementation: str = "auto", block_q: int = 64,
                     block_k: int = 64):
    """Causal GQA self-attention; q `[B, S, Hq, D]`, k/v `[B, S, Hkv, D]`, `lengths [B]`.

    Valid tokens of row b are `[starts[b], starts[b] + lengths[b])` (`starts` defaults to 0, right
    padding; left padding is `starts = S - lengths`). Rows outside the valid range are zero.
    """
    use_pallas, interpret = resolve(implementation)
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    if not use_pallas:
        return reference.causal_attention(q, k, v, lengths, starts)
    pos = jnp.arange(q.shape[1], dtype=jnp.int32)[None]
    ends = (starts + lengths)[:, None]
    valid = (pos >= starts[:, None]) & (pos < ends)
    lo = jnp.where(valid, starts[:, None], 0)
    hi = jnp.where(valid, jnp.minimum(pos + 1, ends), 0)
    return _flash(q, k, v, lo, hi, interpret, block_q, block_k)


def decode_attention(q, k_cache, v_cache, lengths, *, starts=None, implementation: str = "auto",
                     block_k: int = 64, num_splits: int | None = None):
    """One query token per row against a KV cache (split-K in the Pallas kernel).

    q `[B, Hq, D]`, caches `[B, S_max, Hkv, D]`; keys `[starts[b], starts[b] + lengths[b])` are
    attended (`starts` defaults to 0). `num_splits=None` picks enough splits to fill a GPU.
    """
    use_pallas, interpret = resolve(implementation)
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    if not use_pallas:
        return reference.decode_attention(q, k_cache, v_cache, lengths, starts)
    return _decode(q, k_cache, v_cache, starts, starts + lengths, interpret, block_k, num_splits)


def mask_intervals(mask):
    """For a boolean mask `[..., S]`, each row's `[lo, hi)` key interval and whether the row
    really is that interval (`ok`). All-False rows are the empty interval `[0, 0)`."""
    size = mask.shape[-1]
    any_key = jnp.any(mask, axis=-1)
    lo = jnp.argmax(mask, axis=-1).astype(jnp.int32)
    hi = (size - jnp.argmax(mask[..., ::-1], axis=-1)).astype(jnp.int32)
    lo, hi = jnp.where(any_key, lo, 0), jnp.where(any_key, hi, 0)
    pos = jnp.arange(size, dtype=jnp.int32)
    ok = jnp.all(((pos >= lo[..., None]) & (pos < hi[..., None])) == mask, axis=-1)
    return lo, hi, ok


def masked_attention(q, k, v, mask, *, implementation: str = "auto"):
    """Grouped-query attention under a boolean mask; q `[B, L, H, D]`, k/v `[B, S, G, D]`, mask `[B, L, S]`.

    The Pallas path serves masks whose rows are each one contiguous key interval — every mask the
    language model builds (causal with left or right padding in prefill; the cache window in
    decode) — by converting rows to intervals: L > 1 runs the flash kernel, L == 1 the split-K
    decode kernel. A row that is not an interval comes back as NaN (loud, never silently wrong).
    """
    use_pallas, interpret = resolve(implementation)
    if not use_pallas:
        return reference.masked_attention(q, k, v, mask)
    lo, hi, ok = mask_intervals(mask)  # [B, L]
    if q.shape[1] == 1:
        # Decode: one interval per row; all query heads share it.
        out = _decode(q[:, 0], k, v, lo[:, 0], hi[:, 0], interpret, 64, None)[:, None]
    else:
        out = _flash(q, k, v, lo, hi, interpret, 64, 64)
    return jnp.where(ok[:, :, None, None], out, jnp.nan).astype(q.dtype)
