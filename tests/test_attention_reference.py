"""The pure-jnp attention specs against plain dense softmax attention, and their memory bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference
from pallas_kernels.attention.mask import AttentionMask


def _dense_varlen(q, k, v, seg):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    allowed = (seg[:, None] == seg[None, :]) & (seg[None, :] >= 0)
    s = np.where(allowed[None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(allowed[None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("hqk,khd->qhd", p, v)


SEGMENTS = {
    "uneven": [37, 100, 5, 250, 64],
    "block_aligned": [64, 128, 64],
    "many_tiny": [4] * 40,
    "one_long": [700],
    "with_padding": [50, 90, -30],  # a negative length is a padding run
}


@pytest.mark.parametrize("case", list(SEGMENTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_varlen_matches_dense(case, dtype):
    lengths = SEGMENTS[case]
    seg = np.concatenate([np.full(abs(n), i if n > 0 else -1) for i, n in enumerate(lengths)]).astype(np.int32)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((len(seg), 3, 16)).astype(np.float32) for _ in range(3))
    out = reference.varlen_attention(*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(seg), block_size=64)
    assert out.dtype == dtype
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
    ref = _dense_varlen(q, k, v, seg)
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=atol, rtol=atol)
    assert np.all(np.asarray(out)[seg < 0] == 0)


def test_block_ranges_cover_only_overlapping_segments():
    seg = jnp.asarray(np.repeat([0, 1, 2, -1], [10, 30, 20, 4]).astype(np.int32))
    mask = AttentionMask.segments(seg)
    lo, hi = reference.block_ranges(mask.kv_start[0], mask.kv_end[0], 16, 16)
    # blocks: [0,16) seg 0,1 -> keys 0..39 -> blocks 0..2; [16,32) seg 1 -> 0..2; [32,48) seg 1,2 -> 0..3;
    # [48,64) seg 2 and padding -> blocks 2..3
    np.testing.assert_array_equal(lo, [0, 0, 0, 2])
    np.testing.assert_array_equal(hi, [3, 3, 4, 4])


@pytest.mark.parametrize("rows,length,block,expected", [
    (784, 3136, 512, 392),   # a long frame: halves, so 8 blocks each visit their own 2 key blocks
    (196, 784, 512, 392),    # short frames: two whole frames per block
    (16, 528, 512, 272),     # 33 frames of 16: 2 blocks of 17 frames, not 512 + 16
    (1018, 1018, 512, 509),  # a divisor that is not a multiple of 8 is still taken
    (1031, 1031, 512, 344),  # a prime: no divisor, so the balanced block (3 x 344)
])
def test_aligned_block(rows, length, block, expected):
    got = reference.aligned_block(rows, length, block)
    assert got == expected
    assert got % rows == 0 or rows % got == 0 or rows == 1031


def _score_entries(mask: AttentionMask, block: int) -> int:
    """Score entries the blocked spec computes for `mask` in square blocks of `block` rows: the key
    blocks each query block visits (`reference.block_ranges`) times block x block."""
    pad = -mask.shape[1] % block
    lo, hi = reference.block_ranges(*(jnp.pad(x, ((0, 0), (0, pad))) for x in (mask.kv_start, mask.kv_end)),
                                    block, block)
    return int(jnp.sum(hi - lo)) * block * block


@pytest.mark.parametrize("frames,rows,hint", [(4, 40, 40), pytest.param(3, 24, 24, marks=pytest.mark.slow),
                                              pytest.param(5, 20, 20, marks=pytest.mark.slow), (4, 40, 24), (4, 40, 0)])
def test_segment_rows_hint_changes_work_not_result(frames, rows, hint):
    """Equal frames (and trailing padding) with the block layout aligned by the hint, a wrong hint and
    none: all equal the dense oracle, and so do their gradients; the right hint visits fewer pairs."""
    seg = np.concatenate([np.repeat(np.arange(frames), rows), np.full(6, -1)]).astype(np.int32)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, len(seg), 4, 8)), jnp.float32) for _ in range(3))
    mask = AttentionMask.segments(jnp.asarray(seg), hint)
    assert mask.segment_rows == hint

    def run(q, k, v, block=32):
        return reference.attention(q, k, v, mask.kv_start, mask.kv_end, block_q=block, block_k=block,
                                   segment_rows=mask.segment_rows)

    dense = mask.dense(len(seg))
    np.testing.assert_allclose(run(q, k, v), reference.masked_attention(q, k, v, dense), atol=1e-5, rtol=1e-5)
    probe = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(run(*a) * probe), argnums=(0, 1, 2))(q, k, v)
    oracle = jax.grad(lambda *a: jnp.sum(reference.masked_attention(*a, dense) * probe), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, oracle):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    if hint == rows:  # aligned: each query block visits only the key blocks of its own frames
        block = reference.aligned_block(rows, len(seg), 32)
        balanced = reference.balanced_block(len(seg), 32)
        aligned_rows, balanced_rows = _score_entries(mask, block), _score_entries(mask, balanced)
        assert aligned_rows < balanced_rows, (block, balanced, aligned_rows, balanced_rows)


def test_longest_segment_hint_changes_work_not_result():
    """Frames of different sizes (the vision tower's padded training batches): with the bound on the
    longest frame the spec runs smaller blocks (`segment_block`), and the outputs and gradients still
    equal the dense oracle's; the hint visits under half the score entries of the default blocks (98,304
    against 278,784 here)."""
    sizes = (70, 100, 36, 90, 64, 100, 18)
    seg = np.concatenate([np.repeat(i, n) for i, n in enumerate(sizes)] + [np.full(40, -1)]).astype(np.int32)
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((1, len(seg), 4, 8)), jnp.float32) for _ in range(3))
    mask = AttentionMask.segments(jnp.asarray(seg), 0, 128)
    assert (mask.segment_rows, mask.longest_segment) == (0, 128)
    assert reference.segment_block(128, 512) == 64 and reference.segment_block(4096, 512) == 512

    def run(q, k, v, bound):
        return reference.attention(q, k, v, mask.kv_start, mask.kv_end, longest_segment=bound)

    dense = mask.dense(len(seg))
    oracle = reference.masked_attention(q, k, v, dense)
    probe = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want = jax.grad(lambda *a: jnp.sum(reference.masked_attention(*a, dense) * probe), argnums=(0, 1, 2))(q, k, v)
    for bound in (128, 0):
        np.testing.assert_allclose(run(q, k, v, bound), oracle, atol=1e-5, rtol=1e-5)
        grads = jax.grad(lambda *a: jnp.sum(run(*a, bound) * probe), argnums=(0, 1, 2))(q, k, v)
        for got, expected in zip(grads, want):
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)

    hinted = reference.balanced_block(len(seg), reference.segment_block(128, reference.ATTENTION_BLOCK))
    default = reference.balanced_block(len(seg), reference.ATTENTION_BLOCK)
    assert (hinted, default) == (64, 264)
    hinted_entries, default_entries = _score_entries(mask, hinted), _score_entries(mask, default)
    assert hinted_entries < default_entries / 2, (hinted_entries, default_entries)


def test_four_large_images_do_not_allocate_a_full_score_matrix():
    """Four 1024x1024 images (4 x 4096 patches, 16 heads, head_dim 72) in one call."""
    tokens, heads, dim = 4 * 4096, 16, 72
    spec = jax.ShapeDtypeStruct((tokens, heads, dim), jnp.float32)
    seg = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    compiled = jax.jit(reference.varlen_attention).lower(spec, spec, spec, seg).compile()
    memory = compiled.memory_analysis()
    full_scores = tokens * tokens * heads * 4
    one_input = tokens * heads * dim * 4
    # Working memory is a few copies of the inputs (re-laid-out q, k, v, the output) plus one block's
    # scores: far below even one segment's 4096 x 4096 score matrix (1 GiB), let alone the full 16 GiB.
    assert memory.temp_size_in_bytes < 5 * one_input < 4096 * 4096 * heads * 4, (
        f"temp {memory.temp_size_in_bytes / 2**20:.0f} MiB; a full score matrix would be "
        f"{full_scores / 2**30:.0f} GiB"
    )


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_masked_attention_gqa(groups):
    rng = np.random.default_rng(1)
    b, length, heads, dim = 2, 9, 8, 16
    q = rng.standard_normal((b, length, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((b, length, groups, dim)).astype(np.float32) for _ in range(2))
    mask = np.tril(np.ones((length, length), bool))[None].repeat(b, 0)
    mask[1, :, :3] = False  # left padding of 3 in row 1
    out = np.asarray(reference.masked_attention(*map(jnp.asarray, (q, k, v, mask))))
    rep = heads // groups
    kk, vv = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # HF's repeat_kv order
    s = np.einsum("blhd,bshd->bhls", q, kk) / np.sqrt(dim)
    s = np.where(mask[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    ref = np.einsum("bhls,bshd->blhd", p, vv)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert np.all(out[1, :3] == 0)  # fully masked rows (padding queries) are zero
