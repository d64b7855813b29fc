"""Building blocks shared by the vision tower and the language model.

Numerics follow HF: LayerNorm statistics in float32 with the two-pass variance (Flax's default
fast variance E[x^2] - E[x]^2 loses digits that torch keeps); RMSNorm normalizes in float32,
casts back, then scales; rotary is applied by the callers in float32.

Layer stacks (`make_stack` / `run_stack`): a tower's repeated blocks are either a list of modules
(one parameter per block; unrolled) or one module whose parameters carry a leading block axis
(built with `nnx.vmap`, run under `lax.scan`, so compile time does not grow with depth). The
choice is a runtime option: both layouts hold the same numbers, and the converter and Orbax see
one canonical per-block naming (`model.py`). On a CPU, XLA copies a stacked parameter's slice
before each matmul, so memory-bound decoding prefers the list; on deep models compile time
prefers the stack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["Linear", "LayerNorm", "RMSNorm", "rotate_half", "apply_rotary", "make_stack", "run_stack",
           "SCAN_MIN_DEPTH", "use_scan", "check_layers", "segment_edges"]


Linear = nnx.Linear
"""`nnx.Linear`: kernel `[in, out]` (HF's weight transposed), optional bias."""

LayerNorm = functools.partial(nnx.LayerNorm, epsilon=1e-6, use_fast_variance=False)
"""LayerNorm with HF's epsilon (1e-6) and an exact two-pass variance."""


class RMSNorm(nnx.Module):
    """Qwen3's RMSNorm: `weight * (x / rms(x))`, normalized in float32 (`Qwen3VLTextRMSNorm`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x32 = x.astype(jnp.float32)
        normed = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return self.weight[...] * normed.astype(x.dtype)


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    """`[x1, x2] -> [-x2, x1]` over the last axis (the rotate-half rotary layout)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half rotary in float32, cast back to x's dtype; cos/sin broadcast against x."""
    x32 = x.astype(jnp.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)


# ---------------------------------------------------------------------- layer stacks

SCAN_MIN_DEPTH = 16
"""`scan_layers=None` scans a tower of at least this many blocks (every full-size preset)."""


def use_scan(scan_layers: bool | None, depth: int) -> bool:
    """Resolve the `scan_layers` option for a tower of `depth` blocks (None: by depth)."""
    if scan_layers is None:
        return depth >= SCAN_MIN_DEPTH
    if not isinstance(scan_layers, bool):
        raise ValueError(f"scan_layers must be True, False or None (by depth), got {scan_layers!r}")
    return scan_layers


def make_stack(factory: Callable[[nnx.Rngs], nnx.Module], count: int, scan: bool, rngs: nnx.Rngs):
    """`count` blocks from `factory(rngs)`: an `nnx.List`, or (scan) one module with stacked parameters."""
    if not scan:
        return nnx.List([factory(rngs) for _ in range(count)])

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
    def create(block_rngs):
        return factory(block_rngs)

    return create(rngs)


def run_stack(blocks, step: Callable, carry, *, scan: bool, remat: bool = False, collect: bool = False,
              start: int = 0, stop: int | None = None):
    """Run `carry = step(block, carry, index)` over the blocks `[start, stop)`; returns `(carry, outputs)`.

    `step` returns `(carry, output)`; outputs (only when `collect`) are stacked along a new leading
    axis. `index` is a Python int when unrolled and a traced int32 under `lax.scan`, so a step can
    branch statically when it can. A stacked (`scan`) tower runs a range of several blocks under
    `lax.scan` over the slice of its parameters, and a range of one block unrolled (a static index:
    the way to treat one block specially, e.g. to return its attention). `remat` recomputes each
    block's activations in the backward pass (`jax.checkpoint` per block).
    """

    def apply(graphdef, params, carry, index):
        carry, out = step(nnx.merge(graphdef, params), carry, index)
        return carry, (out if collect else None)

    if scan:
        graphdef, params = nnx.split(blocks)
        count = jax.tree.leaves(params)[0].shape[0]
    else:
        count = len(blocks)
    stop = count if stop is None else stop
    if not 0 <= start < stop <= count:
        raise ValueError(f"block range [{start}, {stop}) is not inside the {count} blocks")
    if scan and stop - start > 1:
        if (start, stop) != (0, count):
            params = jax.tree.map(lambda x: x[start:stop], params)

        def body(carry, xs):
            params_i, index = xs
            return apply(graphdef, params_i, carry, index)

        if remat:
            body = jax.checkpoint(body)
        return jax.lax.scan(body, carry, (params, jnp.arange(start, stop, dtype=jnp.int32)))
    outputs = []
    for index in range(start, stop):
        if scan:
            block_def, block_params = graphdef, jax.tree.map(lambda x, i=index: x[i], params)
        else:
            block_def, block_params = nnx.split(blocks[index])
        fn = jax.checkpoint(apply, static_argnums=(0, 3)) if remat else apply
        carry, out = fn(block_def, block_params, carry, index)
        outputs.append(out)
    if not collect:
        return carry, None
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def check_layers(layers, count: int, what: str = "return_attentions", noun: str = "layer") -> tuple[int, ...]:
    """The sorted distinct layer indices of `layers` (None, an int or a sequence of ints), each in
    `[0, count)`; ValueError naming `what` otherwise."""
    if layers is None:
        return ()
    items = (layers,) if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool) else layers
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"{what} must be a {noun} index or a sequence of them, got {layers!r}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or not 0 <= item < count:
            raise ValueError(f"{what}: {item!r} is not a {noun} index in [0, {count}) (the model has {count} {noun}s)")
    return tuple(sorted({int(i) for i in items}))


def segment_edges(count: int, single: tuple[int, ...]) -> list[tuple[int, int]]:
    """`[0, count)` cut into ranges so that each index of `single` is a range of its own."""
    edges = sorted({0, count} | {i for s in single for i in (s, s + 1)})
    return list(zip(edges, edges[1:]))
