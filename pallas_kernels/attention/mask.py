"""What attention may see, described rather than materialized.

Every mask the model needs gives each query row one contiguous run of keys, so the description is
two integers per query row: query row `(b, i)` attends to the keys `kv_start[b, i] <= s <
kv_end[b, i]` (an empty run gives a zero output row). That is `O(B * L)` integers instead of a
`[B, L, S]` boolean array, and it is what both the jnp references (`reference.py`) and the Pallas
kernels (`kernel.py`) read directly.

The constructors say what the mask is:

- `AttentionMask.causal(starts, ends, num_queries, offset)`: causal self-attention over a padded
  batch. Row b's real tokens are the slots `[starts[b], ends[b])` (left padding: `ends = L`; right
  padding: `starts = 0`); the query in slot `offset + i` sees the real keys up to itself. With a KV
  cache, `offset` is the slot the call starts writing at, so prefill (offset 0) and one decode
  step (offset = the cache index, `num_queries = 1`) are the same constructor.
- `AttentionMask.segments(segment_ids, segment_rows)`: packed non-causal attention within contiguous
  segments (one per image frame in the vision tower); negative ids are padding. `segment_rows`, when
  the caller knows it, says every segment is that many rows long, starting at row 0: a static hint
  the blocked spec uses to align its blocks with the segments (`reference.aligned_block`). It
  changes which block pairs are computed, never the result. `longest_segment`, when segments differ
  in length, bounds them: the blocked spec then uses blocks of about half that many rows
  (`reference.segment_block`) instead of its default, so a query block of short segments visits a few
  short key blocks rather than one long, mostly masked one. Also work only, never the result.

`dense(num_keys)` expands a description to the boolean `[B, L, S]` mask: a test oracle only.

Axes: B batch, L query rows, S keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["AttentionMask", "segment_intervals"]


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Per query row, the key run `[kv_start, kv_end)`; both `[B, L]` int32 (a pytree).

    `segment_rows` (static, 0 = no promise): every segment is this many rows, the first at row 0.
    `longest_segment` (static, 0 = no promise): no segment is longer than this many rows.
    """

    kv_start: jax.Array
    kv_end: jax.Array
    segment_rows: int = 0
    longest_segment: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.kv_start.shape)

    @classmethod
    def causal(cls, starts, ends, num_queries: int, offset=0) -> "AttentionMask":
        """Causal attention over real slots `[starts[b], ends[b])`; query i sits at slot `offset + i`.

        A query outside its row's real slots (padding) sees nothing. `offset` may be traced.
        """
        starts = jnp.asarray(starts, jnp.int32)[:, None]
        ends = jnp.asarray(ends, jnp.int32)[:, None]
        slot = jnp.asarray(offset, jnp.int32) + jnp.arange(num_queries, dtype=jnp.int32)[None]
        real = (slot >= starts) & (slot < ends)
        return cls(jnp.where(real, starts, 0), jnp.where(real, slot + 1, 0))

    @classmethod
    def segments(cls, segment_ids, segment_rows: int = 0, longest_segment: int = 0) -> "AttentionMask":
        """Non-causal attention within contiguous runs of equal ids; `segment_ids [S]` or `[B, S]`.

        `segment_rows`: the common length of the segments when the caller knows it (a hint for the
        block layout; 0 = unknown or mixed). `longest_segment`: an upper bound on their lengths when
        they differ (a hint for the block size; 0 = unknown)."""
        ids = jnp.asarray(segment_ids, jnp.int32)
        lo, hi = segment_intervals(ids)
        if ids.ndim == 1:
            lo, hi = lo[None], hi[None]
        return cls(lo, hi, int(segment_rows), int(longest_segment))

    def dense(self, num_keys: int) -> jax.Array:
        """The boolean `[B, L, S]` mask this describes (test oracle; never on the model's path)."""
        pos = jnp.arange(num_keys, dtype=jnp.int32)
        return (pos >= self.kv_start[..., None]) & (pos < self.kv_end[..., None])


jax.tree_util.register_dataclass(AttentionMask, data_fields=["kv_start", "kv_end"], meta_fields=["segment_rows", "longest_segment"])


def segment_intervals(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token, the `[first, last + 1)` key run of its contiguous segment; padding (< 0) gets `[0, 0)`."""
    size = segment_ids.shape[-1]
    idx = jnp.arange(size, dtype=jnp.int32)
    boundary = segment_ids[..., 1:] != segment_ids[..., :-1]
    true = jnp.ones(segment_ids.shape[:-1] + (1,), bool)
    starts = jnp.concatenate([true, boundary], axis=-1)
    ends = jnp.concatenate([boundary, true], axis=-1)
    first = lax.cummax(jnp.where(starts, idx, 0), axis=segment_ids.ndim - 1)
    last = lax.cummin(jnp.where(ends, idx, size - 1), axis=segment_ids.ndim - 1, reverse=True)
    valid = segment_ids >= 0
    return jnp.where(valid, first, 0).astype(jnp.int32), jnp.where(valid, last + 1, 0).astype(jnp.int32)
