"""Multiple-choice video tasks for the accuracy ablation: the JSONL format, its checks, the prompt,
answer parsing, and a generator of small synthetic sets whose answers are knowable from the frames.

One item per line (docs/pruning.md §10):

    {"video": "clip.mp4", "question": "...", "options": ["A. ...", "B. ..."], "answer": "B",
     "fps": 2, "max_frames": 32, "id": "optional name", "open_question": "..."}

`"image"` instead of `"video"` also works. Paths are relative to the JSONL file. A `.npy` video is
an array of decoded frames `(T, H, W, 3)` uint8 taken as recorded at the item's fps (so sampling at
that fps keeps every frame, up to the frame cap); other paths are decoded by the processor (PyAV).
An option's letter is its `"X."` / `"X)"` / `"X:"` prefix, or A, B, C... by position when options
carry no prefix; the answer must be one of those letters. `"open_question"` (optional) is the question
as asked without options, for option scoring (`option_words`: each option's text is scored as the
answer; default: `"question"`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np

__all__ = ["TaskItem", "load_dataset", "option_letters", "option_words", "single_token_ids", "mc_prompt",
           "parse_letter", "synthetic_dataset", "SYNTHETIC_COLORS", "SYNTHETIC_DIRECTIONS"]

_PREFIX = re.compile(r"^\s*([A-Z])\s*[.):]")
ANSWER_INSTRUCTION = "Answer with the option's letter from the given choices directly."


@dataclasses.dataclass(frozen=True)
class TaskItem:
    """One multiple-choice item (or, with no options, a plain clip for the fidelity ablation)."""

    id: str
    kind: str  # "video" or "image"
    media: object  # a path, or frames (T, H, W, 3) / an image array already in memory
    question: str
    options: tuple[str, ...] = ()
    answer: str | None = None  # the correct option's letter
    fps: float | None = None
    max_frames: int | None = None
    open_question: str | None = None  # the question without options (option scoring; default: question)

    @property
    def letters(self) -> list[str]:
        return option_letters(self.options)

    @property
    def words(self) -> list[str]:
        return option_words(self.options)


def option_letters(options) -> list[str]:
    """Each option's letter: its "X." / "X)" / "X:" prefix if every option has one, else A, B, C..."""
    found = [_PREFIX.match(o) for o in options]
    if options and all(found):
        return [m.group(1) for m in found]
    return [chr(ord("A") + i) for i in range(len(options))]


def option_words(options) -> list[str]:
    """Each option's text without its letter prefix ("A. red" -> "red")."""
    if options and all(_PREFIX.match(o) for o in options):
        return [o[_PREFIX.match(o).end():].strip() for o in options]
    return [o.strip() for o in options]


def single_token_ids(tokenizer, texts, what: str) -> list[int]:
    """The one token id of each text (log-likelihood scoring of a first answer token); ValueError naming
    the text that is not exactly one token (`what`: e.g. "option letter")."""
    ids = []
    for text in texts:
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        if len(tokens) != 1:
            raise ValueError(f"{what} {text!r} is {len(tokens)} tokens; log-likelihood scoring of the first answer "
                             "token needs one")
        ids.append(tokens[0])
    return ids


def mc_prompt(question: str, options) -> str:
    """The question, the options one per line, and the letter instruction (Video-MME's phrasing)."""
    lines = [question.strip()]
    letters = option_letters(options)
    for letter, option in zip(letters, options):
        lines.append(option if _PREFIX.match(option) else f"{letter}. {option}")
    lines.append(ANSWER_INSTRUCTION)
    return "\n".join(lines)


def parse_letter(text: str, letters) -> str | None:
    """The option letter a generated answer names: a leading letter, else the first standalone one."""
    text = text.strip()
    if text[:1] in letters and (len(text) == 1 or not text[1].isalpha()):
        return text[0]
    for match in re.finditer(r"\b([A-Z])\b", text):
        if match.group(1) in letters:
            return match.group(1)
    return None


def load_dataset(path: str | os.PathLike) -> list[TaskItem]:
    """Read and check a JSONL task file; ValueError naming `file:line` and the problem."""
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    items, seen = [], set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            items.append(_item(record, where, base, default_id=f"line{number}"))
            if items[-1].id in seen:
                raise ValueError(f"{where}: duplicate id {items[-1].id!r}")
            seen.add(items[-1].id)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def _item(record, where: str, base: str, default_id: str) -> TaskItem:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
    kinds = [k for k in ("video", "image") if k in record]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of \"video\" or \"image\" (a path), got {kinds or 'neither'}")
    kind = kinds[0]
    media = record[kind]
    if not isinstance(media, str) or not media:
        raise ValueError(f"{where}: \"{kind}\" must be a path, got {media!r}")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: \"question\" must be a non-empty string")
    options = record.get("options")
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) and o.strip()
                                                                    for o in options):
        raise ValueError(f"{where}: \"options\" must be a list of at least two non-empty strings, got {options!r}")
    letters = option_letters(options)
    if len(set(letters)) != len(letters):
        raise ValueError(f"{where}: option letters repeat: {letters}")
    answer = record.get("answer")
    if not isinstance(answer, str) or answer.strip() not in letters:
        raise ValueError(f"{where}: answer {answer!r} is not among the option letters {letters}")
    fps = record.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"{where}: \"fps\" must be a positive number, got {fps!r}")
    max_frames = record.get("max_frames")
    if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                   or max_frames < 2):
        raise ValueError(f"{where}: \"max_frames\" must be an integer >= 2, got {max_frames!r}")
    open_question = record.get("open_question")
    if open_question is not None and (not isinstance(open_question, str) or not open_question.strip()):
        raise ValueError(f"{where}: \"open_question\" must be a non-empty string, got {open_question!r}")
    item_id = record.get("id", default_id)
    if not isinstance(item_id, str) or not item_id:
        raise ValueError(f"{where}: \"id\" must be a non-empty string, got {item_id!r}")
    unknown = set(record) - {"video", "image", "question", "options", "answer", "fps", "max_frames", "id",
                             "open_question"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    full = media if os.path.isabs(media) else os.path.join(base, media)
    if not os.path.isfile(full):
        raise ValueError(f"{where}: {kind} file {full} does not exist")
    return TaskItem(item_id, kind, full, question, tuple(options), answer.strip(),
                    None if fps is None else float(fps), max_frames, open_question)


# ---------------------------------------------------------------------------------------------- synthetic

SYNTHETIC_COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 60, 230), "yellow": (230, 220, 30)}
SYNTHETIC_DIRECTIONS = ("left", "right", "up", "down")


def _clip(task: str, answer: str, frames: int, height: int, width: int, rng) -> np.ndarray:
    """A grey noisy background with one square: its colour (task "color") or its motion ("direction")
    is the answer; the other attribute is random."""
    background = np.repeat(rng.integers(90, 140, (height, width, 1)), 3, axis=-1).astype(np.uint8)  # grey
    video = np.repeat(background[None], frames, axis=0)
    side = max(4, min(height, width) // 4)
    color = SYNTHETIC_COLORS[answer] if task == "color" else SYNTHETIC_COLORS[rng.choice(list(SYNTHETIC_COLORS))]
    direction = answer if task == "direction" else SYNTHETIC_DIRECTIONS[rng.integers(4)]
    y0, x0 = (height - side) // 2, (width - side) // 2
    span_y, span_x = (height - side) // 2, (width - side) // 2
    for t in range(frames):
        step = t / max(frames - 1, 1)
        dy = {"up": -1, "down": 1}.get(direction, 0) * int(round(step * span_y))
        dx = {"left": -1, "right": 1}.get(direction, 0) * int(round(step * span_x))
        video[t, y0 + dy:y0 + dy + side, x0 + dx:x0 + dx + side] = color
    return video


def synthetic_dataset(out_dir: str | os.PathLike, n_items: int = 24, *, frames: int = 8, height: int = 64,
                      width: int = 64, fps: float = 2.0, tasks=("color", "direction"), seed: int = 0) -> str:
    """Write `n_items` multiple-choice clips (`.npy`) and `dataset.jsonl` under `out_dir`; returns its path.

    Tasks alternate: "color" (what colour is the square?) and "direction" (which way does it move?),
    four options each, shuffled per item with a seeded generator, so the correct letter is uniform
    over A-D and a model that ignores the video scores 1/4 in expectation.
    """
    if n_items < 1 or frames < 2:
        raise ValueError(f"need n_items >= 1 and frames >= 2, got {n_items} and {frames}")
    unknown = set(tasks) - {"color", "direction"}
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of ('color', 'direction'), got {tasks!r}")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_items):
        task = tasks[i % len(tasks)]
        choices = list(SYNTHETIC_COLORS) if task == "color" else list(SYNTHETIC_DIRECTIONS)
        answer = choices[rng.integers(len(choices))]
        order = rng.permutation(len(choices))
        options = [f"{chr(ord('A') + j)}. {choices[k]}" for j, k in enumerate(order)]
        letter = chr(ord("A") + int(np.flatnonzero(np.asarray(choices)[order] == answer)[0]))
        name = f"clip{i:03d}.npy"
        np.save(os.path.join(out_dir, name), _clip(task, answer, frames, height, width, rng))
        question = "What color is the square?" if task == "color" else "Which way does the square move?"
        lines.append({"id": f"{task}{i:03d}", "video": name, "question": question, "options": options,
                      "answer": letter, "fps": fps, "max_frames": frames})
    path = os.path.join(out_dir, "dataset.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return path
