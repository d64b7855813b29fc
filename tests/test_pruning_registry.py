"""The pruning-method registry and the baselines: protocol checks, bad input, exact counts."""

from __future__ import annotations

import numpy as np
import pytest

from qwen3vl_jax import pruning
from qwen3vl_jax.pruning import baselines, frame_counts, register_method, retention_mask, unregister_method


class KeepFirst:
    """Keeps the first K flat tokens (a deliberately simple, content-blind method)."""

    def __init__(self, extra: int = 0):
        self.extra = extra  # keep this many more than retained_count says (a broken method)

    def retained_count(self, tokens_per_frame, num_frames, rate):
        return max(1, int(tokens_per_frame * num_frames * (1 - rate)))

    def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
        t, r, c = pruning.merged_grid(grid_thw, spatial_merge_size)
        mask = np.zeros(t * r * c, bool)
        mask[: self.retained_count(r * c, t, rate) + self.extra] = True
        return mask


@pytest.fixture
def registered():
    names = []

    def add(name, method, **kw):
        register_method(name, method, **kw)
        names.append(name)
        return method

    yield add
    for name in names:
        if name in pruning.PRUNING_METHODS:
            unregister_method(name)


def test_builtins_and_baselines_are_registered_entries():
    assert pruning.get_method("evs") is pruning.evs and pruning.get_method("vidcom2") is pruning.vidcom2
    for name in ("evs", "vidcom2", "random", "spatial_grid", "temporal"):
        assert isinstance(pruning.get_method(name), pruning.PruningMethod)
    assert pruning.registered_methods() == sorted(pruning.PRUNING_METHODS)


def test_register_use_and_unregister(registered):
    method = registered("keep_first", KeepFirst())
    assert pruning.validate_video_pruning(("keep_first", 0.5)) == ("keep_first", 0.5)
    assert pruning.retained_count("keep_first", 4, 3, 0.5) == 6
    mask = retention_mask("keep_first", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)
    assert mask.tolist() == [True] * 6 + [False] * 6
    with pytest.raises(ValueError, match="already registered"):
        register_method("keep_first", KeepFirst())
    register_method("keep_first", method)  # the same object again is a no-op (re-run notebook cell)
    replacement = register_method("keep_first", KeepFirst(), replace=True)
    assert pruning.get_method("keep_first") is replacement
    unregister_method("keep_first")
    with pytest.raises(ValueError, match=r"unknown pruning method 'keep_first'; registered methods: \[.*'evs'"):
        pruning.validate_video_pruning("keep_first", 0.5)


def test_unknown_method_lists_the_registered_ones(registered):
    registered("mine", KeepFirst())
    with pytest.raises(ValueError) as err:
        pruning.validate_video_pruning(("tome", 0.5))
    for name in ("evs", "vidcom2", "random", "spatial_grid", "temporal", "mine"):
        assert repr(name) in str(err.value)


@pytest.mark.parametrize("bad,match", [
    (object(), r"lacks callable \['retained_count', 'retention_mask'\]"),
    (type("OnlyCount", (), {"retained_count": lambda self, *a: 1})(), r"lacks callable \['retention_mask'\]"),
])
def test_register_rejects_objects_without_the_protocol(bad, match):
    with pytest.raises(ValueError, match=match):
        register_method("broken", bad)
    assert "broken" not in pruning.PRUNING_METHODS


@pytest.mark.parametrize("name", ["", " evs", 3, None])
def test_register_rejects_bad_names(name):
    with pytest.raises(ValueError, match="name"):
        register_method(name, KeepFirst())


def test_mask_with_a_different_count_than_retained_count(registered):
    registered("greedy", KeepFirst(extra=1))
    with pytest.raises(ValueError, match=r"'greedy' kept 7 tokens of a video with grid_thw \[3, 4, 4\] at rate 0.5, "
                                         r"but its retained_count said 6"):
        retention_mask("greedy", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)
    registered("shy", KeepFirst(extra=-1))
    with pytest.raises(ValueError, match="'shy' kept 5 tokens"):
        retention_mask("shy", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)


def test_mask_shape_dtype_and_count_range_are_checked(registered):
    class WrongShape(KeepFirst):
        def retention_mask(self, rows, grid_thw, spatial_merge_size, rate):
            return np.ones(5, bool)

    class TooMany(KeepFirst):
        def retained_count(self, tokens_per_frame, num_frames, rate):
            return tokens_per_frame * num_frames + 1

    registered("wrong_shape", WrongShape())
    with pytest.raises(ValueError, match=r"mask of shape \(5,\).*must be bool \[12\]"):
        retention_mask("wrong_shape", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)
    registered("too_many", TooMany())
    with pytest.raises(ValueError, match=r"returned 13; it must be an int in \[1, 12\]"):
        pruning.retained_count("too_many", 4, 3, 0.5)

    class NoneKept(KeepFirst):
        def retained_count(self, tokens_per_frame, num_frames, rate):
            return 0

    registered("none_kept", NoneKept())
    with pytest.raises(ValueError, match=r"returned 0; it must be an int in \[1, 12\]"):
        pruning.retained_count("none_kept", 4, 3, 0.5)


def test_adaptive_may_keep_fewer_but_not_more(registered):
    class Adaptive(KeepFirst):
        adaptive = True

    registered("fewer", Adaptive(extra=-3))
    assert retention_mask("fewer", np.zeros((12, 3)), (3, 4, 4), 2, 0.5).sum() == 3
    registered("more", Adaptive(extra=1))
    with pytest.raises(ValueError, match="'more' kept 7 .*said 6 .an adaptive method keeps at most that many"):
        retention_mask("more", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)


def test_text_guided_methods_need_the_prompt(registered):
    seen = []

    class TextGuided(KeepFirst):
        uses_text = True

        def retention_mask(self, rows, grid_thw, spatial_merge_size, rate, *, text):
            seen.append(text)
            return super().retention_mask(rows, grid_thw, spatial_merge_size, rate)

    registered("guided", TextGuided())
    with pytest.raises(ValueError, match="'guided' is text-guided"):
        retention_mask("guided", np.zeros((12, 3)), (3, 4, 4), 2, 0.5)
    text = pruning.PromptText(np.array([5, 6]), np.zeros((2, 3)))
    retention_mask("guided", np.zeros((12, 3)), (3, 4, 4), 2, 0.5, text=text)
    assert seen == [text]


@pytest.mark.parametrize("spec", [{"evs": 0.5}, ("evs",), "evs", ("evs", 0.5, 1), [], ("evs", "0.5"),
                                  ("evs", 1.0), ("evs", -0.1), ("evs", float("nan")), ("evs", True)])
def test_bad_specs_are_value_errors(spec):
    with pytest.raises(ValueError, match="video_pruning|rate"):
        pruning.validate_video_pruning(spec)


def test_spec_forms():
    assert pruning.validate_video_pruning(None) is None
    assert pruning.validate_video_pruning(("evs", 0)) is None
    assert pruning.validate_video_pruning(["vidcom2", 0.25]) == ("vidcom2", 0.25)
    assert pruning.validate_video_pruning("vidcom2", 0.25) == ("vidcom2", 0.25)  # unpacked, as the processor calls it
    with pytest.raises(ValueError, match="got 'evs'"):
        pruning.validate_video_pruning(*("evs",))


# ---------------------------------------------------------------------------------------------- baselines

GRIDS = [(1, 1, 1), (3, 4, 4), (5, 3, 5), (8, 2, 3), (4, 6, 4)]
RATES = [0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
BASELINES = ["random", "spatial_grid", "temporal"]


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_keep_exactly_the_rate_count(name):
    for t, r, c in GRIDS:
        for q in RATES:
            mask = retention_mask(name, np.zeros((t * r * c, 2)), (t, 2 * r, 2 * c), 2, q)
            n = t * r * c
            assert mask.sum() == max(1, int(n * (1 - q))), (name, t, r, c, q)  # checked inside too


def test_rate_count_float_order():
    assert baselines.rate_count(10, 10, 0.9) == 9  # 100 * (1 - 0.9) = 9.999999999999998
    assert baselines.rate_count(4, 1, 0.99) == 1
    assert baselines.rate_count(0, 3, 0.5) == 0


def test_spatial_grid_is_a_regular_sub_grid_in_every_frame():
    mask = retention_mask("spatial_grid", np.zeros((4 * 16, 2)), (4, 8, 8), 2, 0.75).reshape(4, 4, 4)
    for frame in mask:  # 4 per frame on a 4x4 grid: rows {1, 3} x cols {1, 3}
        assert np.argwhere(frame).tolist() == [[1, 1], [1, 3], [3, 1], [3, 3]]
    mask = retention_mask("spatial_grid", np.zeros((3 * 36, 2)), (3, 12, 12), 2, 0.5).reshape(3, 6, 6)
    assert frame_counts(mask.reshape(-1), 3).tolist() == [18, 18, 18]
    rows, cols = np.nonzero(mask[0])
    assert len(set(rows)) * len(set(cols)) == 18  # a full product grid: 3 x 6 or 6 x 3
    uneven = retention_mask("spatial_grid", np.zeros((3 * 4, 2)), (3, 4, 4), 2, 0.5)
    assert sorted(frame_counts(uneven, 3).tolist()) == [2, 2, 2]


def test_temporal_keeps_whole_evenly_spaced_frames():
    mask = retention_mask("temporal", np.zeros((8 * 4, 2)), (8, 4, 4), 2, 0.75)
    assert frame_counts(mask, 8).tolist() == [0, 0, 4, 0, 0, 0, 4, 0]  # centres of two halves of 0..7
    mask = retention_mask("temporal", np.zeros((8 * 4, 2)), (8, 4, 4), 2, 0.7)  # K = 9: 2 frames + 1 token
    assert sorted(frame_counts(mask, 8).tolist(), reverse=True)[:3] == [4, 4, 1]


def test_random_is_seeded_and_uniform():
    rows = np.zeros((6 * 9, 2))
    a = retention_mask("random", rows, (6, 6, 6), 2, 0.5)
    b = retention_mask("random", rows * 7, (6, 6, 6), 2, 0.5)  # content-blind: same draw
    np.testing.assert_array_equal(a, b)
    other = baselines.RandomSelection(seed=1).retention_mask(rows, (6, 6, 6), 2, 0.5)
    assert other.sum() == a.sum() and (other != a).any()
    # each token kept with probability K / N: over many seeds every token's frequency is near 1/2
    freq = np.mean([baselines.RandomSelection(seed=s).retention_mask(rows, (6, 6, 6), 2, 0.5)
                    for s in range(400)], axis=0)
    assert np.abs(freq - 0.5).max() < 5 * np.sqrt(0.25 / 400)  # 5 sigma, 54 tokens


def test_sub_grid_and_evenly_spaced_edges():
    assert baselines.evenly_spaced(8, 2).tolist() == [2, 6]
    assert baselines.sub_grid(3, 3, 9).all() and not baselines.sub_grid(3, 3, 0).any()
    for k in range(13):
        assert baselines.sub_grid(3, 4, k).sum() == k
    with pytest.raises(ValueError, match="cannot keep 13"):
        baselines.sub_grid(3, 4, 13)


def test_prompt_text_tokens_in_both_prompt_layouts():
    """The text a text-guided method sees: outside vision blocks, not the timestamps between a
    lumped video's frames; in the layout with an outer pair (older HF) not the first one either."""
    from qwen3vl_jax.pruning.apply import prompt_text_tokens

    VS, VE, IMG, VID, TS, Q = 90, 91, 92, 93, 7, 5  # TS: timestamp text, Q: question text
    image = [VS, IMG, IMG, VE]
    frames = [TS, VS, VID, VID, VID, VE, TS, TS, VS, VE, TS, VS, VE]  # 3 frames, all 3 kept in frame 0
    current = [Q, Q] + image + [Q] + frames + [Q]
    older = [Q, Q] + image + [Q] + [VS] + frames + [VE] + [Q]
    pad = 3
    for layout, first_stamp in ((current, 7), (older, None)):
        ids = np.array([0] * pad + layout)
        types = np.where(ids == IMG, 1, np.where(ids == VID, 2, 0))
        mask = np.arange(ids.size) >= pad
        expected = ids == Q
        if first_stamp is not None:  # the first frame's timestamp: nothing tells it from the question
            assert ids[pad + first_stamp] == TS and ids[pad + first_stamp + 1] == VS
            expected[pad + first_stamp] = True
        np.testing.assert_array_equal(prompt_text_tokens(ids, types, mask, VS, VE), expected)
