"""Encoder token budgets: no compilation after warm-up, and the same features as unbucketed calls."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from qwen3vl_jax.buckets import Buckets, EncoderRunner


def _random_mix(rng, width):
    grids = []
    for _ in range(rng.integers(1, 4)):
        if rng.random() < 0.6:  # an image
            grids.append([1, 2 * rng.integers(1, 9), 2 * rng.integers(1, 9)])
        else:  # a video of 2..4 temporal patches
            grids.append([rng.integers(2, 5), 2 * rng.integers(1, 6), 2 * rng.integers(1, 6)])
    grid = np.asarray(grids)
    pixels = rng.standard_normal((int(grid.prod(1).sum()), width)).astype(np.float32)
    return pixels, grid


@pytest.fixture(scope="module")
def runner(jax_model):
    return EncoderRunner(jax_model, budgets=(16, 32, 64), max_segments=6).warmup()


def test_warmup_compiles_each_budget_once(runner):
    assert runner.num_compiles == 3


@pytest.mark.slow  # (the fast tier keeps one compile per budget, the split input and the edited weights)
def test_random_mixes_cause_no_compilation_and_match_unbucketed(runner, jax_model):
    rng = np.random.default_rng(0)
    compiles = runner.num_compiles
    for i in range(12):  # each mix compiles the unbucketed reference once: 12 keep the suite's budget
        pixels, grid = _random_mix(rng, jax_model.config.vision.patch_dim)
        merged, deepstack = runner.encode(pixels, grid)
        ref_merged, ref_deepstack = jax_model.encode_vision(pixels, grid)
        assert_close(merged, ref_merged, "f32_tower", f"mix {i} {grid.tolist()}: merged")
        assert_close(deepstack, ref_deepstack, "f32_tower", f"mix {i}: deepstack")
    assert runner.num_compiles == compiles
    assert sum(s.calls for s in runner.stats.values()) >= 12
    assert "waste" in runner.report()


def test_input_above_the_largest_budget_is_split(runner, jax_model):
    grid = np.asarray([[1, 4, 4], [9, 8, 8], [1, 2, 2]])  # the video is 9 x 16 = 144 merged tokens > 64
    pixels = np.random.default_rng(1).standard_normal((int(grid.prod(1).sum()), 1536)).astype(np.float32)
    calls = runner.plan(grid)
    assert len(calls) >= 3 and sum(p.frames for c in calls for p in c if p.item == 1) == 9
    before = runner.num_compiles
    merged, deepstack = runner.encode(pixels, grid)
    ref_merged, ref_deepstack = jax_model.encode_vision(pixels, grid)
    assert merged.shape == ref_merged.shape  # nothing dropped or truncated
    assert_close(merged, ref_merged, "f32_tower", "split video: merged")
    assert_close(deepstack, ref_deepstack, "f32_tower", "split video: deepstack")
    assert runner.num_compiles == before


def test_a_frame_larger_than_every_budget_is_an_error(runner):
    grid = np.asarray([[1, 2, 2], [1, 18, 16]])  # 72 merged tokens in one frame > 64
    pixels = np.zeros((int(grid.prod(1).sum()), 1536), np.float32)
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \[1, 18, 16\]: one frame is 72 merged tokens"):
        runner.encode(pixels, grid)


def test_segment_limit_is_respected(runner):
    for call in runner.plan(np.asarray([[4, 2, 2], [4, 2, 2], [1, 2, 2]])):
        assert sum(p.frames for p in call) <= runner.max_segments


def test_bucket_ladder():
    b = Buckets.doubling(64, 1000)
    assert b.sizes == (64, 128, 256, 512, 1000)
    assert b.fit(1) == 64 and b.fit(129) == 256 and b.fit(1000) == 1000
    with pytest.raises(ValueError, match="exceeds the largest bucket 1000"):
        b.fit(1001)


def test_persistent_compilation_cache(tmp_path, tiny_dir):
    """With a cache directory, a second process loads the budgets' executables instead of compiling."""
    import subprocess
    import sys

    code = (
        "import time; from qwen3vl_jax import Qwen3VL; from qwen3vl_jax.buckets import EncoderRunner\n"
        f"model = Qwen3VL.from_pretrained({str(tiny_dir)!r})\n"
        f"r = EncoderRunner(model, budgets=(16, 32), compilation_cache_dir={str(tmp_path)!r}).warmup()\n"
        "print(r.compile_seconds)\n"
    )
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    entries = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(entries) >= 2, entries  # one executable per budget at least
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(second.stdout.split()[-1]) < float(first.stdout.split()[-1])


def test_edited_weights_take_effect_without_recompiling(runner, jax_model):
    grid = np.asarray([[1, 4, 4]])
    pixels = np.random.default_rng(2).standard_normal((16, 1536)).astype(np.float32)
    before, compiles = np.asarray(runner.encode(pixels, grid)[0]), runner.num_compiles
    bias = jax_model.visual.merger.linear_fc2.bias
    original = bias[...]
    try:
        bias[...] = original + 1.0
        after = np.asarray(runner.encode(pixels, grid)[0])
    finally:
        bias[...] = original
    np.testing.assert_allclose(after, before + 1.0, rtol=1e-5, atol=1e-5)
    assert runner.num_compiles == compiles
