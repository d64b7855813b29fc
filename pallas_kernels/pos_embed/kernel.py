"""Pallas (Triton backend) kernel for the bilinear position-embedding interpolation.

Each program instance handles `block_tokens` patches x `block_dim` hidden columns: it reads the
four table-row indices and weights of its patches (stored corner-major `[4, P]`, so every load is
a plain row of a ref, never a value slice), gathers the four `[block_tokens, block_dim]` row
tiles from the table and sums them in float32 in the reference's order (tap 0, 1, 2, 3).

Triton rules honoured here (see docs/kernels.md): power-of-two tiles (the hidden dimension is
tiled in 128-wide columns, 1152 = 9 x 128; patches are padded to a block multiple), no value
slicing, gathers written as `ref[index_vector, :]`, the Triton backend selected explicitly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from .._shapes import pow2_at_least

__all__ = ["interpolate_pos_embed"]

TAPS = 4


def _kernel(idx_ref, w_ref, table_ref, out_ref):
    # idx_ref, w_ref: [4, BT]; table_ref: [N, BD] (all table rows, this program's columns).
    acc = None
    for tap in range(TAPS):
        rows = table_ref[idx_ref[tap, :], :].astype(jnp.float32)  # gather [BT, BD]
        term = rows * w_ref[tap, :][:, None]
        acc = term if acc is None else acc + term
    out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("block_tokens", "block_dim", "num_warps", "interpret"))
def interpolate_pos_embed(table, indices, weights, *, block_tokens: int = 64, block_dim: int = 128,
                          num_warps: int = 4, interpret: bool = False):
    """`[P, D]` float32 = sum over taps of `table[indices[:, c]] * weights[:, c]`.

    Args:
      table: `[N, D]` embedding table (any float dtype).
      indices: `[P, 4]` int32 table rows; weights: `[P, 4]` float32 (`reference.interpolation_taps`).
      block_tokens, block_dim: tile sizes (powers of two); block_dim is capped at D rounded up.
      interpret: run the kernel in the Pallas interpreter (CPU testing).
    """
    num_rows, dim = table.shape
    patches = indices.shape[0]
    if patches == 0:
        return jnp.zeros((0, dim), jnp.float32)
    bd = min(block_dim, pow2_at_least(max(dim, 16)))
    bt = min(block_tokens, pow2_at_least(max(patches, 16)))
    dim_pad = -(-dim // bd) * bd
    patches_pad = -(-patches // bt) * bt
    if dim_pad != dim:
        table = jnp.pad(table, ((0, 0), (0, dim_pad - dim)))
    # Corner-major taps; padded patches read row 0 with weight 0.
    idx = jnp.pad(indices.astype(jnp.int32).T, ((0, 0), (0, patches_pad - patches)))
    wgt = jnp.pad(weights.astype(jnp.float32).T, ((0, 0), (0, patches_pad - patches)))
    out = pl.pallas_call(
        _kernel,
        grid=(patches_pad // bt, dim_pad // bd),
        in_specs=[
            pl.BlockSpec((TAPS, bt), lambda i, j: (0, i)),
            pl.BlockSpec((TAPS, bt), lambda i, j: (0, i)),
            pl.BlockSpec((num_rows, bd), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bt, bd), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((patches_pad, dim_pad), jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="interpolate_pos_embed",
    )(idx, wgt, table)
    return out[:patches, :dim]
