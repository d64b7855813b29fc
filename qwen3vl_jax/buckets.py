"""Static shape buckets: the JAX stand-in for vLLM's encoder CUDA graphs.

A jitted function compiles once per input shape. Images come in every size, so encoding each at its
exact shape compiles again and again. `EncoderRunner` instead packs images and video frames into a
few fixed token budgets (64, 128, 256, ... merged tokens), pads the rest of the budget with tokens
in a padding segment of their own (never attended to, outputs dropped), and compiles one
executable per budget ahead of time (`warmup`, the "capture"). After that, any mix of inputs runs
without compiling.

Packing is greedy and order-preserving: items are appended to the current call while they fit the
largest budget and the segment limit, then the call runs at the smallest budget that holds it. A
video longer than the largest budget is split between frames (attention never crosses a frame);
nothing is truncated, and a single frame larger than the largest budget is an error.

Axes: P patches, N merged tokens (P / merge**2), O out hidden, L deepstack levels.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from .sharding import use_mesh
from .shapes import Buckets
from .vision import VisionMetadata, validate_vision_inputs, vision_metadata

__all__ = ["Buckets", "EncoderRunner", "BucketStats"]


@dataclasses.dataclass
class BucketStats:
    """Per-budget counters: calls, real and padded merged tokens."""

    calls: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0

    @property
    def waste(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One contiguous run of frames of one input item, as packed into a call."""

    item: int
    frames: int
    h: int
    w: int
    row_start: int  # first row of this piece in the caller's pixel_values


class EncoderRunner:
    """Run `model.encode_vision` at a fixed set of token budgets, compiled ahead of time.

    Args:
      model: a `Qwen3VL` (its vision tower and attention implementation are used).
      budgets: merged-token budgets per call (default: 64, 128, ... up to `max_budget`).
      max_budget: the largest budget when `budgets` is not given.
      max_segments: at most this many attention segments (frames) per call.
      compilation_cache_dir: if set, JAX's persistent compilation cache lives there, so a later
        process skips compiling budgets it has seen.
    """

    def __init__(self, model, budgets: Sequence[int] | None = None, max_segments: int | None = None, *,
                 max_budget: int = 4096, compilation_cache_dir: str | None = None):
        self.model = model
        self.config = model.config.vision
        self.budgets = Buckets(tuple(budgets)) if budgets else Buckets.doubling(64, max_budget)
        self.max_segments = max_segments or 64
        if compilation_cache_dir:
            if jax.config.jax_compilation_cache_dir != compilation_cache_dir:
                jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
                # a cache already opened at another directory (JAX opens it once) moves here
                compilation_cache.reset_cache()
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self._graphdef, self._state = nnx.split(model.visual)
        self._executables: dict[int, object] = {}
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.stats: dict[int, BucketStats] = {b: BucketStats() for b in self.budgets.sizes}

    # ------------------------------------------------------------------ compilation

    def _abstract_args(self, budget: int):
        patches = budget * self.config.merge_unit
        sds = jax.ShapeDtypeStruct
        meta = VisionMetadata(
            pos_indices=sds((patches, 4), jnp.int32),
            pos_weights=sds((patches, 4), jnp.float32),
            rotary_ids=sds((patches, 2), jnp.int32),
            segment_ids=sds((patches,), jnp.int32),
        )
        # A sharded model's executables are compiled for its parameters' shardings.
        state = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), self._state)
        return state, sds((patches, self.config.patch_dim), jnp.float32), meta

    def _executable(self, budget: int):
        if budget not in self._executables:
            graphdef, implementation = self._graphdef, self.model.attention_implementation

            def run(state, pixels, meta):
                visual = nnx.merge(graphdef, state)
                out = visual(pixels, meta, implementation=implementation)
                return out.merged, out.deepstack

            start = time.perf_counter()
            with use_mesh(self.model):  # a sharded model: its activation constraints and per-device attention
                self._executables[budget] = jax.jit(run).lower(*self._abstract_args(budget)).compile()
            self.compile_seconds += time.perf_counter() - start
            self.num_compiles += 1
        return self._executables[budget]

    def warmup(self) -> "EncoderRunner":
        """Compile every budget now, from abstract shapes (no data needed)."""
        for budget in self.budgets.sizes:
            self._executable(budget)
        return self

    # ------------------------------------------------------------------ packing

    def plan(self, grid_thw) -> list[list[_Piece]]:
        """Split inputs into calls: lists of pieces, each call within the largest budget."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        unit = self.config.merge_unit
        calls: list[list[_Piece]] = [[]]
        tokens = segments = 0
        row = 0
        for item, (t, h, w) in enumerate(grid):
            per_frame = int(h * w) // unit
            if per_frame > self.budgets.largest:
                raise ValueError(
                    f"grid_thw[{item}] = {[int(t), int(h), int(w)]}: one frame is {per_frame} merged tokens, "
                    f"more than the largest budget {self.budgets.largest}; raise max_budget"
                )
            frame = 0
            while frame < t:
                room_tokens = (self.budgets.largest - tokens) // per_frame
                room_segments = self.max_segments - segments
                take = min(int(t) - frame, room_tokens, room_segments)
                if take <= 0:
                    calls.append([])
                    tokens = segments = 0
                    continue
                calls[-1].append(_Piece(item, take, int(h), int(w), row + frame * int(h * w)))
                tokens += take * per_frame
                segments += take
                frame += take
            row += int(t * h * w)
        return [c for c in calls if c]

    def _call_inputs(self, pieces: list[_Piece], pixel_values: np.ndarray, budget: int):
        """Pixels and metadata of one call, padded to `budget` merged tokens."""
        grid = np.asarray([[p.frames, p.h, p.w] for p in pieces])
        meta = vision_metadata(grid, self.config)
        rows = np.concatenate([np.arange(p.row_start, p.row_start + p.frames * p.h * p.w) for p in pieces])
        patches = budget * self.config.merge_unit
        pixels = np.zeros((patches, self.config.patch_dim), np.float32)
        pixels[:rows.size] = pixel_values[rows]
        # Compiled before any data (one executable per budget), so without the frame-size hint.
        return pixels, dataclasses.replace(meta.padded(patches), longest_segment=0)

    # ------------------------------------------------------------------ running

    def encode(self, pixel_values, grid_thw):
        """What `model.encode_vision` returns: `(merged [N, O], deepstack [L, N, O])`."""
        grid = validate_vision_inputs(pixel_values, grid_thw, self.config)
        pixel_values = np.asarray(pixel_values, np.float32)
        # The current parameters (edited weights take effect); the executables depend only on shapes.
        state = nnx.state(self.model.visual)
        merged_parts, deepstack_parts = [], []
        for pieces in self.plan(grid):
            real = sum(p.frames * p.h * p.w for p in pieces) // self.config.merge_unit
            budget = self.budgets.fit(real)
            pixels, meta = self._call_inputs(pieces, pixel_values, budget)
            merged, deepstack = self._executable(budget)(state, pixels, meta)
            merged_parts.append(merged[:real])
            deepstack_parts.append(deepstack[:, :real])
            stats = self.stats[budget]
            stats.calls += 1
            stats.real_tokens += real
            stats.padded_tokens += budget - real
        # Pieces were packed in input order, so concatenating the calls restores the item order.
        return jnp.concatenate(merged_parts), jnp.concatenate(deepstack_parts, axis=1)

    def report(self) -> str:
        """Calls and padding waste per budget, one line each."""
        lines = [f"{'budget':>8}{'calls':>8}{'real':>10}{'padding':>10}{'waste':>8}"]
        for budget, s in self.stats.items():
            lines.append(f"{budget:>8}{s.calls:>8}{s.real_tokens:>10}{s.padded_tokens:>10}{s.waste:>8.1%}")
        return "\n".join(lines)
