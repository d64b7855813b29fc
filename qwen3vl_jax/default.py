"""The built-in default model: a small Qwen3-VL trained from random weights on the synthetic tasks
of `qwen3vl_jax.pruning.synthetic` (docs/tasks.md), shipped inside the package as an HF-format
checkpoint directory (what `Qwen3VL.from_pretrained` and HF's `Qwen3VLForConditionalGeneration` /
`AutoProcessor` load); the conversations it is trained on; and the scoring that measures it.

    from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor, default
    from qwen3vl_jax.pruning import synthetic
    path = default.default_checkpoint()
    model, processor = Qwen3VL.from_pretrained(path), Qwen3VLProcessor.from_pretrained(path)
    items = synthetic.make_set(70, seed=1001)               # held out: not a training seed
    table = default.accuracy(default.evaluate(model, processor, items))  # {family: {"mc": .., "open": ..}}

`scripts/train_tiny_default.py` trains it with the project's `Trainer` and writes its held-out
figures.

Scoring (`evaluate`): "mc" asks the multiple-choice form (the ablation's prompt, `tasks.mc_prompt`)
and picks the option letter with the highest log-probability as the first answer token
(`generate.next_token_logits`, the prefill greedy generation runs); "option" asks the open question
and picks, among the same four options, the word with the highest log-probability as the first
answer token (the cloze form of the multiple-choice item, the ablation's `score="option"`); "open"
asks the open question (`synthetic.to_task_item(item, "open")`) and decodes greedily, right when the
decoded text, stripped, equals the answer. The model is trained on the "mc" and "open" forms.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from .generate import next_token_logits
from .model import MODEL_INPUTS
from .pruning.synthetic import (COUNTS, DIRECTIONS, PALETTE, POSITIONS, QUESTIONS, SHAPES, WHEN_HIDDEN, SyntheticItem,
                                draw_options, to_task_item)
from .pruning.tasks import mc_prompt, option_letters, single_token_ids
from .testing import write_video

__all__ = ["DEFAULT_MODEL_DIR", "FORMS", "SCORED_FORMS", "TRAIN_SEED", "WARM_SEED", "SEQUENCE_SEED",
           "SHIPPED_SEQUENCE_PHASES", "training_seeds", "default_checkpoint",
           "item_prompt", "item_inputs", "write_sft_dataset", "letter_drill", "ANSWER_WORDS", "Scored", "evaluate",
           "accuracy"]

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
FORMS = ("mc", "open")  # the forms an item is asked (and trained) in
SCORED_FORMS = ("mc", "option", "open")  # what `evaluate` scores: "option" asks the open form
# Where scripts/train_tiny_default.py draws its training items (held-out sets use any other seed): from
# --seed (TRAIN_SEED for the shipped default) plus WARM_SEED for a colour warm-up phase, and plus
# SEQUENCE_SEED + 1000 k for phase k of a --sequence (its replay of the earlier families at + 500).
TRAIN_SEED = 0
WARM_SEED = 1_000_000
SEQUENCE_SEED = 3_000_000
SHIPPED_SEQUENCE_PHASES = 6  # the shipped default's --sequence (docs/tasks.md §8)


def training_seeds() -> frozenset[int]:
    """The seeds of every item the shipped default (or the previous default's recipe) trained on."""
    base = TRAIN_SEED + SEQUENCE_SEED
    return frozenset({TRAIN_SEED, TRAIN_SEED + WARM_SEED, *(base + 1000 * k + replay for k in
                      range(SHIPPED_SEQUENCE_PHASES) for replay in (0, 500))})


_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "preprocessor_config.json", "video_preprocessor_config.json")


def default_checkpoint() -> str:
    """The shipped default's directory; a clear error if the package was installed without it."""
    missing = [name for name in _REQUIRED if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, name))]
    if missing:
        raise FileNotFoundError(
            f"the built-in default model is incomplete at {DEFAULT_MODEL_DIR} (missing {', '.join(missing)}); "
            "reinstall the package with its data files, or train it with scripts/train_tiny_default.py --install")
    return DEFAULT_MODEL_DIR


def _check_form(form: str) -> None:
    if form not in SCORED_FORMS:
        raise ValueError(f"form must be one of {SCORED_FORMS}, got {form!r}")


def item_prompt(item: SyntheticItem, form: str = "open") -> tuple[str, str]:
    """`(user text, reply)` of `item` asked in `form`: "open" the open question and the word, "mc" the
    ablation's multiple-choice prompt and the option letter; "option" as "open"."""
    _check_form(form)
    task = to_task_item(item, "mc" if form == "mc" else "open")
    if form == "mc":
        return mc_prompt(task.question, task.options), task.answer
    return task.question, task.answer


def item_inputs(processor, item: SyntheticItem, form: str = "open") -> dict:
    """Processor outputs (numpy) for asking `item` in `form`, with the generation prompt. A clip is
    given with its recorded fps (`video_metadata`), so the processor's sampling (fps 8, at most 32
    frames in the default's config) keeps every frame, as when training reads its `.mov` file."""
    text, _ = item_prompt(item, form)
    messages = [{"role": "user", "content": [{"type": item.kind}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    if item.kind == "video":
        return processor(text=[prompt], videos=[item.media], return_tensors="np",
                         video_metadata=[{"fps": item.fps, "total_num_frames": len(item.media)}])
    return processor(text=[prompt], images=[item.media], return_tensors="np")


def write_sft_dataset(items: Sequence[SyntheticItem], directory: str | os.PathLike, *, mc_fraction: float = 0.5,
                      seed: int = 0, name: str = "train.jsonl", extra_questions: int = 0,
                      letter_drills: int = 0) -> str:
    """A fine-tuning JSONL (`training.SFTDataset`'s format) under `directory` with the media beside it:
    each item one conversation, its multiple-choice form (answered with the letter) with probability
    `mc_fraction`, else its open form (answered with the word). Images are PNG, clips lossless `.mov`
    (PNG frames) at the item's fps, which the processor decodes to the very pixels. Returns the path.

    `extra_questions` > 0: after the item's own question, up to that many further user/assistant turns
    about the same media, from the item's `facts` (`color` and, for images, `shape`; in a random
    order), each in a form drawn like the first, its options drawn as `synthetic` draws them. So one
    vision forward supervises several answers. 0 (the default) writes exactly what it always wrote.

    `letter_drills` > 0: that many text-only conversations more (`letter_drill`), after the items, that
    ask for the letter of the option naming a given word: the multiple-choice answer format alone."""
    from PIL import Image

    if not 0 <= mc_fraction <= 1:
        raise ValueError(f"mc_fraction must be in [0, 1], got {mc_fraction!r}")
    if isinstance(letter_drills, bool) or not isinstance(letter_drills, int) or letter_drills < 0:
        raise ValueError(f"letter_drills must be an integer >= 0, got {letter_drills!r}")
    items = list(items)
    if not items:
        raise ValueError("items: nothing to write")
    directory = os.fspath(directory)
    os.makedirs(os.path.join(directory, "media"), exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i, item in enumerate(items):
        media = f"media/{item.family}{i:05d}." + ("mov" if item.kind == "video" else "png")
        if item.kind == "video":
            write_video(os.path.join(directory, media), item.media, item.fps, codec="png")
        else:
            Image.fromarray(item.media).save(os.path.join(directory, media), "PNG")
        text, reply = item_prompt(item, "mc" if rng.random() < mc_fraction else "open")
        messages = [{"role": "user", "content": [{"type": item.kind, item.kind: media}, {"type": "text", "text": text}]},
                    {"role": "assistant", "content": [{"type": "text", "text": reply}]}]
        if extra_questions:
            for extra in _extra_items(item, rng, extra_questions):
                text, reply = item_prompt(extra, "mc" if rng.random() < mc_fraction else "open")
                messages += _text_exchange(text, reply)
        lines.append(json.dumps({"messages": messages}) + "\n")
    for _ in range(letter_drills):
        lines.append(json.dumps({"messages": _text_exchange(*letter_drill(rng))}) + "\n")
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    return path


def _text_exchange(text: str, reply: str) -> list[dict]:
    """A user turn of text alone and the assistant's reply, as chat messages."""
    return [{"role": "user", "content": [{"type": "text", "text": text}]},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]}]


ANSWER_WORDS = (tuple(PALETTE), SHAPES, COUNTS, POSITIONS, DIRECTIONS, WHEN_HIDDEN)  # each family's options


def letter_drill(rng: np.random.Generator) -> tuple[str, str]:
    """`(user text, reply)`: "Which option is <word>?" in the ablation's multiple-choice prompt
    (`tasks.mc_prompt`), the options drawn from one family's answer words as the items draw theirs,
    and the letter of the option that is the word. The answer format without the media: a small model
    trained from random weights learns to read the pixels (open answers) long before it learns to
    point at an option's letter, and these rows train the pointing on its own (measured in
    docs/tasks.md §8)."""
    words = ANSWER_WORDS[int(rng.integers(len(ANSWER_WORDS)))]
    word = words[int(rng.integers(len(words)))]
    options = draw_options(rng, word, words)
    return mc_prompt(f"Which option is {word}?", options), option_letters(options)[options.index(word)]


def _extra_items(item: SyntheticItem, rng: np.random.Generator, limit: int) -> list[SyntheticItem]:
    """Up to `limit` further questions about `item`'s media from its `facts`, as items of those families
    (same media; the shape question names "the image", so clips get the colour question only)."""
    asked = [f for f in ("color", "shape") if f in item.facts and f != item.family
             and (f == "color" or item.kind == "image")]
    asked = [asked[i] for i in rng.permutation(len(asked))][:limit]
    vocabulary = {"color": tuple(PALETTE), "shape": SHAPES}
    return [dataclasses.replace(item, family=f, question=QUESTIONS[f], answer=item.facts[f],
                                options=draw_options(rng, item.facts[f], vocabulary[f]), facts={})
            for f in asked]


@dataclasses.dataclass(frozen=True)
class Scored:
    """One item asked in one form."""

    index: int  # the item's position in the evaluated list
    family: str
    form: str  # "mc", "option" or "open"
    truth: str  # the letter (mc) or the word (option, open)
    prediction: str
    correct: bool
    tokens: tuple[int, ...] = ()  # open: the greedy ids after the prompt


def evaluate(model, processor, items: Sequence[SyntheticItem], *, forms: Sequence[str] = SCORED_FORMS,
             max_new_tokens: int = 4, vision_encoder=None, progress: bool = False) -> list[Scored]:
    """Score every item in every form (see the module docstring); one `Scored` per (item, form)."""
    for form in forms:
        _check_form(form)
    letter_ids = {}
    if "mc" in forms:
        letter_ids = dict(zip("ABCD", single_token_ids(processor.tokenizer, "ABCD", "option letter")))
    work = [(i, item, form) for i, item in enumerate(items) for form in forms]
    if progress:
        from tqdm.auto import tqdm

        work = tqdm(work, desc="evaluate", unit="prompt")
    out = []
    for i, item, form in work:
        batch = item_inputs(processor, item, form)
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        _, truth = item_prompt(item, form)
        if form in ("mc", "option"):
            logits = next_token_logits(model, **inputs, vision_encoder=vision_encoder)[0]
            choices = letter_ids if form == "mc" else dict(zip(item.options, single_token_ids(
                processor.tokenizer, item.options, f"{item.family} option")))
            prediction = max(choices, key=lambda x: logits[choices[x]])
            out.append(Scored(i, item.family, form, truth, prediction, prediction == truth))
        else:
            length = inputs["input_ids"].shape[1]
            ids = np.asarray(model.generate(**inputs, max_new_tokens=max_new_tokens,
                                            vision_encoder=vision_encoder))[0, length:]
            text = processor.decode(ids, skip_special_tokens=True).strip()
            out.append(Scored(i, item.family, form, truth, text, text == truth, tuple(int(t) for t in ids)))
    return out


def accuracy(scored: Sequence[Scored]) -> dict[str, dict[str, float]]:
    """`{family: {form: fraction right}}`, families in order of first appearance."""
    table: dict[str, dict[str, list[bool]]] = {}
    for s in scored:
        table.setdefault(s.family, {}).setdefault(s.form, []).append(s.correct)
    return {family: {form: float(np.mean(v)) for form, v in forms.items()} for family, forms in table.items()}
