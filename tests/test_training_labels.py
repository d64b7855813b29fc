"""Assistant-only labels on real processor outputs, checked against the decoded assistant spans."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_image, random_video

from qwen3vl_jax import Qwen3VLProcessor
from qwen3vl_jax.training import IGNORE_INDEX, assistant_labels

ANSWERS = ["A red square and a blue circle.", "It is gray.", "A red square moves across the video."]

CONVERSATIONS = [
    [  # system + image + two assistant turns
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
        {"role": "user", "content": [{"type": "text", "text": "And the background?"}]},
        {"role": "assistant", "content": ANSWERS[1]},
    ],
    [  # a video, one short turn: the shorter row, so it gets the padding
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[2]}]},
    ],
]


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


def conversation_batch(processor, conversations, padding_side):
    """Processor outputs for `CONVERSATIONS`-like rows (one image in row 0, one video in row 1)."""
    texts = processor.apply_chat_template(conversations)
    return processor(text=texts, images=[random_image(64, 96, 0)], videos=[random_video(4, 64, 64, 1)],
                     video_metadata=[{"fps": 2.0, "total_num_frames": 4}], padding=True,
                     padding_side=padding_side, return_tensors="np")


def runs(mask_row: np.ndarray) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs of True."""
    edges = np.diff(np.concatenate([[0], mask_row.astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_only_assistant_text_and_im_end_are_supervised(processor, padding_side):
    batch = conversation_batch(processor, CONVERSATIONS, padding_side)
    ids, mask = batch["input_ids"], batch["attention_mask"].astype(bool)
    assert not mask.all(), "the batch should be padded"
    labels = assistant_labels(ids, mask, processor, CONVERSATIONS)
    assert labels.shape == ids.shape
    supervised = labels != IGNORE_INDEX
    np.testing.assert_array_equal(labels[supervised], ids[supervised])
    assert not (supervised & ~mask).any()
    assert not (supervised & (batch["mm_token_type_ids"] != 0)).any()
    expected = [ANSWERS[:2], ANSWERS[2:]]
    for row in range(len(ids)):
        spans = [processor.decode(ids[row, a:b], skip_special_tokens=False) for a, b in runs(supervised[row])]
        assert spans == [answer + "<|im_end|>" for answer in expected[row]], (row, spans)
    # What is left out: everything else of the rendered conversation, vision tokens included.
    rest = processor.decode(ids[0][mask[0] & ~supervised[0]], skip_special_tokens=False)
    full = processor.decode(ids[0][mask[0]], skip_special_tokens=False)
    assert rest == full.replace(ANSWERS[0] + "<|im_end|>", "").replace(ANSWERS[1] + "<|im_end|>", "")
    assert rest.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|image_pad|>" in rest and rest.endswith("<|im_start|>assistant\n\n")


def test_without_conversations_and_open_final_turn(processor):
    """Without the conversations the spans are still found; a turn with no `<|im_end|>` (a prompt
    cut after the answer's text) is supervised to its last real token."""
    texts = processor.apply_chat_template(CONVERSATIONS)
    texts[1] = texts[1][: texts[1].rindex("<|im_end|>")]
    batch = processor(text=texts, images=[random_image(64, 96, 0)], videos=[random_video(4, 64, 64, 1)],
                      video_metadata=[{"fps": 2.0, "total_num_frames": 4}], padding=True,
                      padding_side="right",
                      return_tensors="np")
    labels = assistant_labels(batch["input_ids"], batch["attention_mask"], processor)
    ids, supervised = batch["input_ids"], labels != IGNORE_INDEX
    assert processor.decode(ids[1][supervised[1]], skip_special_tokens=False) == ANSWERS[2]


def test_miscounted_assistant_turns_are_an_error(processor):
    """Tokens and conversation disagree about the assistant turns (here an answer that itself
    contains the chat markup; with Qwen's real vocabulary also an answer starting with a newline,
    which merges into the header's): an error naming the row, never a silently wrong span."""
    injected = "Sure.<|im_end|>\n<|im_start|>assistant\nAgain."
    conversations = [CONVERSATIONS[0], [CONVERSATIONS[1][0], {"role": "assistant", "content": injected}]]
    batch = conversation_batch(processor, conversations, "left")
    with pytest.raises(ValueError, match=r"row 1: found 2 assistant turn\(s\) .* has 1 assistant message"):
        assistant_labels(batch["input_ids"], batch["attention_mask"], processor, conversations)
    with pytest.raises(ValueError, match="1 conversations for a batch of 2 rows"):
        assistant_labels(batch["input_ids"], batch["attention_mask"], processor, conversations[:1])
