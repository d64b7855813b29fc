"""The routed Mixture-of-Experts block of Qwen3-VL-30B-A3B / 235B-A22B (`Qwen3VLMoeTextSparseMoeBlock`).

Per token: router logits `x @ gate` (`[E]`), softmax in float32, the top k experts, their weights
renormalised to sum to one; each chosen expert is a SwiGLU `(silu(x Wg) * (x Wu)) Wd` of width I, and
the block's output is the weighted sum of the k expert outputs. No shared expert, no capacity: no
token is ever dropped.

Experts run as a **grouped matmul** over the routed rows (a token's k choices are k rows) grouped by
expert, never as a dense all-experts product. Three implementations of the same numbers:

- `"ragged"`: rows sorted by expert, `lax.ragged_dot` with the group sizes (the spec; XLA's GPU
  lowering ran at 5-6 TFLOP/s on an H200 with jax 0.11.2).
- `"tokamax"`: the same sorted rows through `tokamax.ragged_dot` (an optional dependency, Python >=
  3.12: the `tokamax` extra), which picks its kernel for the device (Mosaic GPU on Hopper and
  Blackwell, XLA's where none applies). On an H200 at the 30B-A3B widths, bf16, the experts of a
  4,096-token prefill took 2.00 ms this way against 60.1 ms with `lax.ragged_dot` (jax 0.11.2; HF's
  `grouped_mm` 1.94 ms), and a decode step of 8 tokens 0.23 ms against 0.38 ms (docs/kernels.md).
- `"tiled"`: each expert's rows padded to a tile of `T` rows, and a loop over the tiles, each
  multiplying its rows by its own expert's weights. FLOPs ~ (rows + experts x T) x H x I, weight
  bytes read ~ the active experts'. XLA's CPU lowering of `ragged_dot` computes every expert for
  every row (6.6 s against 34 ms for 128 experts, 4,096 rows, 2048 -> 768), so this is the CPU path.
  Unused tail tiles are skipped (`lax.cond`). Differentiable by JAX's own rules.

`"auto"` takes `"tiled"` on a CPU; elsewhere `"tokamax"` when it is installed, else `"ragged"`.

Parameters (our layout; the released checkpoints' layout, which `params.RULES` also reads in the
transformers-5 module layout): `gate.kernel [H, E]`, `experts.gate_up_proj [E, H, 2I]` (gate columns
first, then up), `experts.down_proj [E, I, H]`.

Expert parallelism: under a mesh with an `expert` axis of size n > 1, `sharding.py` splits the
experts' leading axis over it (and their hidden dimension over `fsdp`), and `expert_parallel` runs
the experts under `shard_map`: each device all-gathers its experts' `fsdp` slices and the tokens
of its expert group (the n devices along `expert`), computes only the rows routed to its E / n
experts, and a reduce-scatter over `expert` sums the partial outputs back onto the devices that
hold the tokens. The exchange is an all-gather plus a reduce-scatter of the group's activations
(n x the bytes of an all-to-all dispatch, with no capacity and no dropped token); the router runs
outside, on the batch-split tokens.

Axes: T tokens, H hidden, E experts, K chosen experts per token, I expert width, M = T*K routed rows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from .config import TextConfig
from .layers import Linear
from .params import EXPERT, FSDP
from .quant import EXPERTS_KIND, QTensor, QuantSpec, qdot, storage_dtype, stored_shapes
from .sharding import BATCH

__all__ = ["MOE_IMPLEMENTATIONS", "Routing", "tokamax_module", "tokamax_installed", "resolve_implementation",
           "route", "expert_ffn", "expert_parallel", "tile_rows", "MoEBlock", "load_balancing_loss"]

MOE_IMPLEMENTATIONS = ("auto", "ragged", "tiled", "tokamax")


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens: `logits [T, E]` (as computed, for the aux loss),
    `experts [T, K]` int32 and their renormalised `weights [T, K]` (in the logits' dtype)."""

    logits: jax.Array
    experts: jax.Array
    weights: jax.Array


def route(logits: jax.Array, k: int) -> Routing:
    """Softmax in float32, top k, renormalised (HF's `Qwen3VLMoeTextTopKRouter`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = lax.top_k(probs, k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(logits, experts.astype(jnp.int32), top.astype(logits.dtype))


def _swiglu(x, gate_up, down):
    """One expert's (or a batch of rows') SwiGLU: `x [R, H]`, `gate_up [H, 2I]`, `down [I, H]` (arrays,
    or `quant.QTensor`s multiplied tile by tile)."""
    h = qdot(x, gate_up)
    gate, up = jnp.split(h, 2, axis=-1)
    return qdot(jax.nn.silu(gate) * up, down)


def _dense(weight, dtype):
    """A weight as an array in `dtype` (a `QTensor` dequantized whole: the `ragged_dot` spec path)."""
    return weight.dequantize(dtype) if isinstance(weight, QTensor) else weight.astype(dtype)


def tile_rows(rows: int, experts: int) -> int:
    """The tile height of the `"tiled"` path for `rows` routed rows (static): 1 while rows are few
    (decoding: each row multiplies only its own expert's weights), else the power of two nearest
    the mean rows per expert (at most 128), so that an expert's rows take about one tile: each tile
    reads its expert's weights once, which on a CPU costs more than the padded rows' FLOPs (30B-A3B
    widths, 2,048 routed rows: tiles of 8 / 16 / 32 / 64 rows took 0.51 / 0.39 / 0.41 / 0.52 s)."""
    if rows < 4 * experts:
        return 1
    return min(128, 1 << round(math.log2(rows / experts)))


def _group_keys(experts, local):
    """`(key [M], outside [M], sizes [count])`: each row's local expert index (`count` for a row
    whose expert is not in `local = (first, count)`, so that it sorts past every group) and the
    rows per local expert."""
    first, count = local
    local_id = experts - first
    outside = (local_id < 0) | (local_id >= count)
    key = jnp.where(outside, count, local_id)
    return key, outside, jnp.bincount(key, length=count + 1)[:count]


def tokamax_module():
    """The optional `tokamax` package (the `"tokamax"` implementation), or an ImportError saying how to
    install it."""
    try:
        return importlib.import_module("tokamax")
    except ImportError as error:
        raise ImportError("moe implementation 'tokamax' needs the tokamax package (Python >= 3.12): "
                          "pip install 'qwen3vl-jax[tokamax]'") from error


@functools.cache
def tokamax_installed() -> bool:
    """Whether the `"tokamax"` implementation can run here (tokamax imports)."""
    try:
        tokamax_module()
    except ImportError:
        return False
    return True


def resolve_implementation(implementation: str) -> str:
    """`implementation` checked, with `"auto"` replaced by this backend's choice (module docstring)."""
    if implementation not in MOE_IMPLEMENTATIONS:
        raise ValueError(f"moe implementation must be one of {MOE_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    if jax.default_backend() == "cpu":
        return "tiled"
    return "tokamax" if tokamax_installed() else "ragged"


def _ragged_ffn(x, experts, gate_up, down, local, *, library: bool = False):
    """Rows `x [M, H]` routed to `experts [M]` through a sorted grouped matmul (`lax.ragged_dot`, or
    `tokamax.ragged_dot` when `library`); rows whose expert is not in `local` (a [first, count)
    range of the experts) give zeros."""
    key, outside, sizes = _group_keys(experts, local)
    order = jnp.argsort(key, stable=True)
    sizes = sizes.astype(jnp.int32)
    rows, gate_up, down = x[order], _dense(gate_up, x.dtype), _dense(down, x.dtype)
    ragged_dot = tokamax_module().ragged_dot if library else lax.ragged_dot
    h = ragged_dot(rows, gate_up, sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h.astype(x.dtype), 2, axis=-1)
    y = ragged_dot(jax.nn.silu(gate) * up, down, sizes, preferred_element_type=jnp.float32)
    if library:
        y = jnp.where(outside[order][:, None], 0.0, y)  # rows past the groups: not written by every kernel
    return jnp.zeros_like(x).at[order].set(y.astype(x.dtype))


def _tiled_ffn(x, experts, gate_up, down, local):
    """The same rows through a loop over expert tiles (see the module docstring)."""
    count = local[1]
    rows = x.shape[0]
    tile = tile_rows(rows, count)
    key, outside, sizes = _group_keys(experts, local)
    tiles_per_expert = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per_expert)  # [count]
    tile_start = tile_end - tiles_per_expert
    row_start = jnp.cumsum(sizes) - sizes
    # Each row's rank within its expert's group (stable), hence its slot in the padded buffer.
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros(rows, jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    safe = jnp.minimum(key, count - 1)
    slot = tile_start[safe] * tile + rank - row_start[safe]
    n_tiles = -(-(rows + min(count, rows) * (tile - 1)) // tile)  # sum of ceil(size / T), at most
    slot = jnp.where(outside, n_tiles * tile, slot)  # outsiders land out of bounds: dropped
    padded = jnp.zeros((n_tiles * tile, x.shape[1]), x.dtype).at[slot].set(x, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), count - 1)
    used = tile_end[-1]

    def one_tile(args):
        index, rows_t, expert = args
        return lax.cond(index < used, lambda: _swiglu(rows_t, gate_up[expert], down[expert]),
                        lambda: jnp.zeros_like(rows_t))

    out = lax.map(one_tile, (jnp.arange(n_tiles), padded.reshape(n_tiles, tile, -1), tile_expert))
    return out.reshape(n_tiles * tile, -1).at[slot].get(mode="fill", fill_value=0)


def expert_ffn(x, routing: Routing, gate_up, down, *, implementation: str = "auto", local=None):
    """`x [T, H]` through each token's chosen experts, combined by the routing weights -> `[T, H]`.

    `gate_up [E', H, 2I]`, `down [E', I, H]` hold the experts `local = (first, E')` (default: all);
    choices of other experts contribute nothing (expert parallelism sums the devices' parts).
    """
    implementation = resolve_implementation(implementation)
    tokens, k = routing.experts.shape
    local = (0, gate_up.shape[0]) if local is None else local
    rows = jnp.repeat(x, k, axis=0)  # row t*K + j is token t's j-th choice
    chosen = routing.experts.reshape(-1)
    if implementation == "tiled":
        y = _tiled_ffn(rows, chosen, gate_up, down, local)
    else:
        y = _ragged_ffn(rows, chosen, gate_up, down, local, library=implementation == "tokamax")
    weights = routing.weights.astype(jnp.float32)[..., None]
    return jnp.sum(y.reshape(tokens, k, -1).astype(jnp.float32) * weights, axis=1).astype(x.dtype)


def _expert_axis_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[EXPERT]


def expert_parallel(x, routing: Routing, gate_up, down, *, implementation: str = "auto"):
    """`expert_ffn` under the current mesh's `expert` axis (see the module docstring); `x [T, H]`."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    n, experts = sizes[EXPERT], gate_up.shape[0]
    local = experts // n
    split = x.shape[0] % math.prod(sizes[a] for a in BATCH) == 0  # tokens split over the batch axes
    tokens = P(BATCH) if split else P()
    # (a quantized weight's stored kernel carries the sharding; its scale grid is replicated)
    gather_fsdp = sizes[FSDP] > 1 and _stored(gate_up).shape[1] % sizes[FSDP] == 0

    def body(x, chosen, weights, gate_up, down):
        if gather_fsdp:
            gate_up = _gathered(gate_up, axis=1)
            down = _gathered(down, axis=2)
        if split:
            x, chosen, weights = (lax.all_gather(a, EXPERT, axis=0, tiled=True) for a in (x, chosen, weights))
        first = lax.axis_index(EXPERT) * local
        y = expert_ffn(x, Routing(None, chosen, weights), gate_up, down, implementation=implementation,
                       local=(first, local))
        if split:
            return lax.psum_scatter(y, EXPERT, scatter_dimension=0, tiled=True)
        return lax.psum(y, EXPERT)

    kernel_specs = (P(EXPERT, FSDP, None), P(EXPERT, None, FSDP)) if gather_fsdp else (P(EXPERT), P(EXPERT))
    weight_specs = tuple(_weight_spec(w, spec) for w, spec in zip((gate_up, down), kernel_specs))
    return jax.shard_map(body, in_specs=(tokens, tokens, tokens, *weight_specs), out_specs=tokens,
                         check_vma=False)(x, routing.experts, routing.weights, gate_up, down)


def _stored(weight):
    """The array that holds a weight's experts (a `QTensor`'s stored kernel)."""
    return weight.kernel if isinstance(weight, QTensor) else weight


def _gathered(weight, axis: int):
    """A weight's `fsdp` slices all-gathered along `axis` (a `QTensor`'s kernel; its scales are whole)."""
    if isinstance(weight, QTensor):
        return dataclasses.replace(weight, kernel=lax.all_gather(weight.kernel, FSDP, axis=axis, tiled=True))
    return lax.all_gather(weight, FSDP, axis=axis, tiled=True)


def _weight_spec(weight, kernel_spec: P):
    """`shard_map`'s spec for a weight: `kernel_spec`, or for a `QTensor` the kernel's and its scale
    grid's (split over `expert` only)."""
    if isinstance(weight, QTensor):
        return dataclasses.replace(weight, kernel=kernel_spec, scale=P(EXPERT))
    return kernel_spec


class MoEBlock(nnx.Module):
    """Router + routed experts, in place of a decoder layer's dense MLP."""

    def __init__(self, config: TextConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.dtype = dtype
        self.gate = Linear(h, e, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if quant is not None and quant.covers(EXPERTS_KIND):
            self.experts = QuantExperts(e, h, i, spec=quant)
        else:
            self.experts = Experts(e, h, i, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, implementation: str = "auto"):
        """`x [B, L, H]` -> `(out [B, L, H], router logits [B*L, E])`."""
        b, length, h = x.shape
        flat = x.reshape(b * length, h)
        routing = route(self.gate(flat), self.top_k)
        run = expert_parallel if _expert_axis_size() > 1 else expert_ffn
        out = run(flat, routing, *self.experts.weights(), implementation=implementation)
        return out.reshape(b, length, h), routing.logits


class Experts(nnx.Module):
    """The fused expert weights of one layer (`Qwen3VLMoeTextExperts`)."""

    def __init__(self, experts: int, hidden: int, width: int, *, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.gate_up_proj = nnx.Param(init(rngs.params(), (experts, hidden, 2 * width), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))

    def weights(self):
        return self.gate_up_proj[...], self.down_proj[...]


class QuantExperts(nnx.Module):
    """Quantized expert weights (`quant.QuantSpec`): `gate_up_proj` / `down_proj` in the storage dtype
    with their scale grids `gate_up_proj_scale` / `down_proj_scale` (`[E, ...]` each), multiplied tile
    by tile inside each expert tile (`_swiglu`)."""

    def __init__(self, experts: int, hidden: int, width: int, *, spec: QuantSpec):
        self.method = spec.method
        self.blocks = (spec.block_for(hidden), spec.block_for(width))
        self.rows = (hidden, width)
        for name, (rows, cols), block in (("gate_up_proj", (hidden, 2 * width), self.blocks[0]),
                                          ("down_proj", (width, hidden), self.blocks[1])):
            shape, grid = stored_shapes(spec.method, block, rows, cols, out_major=False)
            setattr(self, name, nnx.Param(jnp.zeros((experts,) + shape, storage_dtype(spec.method))))
            setattr(self, name + "_scale", nnx.Param(jnp.ones((experts,) + grid, spec.np_scale_dtype)))

    def weights(self):
        return (QTensor(self.gate_up_proj[...], self.gate_up_proj_scale[...], self.method, self.blocks[0], self.rows[0]),
                QTensor(self.down_proj[...], self.down_proj_scale[...], self.method, self.blocks[1], self.rows[1]))


def load_balancing_loss(router_logits, k: int, mask=None) -> jax.Array:
    """HF's `load_balancing_loss_func` (Switch Transformer): `E * sum_e f_e * P_e` over all sparse
    layers' rows together, f_e the share of top-k assignments to expert e, P_e its mean router
    probability; padding rows (`mask [B*L]` False) excluded.

    `router_logits`: `[layers, B*L, E]` (or a sequence of `[B*L, E]`).
    """
    logits = jnp.stack(list(router_logits)) if not isinstance(router_logits, jax.Array) else router_logits
    experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, R, E]
    _, chosen = lax.top_k(probs, k)
    counts = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32), axis=-2)  # [N, R, E]
    weight = jnp.ones(logits.shape[1], jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32).reshape(-1)
    rows = weight.sum() * logits.shape[0]
    tokens_per_expert = jnp.einsum("nre,r->e", counts, weight) / rows
    prob_per_expert = jnp.einsum("nre,r->e", probs, weight) / rows
    return experts * jnp.sum(tokens_per_expert * prob_per_expert)
