"""Token reduction inside the language model: drop vision tokens at decoder layers (docs/pruning.md §11).

A method of this kind (`kind = "llm"`) says at which layers it drops and how it scores:

    stages(options: dict) -> tuple[Stage, ...]     Stage(layer K, rate r), K strictly increasing
    score(weights [B, H, S]) -> [B, S]             jnp: one score per key from the attention rows

Stage `(K, r)`: layers `0 .. K-1` see the tokens still present; the row of layer K-1's attention that
the last prompt token pays (`[B, H, S]`, every head) is scored (`score`); of the vision tokens
present, the `floor(r * n)` with the lowest scores are dropped (ties: the later position goes first),
and layers `K ..` and their KV cache hold only the rest. Text tokens are never dropped; kept tokens
keep their positions (mRoPE) and their order. Deepstack additions after later layers (K <= level)
go to the kept tokens only, as the features of the dropped tokens have nowhere to go.

  fastv         one stage: `{"layer": K, "rate": r}` (FastV: K = 2, r = 0.5 in the paper);
                the last prompt token's attention averaged over heads.
  pyramiddrop   several stages: `{"layers": (K1, K2, ...), "rate": r}` drops the share r of the vision
                tokens still present at each stage (PyramidDrop's lambda), or `"rates": (r1, r2, ...)`
                one per stage; the same score.

Static shapes: how many tokens each row keeps is known on the host (the rate and the row's vision
tokens), so each stage's length is a static number: the longest row's kept tokens rounded up to
`stage_granularity(L)` (an eighth of the sequence or bucket, at least 8), at most the previous
stage's. A bucketed `generate` then compiles once per (bucket, stage lengths), which for prompts
with the same images is once per bucket and rate. Which tokens are kept is decided on the device.

Axes: B batch, L tokens of the current stage, L' of the next, S keys, H heads.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Stage", "FastV", "PyramidDrop", "LLMPruning", "plan_llm_pruning", "compaction", "gather_rows",
           "stage_granularity", "stage_length", "llm_option", "prefill_flops"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """Layers `layer ..` hold only the vision tokens kept after dropping the share `rate` of those present."""

    layer: int
    rate: float


def _rate(value, method: str, what: str = "rate") -> float:
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Real):
        raise ValueError(f"in-LLM pruning method {method!r}: {what} must be a number in [0, 1), got {value!r}")
    value = float(value)
    if math.isnan(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"in-LLM pruning method {method!r}: {what} must be in [0, 1), got {value}")
    return value


def _layer(value, method: str, what: str = "layer") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"in-LLM pruning method {method!r}: {what} must be an integer >= 1 (the first layer "
                         f"that sees only the kept tokens), got {value!r}")
    return int(value)


def _options(options, method: str, allowed: set[str]) -> dict:
    if not isinstance(options, Mapping):
        raise ValueError(f"in-LLM pruning method {method!r} takes a dict of options {sorted(allowed)}, "
                         f"got {options!r}")
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(f"in-LLM pruning method {method!r}: unknown options {sorted(unknown)}; it takes "
                         f"{sorted(allowed)}")
    return dict(options)


def mean_over_heads(weights):
    """`[B, H, S] -> [B, S]`: the attention each key receives, averaged over the heads (float32)."""
    return jnp.mean(weights.astype(jnp.float32), axis=1)


class FastV:
    """FastV (Chen et al., 2024): at layer K drop the share r of the vision tokens that the last prompt
    token attends to least (layer K-1's attention, averaged over heads)."""

    kind = "llm"

    def stages(self, options) -> tuple[Stage, ...]:
        options = _options(options, "fastv", {"layer", "rate"})
        if set(options) != {"layer", "rate"}:
            raise ValueError(f"in-LLM pruning method 'fastv' needs both 'layer' and 'rate', got {sorted(options)}")
        return (Stage(_layer(options["layer"], "fastv"), _rate(options["rate"], "fastv")),)

    def score(self, weights):
        return mean_over_heads(weights)


class PyramidDrop:
    """PyramidDrop (Xing et al., 2024): stages at layers K1 < K2 < ..., each dropping the share r (or
    r_i) of the vision tokens still present, ranked as FastV ranks them."""

    kind = "llm"

    def stages(self, options) -> tuple[Stage, ...]:
        options = _options(options, "pyramiddrop", {"layers", "rate", "rates"})
        layers = options.get("layers")
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError(f"in-LLM pruning method 'pyramiddrop' needs 'layers', a non-empty list of layer "
                             f"indices, got {layers!r}")
        layers = [_layer(k, "pyramiddrop", "each of layers") for k in layers]
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"in-LLM pruning method 'pyramiddrop': layers must increase strictly, got {layers}")
        if ("rate" in options) == ("rates" in options):
            raise ValueError("in-LLM pruning method 'pyramiddrop' needs exactly one of 'rate' (every stage) and "
                             "'rates' (one per stage)")
        rates = options.get("rates")
        if rates is None:
            rates = [options["rate"]] * len(layers)
        if not isinstance(rates, (list, tuple)) or len(rates) != len(layers):
            raise ValueError(f"in-LLM pruning method 'pyramiddrop': 'rates' must hold one rate per layer "
                             f"({len(layers)}), got {rates!r}")
        return tuple(Stage(k, _rate(r, "pyramiddrop", "each rate")) for k, r in zip(layers, rates))

    def score(self, weights):
        return mean_over_heads(weights)


def stage_granularity(length: int) -> int:
    """Stage lengths are multiples of this: an eighth of the (bucketed) length, at least 8."""
    return max(8, int(length) // 8)


def stage_length(needed: int, previous: int, granularity: int) -> int:
    """`needed` rounded up to `granularity`, at most `previous` (and at least 1)."""
    return int(min(previous, max(1, -(-int(needed) // granularity) * granularity)))


@dataclasses.dataclass(frozen=True)
class LLMPruning:
    """An in-LLM pruning plan for one batch (a pytree: the arrays are data, the rest static).

    method: the registered name (its `score` ranks the tokens). layers: each stage's first pruned
    layer. lengths: each stage's sequence length. right_aligned: the batch is left-padded (every row
    ends at the last column), so the kept tokens of every stage end there too (what `generate`
    needs); otherwise each row's kept tokens start where its real tokens did.
    keep: `[stages, B]` int32, the vision tokens each row keeps after each stage.
    visual: `[B, L]` bool, the vision tokens of the input layout.
    """

    keep: jax.Array
    visual: jax.Array
    method: str = "fastv"
    layers: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    right_aligned: bool = True


jax.tree_util.register_dataclass(LLMPruning, data_fields=["keep", "visual"],
                                 meta_fields=["method", "layers", "lengths", "right_aligned"])


def plan_llm_pruning(attention_mask, visual, method: str, stages: tuple[Stage, ...], num_layers: int,
                     bucket: int | None = None) -> LLMPruning:
    """The host plan of `stages` for a batch: kept vision tokens per row and stage, static lengths.

    Args:
      attention_mask: `[B, L]` bool real tokens (one run per row). visual: `[B, L]` bool vision tokens.
      stages: validated stages; every layer must be < num_layers (ValueError naming the method).
      bucket: the length the granularity is taken from (default L).
    """
    mask = np.asarray(attention_mask, bool)
    visual = np.asarray(visual, bool) & mask
    for stage in stages:
        if stage.layer >= num_layers:
            raise ValueError(f"in-LLM pruning method {method!r} drops at layer {stage.layer}, but the model has "
                             f"{num_layers} decoder layers (layers 1 .. {num_layers - 1} can be pruned)")
    batch, length = mask.shape
    real = mask.sum(axis=1)
    starts = np.where(real > 0, np.argmax(mask, axis=1), 0)
    right = bool(mask[:, -1].all())
    text = real - visual.sum(axis=1)
    present = visual.sum(axis=1).astype(np.int64)
    granularity = stage_granularity(bucket or length)
    keep, lengths, previous = [], [], length
    for stage in stages:
        present = present - np.floor(stage.rate * present.astype(np.float64)).astype(np.int64)
        count = text + present
        needed = count.max() if right else (starts + count).max()
        previous = stage_length(needed, previous, granularity)
        keep.append(present.copy())
        lengths.append(previous)
    return LLMPruning(jnp.asarray(np.stack(keep).reshape(len(stages), batch), jnp.int32), jnp.asarray(visual),
                      method, tuple(s.layer for s in stages), tuple(lengths), right)


def compaction(scores, visual, real, keep, length: int, right_aligned: bool):
    """Which rows of the current layout fill the next stage's `length` slots.

    Args:
      scores: `[B, L]` float, higher = more worth keeping (read at vision tokens only).
      visual, real: `[B, L]` bool. keep: `[B]` int, the vision tokens each row keeps.
    Returns:
      `[B, length]` int32 source row of each slot, -1 for padding. A row keeps its real text tokens and
      its `keep` best-scored vision tokens (ties to the earlier position), in order, right-aligned
      or starting where its real tokens started.
    """
    batch, current = visual.shape
    pos = jnp.arange(current, dtype=jnp.int32)
    candidates = visual & real
    key = jnp.where(candidates, -scores.astype(jnp.float32), jnp.inf)
    order = jnp.argsort(key, axis=1, stable=True)
    rank = jnp.zeros((batch, current), jnp.int32).at[jnp.arange(batch)[:, None], order].set(pos[None])
    kept = (real & ~visual) | (candidates & (rank < keep[:, None]))
    count = jnp.sum(kept, axis=1, dtype=jnp.int32)
    first = jnp.where(jnp.any(real, axis=1), jnp.argmax(real, axis=1), 0).astype(jnp.int32)
    offset = length - count if right_aligned else first
    sources = jnp.argsort(jnp.where(kept, pos[None], current + pos[None]), axis=1, stable=True).astype(jnp.int32)
    slot = jnp.arange(length, dtype=jnp.int32)[None] - offset[:, None]
    valid = (slot >= 0) & (slot < count[:, None])
    picked = jnp.take_along_axis(sources, jnp.clip(slot, 0, current - 1), axis=1)
    return jnp.where(valid, picked, -1)


def gather_rows(x, rows, axis: int, fill=0):
    """`x` with its `axis` (length L, the batch just before it) taken at `rows [B, L']`; -1 -> `fill`."""
    index = jnp.maximum(rows, 0)
    shape = [1] * x.ndim
    shape[axis - 1], shape[axis] = rows.shape
    index = index.reshape(shape)
    picked = jnp.take_along_axis(x, jnp.broadcast_to(index, x.shape[:axis] + rows.shape[1:2] + x.shape[axis + 1:]),
                                 axis=axis)
    valid = (rows >= 0).reshape(shape)
    return jnp.where(valid, picked, jnp.asarray(fill, x.dtype))


def llm_option(method: str, rate: float, num_layers: int) -> tuple[str, dict]:
    """The in-LLM option for a method named as the ablation names it, at `rate`.

    `"fastv"` drops at layer 2 (the paper's K; layer 1 in a 2-layer model), `"fastv@K"` at layer K;
    `"pyramiddrop"` at a quarter, a half and three quarters of the depth (PyramidDrop's 4 stages:
    8, 16, 24 of 32; at least layer 1, repeats removed), `"pyramiddrop@K1,K2,..."` at those layers,
    each stage dropping the share `rate` of the vision tokens present. ValueError naming the method
    for anything else.
    """
    name, _, layers = str(method).partition("@")
    try:
        chosen = [int(k) for k in layers.split(",")] if layers else None
    except ValueError:
        raise ValueError(f"in-LLM pruning method {method!r}: the layers after '@' must be integers, e.g. "
                         f"'{name}@2' or '{name}@2,4'") from None
    if name == "fastv":
        if chosen is not None and len(chosen) != 1:
            raise ValueError(f"in-LLM pruning method {method!r}: fastv drops at one layer, e.g. 'fastv@2'")
        return name, {"layer": chosen[0] if chosen else min(2, max(1, num_layers - 1)), "rate": rate}
    if name == "pyramiddrop":
        if chosen is None:
            chosen = sorted({max(1, num_layers * i // 4) for i in (1, 2, 3)})
        return name, {"layers": tuple(chosen), "rate": rate}
    raise ValueError(f"in-LLM pruning method {method!r}: the ablation knows 'fastv[@K]' and "
                     "'pyramiddrop[@K1,K2,...]'")


def prefill_flops(config, tokens_per_layer) -> float:
    """Matmul FLOPs of the language model's prefill when layer n runs over `tokens_per_layer[n]`
    tokens (causal attention over the same tokens), plus the LM head of the last token.

    Per layer of n tokens: the q, k, v and o projections `2 n E (2 H D + 2 G D)`, the SwiGLU MLP
    `6 n E I`, and attention `2 H D n (n + 1)` (scores and the weighted sum over the n (n + 1) / 2
    causal pairs). `config`: a `TextConfig`.
    """
    e, h, g, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    total = 2.0 * e * config.vocab_size
    for n in tokens_per_layer:
        n = float(n)
        total += 2 * n * e * (2 * h * d + 2 * g * d) + 6 * n * e * config.intermediate_size + 2 * h * d * n * (n + 1)
    return total
