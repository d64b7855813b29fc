"""Attention specs in pure jnp.

`varlen_attention`: packed non-causal attention over contiguous segments (one segment per image
frame in the vision tower). It never forms a score matrix over the whole packed sequence: queries
are processed one block at a time, and each query block visits only the key blocks that overlap
its segments, with an online softmax. Peak memory follows the block size, cost follows
sum(len_i^2), so four 1024x1024 images in one call stay four 4k x 4k problems.

Axes: S packed tokens, H heads, D head dim, Q/K tokens in a query/key block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._shapes import pow2_at_least

__all__ = ["varlen_attention", "masked_attention", "causal_attention", "decode_attention", "segment_block_ranges"]

# Finite stand-in for -inf: masked scores underflow to exactly 0 after exp without inf - inf = nan.
_MASKED = -1e30


def segment_block_ranges(segment_ids: jnp.ndarray, block: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """For each block of `block` queries, the key-block range [lo, hi) that its segments cover.

    Segments must be contiguous runs of equal ids. Blocks holding only padding (ids < 0) get an
    empty range.
    """
    size = segment_ids.shape[0]
    idx = jnp.arange(size)
    boundary = segment_ids[1:] != segment_ids[:-1]
    starts = jnp.concatenate([jnp.array([True]), boundary])
    ends = jnp.concatenate([boundary, jnp.array([True])])
    run_first = jax.lax.cummax(jnp.where(starts, idx, 0))
    run_last = jax.lax.cummin(jnp.where(ends, idx, size - 1), reverse=True)
    lo = run_first[::block] // block
    hi = run_last[block - 1 :: block] // block + 1
    has_tokens = jnp.any(segment_ids.reshape(-1, block) >= 0, axis=1)
    return lo, jnp.where(has_tokens, hi, lo)


@functools.partial(jax.jit, static_argnames=("block_size",))
def varlen_attention(q, k, v, segment_ids, *, block_size: int = 256):
    """Non-causal attention within segments.

    Args:
      q, k, v: `[S, H, D]`.
      segment_ids: `[S]` int32, contiguous runs; negative ids mark padding, which is never
        attended to and whose outputs are zero.
      block_size: queries and keys per block (rounded down to the padded length).
    Returns:
      `[S, H, D]` in q's dtype. Scores and softmax in float32, scale 1/sqrt(D).
    """
    size, heads, dim = q.shape
    block = min(block_size, pow2_at_least(size))
    padded = -(-size // block) * block
    pad = padded - size
    segment_ids = segment_ids.astype(jnp.int32)
    if pad:
        q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    lo, hi = segment_block_ranges(segment_ids, block)
    num_blocks = padded // block
    # Heads-major blocks [n, H, block, D], so each block visit is a plain batched matmul.
    qb, kb, vb = (x.reshape(num_blocks, block, heads, dim).transpose(0, 2, 1, 3) for x in (q, k, v))
    sb = segment_ids.reshape(num_blocks, block)
    scale = dim**-0.5

    def one_query_block(args):
        q_blk, q_seg, k_lo, k_hi = args

        def visit(j, carry):
            m, l, acc = carry
            k_blk, v_blk, k_seg = kb[j], vb[j], sb[j]
            s = jnp.einsum("hqd,hkd->hqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            mask = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
            s = jnp.where(mask[None], s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None]) * mask[None]
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(axis=-1)
            pv = jnp.einsum("hqk,hkd->hqd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        init = (
            jnp.full((heads, block), _MASKED, jnp.float32),
            jnp.zeros((heads, block), jnp.float32),
            jnp.zeros((heads, block, dim), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(k_lo, k_hi, visit, init)
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)

    out = jax.lax.map(one_query_block, (qb, sb, lo, hi))  # [n, H, block, D]
    out = out.transpose(0, 2, 1, 3)
    return out.reshape(padded, heads, dim)[:size]


def masked_attention(q, k, v, mask):
    """Dense grouped-query attention under an explicit boolean mask.

    Args:
      q: `[B, L, H, D]`; k, v: `[B, S, G, D]` with H a multiple of G (query head h reads kv head
        h // (H / G), HF's `repeat_kv` order).
      mask: `[B, L, S]` bool, True where query l may attend to key s.
    Returns:
      `[B, L, H, D]` in q's dtype; rows with no allowed key are zero.
    """
    b, length, heads, dim = q.shape
    groups = k.shape[2]
    qg = q.reshape(b, length, groups, heads // groups, dim)
    s = jnp.einsum("blgrd,bsgd->bgrls", qg, k, preferred_element_type=jnp.float32) * dim**-0.5
    allowed = mask[:, None, None, :, :]
    s = jnp.where(allowed, s, _MASKED)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True)) * allowed
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("bgrls,bsgd->blgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, length, heads, dim).astype(q.dtype)


def causal_attention(q, k, v, lengths, starts=None):
    """Causal grouped-query self-attention over a padded batch.

    Args:
      q: `[B, S, Hq, D]`; k, v: `[B, S, Hkv, D]` (query head h reads kv head h // (Hq / Hkv)).
      lengths: `[B]` valid tokens per row; starts: `[B]` first valid position (default 0, right
        padding; left padding is `starts = S - lengths`). Valid tokens are `[start, start + length)`.
    Returns:
      `[B, S, Hq, D]` in q's dtype. A valid query at p sees keys `start <= s <= p`; rows outside
      the valid range are zero.
    """
    size = q.shape[1]
    starts = jnp.zeros_like(lengths) if starts is None else starts
    pos = jnp.arange(size)
    valid = (pos[None] >= starts[:, None]) & (pos[None] < (starts + lengths)[:, None])  # [B, S]
    mask = valid[:, :, None] & valid[:, None, :] & (pos[None, :, None] >= pos[None, None, :])
    return masked_attention(q, k, v, mask)


def decode_attention(q, k_cache, v_cache, lengths, starts=None):
    """One query token per row against a KV cache.

    Args:
      q: `[B, Hq, D]`; k_cache, v_cache: `[B, S_max, Hkv, D]`.
      lengths: `[B]` valid cache entries; starts: `[B]` first valid slot (default 0). Keys
        `[start, start + length)` are attended.
    Returns:
      `[B, Hq, D]` in q's dtype (zero for an empty range).
    """
    pos = jnp.arange(k_cache.shape[1])
    starts = jnp.zeros_like(lengths) if starts is None else starts
    mask = (pos[None] >= starts[:, None]) & (pos[None] < (starts + lengths)[:, None])
    return masked_attention(q[:, None], k_cache, v_cache, mask[:, None])[:, 0]
