"""The synthetic task generator (`qwen3vl_jax.pruning.synthetic`): every answer is recovered from the
pixels by an independent numpy oracle written here, the sets are seeded, and bad ranges are refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from qwen3vl_jax.pruning import synthetic
from qwen3vl_jax.pruning.tasks import load_dataset

N_PER_FAMILY = 12
SMALL = synthetic.TaskRanges(image_side=(56, 96), frame_side=(56, 80), frames=(4, 12))


@pytest.fixture(scope="module")
def items():
    return synthetic.make_set(N_PER_FAMILY * len(synthetic.FAMILIES), seed=3, ranges=SMALL)


# ---------------------------------------------------------------------------------------------- oracles

def shape_mask(image):
    """Shape pixels: the background is achromatic, every palette colour is not."""
    image = image.astype(int)
    return (image.max(-1) - image.min(-1)) > 0


def nearest_color(pixels):
    names = list(synthetic.PALETTE)
    rgb = np.array([synthetic.PALETTE[n] for n in names], float)
    return names[int(np.argmin(((rgb - pixels.astype(float).mean(0)) ** 2).sum(-1)))]


def components(mask):
    """The number of 4-connected components, by repeated min-label propagation."""
    h, w = mask.shape
    big = h * w
    labels = np.where(mask, np.arange(big).reshape(h, w), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        neighbours = np.min([padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2],
                             padded[1:-1, 2:]], axis=0)
        new = np.where(mask, neighbours, big)
        if np.array_equal(new, labels):
            return len(np.unique(labels[mask]))
        labels = new


def kind_of(mask):
    ys, xs = np.nonzero(mask)
    box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    fill = box.mean()
    if fill > 0.95:
        return "square"
    if fill > 0.65:
        return "circle"
    half = box.shape[0] // 2
    top, bottom = box[:half].sum(), box[box.shape[0] - half:].sum()
    return "triangle" if bottom > 1.8 * top else "diamond"


def centroid(mask):
    ys, xs = np.nonzero(mask)
    return ys.mean(), xs.mean()


def oracle(item):
    """The answer, from the pixels alone."""
    media, family = item.media, item.family
    if family == "color":
        return nearest_color(media[shape_mask(media)])
    if family == "shape":
        return kind_of(shape_mask(media))
    if family == "count":
        return str(components(shape_mask(media)))
    if family == "position":
        h, w = media.shape[:2]
        cy, cx = centroid(shape_mask(media))
        dy, dx = (cy + 0.5) / h - 0.5, (cx + 0.5) / w - 0.5
        return ("left" if dx < 0 else "right") if abs(dx) > abs(dy) else ("top" if dy < 0 else "bottom")
    masks = [shape_mask(frame) for frame in media]
    if family == "direction":
        ys, xs = np.array([centroid(m) for m in masks]).T
        h, w = media.shape[1:3]
        dy, dx = ys[-1] - ys[0], xs[-1] - xs[0]
        moving = xs if abs(dx) / w > abs(dy) / h else ys
        steps = np.diff(moving)
        assert np.all(steps >= 0) or np.all(steps <= 0), "the motion is not monotone"
        along = w if moving is xs else h
        assert abs(moving[-1] - moving[0]) >= SMALL.min_displacement * along - 1e-9
        if moving is xs:
            return "left" if dx < 0 else "right"
        return "up" if dy < 0 else "down"
    if family == "order":
        colors = [nearest_color(frame[m]) for frame, m in zip(media, masks)]
        changes = [c for i, c in enumerate(colors) if i == 0 or c != colors[i - 1]]
        assert 2 <= len(changes) == len(set(changes)), f"not one colour after another: {colors}"
        return changes[0] if "first" in item.question else changes[-1]
    if family == "hidden":
        t = len(masks)
        absent = [i for i, m in enumerate(masks) if not m.any()]
        if not absent:
            return "never"
        assert absent == list(range(absent[0], absent[-1] + 1)), f"the gap is not contiguous: {absent}"
        assert len(absent) < t
        c = (absent[0] + absent[-1]) / 2
        return "early" if c < t / 3 else "late" if c >= 2 * t / 3 else "middle"
    raise AssertionError(family)


# ---------------------------------------------------------------------------------------------- tests

def test_answers_are_recoverable_from_pixels(items):
    for i, item in enumerate(items):
        assert oracle(item) == item.answer, (i, item.family, item.question)


def test_facts_are_recoverable_from_pixels(items):
    """`facts` (the colour and kind of a one-shape item) agree with the oracles, frame by frame for clips."""
    for i, item in enumerate(items):
        if item.family in ("count", "order"):
            assert item.facts == {}, (i, item.family)
            continue
        assert set(item.facts) == {"color", "shape"}, (i, item.family)
        assert item.facts.get(item.family, item.answer) == item.answer
        frames = [item.media] if item.kind == "image" else [f for f in item.media if shape_mask(f).any()]
        for frame in frames:
            mask = shape_mask(frame)
            assert nearest_color(frame[mask]) == item.facts["color"], (i, item.family)
            if item.kind == "image" or not (mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any()):
                assert kind_of(mask) == item.facts["shape"], (i, item.family)


def test_set_is_balanced_and_answers_vary(items):
    families = [it.family for it in items]
    assert all(families.count(f) == N_PER_FAMILY for f in synthetic.FAMILIES)
    for family in synthetic.FAMILIES:
        answers = {it.answer for it in items if it.family == family}
        assert len(answers) >= 2, (family, answers)


def test_media_shapes_and_ranges(items):
    for item in items:
        assert item.media.dtype == np.uint8 and item.media.shape[-1] == 3
        if item.family in synthetic.IMAGE_FAMILIES:
            assert item.kind == "image" and item.fps is None
            assert all(SMALL.image_side[0] <= s <= SMALL.image_side[1] for s in item.media.shape[:2])
        else:
            assert item.kind == "video"
            assert SMALL.frames[0] <= item.media.shape[0] <= SMALL.frames[1]
            assert all(SMALL.frame_side[0] <= s <= SMALL.frame_side[1] for s in item.media.shape[1:3])
            assert SMALL.fps[0] <= item.fps <= SMALL.fps[1]
    grids = {it.media.shape[-3:-1] for it in items}
    assert len(grids) > 10  # sizes vary, so grids vary


def test_options_hold_the_answer_once(items):
    vocab = {"color": synthetic.PALETTE, "shape": synthetic.SHAPES, "count": synthetic.COUNTS,
             "position": synthetic.POSITIONS, "direction": synthetic.DIRECTIONS, "order": synthetic.PALETTE,
             "hidden": synthetic.WHEN_HIDDEN}
    for item in items:
        assert len(item.options) == 4 == len(set(item.options))
        assert item.options.count(item.answer) == 1
        assert set(item.options) <= set(vocab[item.family])
    slots = [it.options.index(it.answer) for it in items]
    assert len(set(slots)) == 4  # the answer's position is shuffled


def test_seeded_determinism_and_other_seeds_differ():
    a = synthetic.make_set(14, seed=7, ranges=SMALL)
    b = synthetic.make_set(14, seed=7, ranges=SMALL)
    c = synthetic.make_set(14, seed=8, ranges=SMALL)
    for x, y in zip(a, b):
        assert (x.family, x.question, x.answer, x.options, x.fps) == (y.family, y.question, y.answer, y.options, y.fps)
        assert np.array_equal(x.media, y.media)
    assert any(x.media.shape != z.media.shape or not np.array_equal(x.media, z.media) for x, z in zip(a, c))
    assert [x.family for x in a] == [z.family for z in c]


def test_plain_and_noisy_backgrounds():
    plain = synthetic.make_set(4, seed=0, families=("color",), ranges=synthetic.TaskRanges(noise=(0.0,)))
    noisy = synthetic.make_set(4, seed=0, families=("color",), ranges=synthetic.TaskRanges(noise=(16.0,)))
    for it in plain:
        assert len(np.unique(it.media[~shape_mask(it.media)][:, 0])) == 1
    for it in noisy:
        assert len(np.unique(it.media[~shape_mask(it.media)][:, 0])) > 10
        assert oracle(it) == it.answer


def test_task_items_and_jsonl_round_trip(items, tmp_path):
    chosen = [items[i] for i in range(len(synthetic.FAMILIES))]
    mc = synthetic.to_task_item(chosen[0], "mc", "x")
    assert [o[:3] for o in mc.options] == ["A. ", "B. ", "C. ", "D. "]
    assert mc.options[mc.letters.index(mc.answer)] == f"{mc.answer}. {chosen[0].answer}"
    opened = synthetic.to_task_item(chosen[0], "open", "x")
    assert opened.options == () and opened.answer == chosen[0].answer and "one word" in opened.question
    with pytest.raises(ValueError, match="mode"):
        synthetic.to_task_item(chosen[0], "essay")

    path = synthetic.write_jsonl(chosen, tmp_path / "set")
    loaded = load_dataset(path)
    assert len(loaded) == len(chosen)
    assert not [n for n in os.listdir(tmp_path / "set") if n.startswith(".tmp")]
    for task, item in zip(loaded, chosen):
        assert task.kind == item.kind
        media = np.load(task.media) if item.kind == "video" else np.asarray(Image.open(task.media).convert("RGB"))
        assert np.array_equal(media, item.media)  # lossless: the pixels still determine the answer
        word = task.options[task.letters.index(task.answer)].split(". ", 1)[1]
        assert word == item.answer and task.words[task.letters.index(task.answer)] == item.answer
        assert task.words == list(item.options)
        assert task.open_question == synthetic.to_task_item(item, "open").question  # the cloze prompt
        if item.kind == "video":
            assert task.fps == item.fps and task.max_frames == len(item.media)
    with open(tmp_path / "set" / "open.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["answer"] for r in records] == [it.answer for it in chosen]
    assert [r["family"] for r in records] == list(synthetic.FAMILIES)


def test_hidden_gaps_cover_every_answer():
    for frames in range(4, 33):
        for when in ("early", "middle", "late"):
            assert synthetic.hidden_gaps(frames, when), (frames, when)


@pytest.mark.parametrize("kwargs, field", [
    ({"frames": (0, 8)}, "frames"),
    ({"frames": (2, 8)}, "frames"),
    ({"frames": (9, 8)}, "frames"),
    ({"image_side": (128, 64)}, "image_side"),
    ({"image_side": (64.0, 96)}, "image_side"),
    ({"shape_size": (0.2, 1.5)}, "shape_size"),
    ({"shape_size": (0.2, 0.7)}, "shape_size"),
    ({"shape_size": (0.0, 0.3)}, "shape_size"),
    ({"image_side": (20, 40)}, "shape_size"),
    ({"fps": (0.0, 2.0)}, "fps"),
    ({"noise": (-1.0,)}, "noise"),
    ({"noise": ()}, "noise"),
    ({"background": (0, 300)}, "background"),
    ({"palette": ("red", "green", "blue", "magenta")}, "palette"),
    ({"palette": ("red", "green", "blue")}, "palette"),
    ({"order_colors": (1, 3)}, "order_colors"),
    ({"order_colors": (2, 5)}, "order_colors"),
    ({"min_displacement": 0.9}, "min_displacement"),
])
def test_bad_ranges_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        synthetic.TaskRanges(**kwargs)


def test_bad_calls():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown task family"):
        synthetic.make_item("smell", rng)
    with pytest.raises(ValueError, match="families"):
        synthetic.make_set(3, seed=0, families=("color", "taste"))
    with pytest.raises(ValueError, match="^n:"):
        synthetic.make_set(0, seed=0)
