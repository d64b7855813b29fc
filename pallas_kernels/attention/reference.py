"""Attention specs in pure jnp, differentiable, reading the mask description of `mask.py`.

`attention(q, k, v, kv_start, kv_end)` is the one spec: grouped-query softmax attention where query
row `(b, i)` sees the keys `[kv_start[b, i], kv_end[b, i])`. It never forms a score matrix over the
whole sequence: queries are taken one block at a time (`lax.map`), and each query block runs a
`lax.scan` with a static trip count over the key blocks with an online softmax, where a
`lax.cond` skips the key blocks outside the block's rows' runs. So

- cost follows the visited blocks: packed images cost sum(len_i^2), causal prefill stops at the
  diagonal;
- memory follows the block size, not L x S;
- every loop has a static trip count, so reverse-mode autodiff works (`jax.grad`, `nnx.grad`);
- no `[B, L, S]` mask exists anywhere: each visit compares a key-position iota with the rows' runs.

A single query row per batch row (decode) takes a plain pass over the keys instead (its mask is
`[B, S]`, the size of one cache row).

`varlen_attention`, `causal_attention` and `decode_attention` are the same spec under the masks they
name; `masked_attention` is a dense oracle under an explicit boolean mask (tests only).

Axes: B batch, L queries, S keys, H query heads, G kv heads, R = H / G, D head dim,
Q / K rows in a query / key block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._shapes import pow2_at_least
from .mask import AttentionMask

__all__ = [
    "attention",
    "block_ranges",
    "varlen_attention",
    "causal_attention",
    "decode_attention",
    "masked_attention",
]

# Finite stand-in for -inf: masked scores underflow to exactly 0 after exp without inf - inf = nan.
_MASKED = -1e30
_BIG = 2**30


def block_ranges(kv_start, kv_end, block_q: int, block_k: int) -> tuple[jax.Array, jax.Array]:
    """For each block of `block_q` query rows, the key-block range `[lo, hi)` its rows' runs touch.

    `kv_start`, `kv_end`: `[..., L]` with L a multiple of block_q. A block whose rows are all empty
    gets an empty range.
    """
    shape = kv_start.shape[:-1] + (kv_start.shape[-1] // block_q, block_q)
    lo, hi = kv_start.reshape(shape), kv_end.reshape(shape)
    nonempty = hi > lo
    first = jnp.min(jnp.where(nonempty, lo, _BIG), axis=-1) // block_k
    last = (jnp.max(jnp.where(nonempty, hi, 0), axis=-1) + block_k - 1) // block_k
    first = jnp.where(jnp.any(nonempty, axis=-1), first, 0)
    return first.astype(jnp.int32), jnp.maximum(last, first).astype(jnp.int32)


def _single_query(q, k, v, kv_start, kv_end, scale):
    """L == 1: q `[B, H, D]` over all S keys (a `[B, S]` validity row per batch row)."""
    b, heads, dim = q.shape
    groups = k.shape[2]
    qg = q.reshape(b, groups, heads // groups, dim)
    s = jnp.einsum("bgrd,bsgd->bgrs", qg, k, preferred_element_type=jnp.float32) * scale
    pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    allowed = ((pos >= kv_start[:, None]) & (pos < kv_end[:, None]))[:, None, None, :]
    s = jnp.where(allowed, s, _MASKED)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))  # the result does not depend on m
    p = jnp.exp(s - m) * allowed
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bgrs,bsgd->bgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(total > 0, total, 1.0)
    return out.reshape(b, heads, dim)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k"))
def attention(q, k, v, kv_start, kv_end, *, block_q: int = 256, block_k: int = 256):
    """Grouped-query attention where query row `(b, i)` sees keys `kv_start[b, i] <= s < kv_end[b, i]`.

    Args:
      q: `[B, L, H, D]`; k, v: `[B, S, G, D]` with H a multiple of G (query head h reads kv head
        h // (H / G), HF's `repeat_kv` order).
      kv_start, kv_end: `[B, L]` int32 key runs (`AttentionMask`'s fields); empty -> zero row.
      block_q, block_k: block sizes (capped at the padded lengths).
    Returns:
      `[B, L, H, D]` in q's dtype. Scores, softmax and accumulation in float32, scale 1/sqrt(D).
    """
    b, length, heads, dim = q.shape
    kv_len, groups = k.shape[1], k.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} kv heads")
    if b == 0 or length == 0 or kv_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    rep, scale = heads // groups, dim**-0.5
    kv_end = jnp.clip(kv_end.astype(jnp.int32), 0, kv_len)
    kv_start = jnp.minimum(kv_start.astype(jnp.int32), kv_end)
    if length == 1:
        return _single_query(q[:, 0], k, v, kv_start[:, 0], kv_end[:, 0], scale)[:, None].astype(q.dtype)

    bq = min(block_q, pow2_at_least(length))
    bk = min(block_k, pow2_at_least(kv_len))
    lp, sp = -(-length // bq) * bq, -(-kv_len // bk) * bk
    if lp != length:  # padded query rows see nothing
        q = jnp.pad(q, ((0, 0), (0, lp - length), (0, 0), (0, 0)))
        kv_start, kv_end = (jnp.pad(x, ((0, 0), (0, lp - length))) for x in (kv_start, kv_end))
    if sp != kv_len:
        k, v = (jnp.pad(x, ((0, 0), (0, sp - kv_len), (0, 0), (0, 0))) for x in (k, v))
    nq, nk = lp // bq, sp // bk
    first, last = block_ranges(kv_start, kv_end, bq, bk)  # [B, nq]

    def one_query_block(xs):
        q_blk, lo, hi, blk_lo, blk_hi, row = xs  # q_blk [Q, G, R, D]; lo, hi [Q]
        keys, values = (k[0], v[0]) if b == 1 else (k[row], v[row])  # [S, G, D]

        def visit(carry, j):
            m, total, acc = carry
            k_blk = lax.dynamic_slice_in_dim(keys, j * bk, bk)
            v_blk = lax.dynamic_slice_in_dim(values, j * bk, bk)
            s = jnp.einsum("qgrd,kgd->grqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            kpos = j * bk + jnp.arange(bk, dtype=jnp.int32)
            allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None])  # [Q, K]
            s = jnp.where(allowed, s, _MASKED)
            m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
            p = jnp.exp(s - m_new[..., None]) * allowed
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("grqk,kgd->grqd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, total * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        def step(carry, j):
            return lax.cond((j >= blk_lo) & (j < blk_hi), visit, lambda c, _: c, carry, j), None

        init = (
            jnp.full((groups, rep, bq), _MASKED, jnp.float32),
            jnp.zeros((groups, rep, bq), jnp.float32),
            jnp.zeros((groups, rep, bq, dim), jnp.float32),
        )
        (_, total, acc), _ = lax.scan(step, init, jnp.arange(nk, dtype=jnp.int32))
        out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # [G, R, Q, D]
        return jnp.moveaxis(out, 2, 0).astype(q.dtype)  # [Q, G, R, D]

    xs = (
        q.reshape(b * nq, bq, groups, rep, dim),
        kv_start.reshape(b * nq, bq),
        kv_end.reshape(b * nq, bq),
        first.reshape(-1),
        last.reshape(-1),
        jnp.repeat(jnp.arange(b, dtype=jnp.int32), nq),
    )
    out = lax.map(one_query_block, xs)  # [B*nq, Q, G, R, D]
    return out.reshape(b, lp, heads, dim)[:, :length]


# ---------------------------------------------------------------------- the same spec, named masks


def varlen_attention(q, k, v, segment_ids, *, block_size: int = 256):
    """Non-causal attention within contiguous segments; q, k, v `[S, H, D]`, `segment_ids [S]`.

    Negative ids are padding: never attended to, zero output.
    """
    mask = AttentionMask.segments(segment_ids)
    return attention(q[None], k[None], v[None], mask.kv_start, mask.kv_end,
                     block_q=block_size, block_k=block_size)[0]


def causal_attention(q, k, v, lengths, starts=None):
    """Causal GQA self-attention; q `[B, S, Hq, D]`, k/v `[B, S, Hkv, D]`.

    Valid tokens of row b are `[starts[b], starts[b] + lengths[b])` (`starts` defaults to 0, right
    padding; left padding is `starts = S - lengths`). Rows outside the valid range are zero.
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    mask = AttentionMask.causal(starts, starts + lengths, q.shape[1])
    return attention(q, k, v, mask.kv_start, mask.kv_end)


def decode_attention(q, k_cache, v_cache, lengths, starts=None):
    """One query token per row against a cache: q `[B, Hq, D]`, caches `[B, S_max, Hkv, D]`; keys
    `[starts[b], starts[b] + lengths[b])` are attended (`starts` defaults to 0)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    out = attention(q[:, None], k_cache, v_cache, starts[:, None], (starts + lengths)[:, None])
    return out[:, 0]


def masked_attention(q, k, v, mask):
    """Dense GQA attention under an explicit boolean mask `[B, L, S]` (a test oracle; rows with no
    allowed key are zero). q `[B, L, H, D]`, k/v `[B, S, G, D]`."""
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
