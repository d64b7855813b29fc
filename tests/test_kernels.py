"""Pallas kernels in interpret mode (`implementation="pallas"` on CPU) against the jnp references.

Small shapes throughout: the interpreter runs the grid as a sequential loop, so cost follows the
number of program instances (batch x heads x blocks), not FLOPs. Every case prints its max
absolute error against the reference (`pytest -s` shows them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _dispatch
from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention import kernel as attention_kernel
from pallas_kernels.attention import reference as attention_ref
from pallas_kernels.attention.mask import AttentionMask, segment_intervals
from pallas_kernels.pos_embed import api as pos_api
from pallas_kernels.pos_embed import reference as pos_ref

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# The attention kernels' bfloat16 cases repeat the float32 ones' code paths at a coarser tolerance: in
# the slow tier on a CPU (the suite's budget); scripts/gpu_checks.sh runs both tiers on a GPU.
KERNEL_DTYPES = [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)]


def _report(what, ours, ref, dtype):
    ours = np.asarray(jnp.asarray(ours).astype(jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    assert ours.shape == ref.shape, f"{what}: {ours.shape} != {ref.shape}"
    assert np.all(np.isfinite(ours)), f"{what}: non-finite output"
    err = float(np.abs(ours - ref).max()) if ours.size else 0.0
    print(f"\n[kernels] {what}: max|err| {err:.3g}")
    tol = TOL[dtype]
    np.testing.assert_allclose(ours, ref, atol=tol, rtol=tol, err_msg=what)
    return err


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


# ---------------------------------------------------------------------------------- switch


def test_implementation_switch():
    assert _dispatch.resolve("xla") == (False, False)
    if _dispatch.on_gpu():  # the same file runs on a GPU machine (scripts/bench_gpu.py's companion check)
        assert _dispatch.resolve("auto") == (True, False)
        assert _dispatch.resolve("pallas") == (True, False)
    else:
        assert _dispatch.resolve("auto") == (False, False)  # CPU backend: XLA
        assert _dispatch.resolve("pallas") == (True, True)  # CPU backend: interpreted kernel
    with _dispatch.lowering_for_gpu():
        assert _dispatch.resolve("auto") == (True, False)
        assert _dispatch.resolve("pallas") == (True, False)
    for fn, args in [
        (attention_api.varlen_attention, (jnp.zeros((4, 1, 16)),) * 3 + (jnp.zeros(4, jnp.int32),)),
        (pos_api.interpolate_pos_embed, (jnp.zeros((4, 16)), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4)))),
    ]:
        with pytest.raises(ValueError, match="unknown"):
            fn(*args, implementation="triton")


def test_pallas_path_really_runs_the_kernel():
    q = jnp.zeros((32, 2, 16))
    seg = jnp.zeros(32, jnp.int32)
    pallas = str(jax.make_jaxpr(lambda q: attention_api.varlen_attention(q, q, q, seg, implementation="pallas"))(q))
    xla = str(jax.make_jaxpr(lambda q: attention_api.varlen_attention(q, q, q, seg, implementation="xla"))(q))
    auto = str(jax.make_jaxpr(lambda q: attention_api.varlen_attention(q, q, q, seg, implementation="auto"))(q))
    assert "pallas_call" in pallas and "flash_attention" in pallas
    assert "pallas_call" not in xla
    assert ("pallas_call" in auto) == _dispatch.on_gpu()  # "auto": the kernel on a GPU, the spec elsewhere


# ---------------------------------------------------------------------------------- pos embed


@pytest.mark.parametrize("dim", [48, 128, 1152])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pos_embed(dim, dtype):
    grids = [(1, 8, 12), (2, 4, 6), (1, 2, 2), (3, 6, 4)] if dim != 1152 else [(1, 16, 20), (2, 6, 8)]
    indices, weights = pos_ref.interpolation_taps(grids, 16, 2)
    table = _normal(np.random.default_rng(dim), (256, dim), dtype)
    ours = pos_api.interpolate_pos_embed(table, indices, weights, implementation="pallas")
    ref = pos_api.interpolate_pos_embed(table, indices, weights, implementation="xla")
    assert ours.dtype == jnp.float32
    _report(f"pos_embed D={dim} {jnp.dtype(dtype).name}", ours, ref, jnp.float32)


def test_pos_embed_grid_convenience_uses_the_same_kernel():
    table = _normal(np.random.default_rng(1), (256, 64), jnp.float32)
    grids = np.array([(1, 8, 12), (2, 4, 6)])
    ours = pos_api.interpolate_pos_embed_grid(table, grids, 2, implementation="pallas")
    indices, weights = pos_ref.interpolation_taps(grids, 16, 2)
    assert ours.shape == (8 * 12 + 2 * 4 * 6, 64)
    _report("pos_embed grid form", ours, pos_ref.interpolate_pos_embed(table, indices, weights), jnp.float32)


# ---------------------------------------------------------------------------------- varlen


SEGMENTS = {
    "uneven": [37, 100, 5, 250, 64],
    "block_aligned": [64, 128, 64],
    "many_tiny": [4] * 40,
    "one_long": [600],
    "with_padding": [50, 90, -30],  # a negative length is a padding run
    "padding_first": [-7, 120, -1, 60],
}


def _segment_ids(lengths):
    return np.concatenate([np.full(abs(n), i if n > 0 else -1) for i, n in enumerate(lengths)]).astype(np.int32)


def _varlen_case(case, dtype, dim, heads=2):
    seg = _segment_ids(SEGMENTS[case])
    rng = np.random.default_rng(len(seg) + dim)
    q, k, v = (_normal(rng, (len(seg), heads, dim), dtype) for _ in range(3))
    ours = attention_api.varlen_attention(q, k, v, jnp.asarray(seg), implementation="pallas")
    ref = attention_api.varlen_attention(q, k, v, jnp.asarray(seg), implementation="xla")
    assert ours.dtype == dtype and ours.shape == q.shape
    _report(f"varlen {case} D={dim} {jnp.dtype(dtype).name}", ours, ref, dtype)
    assert np.all(np.asarray(ours.astype(jnp.float32))[seg < 0] == 0), "padding rows must be zero"


@pytest.mark.parametrize("case", list(SEGMENTS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_varlen(case, dtype):
    _varlen_case(case, dtype, dim=72)  # 72 -> padded to 128 inside the api


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_varlen_head_dims(dim, dtype):
    _varlen_case("uneven", dtype, dim)


def test_varlen_against_float64_dense():
    seg = _segment_ids(SEGMENTS["uneven"])
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((len(seg), 2, 72)) for _ in range(3))
    ours = attention_api.varlen_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(seg),
                                          implementation="pallas")
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(72)
    allowed = (seg[:, None] == seg[None, :]) & (seg[None, :] >= 0)
    s = np.where(allowed[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    _report("varlen vs float64 dense", ours, ref, jnp.float32)


def test_varlen_visits_only_overlapping_key_blocks():
    """NaN planted in the values of blocks a query block must not visit stays out of its output
    (a visited block would turn it into NaN through p @ v even where p is 0)."""
    seg = _segment_ids([64, 64, 128])  # blocks of 64: segment 0 = block 0, 1 = block 1, 2 = blocks 2-3
    rng = np.random.default_rng(4)
    q, k, v = (_normal(rng, (len(seg), 2, 64), jnp.float32) for _ in range(3))
    v = v.at[:64].set(jnp.nan)  # segment 0's values
    out = np.asarray(attention_api.varlen_attention(q, k, v, jnp.asarray(seg), implementation="pallas",
                                                    block_q=64, block_k=64))
    assert np.all(np.isnan(out[:64]))
    assert np.all(np.isfinite(out[64:])), "a query block visited a key block of another segment"


def test_segment_intervals():
    seg = jnp.asarray(np.repeat([-1, 0, 1, 1, -1, 2], [3, 4, 1, 0, 2, 5]).astype(np.int32))
    lo, hi = segment_intervals(seg)
    np.testing.assert_array_equal(lo, [0, 0, 0, 3, 3, 3, 3, 7, 0, 0, 10, 10, 10, 10, 10])
    np.testing.assert_array_equal(hi, [0, 0, 0, 7, 7, 7, 7, 8, 0, 0, 15, 15, 15, 15, 15])


# ---------------------------------------------------------------------------------- causal


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_causal_gqa(groups, dtype):
    rng = np.random.default_rng(groups)
    b, size, kv_heads, dim = 2, 100, 1, 128
    q = _normal(rng, (b, size, kv_heads * groups, dim), dtype)
    k, v = (_normal(rng, (b, size, kv_heads, dim), dtype) for _ in range(2))
    lengths = jnp.array([100, 37])
    ours = attention_api.causal_attention(q, k, v, lengths, implementation="pallas")
    ref = attention_api.causal_attention(q, k, v, lengths, implementation="xla")
    _report(f"causal GQA group {groups} {jnp.dtype(dtype).name}", ours, ref, dtype)
    assert np.all(np.asarray(ours.astype(jnp.float32))[1, 37:] == 0)


@pytest.mark.parametrize("dim", [64, 72])
def test_causal_left_padding_and_head_dims(dim):
    rng = np.random.default_rng(dim)
    b, size, kv_heads, heads = 3, 80, 2, 4
    q = _normal(rng, (b, size, heads, dim), jnp.float32)
    k, v = (_normal(rng, (b, size, kv_heads, dim), jnp.float32) for _ in range(2))
    lengths = jnp.array([80, 50, 1])
    starts = size - lengths  # left padding
    ours = attention_api.causal_attention(q, k, v, lengths, starts=starts, implementation="pallas")
    ref = attention_api.causal_attention(q, k, v, lengths, starts=starts, implementation="xla")
    _report(f"causal left-padded D={dim}", ours, ref, jnp.float32)


def test_causal_stops_at_the_diagonal():
    rng = np.random.default_rng(5)
    q, k, v = (_normal(rng, (1, 128, 2, 64), jnp.float32) for _ in range(3))
    v = v.at[:, 64:].set(jnp.nan)  # keys of the second block: the first query block must not visit it
    out = np.asarray(attention_api.causal_attention(q, k, v, jnp.array([128]), implementation="pallas",
                                                    block_q=64, block_k=64))
    assert np.all(np.isfinite(out[:, :64])) and np.all(np.isnan(out[:, 64:]))


# ---------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("cache", [16, 300, 1024])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_decode_cache_lengths(cache, dtype):
    rng = np.random.default_rng(cache)
    b, kv_heads, heads, dim = 4, 2, 8, 128
    q = _normal(rng, (b, heads, dim), dtype)
    kc, vc = (_normal(rng, (b, cache, kv_heads, dim), dtype) for _ in range(2))
    lengths = jnp.array([cache, 1, max(1, cache // 2 + 1), max(1, cache - 3)])
    starts = jnp.array([0, 0, 3 if cache > 8 else 0, 2])
    lengths = jnp.minimum(lengths, cache - starts)
    for splits in (None, 4):
        ours = attention_api.decode_attention(q, kc, vc, lengths, starts=starts, implementation="pallas",
                                              num_splits=splits)
        ref = attention_api.decode_attention(q, kc, vc, lengths, starts=starts, implementation="xla")
        _report(f"decode cache {cache} splits {splits} {jnp.dtype(dtype).name}", ours, ref, dtype)


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_decode_gqa_and_padded_head_dim(groups):
    rng = np.random.default_rng(groups)
    b, cache, kv_heads, dim = 2, 200, 2, 72
    q = _normal(rng, (b, kv_heads * groups, dim), jnp.bfloat16)
    kc, vc = (_normal(rng, (b, cache, kv_heads, dim), jnp.bfloat16) for _ in range(2))
    lengths = jnp.array([200, 77])
    ours = attention_api.decode_attention(q, kc, vc, lengths, implementation="pallas")
    ref = attention_api.decode_attention(q, kc, vc, lengths, implementation="xla")
    _report(f"decode GQA group {groups} D=72 bf16", ours, ref, jnp.bfloat16)


def test_decode_empty_range_is_zero():
    q = jnp.ones((1, 2, 16))
    kc = jnp.ones((1, 32, 1, 16))
    out = attention_api.decode_attention(q, kc, kc, jnp.array([0]), implementation="pallas")
    assert np.all(np.asarray(out) == 0)


# ---------------------------------------------------------------------------------- the model's op


def test_attention_prefill_masks():
    """The decoder's prefill description (causal, left-padded rows) on both paths, against the dense oracle."""
    rng = np.random.default_rng(6)
    b, size, heads, kv_heads, dim = 2, 40, 4, 2, 32
    q = _normal(rng, (b, size, heads, dim), jnp.float32)
    k, v = (_normal(rng, (b, size, kv_heads, dim), jnp.float32) for _ in range(2))
    mask = AttentionMask.causal(jnp.array([0, 13]), jnp.array([size, size]), size)
    oracle = attention_ref.masked_attention(q, k, v, mask.dense(size))
    for impl in ("pallas", "xla"):
        _report(f"prefill (causal, left padding) {impl}", attention_api.attention(q, k, v, mask, implementation=impl),
                oracle, jnp.float32)


def test_attention_decode_window():
    """One decode step: the query at cache slot 50 of rows whose prompts start at slots 0 and 9."""
    rng = np.random.default_rng(7)
    b, slots, heads, kv_heads, dim = 2, 96, 4, 2, 32
    q = _normal(rng, (b, 1, heads, dim), jnp.bfloat16)
    k, v = (_normal(rng, (b, slots, kv_heads, dim), jnp.bfloat16) for _ in range(2))
    index = 50
    mask = AttentionMask.causal(jnp.array([0, 9]), jnp.array([index + 1] * 2), 1, offset=index)
    np.testing.assert_array_equal(mask.kv_start[:, 0], [0, 9])
    np.testing.assert_array_equal(mask.kv_end[:, 0], [51, 51])
    oracle = attention_ref.masked_attention(q, k, v, mask.dense(slots))
    for impl in ("pallas", "xla"):
        _report(f"decode (cache window) {impl}", attention_api.attention(q, k, v, mask, implementation=impl),
                oracle, jnp.bfloat16)


def test_mask_constructors_describe_the_masks_they_name():
    causal = AttentionMask.causal(jnp.array([2, 0]), jnp.array([5, 3]), 5)
    pos = np.arange(5)
    for b, (start, end) in enumerate([(2, 5), (0, 3)]):
        real = (pos >= start) & (pos < end)
        want = real[:, None] & real[None, :] & (pos[:, None] >= pos[None, :])
        np.testing.assert_array_equal(causal.dense(5)[b], want)
    seg = jnp.asarray([0, 0, 1, 1, 1, -1])
    ids = np.asarray(seg)
    want = (ids[:, None] == ids[None, :]) & (ids[None, :] >= 0)
    np.testing.assert_array_equal(AttentionMask.segments(seg).dense(6)[0], want)


def test_attention_refuses_a_mismatched_description():
    q = jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="mask describes"):
        attention_api.attention(q, q, q, AttentionMask.causal(jnp.array([0]), jnp.array([3]), 3))


def test_references_agree_with_masked_attention():
    """The causal/decode specs are masked attention under the masks they describe."""
    rng = np.random.default_rng(8)
    q = _normal(rng, (2, 10, 4, 16), jnp.float32)
    k, v = (_normal(rng, (2, 10, 2, 16), jnp.float32) for _ in range(2))
    out = attention_ref.causal_attention(q, k, v, jnp.array([10, 10]))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((10, 10), bool)), (2, 10, 10))
    np.testing.assert_allclose(out, attention_ref.masked_attention(q, k, v, mask), atol=1e-6)
    dec = attention_ref.decode_attention(q[:, 0], k, v, jnp.array([10, 4]), jnp.array([0, 3]))
    dmask = jnp.asarray(np.stack([np.arange(10) < 10, (np.arange(10) >= 3) & (np.arange(10) < 7)]))[:, None]
    np.testing.assert_allclose(dec, attention_ref.masked_attention(q[:, :1], k, v, dmask)[:, 0], atol=1e-6)


def test_dot_precision_follows_the_matmul_precision_config():
    with jax.default_matmul_precision("highest"):
        assert attention_kernel.dot_precision(jnp.float32) == jax.lax.Precision.HIGHEST
        assert attention_kernel.dot_precision(jnp.bfloat16) is None
    with jax.default_matmul_precision("default"):
        assert attention_kernel.dot_precision(jnp.float32) is None


def test_empty_inputs():
    q = jnp.zeros((0, 2, 16))
    out = attention_api.varlen_attention(q, q, q, jnp.zeros((0,), jnp.int32), implementation="pallas")
    assert out.shape == (0, 2, 16)


# ---------------------------------------------------------------------------------- default tiles


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("width", [16, 32, 64, 128, 256])
def test_default_tiles_fit_shared_memory(width, itemsize):
    """The tiles the api picks keep the query tile and double-buffered key/value tiles within the
    budget that compiled on an H200 (float32 at width 128 failed there at 128 x 128 tiles)."""
    bq, bk = attention_api.default_blocks(width, itemsize)
    assert bq == bk and bq >= 16 and bq & (bq - 1) == 0
    assert (bq + 4 * bk) * width * itemsize <= 160 * 1024
    if itemsize == 2 and width == 128:
        assert bq == 128  # the measured best for bf16 at width 128


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("cache", [256, 4096, 8192, 32768])
def test_default_decode_splits_divide_a_power_of_two_cache(batch, cache):
    """An uneven split pads (copies) the whole cache: the default split count is a power of two."""
    splits = attention_api.default_splits(batch, 8, cache)
    assert splits >= 1 and splits & (splits - 1) == 0
    assert cache % (splits * 64) == 0
