"""Fine-tuning data: JSONL conversations -> bucketed, labelled, resumable batches.

The file holds one conversation per line, in the structure `Qwen3VLProcessor.apply_chat_template`
takes, with media paths relative to the file:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

(videos: `{"type": "video", "video": "clip.mp4"}`). A malformed line (bad JSON, wrong structure,
no assistant message) is an error naming the line.

Scanning: every row is processed once when the data set is built (the processor decodes its media),
which gives its exact token count and merged vision-token count. A row whose media file is missing
or unreadable, that is longer than `max_length`, or whose vision tokens exceed the largest vision
bucket, is skipped with a logged reason and counted in `skipped` (or refused with `strict=True`);
no row is ever truncated.

Batches: each row falls in a bucket `(length bucket, vision bucket)` from two fixed ladders
(`buckets.Buckets`), so every batch has `input_ids [batch_size, length bucket]` and at most
`batch_size * vision bucket` merged vision tokens: the batch shapes come from a small fixed set
(`shapes()`). Per epoch the rows are shuffled with `(seed, epoch)`, grouped by bucket, cut into
batches, and the batches shuffled; a bucket's last, partial batch is filled with repeats of rows of
the same bucket whose labels are all -100 (they keep the shape and add nothing to the loss).

Iteration: `iterator()` is a `grain` pipeline (`MapDataset.range -> map_with_index -> prefetch
threads`); its `get_state()` / `set_state()` save and restore the position exactly.

Axes: B batch, L tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buckets import Buckets
from .labels import IGNORE_INDEX, assistant_labels

__all__ = ["read_jsonl", "SFTDataset", "Skipped"]

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant")
_MEDIA = ("image", "video")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message must be an object, got {type(message).__name__}")
    if message.get("role") not in _ROLES:
        raise ValueError(f"{where}: role must be one of {_ROLES}, got {message.get('role')!r}")
    content = message.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    for j, part in enumerate(content):
        at = f"{where}, part {j}"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: a part must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}: a text part needs a string 'text'")
        elif kind in _MEDIA:
            if not isinstance(part.get(kind), str):
                raise ValueError(f"{at}: an {kind} part needs a file path under {kind!r}")
        else:
            raise ValueError(f"{at}: part type must be 'text', 'image' or 'video', got {kind!r}")


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, list[dict]]]:
    """`[(line number, messages), ...]` with media paths made absolute (relative to the file).

    Blank lines are ignored. Raises ValueError naming the file and line of the first malformed row.
    """
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                 f"{e.start + 1}); JSONL files are UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"{where}: expected an object with a non-empty 'messages' list")
            for i, message in enumerate(messages):
                _check_message(message, f"{where}, message {i}")
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{where}: no assistant message, so nothing to learn from")
            rows.append((number, _absolute_media(messages, base)))
    return rows


def _absolute_media(messages: list[dict], base: str) -> list[dict]:
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{**part, part["type"]: os.path.join(base, part[part["type"]])}
                       if part["type"] in _MEDIA else part for part in content]
        out.append({**message, "content": content})
    return out


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A row left out of training, and why."""

    line: int
    reason: str


@dataclasses.dataclass(frozen=True)
class _Row:
    line: int
    messages: list[dict]
    length: int
    vision_tokens: int
    bucket: tuple[int, int]  # (length bucket, vision bucket; 0 = no media)


class SFTDataset:
    """A JSONL fine-tuning set, scanned, bucketed and batched.

    Args:
      path: the JSONL file.
      processor: a `Qwen3VLProcessor` (its chat template, tokenizer and media settings are used).
      batch_size: rows per batch.
      max_length: the context: longer rows are skipped (never truncated).
      length_buckets: padded lengths (default: 64, 128, ... up to `max_length`).
      vision_buckets: per-row merged vision-token ladder (default: 16, 32, ... up to `max_length`).
      seed: shuffling seed; epoch e uses `(seed, e)`.
      strict: raise on the first row that would be skipped.
      padding_side: "right" (training default) or "left".
    """

    def __init__(self, path: str | os.PathLike, processor, *, batch_size: int, max_length: int,
                 length_buckets: Sequence[int] | None = None, vision_buckets: Sequence[int] | None = None,
                 seed: int = 0, strict: bool = False, padding_side: str = "right"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.path = os.fspath(path)
        self.processor = processor
        self.batch_size = batch_size
        self.max_length = max_length
        self.seed = seed
        self.padding_side = padding_side
        self.length_buckets = Buckets(tuple(length_buckets)) if length_buckets else Buckets.doubling(
            min(64, max_length), max_length)
        if self.length_buckets.largest < max_length:
            raise ValueError(f"the largest length bucket {self.length_buckets.largest} is below max_length "
                             f"{max_length}")
        self.vision_buckets = Buckets(tuple(vision_buckets)) if vision_buckets else Buckets.doubling(
            min(16, max_length), max_length)
        self.rows: list[_Row] = []
        self.skipped: list[Skipped] = []
        for line, messages in read_jsonl(self.path):
            row = self._scan(line, messages)
            if isinstance(row, Skipped):
                if strict:
                    raise ValueError(f"{self.path}, line {line}: {row.reason}")
                log.warning("%s, line %d skipped: %s", self.path, line, row.reason)
                self.skipped.append(row)
            else:
                self.rows.append(row)
        if not self.rows:
            raise ValueError(f"{self.path}: no usable rows ({len(self.skipped)} skipped)")
        by_bucket: dict[tuple[int, int], int] = {}
        for row in self.rows:
            by_bucket[row.bucket] = by_bucket.get(row.bucket, 0) + 1
        self._bucket_sizes = dict(sorted(by_bucket.items()))
        self.batches_per_epoch = sum(-(-n // batch_size) for n in self._bucket_sizes.values())

    # ------------------------------------------------------------------ scanning

    def _process(self, conversations: list[list[dict]]) -> dict[str, Any]:
        return self.processor.apply_chat_template(conversations, tokenize=True, return_dict=True, padding=True,
                                                  padding_side=self.padding_side, return_tensors="np")

    def _scan(self, line: int, messages: list[dict]) -> _Row | Skipped:
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part["type"] in _MEDIA and not os.path.isfile(part[part["type"]]):
                    return Skipped(line, f"{part['type']} file not found: {part[part['type']]}")
        try:
            out = self._process([messages])
        except (ValueError, OSError) as e:  # PIL's UnidentifiedImageError is an OSError
            return Skipped(line, f"could not process: {e}")
        length = int(out["input_ids"].shape[1])
        if length > self.max_length:
            return Skipped(line, f"{length} tokens, longer than max_length {self.max_length}")
        vision = int(np.isin(out["input_ids"], [self.processor.image_token_id,
                                                self.processor.video_token_id]).sum())
        if vision > self.vision_buckets.largest:
            return Skipped(line, f"{vision} vision tokens, more than the largest vision bucket "
                                 f"{self.vision_buckets.largest}")
        bucket = (self.length_buckets.fit(length), self.vision_buckets.fit(vision) if vision else 0)
        return _Row(line, messages, length, vision, bucket)

    # ------------------------------------------------------------------ batching

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every batch shape this set yields: `(batch_size, length bucket, vision bucket)`."""
        return [(self.batch_size, length, vision) for length, vision in self._bucket_sizes]

    def encoder_budgets(self) -> list[int]:
        """Merged-token budgets that hold any batch's visual tokens in one vision-encoder call
        (`EncoderRunner(model, budgets=...)`): `batch_size * vision bucket` per bucket in use."""
        return sorted({self.batch_size * vision for _, vision in self._bucket_sizes if vision})

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one data set per run; the plan is rebuilt per epoch)
    def epoch_plan(self, epoch: int) -> list[tuple[tuple[int, int], list[int], int]]:
        """The batches of one epoch in order: `(bucket, row indices, number of real rows)`."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.rows))
        groups: dict[tuple[int, int], list[int]] = {b: [] for b in self._bucket_sizes}
        for index in order:
            groups[self.rows[index].bucket].append(int(index))
        plan = []
        for bucket, members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                real = len(chunk)
                while len(chunk) < self.batch_size:  # fill with rows of the same bucket, unsupervised
                    chunk.append(members[(len(chunk) - real) % len(members)])
                plan.append((bucket, chunk, real))
        return [plan[i] for i in rng.permutation(len(plan))]

    def batch(self, step: int) -> dict[str, Any]:
        """Batch number `step` (counting across epochs): processor outputs, `labels`, and bookkeeping.

        Keys: the processor's outputs (numpy), `labels [B, L]`, `bucket (length, vision)`,
        `num_real_rows`, `epoch`, `lines` (JSONL line numbers of the rows).
        """
        epoch, index = divmod(int(step), self.batches_per_epoch)
        (length, vision), members, real = self.epoch_plan(epoch)[index]
        conversations = [self.rows[i].messages for i in members]
        out = self._process(conversations)
        labels = assistant_labels(out["input_ids"], out["attention_mask"], self.processor, conversations)
        labels[real:] = IGNORE_INDEX
        pad = length - out["input_ids"].shape[1]
        if pad < 0:
            raise AssertionError(f"batch {step}: {out['input_ids'].shape[1]} tokens exceed the bucket "
                                 f"{length}")
        widths = ((0, 0), (pad, 0) if self.padding_side == "left" else (0, pad))
        pad_id = self.processor.pad_token_id
        out["input_ids"] = np.pad(out["input_ids"], widths, constant_values=pad_id)
        out["attention_mask"] = np.pad(out["attention_mask"], widths, constant_values=0)
        out["mm_token_type_ids"] = np.pad(out["mm_token_type_ids"], widths, constant_values=0)
        out["labels"] = np.pad(labels, widths, constant_values=IGNORE_INDEX)
        out.pop("video_timestamps", None)
        out.update(bucket=(length, vision), num_real_rows=real, epoch=epoch,
                   lines=[self.rows[i].line for i in members])
        return out

    def iterator(self, num_epochs: int | None = None, *, num_threads: int = 2, prefetch: int = 4):
        """A grain iterator over batches (`num_epochs=None`: forever), with `get_state` / `set_state`."""
        import grain

        steps = grain.MapDataset.range(self.batches_per_epoch).repeat(num_epochs)
        dataset = steps.map_with_index(lambda step, _: self.batch(step))
        return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                                               prefetch_buffer_size=prefetch)))
