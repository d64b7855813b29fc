"""Pallas (Triton backend) attention kernels.

Two `pallas_call`s, both selecting the Triton backend explicitly (`pltr.CompilerParams`):

- `flash_attention`: blocked online-softmax attention where every query row carries its own
  allowed key interval `[kv_lo, kv_hi)`. That one representation covers
    * packed varlen vision attention (the interval is the row's segment; padding rows are empty),
    * causal prefill with padding (the interval is `[start, min(q + 1, start + length))`),
    * any mask whose rows are intervals (the language model's causal-and-padding masks).
  Each query block loops only over the key blocks between the smallest `kv_lo` and the largest
  `kv_hi` of its rows, so packed images cost sum(len_i^2) rather than S^2, and causal prefill
  stops at the diagonal. GQA: query head h reads kv head h // (Hq / Hkv) through the K/V
  BlockSpec index map.
- `decode_attention`: one query token per sequence against a KV cache, split-K: the grid is
  (batch, kv head, split); each program handles the query heads of one kv head (padded to 16
  rows, the smallest Triton dot) over one slice of the cache, and writes an unnormalised partial
  output with its running max and sum; a small log-sum-exp combine in jnp finishes.

Shapes inside the kernels follow the Triton rules of docs/kernels.md: power-of-two tiles (the
caller pads head_dim, e.g. 72 -> 128), dot dimensions >= 16, no value slicing or reshapes of
loaded tiles, finite mask values, guarded all-masked rows, float32 accumulation.

The wrappers pad the sequence dimensions to block multiples themselves; head_dim must already be
a power of two >= 16 (`api.py` pads it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from .._shapes import pow2_at_least

__all__ = ["flash_attention", "decode_attention", "dot_precision"]

_MASKED = -1e30  # finite stand-in for -inf (no inf - inf = nan)
_BIG = 2**30


def dot_precision(dtype):
    """Kernel dot precision for inputs of `dtype`, following `jax_default_matmul_precision` as XLA
    does: float32 inputs get IEEE float32 dots when the default is "highest"/"float32", otherwise
    the Triton default (TF32 on a GPU). The Triton lowering does not read the config itself."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    default = getattr(jax.config, "jax_default_matmul_precision", None)
    if default is not None and str(default).lower() in ("highest", "float32", "fp32"):
        return lax.Precision.HIGHEST
    return None


def _check_dim(dim: int) -> None:
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"kernel head_dim must be a power of two >= 16 (pad it first), got {dim}")


# ---------------------------------------------------------------------------------- flash


def _flash_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float, precision):
    # lo_ref, hi_ref: [BQ] int32 allowed key interval per query row.
    # q_ref, o_ref: [BQ, D]; k_ref, v_ref: [S, D] (the whole sequence of this kv head).
    q = q_ref[...]
    block_q, dim = q.shape
    lo = lo_ref[...]
    hi = hi_ref[...]
    nonempty = hi > lo
    first_key = jnp.min(jnp.where(nonempty, lo, _BIG))
    end_key = jnp.max(jnp.where(nonempty, hi, 0))
    first_block = first_key // block_k
    end_block = (end_key + block_k - 1) // block_k  # < first_block when every row is empty
    # Key blocks inside every row's interval need no mask: [full_lo, full_hi) (empty unless every
    # row is non-empty). The loop runs masked over the edges, unmasked over the interior.
    all_rows = jnp.min(nonempty.astype(jnp.int32)) > 0
    full_lo = jnp.clip((jnp.max(lo) + block_k - 1) // block_k, first_block, end_block)
    full_hi = jnp.clip(jnp.where(all_rows, jnp.min(hi) // block_k, 0), full_lo, end_block)
    full_lo = jnp.where(all_rows, full_lo, end_block)
    full_hi = jnp.where(all_rows, full_hi, end_block)

    def visit(j, carry, masked: bool):
        m, l, acc = carry
        keys = pl.ds(j * block_k, block_k)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale
        if masked:
            kpos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            mask = (kpos >= lo[:, None]) & (kpos < hi[:, None])
            s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    masked_visit = functools.partial(visit, masked=True)
    carry = (
        jnp.full((block_q,), _MASKED, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, dim), jnp.float32),
    )
    carry = lax.fori_loop(first_block, jnp.minimum(full_lo, end_block), masked_visit, carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(visit, masked=False), carry)
    _, l, acc = lax.fori_loop(jnp.maximum(full_hi, first_block), end_block, masked_visit, carry)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "precision", "interpret")
)
def flash_attention(q, k, v, kv_lo, kv_hi, *, scale: float, block_q: int = 64, block_k: int = 64,
                    num_warps: int | None = None, num_stages: int = 2, precision=None, interpret: bool = False):
    """Attention where query row `i` of batch `b` sees keys `kv_lo[b, i] <= s < kv_hi[b, i]`.

    Args:
      q: `[B, L, Hq, D]`; k, v: `[B, S, Hkv, D]`, Hq a multiple of Hkv, D a power of two >= 16.
      kv_lo, kv_hi: `[B, L]` int32; an empty interval gives a zero output row.
      scale: softmax scale (1/sqrt of the *unpadded* head_dim).
      block_q, block_k: tile sizes (powers of two >= 16), capped at the padded lengths.
      precision: for the two dots; `None` is TF32 for float32 inputs on a GPU, `HIGHEST` is IEEE
        float32 (bf16 inputs are unaffected). See `dot_precision`.
    Returns:
      `[B, L, Hq, D]` in q's dtype.
    """
    b, length, heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    _check_dim(dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    group = heads // kv_heads
    if length == 0 or b == 0:
        return jnp.zeros(q.shape, q.dtype)
    bq = min(block_q, pow2_at_least(max(length, 16)))
    bk = min(block_k, pow2_at_least(max(kv_len, 16)))
    lp = -(-length // bq) * bq
    sp = -(-kv_len // bk) * bk
    if lp != length:
        q = jnp.pad(q, ((0, 0), (0, lp - length), (0, 0), (0, 0)))
        kv_lo = jnp.pad(kv_lo, ((0, 0), (0, lp - length)))
        kv_hi = jnp.pad(kv_hi, ((0, 0), (0, lp - length)))
    if sp != kv_len:
        k, v = (jnp.pad(x, ((0, 0), (0, sp - kv_len), (0, 0), (0, 0))) for x in (k, v))
    kv_lo = jnp.minimum(kv_lo.astype(jnp.int32), kv_len)
    kv_hi = jnp.clip(kv_hi.astype(jnp.int32), 0, kv_len)
    warps = num_warps if num_warps is not None else (4 if dim <= 64 else 8)
    out = pl.pallas_call(
        functools.partial(_flash_kernel, block_k=bk, scale=scale, precision=precision),
        # Query blocks vary fastest (CUDA grid x), so concurrently running programs mostly share
        # one head's K/V in L2.
        grid=(lp // bq, b, heads),
        in_specs=[
            pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i)),
            pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i)),
            pl.BlockSpec((None, bq, None, dim), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, sp, None, dim), lambda i, bi, h: (bi, 0, h // group, 0)),
            pl.BlockSpec((None, sp, None, dim), lambda i, bi, h: (bi, 0, h // group, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, dim), lambda i, bi, h: (bi, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((b, lp, heads, dim), q.dtype),
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=num_stages),
        interpret=interpret,
        name="flash_attention",
    )(kv_lo, kv_hi, q, k, v)
    return out[:, :length]


# ---------------------------------------------------------------------------------- decode


def _decode_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k: int, split: int,
                   scale: float, precision):
    # lo_ref, hi_ref: [R] the batch row's key interval (same value in every row).
    # q_ref: [R, D] the query heads of one kv head; k_ref, v_ref: [split, D] one cache slice.
    # o_ref: [R, D] unnormalised partial output; m_ref, l_ref: [R] running max and sum.
    q = q_ref[...]
    rows, dim = q.shape
    base = pl.program_id(2) * split
    lo = jnp.maximum(lo_ref[...] - base, 0)  # [R], slice-relative
    hi = jnp.minimum(hi_ref[...] - base, split)
    first_block = jnp.min(lo) // block_k
    end_block = jnp.where(jnp.max(hi) > jnp.min(lo), (jnp.max(hi) + block_k - 1) // block_k, 0)

    def visit(j, carry):
        m, l, acc = carry
        keys = pl.ds(j * block_k, block_k)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale
        kpos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = (kpos >= lo[:, None]) & (kpos < hi[:, None])
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(first_block, end_block, visit, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit, static_argnames=("scale", "block_k", "num_splits", "num_warps", "num_stages", "precision", "interpret")
)
def decode_attention(q, k_cache, v_cache, kv_lo, kv_hi, *, scale: float, block_k: int = 64,
                     num_splits: int = 8, num_warps: int = 4, num_stages: int = 2, precision=None,
                     interpret: bool = False):
    """One query token per sequence against a cache, keys `kv_lo[b] <= s < kv_hi[b]`.

    Args:
      q: `[B, Hq, D]`; k_cache, v_cache: `[B, S, Hkv, D]`, D a power of two >= 16.
      kv_lo, kv_hi: `[B]` int32 key interval per sequence (empty -> zero output).
      num_splits: slices of the cache processed in parallel (split-K); capped so each slice holds
        at least one key block.
    Returns:
      `[B, Hq, D]` in q's dtype.
    """
    b, heads, dim = q.shape
    kv_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check_dim(dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    group = heads // kv_heads
    if b == 0 or kv_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    rows = max(16, pow2_at_least(group))
    bk = min(block_k, pow2_at_least(max(kv_len, 16)))
    splits = max(1, min(num_splits, -(-kv_len // bk)))
    split = -(-kv_len // (splits * bk)) * bk  # keys per split, a block multiple
    sp = split * splits
    if sp != kv_len:
        k_cache, v_cache = (jnp.pad(x, ((0, 0), (0, sp - kv_len), (0, 0), (0, 0))) for x in (k_cache, v_cache))
    qg = q.reshape(b, kv_heads, group, dim)
    if rows != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    lo = jnp.broadcast_to(jnp.clip(kv_lo.astype(jnp.int32), 0, kv_len)[:, None], (b, rows))
    hi = jnp.broadcast_to(jnp.clip(kv_hi.astype(jnp.int32), 0, kv_len)[:, None], (b, rows))
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, block_k=bk, split=split, scale=scale, precision=precision),
        grid=(b, kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, rows), lambda bi, g, s: (bi, 0)),
            pl.BlockSpec((None, rows), lambda bi, g, s: (bi, 0)),
            pl.BlockSpec((None, None, rows, dim), lambda bi, g, s: (bi, g, 0, 0)),
            pl.BlockSpec((None, split, None, dim), lambda bi, g, s: (bi, s, g, 0)),
            pl.BlockSpec((None, split, None, dim), lambda bi, g, s: (bi, s, g, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda bi, g, s: (bi, g, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda bi, g, s: (bi, g, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda bi, g, s: (bi, g, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv_heads, splits, rows, dim), jnp.float32),
            jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(lo, hi, qg, k_cache, v_cache)
    # Log-sum-exp combine over the splits (empty splits have l = 0 and contribute nothing).
    m_all = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [B, G, splits, R]
    total = jnp.sum(l * weight, axis=2)  # [B, G, R]
    out = jnp.sum(o * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :group].reshape(b, heads, dim).astype(q.dtype)
