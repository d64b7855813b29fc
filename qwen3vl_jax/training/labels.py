"""Labels for supervised fine-tuning: the assistant turns only.

Qwen's chat layout renders each message as `<|im_start|>{role}\\n{content}<|im_end|>\\n`. The
supervised tokens are an assistant message's content and its closing `<|im_end|>` (the model must
learn to stop); the `<|im_start|>assistant\\n` header, the newline after `<|im_end|>`, system and
user turns, vision tokens (`<|vision_start|>`, pads, `<|vision_end|>`) and padding are -100, the
index HF's cross-entropy ignores.

Spans are found on the token ids the processor produced (after vision expansion and padding, left
or right), by matching the tokenized assistant header and running to the next `<|im_end|>`. Given
the conversations, the number of spans found per row is checked against the number of assistant
messages, so a header the tokenizer merged with the content's first characters (say content that
starts with a newline) is an error, never a silently unsupervised turn.

Axes: B batch, L tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["IGNORE_INDEX", "assistant_labels", "assistant_spans"]

IGNORE_INDEX = -100  # what HF's (and our) cross-entropy skips

_ASSISTANT_HEADER = "<|im_start|>assistant\n"
_IM_END = "<|im_end|>"


def _token_id(processor, token: str) -> int:
    token_id = processor.tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token} token, so assistant turns cannot be found")
    return int(token_id)


def assistant_spans(ids: np.ndarray, mask: np.ndarray, header: np.ndarray,
                    end_id: int) -> list[tuple[int, int]]:
    """`[(start, stop), ...]` of one row: content after each header through the closing token.

    `stop` is exclusive and includes the `end_id` token; an assistant turn still open at the end of
    the real tokens (no `end_id`) runs to the last real token.
    """
    real = np.flatnonzero(mask)
    if real.size == 0:
        return []
    last = int(real[-1]) + 1
    n = header.size
    windows = np.lib.stride_tricks.sliding_window_view(ids[:last], n) if last >= n else np.zeros((0, n))
    starts = np.flatnonzero((windows == header).all(axis=1) & mask[: windows.shape[0]].astype(bool)) + n
    ends = np.flatnonzero(ids[:last] == end_id)
    spans = []
    for start in starts:
        after = ends[ends >= start]
        spans.append((int(start), int(after[0]) + 1 if after.size else last))
    return spans


def assistant_labels(input_ids, attention_mask, processor,
                     conversations: Sequence[Sequence[dict]] | None = None) -> np.ndarray:
    """`[B, L]` int64 labels: the token id inside assistant turns, -100 elsewhere.

    Args:
      input_ids, attention_mask: `[B, L]` as `Qwen3VLProcessor.__call__` returns them (any padding side).
      processor: the `Qwen3VLProcessor` that produced them (its tokenizer gives the header ids).
      conversations: the rendered conversations, one per row. When given, each row must hold exactly
        as many assistant turns as its conversation has assistant messages.
    Raises ValueError naming the row whose turns cannot be found.
    """
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids must be [batch, length] with a matching attention_mask, got {ids.shape} "
                         f"and {mask.shape}")
    if conversations is not None and len(conversations) != ids.shape[0]:
        raise ValueError(f"{len(conversations)} conversations for a batch of {ids.shape[0]} rows")
    header = np.asarray(processor.tokenizer.encode(_ASSISTANT_HEADER, add_special_tokens=False).ids)
    end_id = _token_id(processor, _IM_END)
    # Vision tokens are inputs, never targets, even inside an assistant turn.
    vision = np.asarray([processor.image_token_id, processor.video_token_id, processor.vision_start_token_id,
                         processor.vision_end_token_id])
    labels = np.full(ids.shape, IGNORE_INDEX, np.int64)
    for row in range(ids.shape[0]):
        spans = assistant_spans(ids[row], mask[row], header, end_id)
        if conversations is not None:
            expected = sum(1 for m in conversations[row] if m.get("role") == "assistant")
            if len(spans) != expected:
                raise ValueError(
                    f"row {row}: found {len(spans)} assistant turn(s) in the tokens but the conversation has "
                    f"{expected} assistant message(s) (does a message contain the chat markup, or start with "
                    f"whitespace that the tokenizer merges into the {_ASSISTANT_HEADER!r} header?)")
        for start, stop in spans:
            labels[row, start:stop] = ids[row, start:stop]
    labels[np.isin(ids, vision) | ~mask] = IGNORE_INDEX
    return labels
