"""Video token pruning: every worked example of docs/pruning.md (values produced by vLLM 0.33.0
itself, so independent goldens), plus properties and literal torch references of the spec."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import vllm_reference as P

from qwen3vl_jax.mrope import get_rope_index
from qwen3vl_jax.pruning import (
    PRUNING_METHODS,
    concat_levels,
    evs,
    frame_counts,
    retained_count,
    retention_mask,
    validate_video_pruning,
    vidcom2,
)
from qwen3vl_jax.pruning.prompt import sequence_keep_mask

METHODS = ["evs", "vidcom2"]

# ----------------------------------------------------------------------------------------------
# §6.1 counts, with their float behaviour

COUNTS = [
    # tpf, T, q, tpf*T*(1-q) in double (repr), EVS K, VidCom2 K
    (16, 4, 0.5, "32.0", 32, 32),
    (16, 4, 0.75, "16.0", 16, 16),
    (16, 4, 0.9, "6.399999999999999", 16, 6),
    (16, 4, 0.99, "0.6400000000000006", 16, 4),
    (100, 1, 0.9, "9.999999999999998", 100, 9),
    (10, 10, 0.9, "9.999999999999998", 10, 10),
    (10, 1, 0.9, "0.9999999999999998", 10, 1),
    (256, 32, 0.7, "2457.6000000000004", 2457, 2457),
    (256, 32, 0.3, "5734.4", 5734, 5734),
    (192, 16, 0.75, "768.0", 768, 768),
    (1, 3, 0.5, "1.5", 1, 3),
    (16, 4, 0.0, "64.0", 64, 64),
]


@pytest.mark.parametrize("tpf,frames,q,product,k_evs,k_vc", COUNTS)
def test_counts_table(tpf, frames, q, product, k_evs, k_vc):
    assert repr((tpf * frames) * (1 - q)) == product  # the double the formulas truncate
    assert evs.retained_count(tpf, frames, q) == k_evs
    assert vidcom2.retained_count(tpf, frames, q) == k_vc
    assert retained_count("evs", tpf, frames, q) == k_evs
    assert retained_count("vidcom2", tpf, frames, q) == k_vc


def test_counts_bounds():
    for tpf in (1, 2, 7, 16, 100):
        for frames in (1, 2, 5, 9):
            for q in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99):
                n = tpf * frames
                assert tpf <= evs.retained_count(tpf, frames, q) <= n
                assert frames <= vidcom2.retained_count(tpf, frames, q) <= n
    assert vidcom2.retained_count(1, 7, 0.9) == 7  # tpf = 1: no pruning at all
    assert evs.retained_count(1, 7, 0.9) == 1      # while EVS keeps one token


# ----------------------------------------------------------------------------------------------
# §6.2 EVS, T = 4, merged grid 4x4, D = 2


def evs_4x4() -> np.ndarray:
    e, n, w, d = (1, 0), (0, 1), (-1, 0), (1, 1)
    x = np.zeros((4, 16, 2), np.float32)
    x[:] = e
    x[1, 0], x[1, 5], x[1, 10] = n, w, d
    x[2, 0], x[2, 3], x[2, 5], x[2, 10], x[2, 12] = n, n, w, e, n
    x[3, 0], x[3, 3], x[3, 5], x[3, 6], x[3, 12], x[3, 15] = n, e, w, d, n, w
    return x.reshape(64, 2)


def test_evs_4x4_dissimilarities():
    dis = np.asarray(evs.dissimilarity(jnp.asarray(evs_4x4()), 4, 4, 4)).reshape(4, 16)
    assert (dis[0] == 255).all()
    want = np.zeros((3, 16))
    want[0, [0, 5, 10]] = [1, 2, 0.2929]
    want[1, [3, 12, 10]] = [1, 1, 0.2929]
    want[2, [3, 6, 15]] = [1, 0.2929, 2]
    np.testing.assert_allclose(dis[1:], want, atol=1e-4)


@pytest.mark.parametrize("q,k,per_frame,kept", [
    (0.5, 32, [16, 10, 3, 3], [[0, 1, 2, 3, 4, 5, 6, 7, 8, 10], [3, 10, 12], [3, 6, 15]]),
    (0.75, 16, [16, 0, 0, 0], [[], [], []]),
    (0.25, 48, [16, 16, 13, 3], [list(range(16)), list(range(13)), [3, 6, 15]]),
])
def test_evs_4x4(q, k, per_frame, kept):
    assert evs.retained_count(16, 4, q) == k
    mask = np.asarray(evs.retention_mask(evs_4x4(), (4, 8, 8), 2, q))
    assert mask.dtype == bool and mask.shape == (64,) and mask.sum() == k
    assert frame_counts(mask, 4).tolist() == per_frame
    assert [np.flatnonzero(mask.reshape(4, 16)[t]).tolist() for t in (1, 2, 3)] == kept


# ----------------------------------------------------------------------------------------------
# §6.3 VidCom2 at score level (v, f injected: steps 5-7)


def vc_case_ii():
    j = np.arange(10)
    b = 4.45 - 0.1 * j
    v = np.stack([b, b + 0.001 * j, b - 0.1, b + 0.002 * j])
    f = np.stack([0.01 * (9 - j), 0.013 * j, 0.017 * ((7 * j) % 10), 0.011 * ((3 * j) % 10)])
    return v, f


def vc_case_iii():
    j = np.arange(16)
    b = np.linspace(4.75, 3.25, 16)
    v = np.stack([b, b, b - 0.1, b])
    f = np.stack([0.003 * ((k * j) % 16) for k in (3, 5, 7, 11)])
    return v, f


def run_select(v, f, q, frames, tpf):
    target = min(vidcom2.retained_count(tpf, frames, q), frames * tpf)
    v32, f32 = jnp.asarray(v, jnp.float32), jnp.asarray(f, jnp.float32)
    mask = np.asarray(vidcom2.select(v32, f32, q, target)).reshape(frames, tpf)
    return target, v32, mask


def test_vidcom2_scores_i():
    v = [[4.2, 4.1, 3.9, 3.8], [4.05, 3.95, 3.85, 3.75], [4.3, 4.0, 3.7, 4.0]]
    f = [[0.50, 0.10, 0.26, 0.31], [0.20, 0.40, 0.10, 0.33], [0.10, 0.22, 0.34, 0.65]]
    target, v32, mask = run_select(v, f, 0.5, 3, 4)
    assert target == 6
    np.testing.assert_allclose(np.add(v, f), [[4.7, 4.2, 4.16, 4.11], [4.25, 4.35, 3.95, 4.08],
                                              [4.4, 4.22, 4.04, 4.65]], atol=1e-12)
    p, scale = vidcom2.frame_scales(v32, 0.5)
    np.testing.assert_allclose(p, [4.53958e-5, 0.999909, 4.53958e-5], rtol=2e-4)
    np.testing.assert_allclose(np.asarray(scale) * 4, [1.33342, 3.33315, 1.33342], rtol=1e-5)
    assert vidcom2.frame_budgets(v32, 0.5).tolist() == [1, 3, 1]  # sum 5 < 6: add flat 2 (s = 4.16)
    assert [np.flatnonzero(r).tolist() for r in mask] == [[2, 3], [0, 2, 3], [2]]


def test_vidcom2_scores_ii():
    v, f = vc_case_ii()
    target, v32, mask = run_select(v, f, 0.5, 4, 10)
    assert target == 20
    p, scale = vidcom2.frame_scales(v32, 0.5)
    np.testing.assert_allclose(p, [4.54e-5, 2.89e-5, 0.999907, 1.85e-5], rtol=5e-3)
    np.testing.assert_allclose(np.asarray(scale) * 10, [3.75023, 3.75014, 8.74954, 3.75009], rtol=1e-5)
    assert vidcom2.frame_budgets(v32, 0.5).tolist() == [4, 4, 9, 4]  # sum 21 > 20: drop flat 20 (s = 4.35)
    assert not mask.reshape(-1)[20]
    assert [np.flatnonzero(r).tolist() for r in mask] == [[6, 7, 8, 9], [6, 7, 8, 9], list(range(2, 10)),
                                                          [6, 7, 8, 9]]


def test_vidcom2_scores_iii():
    v, f = vc_case_iii()
    target, v32, mask = run_select(v, f, 0.5, 4, 16)
    assert target == 32
    assert vidcom2.frame_budgets(v32, 0.5).tolist() == [6, 6, 14, 6]  # no reconcile
    tail = list(range(10, 16))
    assert [np.flatnonzero(r).tolist() for r in mask] == [tail, tail, list(range(2, 16)), tail]


def test_vidcom2_budget_edges():
    # §4.5: tpf=16, T=4, q=0.99 -> target 4 = T, every k_t = 1
    rng = np.random.default_rng(0)
    v = jnp.asarray(rng.uniform(3, 5, (4, 16)), jnp.float32)
    assert vidcom2.retained_count(16, 4, 0.99) == 4
    assert vidcom2.frame_budgets(v, 0.99).tolist() == [1, 1, 1, 1]
    mask = np.asarray(vidcom2.select(v, v * 0, 0.99, 4)).reshape(4, 16)
    assert mask.sum(1).tolist() == [1, 1, 1, 1]
    # tpf=256, T=4, q=0.99 -> target 10, k = [2, 4, 2, 2] when frame 1 is the distinctive one
    v = np.full((4, 256), 4.0, np.float32)
    v[1] -= 0.5
    assert vidcom2.retained_count(256, 4, 0.99) == 10
    assert vidcom2.frame_budgets(jnp.asarray(v), 0.99).tolist() == [2, 4, 2, 2]


# ----------------------------------------------------------------------------------------------
# §6.4 golden full-pipeline masks


def golden_embeds(frames: int, rows: int, cols: int, dim: int) -> np.ndarray:
    t, j, c = np.meshgrid(np.arange(frames), np.arange(rows * cols), np.arange(dim), indexing="ij")
    e = np.sin(0.5 * c + 0.9 * j + 0.37 * t * (j % 5)) * (1 + 0.25 * c) + 0.1 * c
    return e.reshape(frames * rows * cols, dim)


def test_golden_embeds_spot_values():
    e = golden_embeds(4, 4, 4, 8)
    np.testing.assert_allclose(e[0, :3], [0.0, 0.699282, 1.462206], atol=1e-6)
    np.testing.assert_allclose(e[17, 5], -0.822678, atol=1e-6)


def _r(a, b):
    return list(range(a, b + 1))


GOLDEN = [
    ("evs", 4, 4, 4, 8, 0.5, [16, 5, 6, 5],
     _r(0, 15) + [19, 20, 24, 25, 30, 34, 36, 40, 41, 45, 46, 52, 56, 57, 61, 62]),
    ("vidcom2", 4, 4, 4, 8, 0.5, [6, 7, 9, 10],
     [3, 4, 5, 10, 11, 12, 18, 19, 20, 21, 25, 26, 27, 33, 34, 35, 37, 40, 41, 42, 43, 46, 49, 50, 52, 53,
      55, 56, 58, 59, 61, 62]),
    ("evs", 4, 4, 4, 8, 0.75, [16, 0, 0, 0], _r(0, 15)),
    ("vidcom2", 4, 4, 4, 8, 0.75, [3, 4, 4, 5],
     [4, 10, 11, 19, 25, 26, 27, 34, 40, 42, 46, 50, 53, 56, 58, 62]),
    ("evs", 3, 2, 3, 6, 0.5, [6, 2, 1], _r(0, 5) + [9, 10, 15]),
    ("vidcom2", 3, 2, 3, 6, 0.5, [4, 3, 2], [0, 3, 4, 5, 6, 7, 8, 13, 14]),
    ("evs", 6, 3, 4, 16, 0.7, [12, 2, 2, 2, 1, 2], _r(0, 11) + [16, 21, 28, 33, 39, 45, 52, 64, 69]),
    ("vidcom2", 6, 3, 4, 16, 0.7, [6, 3, 3, 3, 3, 3],
     [1, 2, 3, 8, 9, 10, 13, 19, 20, 25, 31, 34, 37, 40, 43, 49, 57, 58, 63, 66, 70]),
]


@pytest.mark.parametrize("method,frames,rows,cols,dim,q,per_frame,kept", GOLDEN)
def test_golden_masks(method, frames, rows, cols, dim, q, per_frame, kept):
    e = golden_embeds(frames, rows, cols, dim).astype(np.float32)
    mask = np.asarray(retention_mask(method, e, (frames, 2 * rows, 2 * cols), 2, q))
    assert frame_counts(mask, frames).tolist() == per_frame
    assert np.flatnonzero(mask).tolist() == kept
    idx = np.asarray(PRUNING_METHODS[method].keep_indices(e, (frames, 2 * rows, 2 * cols), 2, q))  # the jitted core
    assert idx.dtype == np.int32 and idx.tolist() == kept


def test_vidcom2_golden_internals():
    e = jnp.asarray(golden_embeds(4, 4, 4, 8), jnp.float32)
    v, _ = vidcom2.scores(e, 4, 16)
    p, scale = vidcom2.frame_scales(v, 0.5)
    np.testing.assert_allclose(p, [0.013492, 0.133451, 0.405783, 0.447274], atol=2e-6)
    np.testing.assert_allclose(np.asarray(scale) * 16, [6.1079, 7.0676, 9.2463, 9.5782], atol=2e-4)
    assert vidcom2.frame_budgets(v, 0.5).tolist() == [6, 7, 9, 10]
    assert vidcom2.frame_budgets(v, 0.75).tolist() == [3, 4, 5, 5]  # 17 > 16: one drop, in frame 2


# ----------------------------------------------------------------------------------------------
# §6.5 mRoPE end to end (EVS, q = 0.5) and §6.6 the image case

X, TS, VS, VE, VID, IMG = 100, 101, 1, 2, 3, 4


def types_of(ids) -> np.ndarray:
    ids = np.asarray(ids)
    return np.where(ids == VID, P.VIDEO, np.where(ids == IMG, P.IMAGE, P.TEXT))


def trace_video() -> np.ndarray:
    x = np.zeros((3, 4, 2), np.float32)
    x[:] = (1, 0)
    x[1, 0], x[1, 3] = (0, 1), (0.6, 0.8)
    x[2, 0], x[2, 1] = (0, 1), (-1, 0)
    return x.reshape(12, 2)


def rows_of(text: str) -> np.ndarray:
    return np.array([[int(v) for v in line.split()[1:]] for line in text.strip().splitlines()])


def test_mrope_trace():
    emb = trace_video()
    dis = np.asarray(evs.dissimilarity(jnp.asarray(emb), 3, 2, 2)).reshape(3, 4)
    np.testing.assert_allclose(dis[1:], [[1, 0, 0, 0.4], [0, 2, 0, 0.4]], atol=1e-6)
    assert evs.retained_count(4, 3, 0.5) == 6
    mask = np.asarray(evs.retention_mask(emb, (3, 4, 4), 2, 0.5))
    assert mask.reshape(3, 4).astype(int).tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0]]

    # lumped prompt (N = 22) and vLLM's initial positions on it
    lumped = np.array([X, X, TS, TS, VS] + [VID] * 6 + [VE] + [TS, TS, VS, VE] * 2 + [X, X])
    initial, delta = P.lumped_initial_positions(types_of(lumped), video_grid_thw=[[3, 4, 4]],
                                                video_token_counts=[6])
    want = rows_of("""
        t 0 1 2 3 4 5 5 5 5 7 7  9 10 11 12 13 14 15 16 17 18 19
        h 0 1 2 3 4 5 5 6 6 7 7  9 10 11 12 13 14 15 16 17 18 19
        w 0 1 2 3 4 5 6 5 6 7 8  9 10 11 12 13 14 15 16 17 18 19""")
    np.testing.assert_array_equal(initial, want)
    assert delta == -2

    # the embedding-order block B and its 5-channel metadata
    meta = P.video_block_metadata([2, 2, 2], 2, 2, mask)
    want_meta = rows_of("""
        t      0 1 2 3 3 3 3 5 6 7 8 9 11 12 13 14 15 17
        h      0 1 2 3 3 4 4 5 6 7 8 9 11 12 13 14 15 17
        w      0 1 2 3 4 3 4 5 6 7 8 9 11 12 13 14 16 17
        is_vs  0 0 1 0 0 0 0 0 0 0 1 0  0  0  0  1  0  0
        is_vid 0 0 0 1 1 1 1 0 0 0 0 1  0  0  0  0  1  0""")
    np.testing.assert_array_equal(meta, want_meta)

    # vLLM's recompute (nct = 0)
    final, delta = P.recompute_mrope_positions(lumped, [meta], initial, 0, VS, IMG, VID)
    want_final = rows_of("""
        t 0 1 2 3 4 5 5 5 5 7 8 9 10 11 13 14 15 16 17 19 20 21
        h 0 1 2 3 4 5 5 6 6 7 8 9 10 11 13 14 15 16 17 19 20 21
        w 0 1 2 3 4 5 6 5 6 7 8 9 10 11 13 14 15 16 18 19 20 21""")
    np.testing.assert_array_equal(final, want_final)
    assert delta == 0

    # the closed form: unpruned prompt (N = 28, delta -6), pruned tokens deleted, delta -6 + 6 = 0
    unpruned = np.array([X, X] + ([TS, TS, VS] + [VID] * 4 + [VE]) * 3 + [X, X])
    pos_u, delta_u = get_rope_index(unpruned[None], types_of(unpruned)[None], video_grid_thw=[[3, 4, 4]])
    assert unpruned.size == 28 and delta_u.tolist() == [[-6]]
    keep = sequence_keep_mask(types_of(unpruned), [mask])
    pos, delta = P.prune_positions(pos_u[:, 0], keep)
    np.testing.assert_array_equal(pos, want_final)
    assert delta == 0 == delta_u[0, 0] + int((~mask).sum())
    # decode continues at |S| + i + delta = last prompt position + 1 + i
    np.testing.assert_array_equal(P.decode_positions(22, delta, 3), [[22, 23, 24]] * 3)


def test_mrope_image_case():
    ids = np.array([X, VS] + [IMG] * 6 + [VE, X])
    want = rows_of("""
        t 0 1 2 2 2 2 2 2 5 6
        h 0 1 2 2 2 3 3 3 5 6
        w 0 1 2 3 4 2 3 4 5 6""")
    grid = [[1, 4, 6]]  # merged 2 x 3
    pos, delta = get_rope_index(ids[None], types_of(ids)[None], image_grid_thw=grid)
    np.testing.assert_array_equal(pos[:, 0], want)
    assert delta.tolist() == [[-3]]
    initial, delta = P.lumped_initial_positions(types_of(ids), image_grid_thw=grid)
    np.testing.assert_array_equal(initial, want)
    assert delta == -3
    meta = P.image_block_metadata(grid[0], 2)
    r, c = np.divmod(np.arange(6), 3)
    np.testing.assert_array_equal(meta, np.stack([0 * r, r, c, np.full(6, 3), 0 * r]))
    final, delta = P.recompute_mrope_positions(ids, [meta], initial, 0, VS, IMG, VID)
    np.testing.assert_array_equal(final, want)
    assert delta == -3
    # images are never pruned: the closed form keeps everything
    keep = sequence_keep_mask(types_of(ids), [])
    assert keep.all()
    pos2, delta2 = P.prune_positions(pos[:, 0], keep)
    np.testing.assert_array_equal(pos2, want)
    assert delta2 == -3


def test_closed_form_matches_recompute_random():
    """§5.6: one video per prompt, plain layout: vLLM's recompute equals the closed form."""
    rng = np.random.default_rng(1)
    for trial in range(12):
        method = METHODS[trial % 2]
        frames, rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
        tpf = rows * cols
        q = float(rng.choice([0.25, 0.5, 0.75, 0.9]))
        k = PRUNING_METHODS[method].retained_count(tpf, frames, q)
        if method == "vidcom2" and k < tpf:
            continue  # F5: vLLM's over-long initial positions change its delta
        ts_len = rng.integers(1, 4, frames)
        before, after = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        emb = rng.standard_normal((frames * tpf, 6)).astype(np.float32)
        mask = np.asarray(retention_mask(method, emb, (frames, 2 * rows, 2 * cols), 2, q))
        # unpruned per-frame prompt and the closed form
        unpruned = [X] * before
        for n in ts_len:
            unpruned += [TS] * int(n) + [VS] + [VID] * tpf + [VE]
        unpruned = np.array(unpruned + [X] * after)
        grid = [[frames, 2 * rows, 2 * cols]]
        pos_u, _ = get_rope_index(unpruned[None], types_of(unpruned)[None], video_grid_thw=grid)
        pos, delta = P.prune_positions(pos_u[:, 0], sequence_keep_mask(types_of(unpruned), [mask]))
        # vLLM: lumped prompt, initial positions, block metadata, recompute
        lumped = [X] * before
        for f, n in enumerate(ts_len):
            lumped += [TS] * int(n) + [VS] + [VID] * (k if f == 0 else 0) + [VE]
        lumped = np.array(lumped + [X] * after)
        initial, _ = P.lumped_initial_positions(types_of(lumped), video_grid_thw=grid, video_token_counts=[k])
        meta = P.video_block_metadata(ts_len, rows, cols, mask)
        final, delta_v = P.recompute_mrope_positions(lumped, [meta], initial, 0, VS, IMG, VID)
        np.testing.assert_array_equal(final[:, :lumped.size], pos)
        assert delta_v == delta


def test_prune_batch_left_and_right_padding():
    emb = trace_video()
    mask = np.asarray(evs.retention_mask(emb, (3, 4, 4), 2, 0.5))
    unpruned = np.array([X, X] + ([TS, TS, VS] + [VID] * 4 + [VE]) * 3 + [X, X])
    text_row = np.array([X] * 5)
    for side in ("left", "right"):
        ids = np.full((2, 28), 0)
        att = np.zeros((2, 28), np.int64)
        if side == "left":
            ids[0], att[0] = unpruned, 1
            ids[1, -5:], att[1, -5:] = text_row, 1
        else:
            ids[0], att[0] = unpruned, 1
            ids[1, :5], att[1, :5] = text_row, 1
        types = types_of(ids) * att
        pos_u, deltas_u = get_rope_index(ids, types, video_grid_thw=[[3, 4, 4]], attention_mask=att)
        keep = sequence_keep_mask(types, [mask], attention_mask=att)
        out = P.prune_batch(pos_u, keep, att, padding_side=side)
        assert out.index.shape == (2, 22) and out.attention_mask.sum(1).tolist() == [22, 5]
        single, delta = P.prune_positions(pos_u[:, 0], keep[0])
        np.testing.assert_array_equal(out.positions[:, 0], single)
        assert out.rope_deltas.tolist() == [[delta], [deltas_u[1, 0]]] == [[0], [0]]
        real = out.attention_mask[1].astype(bool)
        np.testing.assert_array_equal(np.take_along_axis(ids, out.index, 1)[1][real], text_row)
        np.testing.assert_array_equal(out.positions[:, 1, real], np.broadcast_to(np.arange(5), (3, 5)))
        assert (out.positions[:, 1, ~real] == 0).all()
        assert real[-1] if side == "left" else real[0]


def test_sequence_keep_mask_checks_lengths():
    types = types_of([X, VID, VID, X])
    with pytest.raises(ValueError, match="video masks cover 3 tokens"):
        sequence_keep_mask(types, [[True, False, True]])
    assert sequence_keep_mask(types, [[False, True]]).tolist() == [True, False, True, True]


# ----------------------------------------------------------------------------------------------
# properties


def random_cases():
    rng = np.random.default_rng(2)
    cases = [(1, 2, 2), (2, 1, 1), (3, 1, 5), (4, 3, 3), (5, 2, 4), (1, 1, 1), (7, 2, 3)]
    return [(t, r, c, rng.standard_normal((t * r * c, 12)).astype(np.float32)) for t, r, c in cases]


@pytest.mark.parametrize("method", METHODS)
def test_exactly_k_kept(method):
    mod = PRUNING_METHODS[method]
    for frames, rows, cols, emb in random_cases():
        for q in (0.0, 0.1, 0.5, 0.75, 0.9, 0.99):
            mask = np.asarray(mod.retention_mask(emb, (frames, 2 * rows, 2 * cols), 2, q))
            k = min(mod.retained_count(rows * cols, frames, q), frames * rows * cols)
            assert mask.shape == (frames * rows * cols,) and mask.dtype == bool
            assert mask.sum() == k, (frames, rows, cols, q)
            if method == "evs":
                assert mask[: rows * cols].all()  # all of frame 0
            if q == 0.0:
                assert mask.all()  # the formula alone keeps everything at rate 0


def test_evs_frame0_and_global_selection():
    # T = 4, q = 0.75: every frame but the first dropped; T = 1: everything kept
    emb = np.random.default_rng(3).standard_normal((4 * 9, 5)).astype(np.float32)
    mask = np.asarray(evs.retention_mask(emb, (4, 6, 6), 2, 0.75))
    assert frame_counts(mask, 4).tolist() == [9, 0, 0, 0]
    assert np.asarray(evs.retention_mask(emb[:9], (1, 6, 6), 2, 0.9)).all()


def test_evs_zero_vectors_no_nan():
    emb = np.zeros((3 * 4, 3), np.float32)
    emb[4:8] = 1.0  # frame 1 non-zero, frames 0 and 2 zero: similarity 0, dissimilarity 1
    dis = np.asarray(evs.dissimilarity(jnp.asarray(emb), 3, 2, 2))
    assert np.isfinite(dis).all()
    np.testing.assert_array_equal(dis[4:], 1.0)


def test_vidcom2_first_frame_not_privileged_and_t1():
    e = golden_embeds(4, 4, 4, 8).astype(np.float32)
    mask = np.asarray(vidcom2.retention_mask(e, (4, 8, 8), 2, 0.5))
    assert mask[:16].sum() < 16
    # T = 1: reconcile to max(1, floor(tpf (1 - q)))
    for q in (0.3, 0.5, 0.9, 0.99):
        m = np.asarray(vidcom2.retention_mask(e[:16], (1, 8, 8), 2, q))
        assert m.sum() == max(1, int(16 * (1 - q)))
    # tpf = 1: nothing pruned
    assert np.asarray(vidcom2.retention_mask(e[:5], (5, 2, 2), 2, 0.9)).all()


def test_rate_zero_is_off_and_validation():
    assert {"evs", "vidcom2", "random", "spatial_grid", "temporal"} <= set(PRUNING_METHODS)
    assert PRUNING_METHODS["evs"] is evs and PRUNING_METHODS["vidcom2"] is vidcom2
    for method in METHODS:
        assert validate_video_pruning(method, 0) is None
        assert validate_video_pruning(method, 0.0) is None
        assert validate_video_pruning(method, None) is None
        assert validate_video_pruning(method, 0.75) == (method, 0.75)
    assert validate_video_pruning(None, 0.5) == ("evs", 0.5)  # vLLM's default method
    assert validate_video_pruning("evs", np.float32(0.25)) == ("evs", 0.25)
    with pytest.raises(ValueError, match="unknown pruning method 'tome'"):
        validate_video_pruning("tome", 0.5)
    with pytest.raises(ValueError, match="unknown pruning method"):
        retention_mask("EVS", np.zeros((4, 2)), (1, 4, 4), 2, 0.5)
    for bad in (1.0, 1.5, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="rate"):
            validate_video_pruning("evs", bad)


@pytest.mark.parametrize("method", METHODS)
def test_jit_static_keep_count(method):
    mod = PRUNING_METHODS[method]
    frames, rows, cols = 4, 4, 4
    e = jnp.asarray(golden_embeds(frames, rows, cols, 8), jnp.float32)
    k = mod.retained_count(16, 4, 0.5)
    extra = (1.0 - 0.5,) if method == "vidcom2" else ()  # VidCom2's core takes the retention 1 - q
    ref = np.flatnonzero(np.asarray(mod.retention_mask(np.asarray(e), (4, 8, 8), 2, 0.5))).tolist()

    @jax.jit
    def kept(x):  # the core traced inside a caller's jit: static (T, R, C, K), traced embeddings
        mask = mod.keep_mask(x, frames, rows, cols, k, *extra)
        idx = jnp.nonzero(mask, size=k)[0]
        return idx, x[idx]

    idx, rows_kept = kept(e)
    assert idx.shape == (k,) and rows_kept.shape == (k, 8)
    assert np.asarray(idx).tolist() == ref
    # K static as well: a static-shape program
    static = jax.jit(mod.keep_mask, static_argnums=tuple(range(1, 5 + len(extra))))
    assert np.flatnonzero(np.asarray(static(e, frames, rows, cols, k, *extra))).tolist() == ref


@pytest.mark.parametrize("method", METHODS)
def test_one_compile_for_every_rate(method):
    mod = PRUNING_METHODS[method]
    e = golden_embeds(3, 5, 3, 10).astype(np.float32)  # a shape no other test uses
    mod.retention_mask(e, (3, 10, 6), 2, 0.25)
    before = mod.keep_mask._cache_size()
    for q in (0.5, 0.75, 0.9):
        mask = mod.retention_mask(e, (3, 10, 6), 2, q)
        assert int(mask.sum()) == mod.retained_count(15, 3, q)
    assert mod.keep_mask._cache_size() == before


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_run(method, dtype):
    e = jnp.asarray(golden_embeds(6, 3, 4, 16), dtype)
    mask = retention_mask(method, e, (6, 6, 8), 2, 0.7)
    k = retained_count(method, 12, 6, 0.7)
    assert mask.dtype == jnp.bool_ and int(mask.sum()) == k
    if method == "evs":
        assert bool(mask[:12].all())


def test_concat_levels():
    merged = jnp.arange(6.0).reshape(3, 2)
    deep = jnp.stack([merged + 10, merged + 20])
    rows = concat_levels(merged, deep)
    assert rows.shape == (3, 6)
    np.testing.assert_array_equal(rows[1], [2, 3, 12, 13, 22, 23])
    assert concat_levels(merged, jnp.zeros((0, 3, 2))).shape == (3, 2)
    with pytest.raises(ValueError, match="deepstack must be"):
        concat_levels(merged, jnp.zeros((2, 4, 2)))


# ----------------------------------------------------------------------------------------------
# literal torch references of the spec (vLLM's semantics, written independently of the JAX code)


def torch_evs_mask(x, frames, tpf, k, dtype):
    import torch

    t = torch.tensor(x).to(dtype).reshape(frames, tpf, -1)
    sim = torch.nn.functional.cosine_similarity(t[1:], t[:-1], dim=-1)
    dis = torch.cat([torch.full((1, tpf), 255.0, dtype=dtype), 1 - sim]).reshape(-1)
    order = torch.argsort(dis, descending=True, stable=True)[:k]
    mask = torch.zeros(frames * tpf, dtype=torch.bool)
    mask[order] = True
    return mask.numpy(), dis.float().numpy()


def torch_vidcom2_mask(x, frames, tpf, q):
    import torch

    x = torch.tensor(x, dtype=torch.float32)
    n, d = x.shape
    target = min(vidcom2.retained_count(tpf, frames, q), n)
    var = x.var(dim=0, unbiased=False)
    ch = torch.topk(var, max(1, int(0.5 * d)), largest=False).indices
    z = torch.nn.functional.normalize(x[:, ch], dim=-1).reshape(frames, tpf, -1)

    def gauss(a, mu):
        dist = ((a - mu) ** 2).sum(-1)
        return sum(torch.exp(-dist / (2 * al)) for al in (0.125, 0.25, 0.5, 1.0, 2.0))

    v = gauss(z, z.reshape(-1, z.shape[-1]).mean(0))
    f = gauss(z, z.mean(1, keepdim=True))
    s = v + f
    p = torch.softmax((-v.mean(1) - (-v.mean(1)).max()) / 0.01, dim=0)
    scale = torch.clamp((1 - q) * (1 + p - p.mean()), max=1.0)
    k = torch.clamp(torch.round(scale * tpf), 1, tpf).long()
    mask = torch.zeros(frames, tpf, dtype=torch.bool)
    for t in range(frames):
        mask[t, torch.topk(s[t], int(k[t]), largest=False).indices] = True
    mask, s = mask.reshape(-1), s.reshape(-1)
    cur = int(mask.sum())
    if cur > target:
        kept = torch.nonzero(mask)[:, 0]
        mask[kept[torch.topk(s[kept], cur - target).indices]] = False
    elif cur < target:
        free = torch.nonzero(~mask)[:, 0]
        mask[free[torch.topk(s[free], target - cur, largest=False).indices]] = True
    return mask.numpy()


def test_evs_matches_torch_reference():
    import torch

    rng = np.random.default_rng(4)
    for frames, rows, cols, dim in [(4, 3, 3, 16), (6, 2, 5, 24), (3, 4, 4, 8)]:
        x = rng.standard_normal((frames * rows * cols, dim)).astype(np.float32)
        for q in (0.3, 0.5, 0.8):
            k = evs.retained_count(rows * cols, frames, q)
            want, _ = torch_evs_mask(x, frames, rows * cols, k, torch.float32)
            got = np.asarray(evs.retention_mask(x, (frames, 2 * rows, 2 * cols), 2, q))
            np.testing.assert_array_equal(got, want)


def test_evs_bf16_dissimilarity_like_torch():
    import torch

    rng = np.random.default_rng(5)
    base = rng.standard_normal((1, 16, 32))
    x = (base + 0.1 * rng.standard_normal((5, 16, 32))).reshape(80, 32).astype(np.float32)
    _, want = torch_evs_mask(x, 5, 16, 16, torch.bfloat16)
    got = np.asarray(evs.dissimilarity(jnp.asarray(x, jnp.bfloat16), 5, 4, 4)).astype(np.float32)
    # op-by-op bf16 rounding as torch does it; summation order may move a value by one bf16 step
    assert np.mean(got == want) >= 0.95
    np.testing.assert_allclose(got, want, atol=2 ** -7)


def test_vidcom2_matches_torch_reference():
    rng = np.random.default_rng(6)
    for frames, rows, cols, dim in [(4, 3, 3, 16), (5, 2, 4, 10), (3, 4, 4, 8), (1, 3, 3, 6)]:
        x = rng.standard_normal((frames * rows * cols, dim)).astype(np.float32)
        x[rows * cols:2 * rows * cols] *= 3.0  # one distinctive-looking frame
        for q in (0.3, 0.5, 0.75, 0.9):
            want = torch_vidcom2_mask(x, frames, rows * cols, q)
            got = np.asarray(vidcom2.retention_mask(x, (frames, 2 * rows, 2 * cols), 2, q))
            np.testing.assert_array_equal(got, want, err_msg=f"{frames}x{rows}x{cols} q={q}")


def test_lumped_short_slot_quirk():
    """§5.2 / F5: a VidCom2 lump with 0 < K < tpf still emits a whole grid, so vLLM's initial
    positions run tpf - K columns past the prompt; the closed form has no such tail."""
    k = vidcom2.retained_count(16, 4, 0.99)
    assert k == 4
    lumped = np.array([X, VS] + [VID] * k + [VE] + [VS, VE] * 3 + [X])
    initial, _ = P.lumped_initial_positions(types_of(lumped), video_grid_thw=[[4, 8, 8]], video_token_counts=[k])
    assert initial.shape == (3, lumped.size + 16 - k)
    np.testing.assert_array_equal(initial[:, 2:18], 2 + np.stack([np.zeros(16, int), *np.divmod(np.arange(16), 4)]))
