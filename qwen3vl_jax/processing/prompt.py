"""Prompt expansion and tokenization: placeholders, per-frame timestamps, padding, token types.

`<|image_pad|>` becomes t*h*w/merge^2 pads; `<|video_pad|>` becomes, per temporal patch,
`<t.t seconds><|vision_start|>` + pads + `<|vision_end|>` (HF's Qwen3VLProcessor layout).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any


IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


# ----------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(path: str, tokenizer_config: dict[str, Any]):
    """tokenizer.json with the `tokenizers` library, normalized to what HF's Qwen2Tokenizer builds.

    HF v5's `Qwen2Tokenizer` keeps only the vocabulary, merges and added tokens of tokenizer.json
    and rebuilds the pipeline: NFC normalizer, Qwen's split regex then byte-level (no regex), no
    special tokens added around the text. Real Qwen checkpoints ship exactly that pipeline; doing
    the same here keeps ids identical to HF for any tokenizer.json.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    file = os.path.join(path, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library names neither the file nor always the problem
        raise ValueError(f"{file}: cannot read the tokenizer: {e}") from e
    if tokenizer_config.get("tokenizer_class", "Qwen2Tokenizer") in ("Qwen2Tokenizer", "Qwen2TokenizerFast"):
        regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        add_prefix_space = bool(tokenizer_config.get("add_prefix_space") or False)
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1",
                                                                 special_tokens=[])
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value



# ----------------------------------------------------------------------------------------------
# Placeholders


def image_placeholder(grid_thw: Sequence[int], merge_size: int) -> str:
    t, h, w = (int(x) for x in grid_thw)
    return IMAGE_TOKEN * (t * h * w // merge_size ** 2)


def video_placeholder(timestamps: Sequence[float], tokens_per_frame: Sequence[int]) -> str:
    """`<t.t seconds><|vision_start|>` + pads + `<|vision_end|>` per temporal patch (HF's
    `Qwen3VLProcessor.replace_video_token`).

    The pruning hook: `tokens_per_frame` may be any non-negative counts (one per temporal patch),
    e.g. all retained tokens in frame 0 and zero elsewhere.
    """
    if len(timestamps) != len(tokens_per_frame):
        raise ValueError(f"{len(tokens_per_frame)} token counts given for a video of {len(timestamps)} "
                         f"temporal patches; pass one count per temporal patch")
    parts = []
    for seconds, count in zip(timestamps, tokens_per_frame):
        count = int(count)
        if count < 0:
            raise ValueError(f"token counts must be non-negative, got {count}")
        parts.append(f"<{seconds:.1f} seconds>{VISION_START}{VIDEO_TOKEN * count}{VISION_END}")
    return "".join(parts)


# The chat template writes a video as `<|vision_start|><|video_pad|><|vision_end|>`. Each frame of the
# expansion carries its own markers, so (as HF transformers >= 5.25) the template's wrapper is
# collapsed to the bare pad token first: no outer marker pair around a video's frames.
VIDEO_WRAPPER = VISION_START + VIDEO_TOKEN + VISION_END


def expand(texts: list[str], image_repl: list[str], video_repl: list[str]) -> list[str]:
    """Replace the i-th image / video pad token across the batch with the i-th expansion (a video's
    `VIDEO_WRAPPER` is replaced as a whole)."""
    if video_repl:
        texts = [text.replace(VIDEO_WRAPPER, VIDEO_TOKEN) for text in texts]
    pattern = re.compile(re.escape(IMAGE_TOKEN) + "|" + re.escape(VIDEO_TOKEN))
    images, videos = iter(image_repl), iter(video_repl)

    def sub(match):
        return next(images) if match.group() == IMAGE_TOKEN else next(videos)

    return [pattern.sub(sub, text) for text in texts]


# ----------------------------------------------------------------------------------------------
# Tokenization with HF's text keywords

# Keywords HF's processors route to the tokenizer (`TextKwargs`). Those this port does not
# implement are accepted only at their "off" value (None / False / 0).
TEXT_KEYS = frozenset({
    "text_pair", "text_target", "text_pair_target", "add_special_tokens", "padding", "truncation", "max_length",
    "stride", "is_split_into_words", "pad_to_multiple_of", "return_token_type_ids", "return_attention_mask",
    "return_overflowing_tokens", "return_special_tokens_mask", "return_offsets_mapping", "return_length",
    "verbose", "padding_side", "return_mm_token_type_ids", "return_text_replacement_offsets",
    "sanitize_control_tokens", "return_tensors",
})
_TEXT_UNSUPPORTED = ("text_pair", "text_target", "text_pair_target", "stride", "is_split_into_words",
                     "return_token_type_ids", "return_overflowing_tokens", "return_special_tokens_mask",
                     "return_offsets_mapping", "return_length", "return_text_replacement_offsets",
                     "sanitize_control_tokens")


def tokenize(tokenizer, texts: list[str], *, pad_token_id: int | None, padding_side: str, truncation_side: str,
             model_max_length: int | None, padding=False, truncation=None, max_length=None,
             pad_to_multiple_of=None, return_attention_mask=None, add_special_tokens=None,
             verbose=None, return_tensors=None, return_mm_token_type_ids=None, **unsupported):
    """`(ids, attention_mask)` per text, padded and truncated as HF's tokenizer call does.

    padding: False / "do_not_pad", True / "longest", "max_length" (to `max_length`, default the
    tokenizer's `model_max_length`); truncation: True / "longest_first" / "only_first" cut each
    text to `max_length` on the tokenizer's `truncation_side`. `add_special_tokens` has no effect
    (Qwen's tokenizer adds none).
    """
    for key, value in unsupported.items():
        if key not in _TEXT_UNSUPPORTED:
            raise TypeError(f"unexpected text keyword argument {key!r}")
        if value:
            raise ValueError(f"{key}={value!r} is not supported by this port")
    ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]
    if truncation not in (None, False, "do_not_truncate", True, "longest_first", "only_first"):
        raise ValueError(f"truncation must be a bool, 'longest_first', 'only_first' or 'do_not_truncate', "
                         f"got {truncation!r}")
    if padding not in (None, False, "do_not_pad", True, "longest", "max_length"):
        raise ValueError(f"padding must be a bool, 'longest', 'max_length' or 'do_not_pad', got {padding!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    limit = max_length if max_length is not None else model_max_length
    if truncation not in (None, False, "do_not_truncate"):
        if limit is None:
            raise ValueError("truncation needs max_length (the tokenizer config names no model_max_length)")
        ids = [x[:limit] if truncation_side == "right" else x[max(len(x) - limit, 0):] for x in ids]
    if padding in (None, False, "do_not_pad"):
        target = None
    elif padding == "max_length":
        if limit is None:
            raise ValueError("padding='max_length' needs max_length (the tokenizer config names no "
                             "model_max_length)")
        target = limit
    else:
        target = max((len(x) for x in ids), default=0)
    if target is not None and pad_to_multiple_of:
        target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
    side = padding_side
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
    masks = [[1] * len(x) for x in ids]
    if target is not None and any(len(x) < target for x in ids):
        if pad_token_id is None:
            raise ValueError("padding needs a pad token, and the tokenizer config names none")
        for i, x in enumerate(ids):
            n = max(target - len(x), 0)
            ids[i] = [pad_token_id] * n + x if side == "left" else x + [pad_token_id] * n
            masks[i] = [0] * n + masks[i] if side == "left" else masks[i] + [0] * n
    return ids, masks
