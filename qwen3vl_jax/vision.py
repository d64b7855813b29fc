"""The Qwen3-VL vision tower in Flax NNX.

Data path: patch embed (a linear map of each flattened `C*T*p*p` patch, equal to HF's strided
Conv3d) + bilinear-interpolated learned position embeddings -> `depth` pre-norm ViT blocks with
axial 2D rotary and attention restricted to each temporal slice of each item -> the final patch
merger (2x2 patches -> one token). After the blocks listed in `deepstack_visual_indexes`, a
deepstack merger taps the hidden states, giving one extra feature map per level for the LLM.

Everything that depends on the values of `grid_thw` (interpolation taps, rotary row/col ids,
attention segment ids) is computed on the host by `vision_metadata`, so the jitted tower sees only
arrays whose shapes depend on the number of patches.

Axes: P patches (sum of t*h*w), N merged tokens (P / merge**2), E hidden, H heads, D head dim,
F = 4*E merged width, O out hidden (the LLM width), L deepstack levels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax import lax

from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention.mask import AttentionMask
from pallas_kernels.pos_embed import api as pos_embed_api
from pallas_kernels.pos_embed.reference import interpolation_taps, merge_order_rows_cols

from .config import VisionConfig
from .layers import LayerNorm, Linear, apply_rotary, check_layers, make_stack, run_stack, segment_edges
from .quant import QuantSpec, make_linear
from .sharding import constrain

__all__ = ["VisionMetadata", "vision_metadata", "validate_vision_inputs", "VisionModel"]


# ---------------------------------------------------------------------- host-side metadata


@dataclasses.dataclass(frozen=True)
class VisionMetadata:
    """Everything grid-dependent the tower needs, as arrays (a pytree, jit-friendly).

    pos_indices: `[P, 4]` int32 rows of the position table; pos_weights: `[P, 4]` float32.
    rotary_ids: `[P, 2]` int32 (row, col) of each patch in its frame.
    segment_ids: `[P]` int32, one id per temporal slice of each item; negative = padding.
    frame_rows: static; the patches of every frame when all frames have the same size, else 0 (a
      hint that lets attention align its blocks with the frames: `AttentionMask.segment_rows`).
    longest_segment: static; the patches of the largest frame rounded up to a power of two, at least
      128 (`segment_bound`; 0 = unknown): a hint that lets attention size its blocks to the frames
      when they differ (`AttentionMask.longest_segment`), kept by `padded`. Rounded so that calls
      of one padded size share a few compilations.
    """

    pos_indices: np.ndarray
    pos_weights: np.ndarray
    rotary_ids: np.ndarray
    segment_ids: np.ndarray
    frame_rows: int = 0
    longest_segment: int = 0

    def padded(self, patches: int) -> "VisionMetadata":
        """The metadata of `patches` rows, the extra rows padding (their own attention segment, -1,
        never merged into a token that is used). A padded call serves items of any size, so it
        drops `frame_rows` (keeping `longest_segment`) and compiles once per size and bound. Works
        on numpy and jax arrays alike."""
        real = self.segment_ids.shape[0]
        if real > patches:
            raise ValueError(f"{real} patches exceed the vision budget of {patches} patches")
        pad = patches - real
        xp = jnp if isinstance(self.segment_ids, jax.Array) else np
        rows = lambda x: xp.pad(x, ((0, pad), (0, 0)))  # noqa: E731
        return VisionMetadata(rows(self.pos_indices), rows(self.pos_weights), rows(self.rotary_ids),
                              xp.pad(self.segment_ids, (0, pad), constant_values=-1),
                              longest_segment=self.longest_segment)


jax.tree_util.register_dataclass(
    VisionMetadata, data_fields=["pos_indices", "pos_weights", "rotary_ids", "segment_ids"],
    meta_fields=["frame_rows", "longest_segment"]
)


def segment_bound(rows: int) -> int:
    """`VisionMetadata.longest_segment` for a largest frame of `rows` patches: the next power of two,
    at least 128 (0 for no frames)."""
    return 0 if rows <= 0 else max(128, 1 << (int(rows) - 1).bit_length())


def validate_vision_inputs(pixel_values, grid_thw, config: VisionConfig, *, what: str = "item") -> np.ndarray:
    """Check `pixel_values [P, C*T*p*p]` against `grid_thw [n, 3]`; return the grid as int64 numpy.

    Non-finite pixels are refused (naming the item): attention would otherwise carry a NaN from one
    item into every item packed in the same call (0 * NaN in the value matmul). Raises ValueError
    naming the offending item; `what` ("image", "video") names the items in messages.
    """
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"{what} grid_thw must have shape [num_items, 3], got {grid.shape}")
    if not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"{what} grid_thw must hold integers, got dtype {grid.dtype}")
    grid = grid.astype(np.int64)
    merge = config.spatial_merge_size
    for i, (t, h, w) in enumerate(grid):
        if min(t, h, w) <= 0:
            raise ValueError(f"{what} grid_thw[{i}] = {[int(t), int(h), int(w)]} has a non-positive entry")
        if h % merge or w % merge:
            raise ValueError(
                f"{what} grid_thw[{i}] = {[int(t), int(h), int(w)]}: h and w must be divisible by the spatial "
                f"merge size {merge}"
            )
    shape = tuple(pixel_values.shape)
    if len(shape) != 2:
        raise ValueError(f"{what} pixel_values must be 2-D [patches, {config.patch_dim}], got shape {shape}")
    if shape[1] != config.patch_dim:
        raise ValueError(
            f"{what} pixel_values rows have width {shape[1]}, expected C*T*p*p = {config.in_channels}*"
            f"{config.temporal_patch_size}*{config.patch_size}*{config.patch_size} = {config.patch_dim}"
        )
    counts = grid.prod(axis=1)
    if shape[0] != counts.sum():
        raise ValueError(
            f"{what} pixel_values has {shape[0]} rows but grid_thw describes {int(counts.sum())} patches "
            f"(per item t*h*w = {counts.tolist()})"
        )
    if not isinstance(pixel_values, jax.core.Tracer):
        finite = np.isfinite(np.asarray(pixel_values)).all(axis=1)
        if not finite.all():
            row = int(np.argmin(finite))
            item = int(np.searchsorted(np.cumsum(counts), row, side="right"))
            raise ValueError(f"{what} {item} (grid_thw {grid[item].tolist()}) has non-finite pixel values "
                             f"(first at patch row {row})")
    return grid


def vision_metadata(grid_thw, config: VisionConfig) -> VisionMetadata:
    """Host metadata for a validated `grid_thw` (see `VisionMetadata`)."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    indices, weights = interpolation_taps(grid, config.num_grid_per_side, config.spatial_merge_size)
    rotary, segments = [], []
    sizes = {int(h * w) for _, h, w in grid}
    next_segment = 0
    for t, h, w in grid:
        rows, cols = merge_order_rows_cols(int(h), int(w), config.spatial_merge_size)
        rotary.append(np.tile(np.stack([rows, cols], axis=1), (int(t), 1)))
        segments.append(np.repeat(np.arange(next_segment, next_segment + t), h * w))
        next_segment += int(t)
    return VisionMetadata(
        pos_indices=indices,
        pos_weights=weights,
        rotary_ids=np.concatenate(rotary).astype(np.int32) if rotary else np.zeros((0, 2), np.int32),
        segment_ids=np.concatenate(segments).astype(np.int32) if segments else np.zeros((0,), np.int32),
        frame_rows=next(iter(sizes)) if len(sizes) == 1 else 0,
        longest_segment=segment_bound(max(sizes, default=0)),
    )


def vision_rotary_inv_freq(config: VisionConfig) -> np.ndarray:
    """`[D/4]` float32 inverse frequencies, shared by rows and columns (HF's axial rope)."""
    spatial_dim = config.head_dim // 2
    exponent = np.arange(0, spatial_dim, 2, dtype=np.float32) / np.float32(spatial_dim)
    return (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(np.float32)


def vision_rotary_cos_sin(rotary_ids: jnp.ndarray, inv_freq: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`[P, D]` float32 cos and sin, laid out [row freqs | col freqs] twice (rotate-half layout)."""
    freqs = rotary_ids.astype(jnp.float32)[:, :, None] * inv_freq  # [P, 2, D/4]
    half = freqs.reshape(freqs.shape[0], -1)  # [P, D/2]: rows then cols
    full = jnp.concatenate([half, half], axis=-1)
    return jnp.cos(full), jnp.sin(full)


# ---------------------------------------------------------------------- modules


class PatchEmbed(nnx.Module):
    """HF's Conv3d with kernel == stride is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.proj = Linear(config.patch_dim, config.hidden_size, use_bias=True, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixel_values: jnp.ndarray) -> jnp.ndarray:  # [P, C*T*p*p] -> [P, E]
        return self.proj(pixel_values)


_BLOCK = "visual.blocks.*."  # the kind of a ViT block's module (`quant.module_kind`)


class VisionAttention(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        self.num_heads = config.num_heads
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.qkv = make_linear(config.hidden_size, 3 * config.hidden_size, path=_BLOCK + "attn.qkv", **kw)
        self.proj = make_linear(config.hidden_size, config.hidden_size, path=_BLOCK + "attn.proj", **kw)

    def __call__(self, x, cos, sin, mask: AttentionMask, implementation: str, return_weights: bool = False):
        """`[P, E]` output; with `return_weights` also the probabilities `[H, P, P]`."""
        patches = x.shape[0]
        qkv = self.qkv(x).reshape(patches, 3, self.num_heads, -1)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [P, H, D]
        # Rotary in float32, cast back (HF's apply_rotary_pos_emb_vision).
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.proj(attention_api.attention(q[None], k[None], v[None], mask,
                                                implementation=implementation)[0].reshape(patches, -1))
        if not return_weights:
            return out
        return out, attention_api.attention_weights(q[None], k[None], mask)[0]


class VisionMLP(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.linear_fc1 = make_linear(config.hidden_size, config.intermediate_size, path=_BLOCK + "mlp.linear_fc1",
                                      **kw)
        self.linear_fc2 = make_linear(config.intermediate_size, config.hidden_size, path=_BLOCK + "mlp.linear_fc2",
                                      **kw)

    def __call__(self, x):
        # The ViT MLP uses the tanh approximation (`gelu_pytorch_tanh`); the mergers do not.
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=True))


class VisionBlock(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, quant: QuantSpec | None = None):
        self.norm1 = LayerNorm(config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = LayerNorm(config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn = VisionAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.mlp = VisionMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)

    def __call__(self, x, cos, sin, mask: AttentionMask, implementation: str = "xla", return_weights: bool = False):
        """`[P, E]`; with `return_weights`, `(x, attention probabilities [H, P, P])`."""
        attended = self.attn(self.norm1(x), cos, sin, mask, implementation, return_weights)
        attended, weights = attended if return_weights else (attended, None)
        x = x + attended
        x = x + self.mlp(self.norm2(x))
        return (x, weights) if return_weights else x


class PatchMerger(nnx.Module):
    """Groups each 2x2 block of patches into one token and projects it to the LLM width.

    The final merger normalizes each patch (over E) before grouping; the deepstack mergers
    (`postshuffle_norm=True`) normalize the grouped row (over 4E).
    """

    def __init__(self, config: VisionConfig, *, postshuffle_norm: bool, dtype, param_dtype, rngs: nnx.Rngs,
                 path: str = "visual.merger", quant: QuantSpec | None = None):
        self.postshuffle_norm = postshuffle_norm
        merged = config.hidden_size * config.merge_unit
        self.norm = LayerNorm(merged if postshuffle_norm else config.hidden_size, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.linear_fc1 = make_linear(merged, merged, path=path + ".linear_fc1", **kw)
        self.linear_fc2 = make_linear(merged, config.out_hidden_size, path=path + ".linear_fc2", **kw)
        self.merged = merged

    def __call__(self, x):  # [P, E] -> [N, O]
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged))
        else:
            x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


@dataclasses.dataclass(frozen=True)
class VisionOutput:
    """merged: `[N, O]`; deepstack: `[L, N, O]`; hidden_states: `[depth, P, E]` each block's output,
    when requested; attentions: `{block: [H, P, P]}` the attention probabilities of the blocks asked
    for (zero between patches of different frames or items)."""

    merged: jnp.ndarray
    deepstack: jnp.ndarray
    hidden_states: jnp.ndarray | None = None
    attentions: dict | None = None


jax.tree_util.register_dataclass(
    VisionOutput, data_fields=["merged", "deepstack", "hidden_states", "attentions"], meta_fields=[]
)


class VisionModel(nnx.Module):
    """`Qwen3VLVisionModel`: pixel patches + metadata -> merged and deepstack features."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, param_dtype=None, scan_layers: bool = False,
                 remat: bool = False, quant: QuantSpec | None = None, rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = config
        self.dtype = dtype
        self.scan_layers = scan_layers
        self.remat = remat
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.patch_embed = PatchEmbed(config, **kw)
        self.pos_embed = nnx.Embed(config.num_position_embeddings, config.hidden_size, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        self.blocks = make_stack(lambda r: VisionBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=r,
                                                       quant=quant), config.depth, scan_layers, rngs)
        self.merger = PatchMerger(config, postshuffle_norm=False, quant=quant, **kw)
        self.deepstack_merger_list = nnx.List(
            [PatchMerger(config, postshuffle_norm=True, path=f"visual.deepstack_merger_list.{i}", quant=quant, **kw)
             for i in range(len(config.deepstack_visual_indexes))]
        )

    def __call__(
        self,
        pixel_values: jnp.ndarray,
        meta: VisionMetadata,
        *,
        implementation: str = "xla",
        return_hidden_states: bool = False,
        return_attentions: tuple[int, ...] = (),
    ) -> VisionOutput:
        """The tower; `return_attentions`: block indices (static) whose probabilities to return, each
        block run on its own with a static index (as `text.TextModel`)."""
        attend = check_layers(return_attentions, self.config.depth, noun="block")
        x = self.patch_embed(pixel_values.astype(self.dtype))
        pos = pos_embed_api.interpolate_pos_embed(
            self.pos_embed.embedding[...], meta.pos_indices, meta.pos_weights, implementation=implementation
        )
        x = x + pos.astype(x.dtype)
        cos, sin = vision_rotary_cos_sin(meta.rotary_ids, jnp.asarray(vision_rotary_inv_freq(self.config)))
        mask = AttentionMask.segments(meta.segment_ids, meta.frame_rows, meta.longest_segment)
        taps = self.config.deepstack_visual_indexes
        # Block index -> deepstack level (-1: none), so a scanned stack can tap by a traced index.
        level_of = np.full(self.config.depth, -1, np.int32)
        level_of[list(taps)] = np.arange(len(taps))

        def step(block, carry, index):
            x, tapped = carry
            weights = None
            if isinstance(index, int) and index in attend:
                x, weights = block(x, cos, sin, mask, implementation, return_weights=True)
            else:
                x = block(x, cos, sin, mask, implementation)
            x = constrain(x, "batch", None)  # patch rows over the batch axes
            if isinstance(index, int):
                if level_of[index] >= 0:
                    tapped = tapped.at[int(level_of[index])].set(x)
            else:
                level = jnp.asarray(level_of)[index]
                tapped = lax.cond(level >= 0, lambda t: lax.dynamic_update_index_in_dim(t, x, level, 0),
                                  lambda t: t, tapped)
            return (x, tapped), (x, weights)

        carry = (x, jnp.zeros((len(taps), *x.shape), x.dtype))
        hidden, attentions = [], {}
        for start, stop in segment_edges(self.config.depth, attend):
            carry, outs = run_stack(self.blocks, step, carry, scan=self.scan_layers, remat=self.remat,
                                    collect=return_hidden_states or start in attend, start=start, stop=stop)
            if outs is not None:
                hidden.append(outs[0])
                if start in attend:
                    attentions[start] = outs[1][0]
        x, tapped = carry
        merged = self.merger(x)
        deepstack = [merger(tapped[level]) for level, merger in enumerate(self.deepstack_merger_list)]
        stacked = jnp.stack(deepstack) if deepstack else jnp.zeros((0, *merged.shape), merged.dtype)
        return VisionOutput(merged, stacked, jnp.concatenate(hidden) if return_hidden_states else None,
                            attentions if attend else None)
