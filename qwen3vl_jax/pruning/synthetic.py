"""Synthetic image and video tasks whose answers are fixed by the pixels (issue #28, step 1).

Seven families: on images the shape's `color`, its kind (`shape`), how many shapes (`count`) and
where it is (`position`); on clips which way it moves (`direction`), which colour comes first or
last (`order`) and when it is hidden (`hidden`). Every item is an open question with a one-word
answer ("red", "left", "3") and a 4-option multiple-choice item in the ablation's JSONL format
(`qwen3vl_jax.pruning.tasks`). The distribution (palette, every range, the question templates, how
options are drawn) is written out in docs/tasks.md, so an independent generator can make fresh
items; held-out sets are made from other seeds.

Pixel facts every item keeps (the tests check them with plain numpy oracles):

* the background is achromatic (R = G = B at every pixel, plain or noisy) and every palette colour
  is chromatic, so the shape pixels are exactly the pixels whose channels differ;
* shapes are drawn in flat palette colours, with no noise and no anti-aliasing;
* in `count` items the shapes lie in distinct cells of a 2 x 2 grid with at least 2 pixels between
  any two of them (so they are separate 4-connected components).

    from qwen3vl_jax.pruning import synthetic
    items = synthetic.make_set(70, seed=0)              # 10 per family
    path = synthetic.write_jsonl(items, "data/synth")   # data/synth/dataset.jsonl (+ open.jsonl)
    test = synthetic.make_set(70, seed=1)               # a held-out set: another seed
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile

import numpy as np
from PIL import Image

from .tasks import TaskItem, option_letters

__all__ = ["PALETTE", "SHAPES", "POSITIONS", "DIRECTIONS", "COUNTS", "WHEN_HIDDEN", "FAMILIES",
           "IMAGE_FAMILIES", "VIDEO_FAMILIES", "QUESTIONS", "TaskRanges", "SyntheticItem", "make_item", "make_set",
           "hidden_gaps", "draw_options",
           "to_task_item", "write_jsonl"]

# Named palette: all chromatic (max channel - min channel >= 150), pairwise RGB distance >= 75.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 230),
    "yellow": (235, 215, 30),
    "purple": (150, 40, 190),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("left", "right", "top", "bottom")
DIRECTIONS = ("left", "right", "up", "down")
COUNTS = ("1", "2", "3", "4")
WHEN_HIDDEN = ("never", "early", "middle", "late")
IMAGE_FAMILIES = ("color", "shape", "count", "position")
VIDEO_FAMILIES = ("direction", "order", "hidden")
FAMILIES = IMAGE_FAMILIES + VIDEO_FAMILIES
MAX_SHAPE_FRACTION = 0.45  # a shape fits in half the image (position, count) and has room to move
MIN_SHAPE_PIXELS = 8       # below this the four kinds are not reliably told apart

QUESTIONS = {
    "color": "What color is the shape?",
    "shape": "What kind of shape is in the image?",
    "count": "How many shapes are in the image?",
    "position": "Where in the image is the shape: left, right, top or bottom?",
    "direction": "Which way does the shape move?",
    "order_first": "Which color appears first?",
    "order_last": "Which color appears last?",
    "hidden": "When is the shape hidden: never, early, middle or late in the clip?",
}
OPEN_SUFFIX = {"count": " Answer with a number."}  # every other family: " Answer with one word."


@dataclasses.dataclass(frozen=True)
class TaskRanges:
    """The ranges items are drawn from; pairs are inclusive `(low, high)`. See docs/tasks.md.

    image_side / frame_side: image (and video frame) height and width in pixels, each drawn
    independently; frames: clip length; fps: recorded frame rate; shape_size: a shape's bounding-box
    side as a fraction of min(height, width); noise: background noise standard deviations, one drawn
    per item (0 = a plain background); background: the grey level of the background; palette: the
    colour names used (from `PALETTE`); order_colors: how many colours an `order` clip shows;
    min_displacement: a `direction` shape moves at least this fraction of the frame along its axis.
    """

    image_side: tuple[int, int] = (64, 160)
    frame_side: tuple[int, int] = (64, 128)
    frames: tuple[int, int] = (4, 32)
    fps: tuple[float, float] = (1.0, 4.0)
    shape_size: tuple[float, float] = (0.15, 0.4)
    noise: tuple[float, ...] = (0.0, 8.0, 16.0)
    background: tuple[int, int] = (40, 200)
    palette: tuple[str, ...] = tuple(PALETTE)
    order_colors: tuple[int, int] = (2, 4)
    min_displacement: float = 0.3

    def __post_init__(self):
        for name in ("image_side", "frame_side", "frames", "fps", "shape_size", "background", "order_colors"):
            _check_pair(name, getattr(self, name), integer=name not in ("fps", "shape_size"),
                        positive=name != "background")
        if self.frames[0] < 4:
            raise ValueError(f"frames: a clip needs at least 4 frames, got {self.frames}")
        if self.fps[0] <= 0:
            raise ValueError(f"fps: must be positive, got {self.fps}")
        low, high = self.shape_size
        if low <= 0:
            raise ValueError(f"shape_size: must be a positive fraction of the image side, got {self.shape_size}")
        if high > 1:
            raise ValueError(f"shape_size: a shape larger than the image ({high} x the side), got {self.shape_size}")
        if high > MAX_SHAPE_FRACTION:
            raise ValueError(f"shape_size: at most {MAX_SHAPE_FRACTION} of the side, so a shape fits in half the "
                             f"image and has room to move, got {self.shape_size}")
        for name in ("image_side", "frame_side"):
            smallest = math.floor(low * getattr(self, name)[0])
            if smallest < MIN_SHAPE_PIXELS:
                raise ValueError(f"shape_size: the smallest shape on a {getattr(self, name)[0]}-pixel {name} is "
                                 f"{smallest} pixels; need >= {MIN_SHAPE_PIXELS} (raise shape_size or {name})")
        noise = tuple(self.noise)
        if not noise or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 64
                            for v in noise):
            raise ValueError(f"noise: a non-empty tuple of standard deviations in [0, 64], got {self.noise!r}")
        if not 0 <= self.background[0] <= self.background[1] <= 255:
            raise ValueError(f"background: grey levels within [0, 255], got {self.background}")
        palette = tuple(self.palette)
        unknown = [c for c in palette if c not in PALETTE]
        if unknown:
            raise ValueError(f"palette: unknown colour(s) {unknown}; known: {list(PALETTE)}")
        if len(set(palette)) != len(palette) or len(palette) < 4:
            raise ValueError(f"palette: at least 4 distinct colours (4 options per item), got {self.palette!r}")
        if self.order_colors[0] < 2 or self.order_colors[1] > min(len(palette), self.frames[0]):
            raise ValueError(f"order_colors: between 2 and min(len(palette), frames low) = "
                             f"{min(len(palette), self.frames[0])}, got {self.order_colors}")
        room = 1 - high
        if isinstance(self.min_displacement, bool) or not 0 < self.min_displacement <= room:
            raise ValueError(f"min_displacement: in (0, 1 - shape_size high] = (0, {room:g}] so the largest "
                             f"shape can move that far, got {self.min_displacement!r}")


def _check_pair(name, value, integer, positive):
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if (not isinstance(value, tuple) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, kinds) for v in value)):
        what = "integers" if integer else "numbers"
        raise ValueError(f"{name}: a (low, high) pair of {what}, got {value!r}")
    if not math.isfinite(value[0]) or not math.isfinite(value[1]) or value[0] > value[1]:
        raise ValueError(f"{name}: low must be <= high (finite), got {value!r}")
    if integer and positive and value[0] < 1:
        raise ValueError(f"{name}: must be >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class SyntheticItem:
    """One generated item: `media` is an image (H, W, 3) or a clip (T, H, W, 3), uint8."""

    family: str
    media: np.ndarray
    question: str  # the question without options or answer instruction
    answer: str  # the one-word open answer
    options: tuple[str, ...]  # 4 one-word options, the answer exactly once, shuffled
    fps: float | None = None  # clips only
    # Other facts of the same media, fixed by the pixels like the answer: {"color": .., "shape": ..}
    # for the one-shape families (color, shape, position, direction, hidden), {} for count and order.
    # Recorded from the draws already made (no extra draws), so items are unchanged pixel for pixel.
    facts: dict = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "video" if self.media.ndim == 4 else "image"


# ---------------------------------------------------------------------------------------------- drawing

def _mask(kind: str, size: int) -> np.ndarray:
    """A `size x size` boolean mask of the shape, tested at pixel centres in [-1, 1] coordinates."""
    c = (np.arange(size) + 0.5) / size * 2 - 1
    u, v = c[:, None], c[None, :]  # u: down, v: right
    if kind == "square":
        return np.ones((size, size), bool)
    if kind == "circle":
        return u * u + v * v <= 1
    if kind == "triangle":  # apex up, base along the bottom
        return np.abs(v) <= (u + 1) / 2
    if kind == "diamond":
        return np.abs(u) + np.abs(v) <= 1
    raise ValueError(f"unknown shape kind {kind!r}; known: {SHAPES}")


def _draw(canvas, kind, y0, x0, size, rgb):
    canvas[y0:y0 + size, x0:x0 + size][_mask(kind, size)] = rgb


def _background(rng, ranges, shape):
    """An achromatic (R = G = B) background: a grey level plus grey noise of the item's level."""
    level = int(rng.integers(ranges.background[0], ranges.background[1] + 1))
    sigma = float(ranges.noise[int(rng.integers(len(ranges.noise)))])
    grey = np.full(shape, float(level))
    if sigma > 0:
        grey = grey + rng.normal(0.0, sigma, shape)
    grey = np.clip(np.rint(grey), 0, 255).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1)


def _side(rng, pair):
    return int(rng.integers(pair[0], pair[1] + 1))


def _shape_size(rng, ranges, height, width):
    fraction = rng.uniform(*ranges.shape_size)
    return max(MIN_SHAPE_PIXELS, int(fraction * min(height, width)))  # floor: never above the range


def _color(rng, ranges, exclude=()):
    names = [c for c in ranges.palette if c not in exclude]
    return names[int(rng.integers(len(names)))]


def draw_options(rng, answer, vocabulary):
    """The answer plus 3 distinct others drawn uniformly from `vocabulary`, in a uniform random order."""
    others = [w for w in vocabulary if w != answer]
    picked = [others[i] for i in rng.choice(len(others), size=3, replace=False)]
    options = [answer] + picked
    return tuple(options[i] for i in rng.permutation(4))


# ---------------------------------------------------------------------------------------------- families

def _image_single(family, rng, ranges):
    height, width = _side(rng, ranges.image_side), _side(rng, ranges.image_side)
    image = _background(rng, ranges, (height, width))
    size = _shape_size(rng, ranges, height, width)
    kind = SHAPES[int(rng.integers(len(SHAPES)))]
    color = _color(rng, ranges)
    if family == "position":
        where = POSITIONS[int(rng.integers(4))]
        # The box centre lies within a quarter of the side from the named edge, and within an eighth
        # of the side of the middle of the other axis.
        near = lambda n: int(rng.integers(0, math.floor(n / 4 - size / 2) + 1))  # noqa: E731
        far = lambda n: n - size - near(n)  # noqa: E731
        middle = lambda n: int(rng.integers(math.ceil(3 * n / 8 - size / 2),  # noqa: E731
                                            math.floor(5 * n / 8 - size / 2) + 1))
        y0 = {"top": near, "bottom": far}.get(where, middle)(height)
        x0 = {"left": near, "right": far}.get(where, middle)(width)
        answer = where
    else:
        y0, x0 = int(rng.integers(0, height - size + 1)), int(rng.integers(0, width - size + 1))
        answer = color if family == "color" else kind
    _draw(image, kind, y0, x0, size, PALETTE[color])
    vocabulary = {"color": ranges.palette, "shape": SHAPES, "position": POSITIONS}[family]
    return SyntheticItem(family, image, QUESTIONS[family], answer, draw_options(rng, answer, vocabulary),
                         facts={"color": color, "shape": kind})


def _image_count(rng, ranges):
    height, width = _side(rng, ranges.image_side), _side(rng, ranges.image_side)
    image = _background(rng, ranges, (height, width))
    count = int(rng.integers(1, 5))
    ch, cw = height // 2, width // 2
    for cell in rng.choice(4, size=count, replace=False):
        top, left = (cell // 2) * ch, (cell % 2) * cw
        size = min(_shape_size(rng, ranges, height, width), min(ch, cw) - 2)  # 1-pixel margin in the cell
        y0 = top + 1 + int(rng.integers(0, ch - 2 - size + 1))
        x0 = left + 1 + int(rng.integers(0, cw - 2 - size + 1))
        _draw(image, SHAPES[int(rng.integers(len(SHAPES)))], y0, x0, size, PALETTE[_color(rng, ranges)])
    answer = str(count)
    return SyntheticItem("count", image, QUESTIONS["count"], answer, draw_options(rng, answer, COUNTS))


def _clip_frame(rng, ranges):
    frames = _side(rng, ranges.frames)
    height, width = _side(rng, ranges.frame_side), _side(rng, ranges.frame_side)
    fps = round(float(rng.uniform(*ranges.fps)), 2)
    return frames, height, width, fps, _background(rng, ranges, (frames, height, width))


def _video_direction(rng, ranges):
    frames, height, width, fps, video = _clip_frame(rng, ranges)
    size = _shape_size(rng, ranges, height, width)
    kind, color = SHAPES[int(rng.integers(len(SHAPES)))], _color(rng, ranges)
    direction = DIRECTIONS[int(rng.integers(4))]
    along = width if direction in ("left", "right") else height
    across = height if direction in ("left", "right") else width
    room = along - size
    distance = int(rng.integers(math.ceil(ranges.min_displacement * along), room + 1))
    start = int(rng.integers(0, room - distance + 1))
    if direction in ("left", "up"):
        start = start + distance
    sign = -1 if direction in ("left", "up") else 1
    other = int(rng.integers(0, across - size + 1))
    for t in range(frames):  # linear in t, rounded: monotone, first and last frames `distance` apart
        pos = start + sign * int(round(distance * t / (frames - 1)))
        y0, x0 = (other, pos) if direction in ("left", "right") else (pos, other)
        _draw(video[t], kind, y0, x0, size, PALETTE[color])
    return SyntheticItem("direction", video, QUESTIONS["direction"], direction,
                         draw_options(rng, direction, DIRECTIONS), fps, facts={"color": color, "shape": kind})


def _video_order(rng, ranges):
    frames, height, width, fps, video = _clip_frame(rng, ranges)
    k = int(rng.integers(ranges.order_colors[0], ranges.order_colors[1] + 1))
    colors = [ranges.palette[i] for i in rng.choice(len(ranges.palette), size=k, replace=False)]
    cuts = [0] + sorted(int(c) for c in rng.choice(np.arange(1, frames), size=k - 1, replace=False)) + [frames]
    for color, a, b in zip(colors, cuts[:-1], cuts[1:]):  # one still shape per segment
        size = _shape_size(rng, ranges, height, width)
        y0, x0 = int(rng.integers(0, height - size + 1)), int(rng.integers(0, width - size + 1))
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        for t in range(a, b):
            _draw(video[t], kind, y0, x0, size, PALETTE[color])
    which = "first" if rng.integers(2) == 0 else "last"
    answer = colors[0] if which == "first" else colors[-1]
    return SyntheticItem("order", video, QUESTIONS[f"order_{which}"], answer,
                         draw_options(rng, answer, ranges.palette), fps)


def hidden_gaps(frames: int, when: str) -> list[tuple[int, int]]:
    """The gaps `[a, b)` a `hidden` clip of `frames` frames may have for the answer `when`: contiguous,
    1 to max(1, frames // 2) frames long, classed by their centre c = (a + b - 1) / 2 as early
    (c < frames / 3), middle or late (c >= 2 frames / 3); "never" has no gap."""
    if when == "never":
        return []
    gaps = []
    for length in range(1, max(1, frames // 2) + 1):
        for a in range(0, frames - length + 1):
            c = a + (length - 1) / 2
            klass = "early" if c < frames / 3 else "late" if c >= 2 * frames / 3 else "middle"
            if klass == when:
                gaps.append((a, a + length))
    return gaps


def _video_hidden(rng, ranges):
    frames, height, width, fps, video = _clip_frame(rng, ranges)
    size = _shape_size(rng, ranges, height, width)
    kind, color = SHAPES[int(rng.integers(len(SHAPES)))], _color(rng, ranges)
    y0, x0 = int(rng.integers(0, height - size + 1)), int(rng.integers(0, width - size + 1))
    when = WHEN_HIDDEN[int(rng.integers(4))]
    gaps = hidden_gaps(frames, when)
    a, b = gaps[int(rng.integers(len(gaps)))] if gaps else (frames, frames)
    for t in range(frames):
        if not a <= t < b:
            _draw(video[t], kind, y0, x0, size, PALETTE[color])
    return SyntheticItem("hidden", video, QUESTIONS["hidden"], when, draw_options(rng, when, WHEN_HIDDEN), fps,
                         facts={"color": color, "shape": kind})


def make_item(family: str, rng: np.random.Generator, ranges: TaskRanges | None = None) -> SyntheticItem:
    """One item of `family` (one of `FAMILIES`), drawn with `rng` from `ranges` (default `TaskRanges()`)."""
    ranges = TaskRanges() if ranges is None else ranges
    if family in ("color", "shape", "position"):
        return _image_single(family, rng, ranges)
    if family == "count":
        return _image_count(rng, ranges)
    makers = {"direction": _video_direction, "order": _video_order, "hidden": _video_hidden}
    if family not in makers:
        raise ValueError(f"unknown task family {family!r}; known: {FAMILIES}")
    return makers[family](rng, ranges)


def make_set(n: int, seed: int, families=FAMILIES, ranges: TaskRanges | None = None) -> list[SyntheticItem]:
    """`n` items, family `families[i % len(families)]` for item i (balanced), all drawn in order from
    one `np.random.default_rng(seed)`; a held-out set is another seed."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n: a positive number of items, got {n!r}")
    families = tuple(families)
    unknown = [f for f in families if f not in FAMILIES]
    if not families or unknown:
        raise ValueError(f"families: a non-empty subset of {FAMILIES}, got {families!r}")
    rng = np.random.default_rng(seed)
    return [make_item(families[i % len(families)], rng, ranges) for i in range(n)]


def to_task_item(item: SyntheticItem, mode: str = "mc", item_id: str = "item") -> TaskItem:
    """The item as a `TaskItem` with its media in memory. "mc": the 4 options as "A. red" ... and the
    answer's letter, with the open question as `open_question` (for option scoring); "open": no
    options, the question with a one-word instruction and `answer` the word (the ablation's loader
    reads only mc items)."""
    frames = len(item.media) if item.kind == "video" else None
    open_question = item.question + OPEN_SUFFIX.get(item.family, " Answer with one word.")
    if mode == "mc":
        options = tuple(f"{letter}. {word}" for letter, word in zip(option_letters(item.options), item.options))
        letter = option_letters(item.options)[item.options.index(item.answer)]
        return TaskItem(item_id, item.kind, item.media, item.question, options, letter, item.fps, frames,
                        open_question)
    if mode == "open":
        return TaskItem(item_id, item.kind, item.media, open_question, (), item.answer, item.fps, frames)
    raise ValueError(f"mode: 'mc' or 'open', got {mode!r}")


def _atomic(path, write):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_jsonl(items, directory: str | os.PathLike, name: str = "dataset.jsonl") -> str:
    """Write each item's media (images `.png`, clips `.npy` frames) and two JSONL files under
    `directory`, each written to a temp file and renamed: `name` (the ablation's multiple-choice
    format, read by `tasks.load_dataset`) and `open.jsonl` (the same ids with the open question and its
    one-word answer, plus the family). Returns the path of `name`."""
    items = list(items)
    if not items:
        raise ValueError("items: nothing to write")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    mc_lines, open_lines = [], []
    for i, item in enumerate(items):
        item_id = f"{item.family}{i:04d}"
        mc, opened = to_task_item(item, "mc", item_id), to_task_item(item, "open", item_id)
        if item.kind == "video":
            media = f"{item_id}.npy"
            _atomic(os.path.join(directory, media), lambda f, a=item.media: np.save(f, a))
        else:
            media = f"{item_id}.png"
            _atomic(os.path.join(directory, media), lambda f, a=item.media: Image.fromarray(a).save(f, "PNG"))
        record = {"id": item_id, item.kind: media, "question": mc.question, "options": list(mc.options),
                  "answer": mc.answer, "open_question": mc.open_question}
        if item.kind == "video":
            record.update(fps=item.fps, max_frames=mc.max_frames)
        mc_lines.append(json.dumps(record) + "\n")
        open_lines.append(json.dumps({"id": item_id, "family": item.family, item.kind: media,
                                      "question": opened.question, "answer": item.answer,
                                      **({"fps": item.fps} if item.fps else {})}) + "\n")
    path = os.path.join(directory, name)
    _atomic(os.path.join(directory, "open.jsonl"), lambda f: f.write("".join(open_lines).encode()))
    _atomic(path, lambda f: f.write("".join(mc_lines).encode()))
    return path
