"""Attention as the model calls it: `attention(q, k, v, mask)` with an `AttentionMask` description.

`implementation`: `"xla"` (the pure-jnp spec in `reference.py`), `"pallas"` (the Triton kernels in
`kernel.py`; run in the Pallas interpreter on a non-GPU backend) or `"auto"` (Pallas on a GPU
backend, XLA elsewhere). Unknown names are an error, and `"pallas"` never falls back silently.
Both read the same description (per query row, one run of keys), so every mask the model can
express runs on either path.

L > 1 query rows run the flash kernel; L == 1 (decode) the split-K decode kernel.

Gradients: the kernels are forward-only, so the Pallas path is a `jax.custom_vjp` whose backward
is the jnp spec's own (its flash backward, on the same inputs). The gradient is then
exactly the spec's gradient (the forward values of the two paths agree to rounding), at the spec's
cost and memory; dedicated backward kernels can replace it without changing the contract.

head_dim is padded inside this module to the kernel's power-of-two width (64 -> 64, 72 -> 128,
128 -> 128) with zeros: zero columns change neither q.k nor the kept output columns, and the
softmax scale stays 1/sqrt(original head_dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._dispatch import IMPLEMENTATIONS, resolve
from .._shapes import pow2_at_least
from . import kernel, reference
from .mask import AttentionMask

__all__ = [
    "attention",
    "attention_weights",
    "AttentionMask",
    "varlen_attention",
    "causal_attention",
    "decode_attention",
    "default_blocks",
    "default_splits",
    "IMPLEMENTATIONS",
]


def _kernel_dim(dim: int) -> int:
    return max(16, pow2_at_least(dim))


def _pad_dim(x, width: int):
    pad = width - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


# Shared memory the flash kernel's tiles may take: the query tile plus double-buffered key and value
# tiles, `(bq + 2 * 2 * bk) * width * itemsize`. 160 KiB is what bf16 128 x 128 tiles at width 128
# take, which compiled and ran on an H200; float32 at width 128 asks for 320 KiB at those tiles, over
# the SM's 227 KiB.
_TILE_SMEM_BYTES = 160 * 1024


def default_blocks(width: int, itemsize: int = 2) -> tuple[int, int]:
    """The flash kernel's tiles `(block_q, block_k)` for a padded head width and element size.

    Measured on an H200 (`scripts/bench_gpu.py`'s sweep, bf16): at width 64, 64 x 64 tiles ran a
    12,544-token varlen attention in 2.44 ms and 128 x 128 in 2.49 ms; at width 128 (the 8B vision
    tower's 72, padded), 64 x 64 ran 8.04 ms and 128 x 128 3.69 ms, and the 8B causal prefill of
    4,096 tokens 0.97 ms against 0.49 ms. So: 128 x 128 from width 128, 64 x 64 below, halved
    until the tiles fit `_TILE_SMEM_BYTES` (float32 at width 128 gets 64 x 64).
    """
    tile = 128 if width >= 128 else 64
    while tile > 16 and (tile + 4 * tile) * width * itemsize > _TILE_SMEM_BYTES:
        tile //= 2
    return tile, tile


def default_splits(batch: int, kv_heads: int, kv_len: int) -> int:
    """The decode kernel's split-K when none is given: about 264 programs (two per SM of an H200),
    each split at least 256 keys, rounded up to a power of two so that a power-of-two cache divides
    evenly (an uneven split pads, i.e. copies, the whole cache: 5 splits of an 8,192-slot cache at
    batch 8 ran 3x slower than 8 on an H200)."""
    wanted = pow2_at_least(-(-264 // (batch * kv_heads)))
    return max(1, min(wanted, -(-kv_len // 256)))


def _kernels(q, k, v, kv_start, kv_end, interpret, block_q, block_k, num_splits):
    """The forward kernels: q `[B, L, H, D]`, k/v `[B, S, G, D]`, runs `[B, L]` -> `[B, L, H, D]`.

    Tiles of None take `default_blocks` (the flash kernel) or 64 keys (decode); `num_splits` of None
    takes `default_splits`."""
    b, length, heads, dim = q.shape
    width = _kernel_dim(dim)
    precision = kernel.dot_precision(q.dtype)
    q, k, v = (_pad_dim(x, width) for x in (q, k, v))
    if length == 1:
        kv_len, kv_heads = k.shape[1], k.shape[2]
        splits = num_splits or default_splits(b, kv_heads, kv_len)
        out = kernel.decode_attention(q[:, 0], k, v, kv_start[:, 0], kv_end[:, 0], scale=dim**-0.5,
                                      block_k=block_k or 64, num_splits=splits, precision=precision,
                                      interpret=interpret)[:, None]
    else:
        tile_q, tile_k = default_blocks(width, jnp.dtype(q.dtype).itemsize)
        out = kernel.flash_attention(q, k, v, kv_start, kv_end, scale=dim**-0.5, block_q=block_q or tile_q,
                                     block_k=block_k or tile_k, precision=precision, interpret=interpret)
    return out[..., :dim]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _pallas_attention(q, k, v, kv_start, kv_end, interpret, block_q, block_k, num_splits):
    return _kernels(q, k, v, kv_start, kv_end, interpret, block_q, block_k, num_splits)


def _pallas_forward(q, k, v, kv_start, kv_end, interpret, block_q, block_k, num_splits):
    out = _kernels(q, k, v, kv_start, kv_end, interpret, block_q, block_k, num_splits)
    return out, (q, k, v, kv_start, kv_end)


def _pallas_backward(interpret, block_q, block_k, num_splits, residuals, grad):
    q, k, v, kv_start, kv_end = residuals
    _, pullback = jax.vjp(lambda q, k, v: reference.attention(q, k, v, kv_start, kv_end), q, k, v)
    return (*pullback(grad), None, None)  # the key runs are integers: no cotangent


_pallas_attention.defvjp(_pallas_forward, _pallas_backward)


def attention(q, k, v, mask: AttentionMask, *, implementation: str = "auto", block_q: int | None = None,
              block_k: int | None = None, num_splits: int | None = None):
    """Grouped-query attention under a mask description.

    Args:
      q: `[B, L, H, D]`; k, v: `[B, S, G, D]` (H a multiple of G; query head h reads kv head h // (H / G)).
      mask: an `AttentionMask` with `[B, L]` key runs.
      block_q, block_k: kernel tiles (None: `default_blocks` for the padded head width; decode 64 keys);
        num_splits: the decode kernel's split-K (None: `default_splits`, enough to fill a GPU).
    Returns:
      `[B, L, H, D]` in q's dtype; a row with an empty run is zero.
    """
    use_pallas, interpret = resolve(implementation)
    if mask.shape != q.shape[:2]:
        raise ValueError(f"mask describes {mask.shape} query rows but q has {q.shape[:2]}")
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if not use_pallas:
        op = functools.partial(reference.attention, segment_rows=mask.segment_rows,
                               longest_segment=mask.longest_segment)
    else:
        op = functools.partial(_pallas_attention, interpret=interpret, block_q=block_q, block_k=block_k,
                               num_splits=num_splits)
    return _under_current_mesh(op, q, k, v, mask.kv_start, mask.kv_end)


def attention_weights(q, k, mask: AttentionMask):
    """The softmax probabilities `[B, H, L, S]` (float32) that `attention` applies under `mask`.

    They are the spec's (`reference.attention_weights`: `exp(score - lse)` with the spec's own
    log-sum-exp), whichever implementation computes the outputs: the Pallas kernels are checked
    against that spec. Materializes `[B, H, L, S]`; a row with an empty run is zero.
    """
    if mask.shape != q.shape[:2]:
        raise ValueError(f"mask describes {mask.shape} query rows but q has {q.shape[:2]}")
    return reference.attention_weights(q, k.astype(q.dtype), mask.kv_start, mask.kv_end,
                                       segment_rows=mask.segment_rows, longest_segment=mask.longest_segment)


# The mesh convention of the model (`qwen3vl_jax.sharding`): batch over these axes, heads over this one.
BATCH_AXES = ("data", "expert", "fsdp")
HEAD_AXIS = "tensor"


def _under_current_mesh(op, q, k, v, kv_start, kv_end):
    """Run `op` per device under `shard_map` when a mesh is current (`jax.set_mesh`).

    A Pallas call is opaque to GSPMD, and GSPMD does not split the spec's loops over query blocks
    (it would compute every row on every device), so under a mesh each device runs the op on its
    own rows: the batch split over `BATCH_AXES` and the heads over `HEAD_AXIS`, each where it
    divides (query and kv heads together, so every query head finds its kv head on the same
    device); the rest whole. Attention never mixes batch rows or heads, so no communication is
    needed inside, and the result is the same as on one device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return op(q, k, v, kv_start, kv_end)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    batch = tuple(a for a in BATCH_AXES if a in sizes)
    batch_size = 1
    for a in batch:
        batch_size *= sizes[a]
    batch = batch if batch and q.shape[0] % batch_size == 0 else None
    heads = sizes.get(HEAD_AXIS)
    head = HEAD_AXIS if heads and q.shape[2] % heads == 0 and k.shape[2] % heads == 0 else None
    rows, runs = P(batch, None, head, None), P(batch, None)
    if batch is None and head is None:
        return op(q, k, v, kv_start, kv_end)
    return jax.shard_map(op, in_specs=(rows, rows, rows, runs, runs), out_specs=rows,
                         check_vma=False)(q, k, v, kv_start, kv_end)


# ---------------------------------------------------------------------- named masks (kernel tests, benchmarks)


def varlen_attention(q, k, v, segment_ids, *, implementation: str = "auto", block_q: int | None = None,
                     block_k: int | None = None):
    """Non-causal attention within contiguous segments; q, k, v `[S, H, D]`, `segment_ids [S]`.

    Negative ids are padding (never attended; zero output). Both paths visit only the key blocks
    that overlap each query block's segments.
    """
    mask = AttentionMask.segments(segment_ids)
    return attention(q[None], k[None], v[None], mask, implementation=implementation, block_q=block_q,
                     block_k=block_k)[0]


def causal_attention(q, k, v, lengths, *, starts=None, implementation: str = "auto", block_q: int | None = None,
                     block_k: int | None = None):
    """Causal GQA self-attention; q `[B, S, Hq, D]`, k/v `[B, S, Hkv, D]`, `lengths [B]`.

    Valid tokens of row b are `[starts[b], starts[b] + lengths[b])` (`starts` defaults to 0, right
    padding; left padding is `starts = S - lengths`). Rows outside the valid range are zero.
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    mask = AttentionMask.causal(starts, starts + lengths, q.shape[1])
    return attention(q, k, v, mask, implementation=implementation, block_q=block_q, block_k=block_k)


def decode_attention(q, k_cache, v_cache, lengths, *, starts=None, implementation: str = "auto",
                     block_k: int | None = None, num_splits: int | None = None):
    """One query token per row against a KV cache (split-K in the Pallas kernel).

    q `[B, Hq, D]`, caches `[B, S_max, Hkv, D]`; keys `[starts[b], starts[b] + lengths[b])` are
    attended (`starts` defaults to 0). `num_splits=None` picks enough splits to fill a GPU.
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    mask = AttentionMask(starts[:, None], (starts + lengths)[:, None])
    return attention(q[:, None], k_cache, v_cache, mask, implementation=implementation, block_k=block_k,
                     num_splits=num_splits)[:, 0]
