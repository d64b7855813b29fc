"""Attention specs in pure jnp, differentiable, reading the mask description of `mask.py`.

`attention(q, k, v, kv_start, kv_end)` is the one spec: grouped-query softmax attention where query
row `(b, i)` sees the keys `[kv_start[b, i], kv_end[b, i])`. It never forms a score matrix over the
whole sequence: queries are taken one block at a time (`lax.map`), and each query block loops over
only the key blocks its rows' runs touch (`block_ranges`) with an online softmax. Its gradient is
its own `jax.custom_vjp`, the flash backward: the forward saves the output and each row's
log-sum-exp; the backward revisits the same block pairs, recomputes the softmax weights from the
log-sum-exp and accumulates dQ per query block and dK, dV in place. So

- cost follows the visited blocks: packed images cost sum(len_i^2), causal prefill stops at the
  diagonal; the backward recomputes the scores once (5 block matmuls per pair, not 7);
- memory follows the block size, not L x S, in the forward and in the backward (nothing of size
  `[L, S]` is saved for the backward, unlike autodiff through the loops);
- block sizes are evened out (`balanced_block`): 784 rows in blocks of up to 512 are 2 x 392, not
  a 1024-row padding; when every segment has the same known length, blocks divide it
  (`aligned_block`), so no block straddles two segments: 4 frames of 784 rows are 8 blocks of 392,
  each visiting 2 key blocks, where 7 blocks of 448 would visit 3 to 4;
- no `[B, L, S]` mask exists anywhere: each visit compares a key-position iota with the rows' runs.

A single query row per batch row (decode) takes a plain pass over the keys instead (its mask is
`[B, S]`, the size of one cache row).

`attention_weights` returns the softmax probabilities `[B, H, L, S]` the spec applies, from the
spec's own log-sum-exp (for inspecting a chosen layer; it materializes them).

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

from .mask import AttentionMask

__all__ = [
    "attention",
    "attention_weights",
    "block_ranges",
    "balanced_block",
    "aligned_block",
    "ATTENTION_BLOCK",
    "varlen_attention",
    "causal_attention",
    "decode_attention",
    "masked_attention",
]

# Finite stand-in for -inf: masked scores underflow to exactly 0 after exp without inf - inf = nan.
_MASKED = -1e30
_BIG = 2**30
ATTENTION_BLOCK = 512
"""Default query and key block size (rows): on a 2-core CPU, 784-patch frames ran 1.4x faster in
512-row than in 256-row blocks (fewer, larger batched matmuls); `balanced_block` evens them out."""


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


def aligned_block(segment_rows: int, length: int, block: int) -> int:
    """A block size of about `block` rows that never straddles two segments of `segment_rows` rows
    laid end to end from row 0 over `length` rows: a divisor of a long segment (784 -> 392), or a
    whole number of short segments, as few blocks as possible and evened out (40 segments of 16
    rows in blocks of up to 512 -> 2 blocks of 20 segments). `balanced_block(length, block)` when a
    long segment has no divisor of at least a quarter of `block`."""
    if segment_rows <= block:
        segments = -(-length // segment_rows)
        per_block = block // segment_rows
        blocks = -(-segments // per_block)
        return -(-segments // blocks) * segment_rows
    pieces = -(-segment_rows // block)
    while segment_rows % pieces and segment_rows // pieces >= max(8, block // 4):
        pieces += 1
    if segment_rows % pieces:
        return balanced_block(length, block)
    return segment_rows // pieces


def segment_block(longest_segment: int, block: int) -> int:
    """The block size for segments of different lengths, none longer than `longest_segment` rows:
    about half that, at least 64 rows and at most `block`, so a query block visits the keys of a
    segment or two rather than a `block`-row key block that is mostly masked. Measured on a 2-core
    CPU (one training step of the built-in default: 32 images of 64-100 patches, 4,096 rows with
    padding): 0.62 s in 64-row blocks, 0.70 s in 128-row blocks, 1.0 s in 512-row blocks."""
    return min(block, max(64, longest_segment // 2))


def balanced_block(length: int, block: int) -> int:
    """The block size that splits `length` rows into as few blocks of at most `block` rows as
    possible, all equal and a multiple of 8 (the f32 vector width): 784 rows in blocks of up to
    256 -> 4 blocks of 200 (800 rows, 2% padding) where 256-row blocks would pad to 1024."""
    if block < 8:
        return block
    rows = -(-length // -(-length // block))  # ceil(length / number of blocks)
    return min(block, -(-rows // 8) * 8)


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


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "segment_rows", "longest_segment"))
def attention(q, k, v, kv_start, kv_end, *, block_q: int = ATTENTION_BLOCK, block_k: int = ATTENTION_BLOCK,
              segment_rows: int = 0, longest_segment: int = 0):
    """Grouped-query attention where query row `(b, i)` sees keys `kv_start[b, i] <= s < kv_end[b, i]`.

    Args:
      q: `[B, L, H, D]`; k, v: `[B, S, G, D]` with H a multiple of G (query head h reads kv head
        h // (H / G), HF's `repeat_kv` order).
      kv_start, kv_end: `[B, L]` int32 key runs (`AttentionMask`'s fields); empty -> zero row.
      block_q, block_k: block sizes (evened out by `balanced_block`).
      segment_rows: static hint (0 = none) that the rows form segments of this many rows from row 0
        (`AttentionMask.segment_rows`; self-attention, L == S): blocks of `aligned_block(...,
        block_q)` rows for queries and keys alike. Changes the work done, never the result.
      longest_segment: static hint (0 = none) that no segment is longer than this
        (`AttentionMask.longest_segment`; self-attention, used when `segment_rows` is 0): blocks of
        `segment_block(longest_segment, block_q)` rows. Changes the work done, never the result.
    Returns:
      `[B, L, H, D]` in q's dtype. Scores, softmax and accumulation in float32, scale 1/sqrt(D).
    """
    b, length, heads, dim = q.shape
    kv_len, groups = k.shape[1], k.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} kv heads")
    if b == 0 or length == 0 or kv_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    kv_end = jnp.clip(kv_end.astype(jnp.int32), 0, kv_len)
    kv_start = jnp.minimum(kv_start.astype(jnp.int32), kv_end)
    if length == 1:
        return _single_query(q[:, 0], k, v, kv_start[:, 0], kv_end[:, 0], dim**-0.5)[:, None].astype(q.dtype)

    q, k, v, kv_start, kv_end, bq, bk = _padded_blocks(q, k, v, kv_start, kv_end, block_q, block_k, segment_rows,
                                                       longest_segment)
    return _blocked(q, k, v, kv_start, kv_end, bq, bk)[:, :length]


def _padded_blocks(q, k, v, kv_start, kv_end, block_q, block_k, segment_rows, longest_segment):
    """The block sizes of a call (see `attention`) and its inputs padded to whole blocks."""
    length, kv_len = q.shape[1], k.shape[1]
    if segment_rows and length == kv_len:
        bq = bk = aligned_block(segment_rows, length, block_q)
    elif longest_segment and length == kv_len:
        bq = bk = balanced_block(length, segment_block(longest_segment, block_q))
    else:
        bq, bk = balanced_block(length, block_q), balanced_block(kv_len, block_k)
    lp, sp = -(-length // bq) * bq, -(-kv_len // bk) * bk
    if lp != length:  # padded query rows see nothing
        q = jnp.pad(q, ((0, 0), (0, lp - length), (0, 0), (0, 0)))
        kv_start, kv_end = (jnp.pad(x, ((0, 0), (0, lp - length))) for x in (kv_start, kv_end))
    if sp != kv_len:
        k, v = (jnp.pad(x, ((0, 0), (0, sp - kv_len), (0, 0), (0, 0))) for x in (k, v))
    return q, k, v, kv_start, kv_end, bq, bk


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "segment_rows", "longest_segment"))
def attention_weights(q, k, kv_start, kv_end, *, block_q: int = ATTENTION_BLOCK, block_k: int = ATTENTION_BLOCK,
                      segment_rows: int = 0, longest_segment: int = 0):
    """The softmax probabilities `[B, H, L, S]` (float32) that `attention` applies to the values.

    Exactly the spec's own: each row's log-sum-exp comes from the same computation `attention` runs
    (the blocked online softmax for L > 1, the one pass over the keys for L == 1), and the
    probabilities are `exp(score - lse)` on the row's run of keys, 0 elsewhere, as the flash
    backward recomputes them. A row with an empty run is all zeros. Arguments as `attention`
    (without the values). Materializes `[B, H, L, S]`: for inspecting chosen layers, not for the
    model's path.
    """
    b, length, heads, dim = q.shape
    kv_len, groups = k.shape[1], k.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} kv heads")
    if b == 0 or length == 0 or kv_len == 0:
        return jnp.zeros((b, heads, length, kv_len), jnp.float32)
    kv_end = jnp.clip(kv_end.astype(jnp.int32), 0, kv_len)
    kv_start = jnp.minimum(kv_start.astype(jnp.int32), kv_end)
    qg = q.reshape(b, length, groups, heads // groups, dim)
    s = jnp.einsum("blgrd,bsgd->bgrls", qg, k, preferred_element_type=jnp.float32) * dim**-0.5
    s = s.reshape(b, heads, length, kv_len)
    pos = jnp.arange(kv_len, dtype=jnp.int32)
    allowed = ((pos >= kv_start[..., None]) & (pos < kv_end[..., None]))[:, None]  # [B, 1, L, S]
    if length == 1:  # `_single_query`'s pass: the row maximum and the sum of exp(s - max)
        masked = jnp.where(allowed, s, _MASKED)
        m = jnp.max(masked, axis=-1, keepdims=True)
        total = jnp.sum(jnp.exp(masked - m) * allowed, axis=-1, keepdims=True)
        seen = total > 0
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
    else:
        qp, kp, _, lo, hi, bq, bk = _padded_blocks(q, k, k, kv_start, kv_end, block_q, block_k, segment_rows,
                                                   longest_segment)
        _, lse = _blocked_forward(qp, kp, kp, lo, hi, bq, bk)  # [B * nq, G, R * Q]
        lse = _Layout(qp, kp, bq, bk).unqueries(lse[..., None])[:, :length, :, 0]  # [B, L, H]
        lse = lse.transpose(0, 2, 1)[..., None]
    return jnp.exp(s - lse) * allowed


# ---------------------------------------------------------------------- the blocked online softmax
#
# Inside, a query block is laid out `[G, M, D]` with M = R * Q rows (head-major: row r * Q + i is
# query i of head g * R + r), so each block's scores are one batched matmul `[G, M, K]` over the kv
# heads without repeating keys; keys and values are `[B, G, S, D]`. The rows' runs are tiled to M.


class _Layout:
    """Static sizes of one call and the moves between the caller's layout and the blocked one."""

    def __init__(self, q, k, bq, bk):
        self.b, self.lp, self.heads, self.dim = q.shape
        self.groups = k.shape[2]
        self.rep = self.heads // self.groups
        self.bq, self.bk = bq, bk
        self.nq, self.nk = self.lp // bq, k.shape[1] // bk
        self.scale = self.dim**-0.5

    def queries(self, x):
        """`[B, Lp, H, D]` -> `[B * nq, G, R * Q, D]`."""
        x = x.reshape(self.b, self.nq, self.bq, self.groups, self.rep, x.shape[-1])
        x = x.transpose(0, 1, 3, 4, 2, 5)
        return x.reshape(self.b * self.nq, self.groups, self.rep * self.bq, x.shape[-1])

    def unqueries(self, x):
        """The inverse of `queries`."""
        x = x.reshape(self.b, self.nq, self.groups, self.rep, self.bq, x.shape[-1])
        return x.transpose(0, 1, 4, 2, 3, 5).reshape(self.b, self.lp, self.heads, x.shape[-1])

    def runs(self, x):
        """`[B, Lp]` row runs -> `[B * nq, R * Q]`, tiled like the rows of `queries`."""
        return jnp.tile(x.reshape(self.b * self.nq, 1, self.bq), (1, self.rep, 1)).reshape(
            self.b * self.nq, self.rep * self.bq)

    def visited(self, kv_start, kv_end):
        """Per query block (flat over B * nq), the key-block range `[first, last)` its rows touch."""
        first, last = block_ranges(kv_start, kv_end, self.bq, self.bk)
        return first.reshape(-1), last.reshape(-1)

    @staticmethod
    def keys(x):
        """`[B, S, G, D]` -> `[B, G, S, D]` (and back: the swap is its own inverse)."""
        return x.transpose(0, 2, 1, 3)

    def scores(self, q_blk, k_blk, lo, hi, j):
        """Masked, scaled float32 scores `[G, M, K]` of key block j, and where they are allowed."""
        s = jnp.einsum("gmd,gkd->gmk", q_blk, k_blk, preferred_element_type=jnp.float32) * self.scale
        kpos = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
        allowed = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None])  # [M, K]
        return jnp.where(allowed, s, _MASKED), allowed


def _key_block(x, j, bk):
    return lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)


def _blocked_forward(q, k, v, kv_start, kv_end, bq, bk):
    """`(out [B, Lp, H, D], lse [B * nq, G, M])`; lse is the row's log-sum-exp (0 for empty rows)."""
    lay = _Layout(q, k, bq, bk)
    first, last = lay.visited(kv_start, kv_end)
    keys, values = lay.keys(k), lay.keys(v)
    m_rows = lay.rep * bq

    def one_query_block(xs):
        q_blk, lo, hi, blk_lo, blk_hi, row = xs
        kr, vr = keys[row], values[row]

        def visit(j, carry):
            m, total, acc = carry
            s, allowed = lay.scores(q_blk, _key_block(kr, j, bk), lo, hi, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None]) * allowed
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("gmk,gkd->gmd", p.astype(vr.dtype), _key_block(vr, j, bk),
                            preferred_element_type=jnp.float32)
            return m_new, total * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((lay.groups, m_rows), _MASKED, jnp.float32),
                jnp.zeros((lay.groups, m_rows), jnp.float32),
                jnp.zeros((lay.groups, m_rows, lay.dim), jnp.float32))
        m, total, acc = lax.fori_loop(blk_lo, blk_hi, visit, init)
        seen = total > 0
        out = acc / jnp.where(seen, total, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
        return out.astype(q.dtype), lse

    xs = (lay.queries(q), lay.runs(kv_start), lay.runs(kv_end), first, last,
          jnp.repeat(jnp.arange(lay.b, dtype=jnp.int32), lay.nq))
    out, lse = lax.map(one_query_block, xs)
    return lay.unqueries(out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blocked(q, k, v, kv_start, kv_end, bq, bk):
    return _blocked_forward(q, k, v, kv_start, kv_end, bq, bk)[0]


def _blocked_fwd(q, k, v, kv_start, kv_end, bq, bk):
    out, lse = _blocked_forward(q, k, v, kv_start, kv_end, bq, bk)
    return out, (q, k, v, kv_start, kv_end, out, lse)


def _blocked_bwd(bq, bk, residuals, grad):
    """The flash backward: per visited (query block, key block) pair, recompute the softmax weights
    from the saved log-sum-exp, then dV += P^T dO, dS = P * (dO V^T - delta), dQ += dS K, dK += dS^T Q.
    Only the visited pairs are computed; dK and dV accumulate in place over the query blocks."""
    q, k, v, kv_start, kv_end, out, lse = residuals
    lay = _Layout(q, k, bq, bk)
    first, last = lay.visited(kv_start, kv_end)
    qb, dob = lay.queries(q), lay.queries(grad.astype(q.dtype))
    delta = jnp.sum(lay.queries(grad.astype(jnp.float32) * out.astype(jnp.float32)), axis=-1)  # [B*nq, G, M]
    lo_all, hi_all = lay.runs(kv_start), lay.runs(kv_end)
    keys, values = lay.keys(k), lay.keys(v)
    f32 = jnp.float32

    def one_query_block(i, carry):
        dq, dk, dv = carry
        row = i // lay.nq
        q_blk, do_blk, lse_i, delta_i, lo, hi = qb[i], dob[i], lse[i], delta[i], lo_all[i], hi_all[i]
        kr, vr = keys[row], values[row]

        def visit(j, inner):
            dq_i, dk, dv = inner
            k_blk, v_blk = _key_block(kr, j, bk), _key_block(vr, j, bk)
            s, allowed = lay.scores(q_blk, k_blk, lo, hi, j)
            p = jnp.exp(s - lse_i[..., None]) * allowed  # [G, M, K]
            dv_j = jnp.einsum("gmk,gmd->gkd", p.astype(do_blk.dtype), do_blk, preferred_element_type=f32)
            dp = jnp.einsum("gmd,gkd->gmk", do_blk, v_blk, preferred_element_type=f32)
            ds = p * (dp - delta_i[..., None]) * lay.scale
            dq_i = dq_i + jnp.einsum("gmk,gkd->gmd", ds.astype(k_blk.dtype), k_blk, preferred_element_type=f32)
            dk_j = jnp.einsum("gmk,gmd->gkd", ds.astype(q_blk.dtype), q_blk, preferred_element_type=f32)
            at = (row, 0, j * bk, 0)
            dk = lax.dynamic_update_slice(dk, lax.dynamic_slice(dk, at, (1,) + dk_j.shape) + dk_j[None], at)
            dv = lax.dynamic_update_slice(dv, lax.dynamic_slice(dv, at, (1,) + dv_j.shape) + dv_j[None], at)
            return dq_i, dk, dv

        dq_i = jnp.zeros(q_blk.shape, f32)
        dq_i, dk, dv = lax.fori_loop(first[i], last[i], visit, (dq_i, dk, dv))
        return lax.dynamic_update_index_in_dim(dq, dq_i, i, 0), dk, dv

    zeros = (jnp.zeros(qb.shape, f32), jnp.zeros(keys.shape, f32), jnp.zeros(values.shape, f32))
    dq, dk, dv = lax.fori_loop(0, lay.b * lay.nq, one_query_block, zeros)
    dq = lay.unqueries(dq).astype(q.dtype)
    dk, dv = (lay.keys(x).astype(k.dtype) for x in (dk, dv))
    return dq, dk, dv, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


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
