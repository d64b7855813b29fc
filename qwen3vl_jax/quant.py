"""Quantized weights: FP8 block-wise (HF's fine-grained format), int8 per output channel, int4 grouped.

A quantized linear keeps two parameters side by side, rows of the parameter table
(`params.RULES`): `kernel`, the weight `[in, out]` in its storage dtype, and `kernel_scale`, a
float grid `[ceil(in / bi), ceil(out / bo)]` (one scale per block of `bi x bo` weights; the last
block of an axis may be partial). The dequantized weight is `kernel[i, o] * kernel_scale[i // bi,
o // bo]`: HF's `weight_scale_inv` transposed like the weight ("multiply to dequantize"). An int8
linear is stored the other way round, in HF's own orientation (`OUT_MAJOR`): `weight [out, in]`
and `weight_scale [out, 1]`, so that decoding reads each output's weights as one contiguous row.

| method | weight | block `(bi, bo)` | from |
|---|---|---|---|
| `fp8`  | `kernel`: `float8_e4m3fn [in, out]` | `(128, 128)` (the checkpoint's `weight_block_size`, swapped) | HF FP8 checkpoints, or quantized here |
| `int8` | linears `weight`: `int8 [out, in]`; experts `int8 [E, in, out]` | `(0, 1)` (0: the whole axis): one scale per output channel | quantized here |
| `int4` | `kernel`: `int8 [ceil(in/2), out]`, two signed nibbles per byte (row 2p low, 2p + 1 high) | `(group, 1)`, group 128 | quantized here |

The product never upcasts a whole weight: on a CPU XLA does not fuse a conversion into a
matrix-vector product (a bf16 / int8 / fp8 weight upcast whole runs ~11x slower than f32), so
`qdot` loops over tiles of `TILE` input rows x `TILE_COLS` output columns, each decoded and
multiplied, its partial product scaled, accumulating in float32. A matrix-vector product (decode:
up to `FUSED_ROWS` rows) with an out-major int8 weight is instead one fused reduction along its
contiguous rows, `sum(weight * x, axis=-1) * scale`: XLA's CPU backend fuses the conversion into a
reduction along the contiguous axis (a YNNPACK fusion: an int8 or bf16 conversion only, no shifts or
FP8 decoding, so int4 and fp8 keep the tiles; docs/design.md), which reads a quarter of f32's bytes and
runs faster than the f32 product (README, "Quantized weights"). FP8 bytes are decoded by integer
arithmetic (bit-exact with `astype`: XLA's CPU conversion
from `float8_e4m3fn` is scalar and as slow as a whole-weight upcast).

`QTensor` is a quantized weight as a pytree (`kernel`, `scale` and the static method / block), so a
stack of experts `[E, in, out]` indexes like an array (`moe.py`'s own path: `lax.ragged_dot` has
no quantized form, and qwix's PTQ does not see it). `QuantSpec` says which modules of a model are
quantized (by kind: a module path with `*` for the block index, e.g.
`language_model.layers.*.self_attn.q_proj`) and how; `QuantLinear` is the quantized `nnx.Linear`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax

from .params import LazyTensor

__all__ = ["METHODS", "FP8_MAX", "INT4_GROUP", "TILE", "TILE_COLS", "FP8_TILE_COLS", "FUSED_ROWS", "OUT_MAJOR",
           "QuantSpec", "QTensor", "QuantLinear", "make_linear",
           "quantize", "dequantize", "qdot", "decode_fp8", "pack_int4", "unpack_int4", "module_kind",
           "TEXT_KINDS", "VISION_KINDS", "EXPERTS_KIND", "default_modules", "storage_shape", "scale_shape", "stored_shapes",
           "storage_dtype", "quantize_params", "quantized_path"]

METHODS = ("fp8", "int8", "int4")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT4_GROUP = 128
TILE = 256
"""Input rows per tile of the tiled product (`qdot`; with `TILE_COLS` columns, 2 MiB of float32).
Measured on one decoder layer's seven matrix-vector products at 2B widths (int8, medians of 12
interleaved runs, the 2 cores shared with other work): 128 x 2048 tiles 0.88x the f32 time, 256 x 2048
0.69x, 512 x 2048 0.70x. With both cores free the f32 product is faster and these tiles lose: a layer's
three MLP-sized int8 products 2.25x the f32 time (512 x 8192: 1.38x); not yet re-tuned (README)."""

# The language model's linears (the kinds `default_modules` quantizes), and the others a spec may name.
EXPERTS_KIND = "language_model.layers.*.mlp.experts"  # a MoE layer's experts (`moe.QuantExperts`)
TEXT_KINDS = tuple(f"language_model.layers.*.{m}" for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")) + (EXPERTS_KIND,)
VISION_KINDS = tuple(f"visual.blocks.*.{m}" for m in (
    "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")) + tuple(
    f"{merger}.linear_fc{i}" for merger in ("visual.merger", "visual.deepstack_merger_list.*") for i in (1, 2))
"""The vision tower's linears (each ViT block's four, every merger's two): full precision by default
(as HF's); an FP8 checkpoint's scales, or a spec naming them, quantize them."""
LM_HEAD = "lm_head"


def module_kind(path: str) -> str:
    """A module path with its block index replaced by `*`: `language_model.layers.3.mlp.up_proj` ->
    `language_model.layers.*.mlp.up_proj` (every block of a tower has the same kinds; so have the
    deepstack mergers)."""
    return re.sub(r"^(visual\.blocks|visual\.deepstack_merger_list|language_model\.layers)\.\d+\.", r"\1.*.", path)


def default_modules(lm_head: bool = False) -> frozenset[str]:
    """HF's defaults for weight-only quantization: the language model's linears and experts; the
    vision tower, the mergers and (unless asked) `lm_head` stay in high precision."""
    return frozenset(TEXT_KINDS + ((LM_HEAD,) if lm_head else ()))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """Which modules are quantized (`modules`: kinds, see `module_kind`) and how.

    `block`: `(bi, bo)` input rows x output columns per scale in our `[in, out]` orientation; 0
    stands for the whole axis (int8: `(0, 1)`). `scale_dtype`: "float32" or "bfloat16" (an FP8
    checkpoint's `weight_scale_inv` dtype, kept so that it is written back bit-identical)."""

    method: str
    block: tuple[int, int]
    modules: frozenset[str]
    scale_dtype: str = "float32"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"quantization method must be one of {METHODS}, got {self.method!r}")
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 0 for b in self.block):
            raise ValueError(f"quantization block must be two non-negative ints, got {self.block!r}")
        if self.method == "int8" and tuple(self.block) != (0, 1):
            raise ValueError(f"int8 is per output channel: block (0, 1), got {self.block!r}")
        if self.method == "int4" and (self.block[0] <= 0 or self.block[0] % 2):
            raise ValueError(f"int4 groups must hold an even number of rows, got {self.block[0]}")
        if self.scale_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"scale_dtype must be 'float32' or 'bfloat16', got {self.scale_dtype!r}")

    @classmethod
    def make(cls, method: str, *, group: int = INT4_GROUP, block: tuple[int, int] = (128, 128),
             modules: frozenset[str] | None = None, lm_head: bool = False) -> "QuantSpec":
        """The spec `from_pretrained(quantize=...)` uses: fp8 `block` (HF's `[out, in]` order,
        square by default), int8 per output channel, int4 in groups of `group` input rows."""
        blocks = {"fp8": (int(block[1]), int(block[0])), "int8": (0, 1), "int4": (int(group), 1)}
        if method not in blocks:
            raise ValueError(f"quantize must be one of {METHODS}, got {method!r}")
        return cls(method, blocks[method], frozenset(modules) if modules is not None else default_modules(lm_head))

    def covers(self, path: str) -> bool:
        return module_kind(path) in self.modules

    def block_for(self, in_features: int) -> tuple[int, int]:
        bi, bo = self.block
        return (bi or in_features, bo)

    @property
    def np_scale_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16 if self.scale_dtype == "bfloat16" else np.float32)


def storage_dtype(method: str) -> np.dtype:
    return np.dtype(ml_dtypes.float8_e4m3fn if method == "fp8" else np.int8)


def storage_shape(method: str, in_features: int, out_features: int) -> tuple[int, int]:
    """The stored weight's shape in our `[in, out]` orientation (a linear `OUT_MAJOR` stores it swapped)."""
    return (-(-in_features // 2) if method == "int4" else in_features, out_features)


def scale_shape(block: tuple[int, int], in_features: int, out_features: int) -> tuple[int, int]:
    bi, bo = block
    return (-(-in_features // (bi or in_features)), -(-out_features // (bo or out_features)))


def stored_shapes(method: str, block: tuple[int, int], in_features: int, out_features: int,
                  out_major: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """The stored weight's and its scale grid's shapes (last two axes): `storage_shape` and
    `scale_shape`, swapped to `[out, in]` for an out-major weight (`OUT_MAJOR`)."""
    weight = storage_shape(method, in_features, out_features)
    grid = scale_shape(block, in_features, out_features)
    return (weight[::-1], grid[::-1]) if out_major else (weight, grid)


# ---------------------------------------------------------------------- host-side quantization


def _expand(scale, block: tuple[int, int], shape: tuple[int, int]):
    """A scale grid (numpy or jax) repeated over its blocks and cropped to `shape` (the last two axes)."""
    xp = jnp if isinstance(scale, jax.Array) else np
    bi, bo = block
    bi, bo = bi or shape[0], bo or shape[1]
    return xp.repeat(xp.repeat(scale, bi, axis=-2), bo, axis=-1)[..., :shape[0], :shape[1]]


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Signed int4 values in [-8, 7] `[..., in, out]` -> int8 `[..., ceil(in/2), out]` (row 2p in the
    low nibble, row 2p + 1 in the high one; an odd last row pairs with zero)."""
    v = np.asarray(values, np.int8)
    if v.shape[-2] % 2:
        v = np.concatenate([v, np.zeros(v.shape[:-2] + (1, v.shape[-1]), np.int8)], axis=-2)
    low, high = v[..., 0::2, :], v[..., 1::2, :]
    return ((low & 0x0F) | (high << 4)).astype(np.int8)


def unpack_int4(packed, rows: int | None = None):
    """The inverse of `pack_int4` (numpy or jax): `[..., P, out]` -> `[..., rows or 2P, out]` int8."""
    xp = jnp if isinstance(packed, jax.Array) else np
    low = xp.left_shift(packed, 4) >> 4  # arithmetic shifts sign-extend each nibble
    high = packed >> 4
    both = xp.stack([low, high], axis=-2).reshape(packed.shape[:-2] + (2 * packed.shape[-2], packed.shape[-1]))
    return both if rows is None else both[..., :rows, :]


def quantize(weight: np.ndarray, method: str, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`weight [..., in, out]` (float) -> `(kernel, scale float32)` in `method`'s storage (see the module
    docstring); `block` as `QuantSpec.block`. Each block's scale maps its largest magnitude to the
    format's largest value (FP8 448, int8 127, int4 7); an all-zero block gets scale 1."""
    w = np.asarray(weight, np.float32)
    rows, cols = w.shape[-2:]
    bi, bo = block
    bi, bo = bi or rows, bo or cols
    gi, go = -(-rows // bi), -(-cols // bo)
    padded = np.zeros(w.shape[:-2] + (gi * bi, go * bo), np.float32)
    padded[..., :rows, :cols] = np.abs(w)
    amax = padded.reshape(w.shape[:-2] + (gi, bi, go, bo)).max(axis=(-3, -1))
    top = {"fp8": FP8_MAX, "int8": 127.0, "int4": 7.0}[method]
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    scaled = w / _expand(scale, (bi, bo), (rows, cols))
    if method == "fp8":
        return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale
    q = np.clip(np.rint(scaled), -top, top).astype(np.int8)
    return (pack_int4(q) if method == "int4" else q), scale


def dequantize(kernel, scale, method: str, block: tuple[int, int], rows: int | None = None) -> np.ndarray:
    """`kernel * expanded scale` in float32 (numpy), `[..., in, out]`: what HF's dequantizer computes."""
    kernel = np.asarray(kernel)
    if method == "int4":
        kernel = unpack_int4(kernel, rows)
    values = kernel.astype(np.float32)
    return values * _expand(np.asarray(scale, np.float32), block, values.shape[-2:])


# ---------------------------------------------------------------------- the tiled product


def decode_fp8(bits) -> jax.Array:
    """`float8_e4m3fn` bytes (as int8) -> float32 by integer arithmetic, bit-exact with `astype`
    (NaN aside: weights have none). Vectorizes on a CPU, where XLA's own conversion does not."""
    return _decode_fp8_scaled(bits) * 256.0


def _decode_fp8_scaled(bits) -> jax.Array:
    """FP8 e4m3 bytes (int8) -> their values / 2^8, exactly: the sign and the 7 exponent-mantissa
    bits shifted into a float16 (e4m3's exponent bias 7, float16's 15; its subnormals land on
    float16 numbers too), then widened to float32. Four vector operations per weight."""
    h = (bits.astype(jnp.int16) << 7) & jnp.int16(-16512)  # 0xBF80: the sign bit and bits 7..13
    return lax.bitcast_convert_type(h, jnp.float16).astype(jnp.float32)


def _decode(tile, method: str):
    """A tile of stored rows (fp8 as int8 bits: its values / 2^8; or int8) -> float32."""
    return _decode_fp8_scaled(tile) if method == "fp8" else tile.astype(jnp.float32)


TILE_COLS = 2048
"""Output columns per tile (a chunk of the scale blocks' columns where they are narrower); FP8 takes
`FP8_TILE_COLS`."""

FP8_TILE_COLS = 8192
"""Output columns per FP8 tile: with 2048 a 2B-width decode's MLP products loop over three column
chunks, with 8192 over none. 2B widths, 8 layers, 16 new tokens, two runs each, interleaved in one
session (2-core CPU, jax 0.10.2): fp8 decode at 0.76 / 0.80 of f32's tokens/s with 2048 columns,
1.15 / 0.94 with 8192; int4 0.83 / 0.94 against 0.71 / 0.91 (no gain, so it keeps `TILE_COLS`)."""

OUT_MAJOR = ("int8",)
"""The methods whose linears store the weight `[out, in]` (`QuantLinear`): int8, one scale per output
channel, whose decode product is then one fused reduction (`FUSED_ROWS`). Not int4 or fp8: their
group / block scales make it a two-stage reduction, which XLA's CPU backend does not fuse (measured:
int4 3.7-15 ms against f32's 1.9-3.8 for one 2048 x 6144 product; docs/design.md)."""

FUSED_ROWS = 64
"""Up to this many rows of `x`, an out-major int8 product is one fused reduction; more (prefill)
take the tiles. One 2048 x 6144 product, 24 distinct weights in turn (past the cache), x of 1 / 2 /
8 / 64 / 128 / 256 rows (quiet 2-core CPU, jax 0.10.2, medians of 5): f32 2.32 / 3.84 / 6.15 / 8.60
/ 12.8 / 23.7 ms; the fused reduction 1.50 / 1.47 / 1.83 / 6.13 / 21.6 / 32.2; out-major tiles 6.24
/ 5.37 / 6.17 / 10.1 / 17.7 / 29.1; in-major tiles 5.91 / 4.15 / 5.19 / 9.39 / 16.0 / 31.4."""


def _chunk_cols(cols: int, block_cols: int, method: str) -> int:
    """Output columns per chunk: `TILE_COLS` (`FP8_TILE_COLS`) rounded down to whole scale blocks
    (all when fewer)."""
    tile = FP8_TILE_COLS if method == "fp8" else TILE_COLS
    if cols <= tile:
        return cols
    return max(block_cols, tile // block_cols * block_cols) if block_cols < tile else block_cols


def _tile_rows(block_rows: int, rows: int) -> int:
    """Input rows per tile: `TILE`, or the largest power of two that divides the scale blocks' rows
    (each tile then lies inside one block row, so its scales multiply the tile's partial product
    `[R, out]` rather than every weight)."""
    if block_rows >= rows:
        return TILE
    for t in (TILE, 128, 64, 32, 16, 8, 4, 2):
        if block_rows % t == 0:
            return t
    return 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized weight `[..., in, out]`: `kernel` (storage), `scale` (grid); `method`, `block`
    (`(bi, bo)`, in the `[in, out]` orientation) and `rows` (= in) static. `out_major`: `kernel` and
    `scale` hold their last two axes swapped (`[out, in]`: an int8 linear, `OUT_MAJOR`). Indexing
    the leading axes (`experts[e]`) indexes both arrays."""

    kernel: jax.Array
    scale: jax.Array
    method: str = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    rows: int = dataclasses.field(metadata=dict(static=True))
    out_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape[:-2]) + (self.rows, self.kernel.shape[-2 if self.out_major else -1])

    def __getitem__(self, index) -> "QTensor":
        return QTensor(self.kernel[index], self.scale[index], self.method, self.block, self.rows,
                       self.out_major)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The whole weight `[..., in, out]` in `dtype` (the spec path, e.g. for `lax.ragged_dot`;
        slow on a CPU)."""
        if self.out_major:
            swapped = QTensor(jnp.swapaxes(self.kernel, -1, -2), jnp.swapaxes(self.scale, -1, -2),
                              self.method, self.block, self.rows)
            return swapped.dequantize(dtype)
        if self.method == "int4":
            values = unpack_int4(self.kernel, self.rows).astype(jnp.float32)
        elif self.method == "fp8":
            values = decode_fp8(_bits(self))
        else:
            values = self.kernel.astype(jnp.float32)
        return (values * _expand(self.scale.astype(jnp.float32), self.block, values.shape[-2:])).astype(dtype)


def _bits(q: QTensor):
    return lax.bitcast_convert_type(q.kernel, jnp.int8) if q.method == "fp8" else q.kernel


def qdot(x, weight, *, dtype=None) -> jax.Array:
    """`x [..., in] @ weight [in, out]` -> `[..., out]` in `dtype` (default `x`'s): a plain array, or
    a `QTensor` dequantized tile by tile (float32 accumulation; see the module docstring).

    An out-major int8 weight times up to `FUSED_ROWS` rows: one fused reduction (`_row_reduction`).
    Otherwise tiles of `TILE_ROWS x TILE_COLS` stored weights (`TILE_COLS x TILE_ROWS` out-major): a
    loop over column chunks (`lax.map`), in each a loop over row tiles (`fori_loop`) accumulating
    the chunk's `[R, C]` partial products; each tile lies inside one block row, so its scales
    multiply the partial product, not every weight; the decoded tile (at most 2 MiB of float32)
    stays in the cache for its product."""
    dtype = dtype or x.dtype
    if not isinstance(weight, QTensor):
        return jnp.dot(x.astype(dtype), weight.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    rows, out = weight.shape[-2:]
    bi, bo = weight.block
    bi, bo = bi or rows, bo or out
    lead = x.shape[:-1]
    x2 = x.reshape(-1, rows).astype(dtype)
    bits, scale = _bits(weight), weight.scale.astype(jnp.float32)
    if weight.out_major and weight.method == "int4":
        raise ValueError("int4 weights are stored [in, out] only (OUT_MAJOR)")
    if weight.out_major and weight.method == "int8" and bi == rows and x2.shape[0] <= FUSED_ROWS:
        return _row_reduction(x2, bits, scale[..., 0]).astype(dtype).reshape(lead + (out,))
    if weight.method == "fp8":
        scale = scale * 256.0  # `_decode` gives FP8 values / 2^8 (exact: a power of two)
    packed = 2 if weight.method == "int4" else 1
    tile = _tile_rows(bi, rows)
    if packed == 2 and rows % 2:
        x2 = jnp.pad(x2, ((0, 0), (0, 1)))  # the odd last row pairs with a zero nibble
    padded_rows = rows + (rows % 2 if packed == 2 else 0)
    tiles, rest = divmod(padded_rows, tile)
    chunk = _chunk_cols(out, bo, weight.method)

    def part(start, size, first, width):
        """The partial product of input rows `[start, start + size)` (inside one block row; `size`
        static, even for int4) and output columns `[first, first + width)` (`width` static)."""
        if weight.out_major:  # the tile `[width, size]`, its block column's scales
            q = lax.dynamic_slice(bits, (first, start), (width, size))
            s = lax.dynamic_slice(scale, (first // bo, start // bi), (-(-width // bo), 1)).T
        else:
            q = lax.dynamic_slice(bits, (start // packed, first), (size // packed, width))
            s = lax.dynamic_slice(scale, (start // bi, first // bo), (1, -(-width // bo)))
        s = jnp.repeat(s, bo, axis=1)[:, :width]  # [1, width]
        xs = lax.dynamic_slice_in_dim(x2, start, size, axis=1)
        if packed == 2:  # two products: the even input rows (low nibbles), the odd ones (high nibbles)
            low = (jnp.left_shift(q, 4) >> 4).astype(dtype)
            high = (q >> 4).astype(dtype)
            y = (jnp.dot(xs[:, 0::2], low, preferred_element_type=jnp.float32)
                 + jnp.dot(xs[:, 1::2], high, preferred_element_type=jnp.float32))
        else:
            contract = 1 if weight.out_major else 0  # the tile's input axis
            y = lax.dot_general(xs, _decode(q, weight.method).astype(dtype), (((1,), (contract,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y * s

    def columns(first, width):
        y = jnp.zeros((x2.shape[0], width), jnp.float32)
        if tiles == 1:
            y = part(0, tile, first, width)
        elif tiles > 1:
            y = lax.fori_loop(0, tiles, lambda t, acc: acc + part(t * tile, tile, first, width), y)
        if rest:
            y = y + part(tiles * tile, rest, first, width)
        return y

    chunks, tail = divmod(out, chunk)
    pieces = []
    if chunks == 1:
        pieces.append(columns(0, chunk))
    elif chunks > 1:
        y = lax.map(lambda c: columns(c * chunk, chunk), jnp.arange(chunks))  # [chunks, R, C]
        pieces.append(jnp.moveaxis(y, 0, 1).reshape(x2.shape[0], chunks * chunk))
    if tail:
        pieces.append(columns(chunks * chunk, tail))
    y = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
    return y.astype(dtype).reshape(lead + (out,))


def _row_reduction(x2, kernel, scale) -> jax.Array:
    """`x2 [R, in]` times an out-major int8 weight `kernel [out, in]` with one `scale [out]` per
    output: one fused multiply-and-reduce along the contiguous input axis, in float32.

    The weight passes an optimization barrier together with `x`: inside a decode loop the weight is
    loop-invariant, and XLA would otherwise hoist its conversion out of the loop, materializing the
    whole float32 weight once per call and reading four bytes per weight at every step (measured:
    the 2B-width decode at 0.8x f32 instead of faster)."""
    kernel, x2 = lax.optimization_barrier((kernel, x2))
    w = kernel.astype(jnp.float32)
    x = x2.astype(jnp.float32)
    if x.shape[0] == 1:  # squeezed: a leading axis of 1 takes a slow loop in XLA's CPU reduction
        y = jnp.sum(w * x[0], axis=-1)[None]
    else:
        y = jnp.sum(w[None] * x[:, None, :], axis=-1)
    return y * scale


# ---------------------------------------------------------------------- the module


class QuantLinear(nnx.Module):
    """`nnx.Linear` with a quantized kernel: `kernel` (storage dtype, `storage_shape`) and
    `kernel_scale` (`scale_shape`, in the spec's scale dtype), or for an `OUT_MAJOR` method `weight`
    and `weight_scale`, the same swapped (`[out, in]`, `[out, 1]`); optional `bias`. Frozen weights:
    the product passes gradients to `x` (and the bias), through the dequantized tiles."""

    def __init__(self, in_features: int, out_features: int, *, spec: QuantSpec, use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.method, self.block = spec.method, spec.block_for(in_features)
        self.out_major = spec.method in OUT_MAJOR
        self.param_dtype = param_dtype
        self.dtype = dtype
        shape, grid = stored_shapes(spec.method, self.block, in_features, out_features, self.out_major)
        stored = nnx.Param(jnp.zeros(shape, storage_dtype(spec.method)))
        scale = nnx.Param(jnp.ones(grid, spec.np_scale_dtype))
        if self.out_major:
            self.weight, self.weight_scale = stored, scale
        else:
            self.kernel, self.kernel_scale = stored, scale
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    @property
    def stored(self) -> tuple[nnx.Param, nnx.Param]:
        """The parameters that hold the quantized weight and its scales (`weight` or `kernel`)."""
        return (self.weight, self.weight_scale) if self.out_major else (self.kernel, self.kernel_scale)

    def quantized(self) -> QTensor:
        stored, scale = self.stored
        return QTensor(stored[...], scale[...], self.method, self.block, self.in_features, self.out_major)

    def __call__(self, x):
        dtype = self.dtype or x.dtype
        y = qdot(x, self.quantized(), dtype=dtype)
        return y if self.bias is None else y + self.bias[...].astype(dtype)


def make_linear(in_features: int, out_features: int, *, path: str, quant: QuantSpec | None, **kwargs):
    """`nnx.Linear(in, out, **kwargs)`, or a `QuantLinear` where `quant` covers the module `path`."""
    if quant is not None and quant.covers(path):
        kwargs.pop("kernel_init", None)
        return QuantLinear(in_features, out_features, spec=quant, **kwargs)
    return nnx.Linear(in_features, out_features, **kwargs)



# ---------------------------------------------------------------------- quantizing a checkpoint as it is read


def quantized_path(path: str, spec: QuantSpec) -> str | None:
    """The module a full-precision weight parameter belongs to when `spec` quantizes it, else None:
    `...q_proj.kernel` -> `...q_proj`; `...mlp.experts.gate_up_proj` -> `...mlp.experts`."""
    if path.endswith(".kernel"):
        module = path[: -len(".kernel")]
    elif path.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        module = path.rsplit(".", 1)[0]
    else:
        return None
    return module if spec.covers(module) else None


def quantize_params(params: dict[str, object], spec: QuantSpec) -> dict[str, object]:
    """`{our path: LazyTensor or array}` of a full-precision checkpoint -> the same with every weight
    `spec` covers replaced by its quantized weight and scales (`quantize`), each computed when
    loaded (the float tensor is read once for both, one tensor at a time): `...kernel` ->
    `...kernel` and `...kernel_scale`, or for an `OUT_MAJOR` linear `...weight` and `...weight_scale`
    (both swapped to `[out, in]`); experts' `...gate_up_proj` -> `...gate_up_proj` and `..._scale`."""
    out = {}
    for path, value in params.items():
        module = quantized_path(path, spec)
        if module is None:
            out[path] = value
            continue
        lazy = value if isinstance(value, LazyTensor) else LazyTensor(
            tuple(value.shape), np.dtype(value.dtype), lambda v=value: np.asarray(v), path)
        rows, cols = lazy.shape[-2:]
        block = spec.block_for(rows)
        once = functools.lru_cache(maxsize=1)(lambda t=lazy, b=block: quantize(t.load(), spec.method, b))
        lead = tuple(lazy.shape[:-2])
        out_major = spec.method in OUT_MAJOR and path.endswith(".kernel")
        kernel_shape, grid = stored_shapes(spec.method, block, rows, cols, out_major)
        orient = (lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))) if out_major else (lambda a: a)

        def take_kernel(once=once, orient=orient):
            return orient(once()[0])

        def take_scale(once=once, orient=orient):  # (read after the kernel: the cached pair is then released)
            scale = orient(once()[1].astype(spec.np_scale_dtype))
            once.cache_clear()
            return scale

        name = module + ".weight" if out_major else path
        out[name] = LazyTensor(lead + kernel_shape, storage_dtype(spec.method), take_kernel, lazy.source)
        out[name + "_scale"] = LazyTensor(lead + grid, spec.np_scale_dtype, take_scale,
                                          lazy.source + " (scales)")
    return out
