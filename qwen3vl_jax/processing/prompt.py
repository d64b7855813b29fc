"""Prompt expansion and tokenization: placeholders, per-frame timestamps, padding, token types.

`<|image_pad|>` becomes t*h*w/merge^2 pads; `<|video_pad|>` becomes, per temporal patch,
`<t.t seconds><|vision_start|>` + pads + `<|vision_end|>` (HF's Qwen3VLProcessor layout).
"""

from __future__ import annotations

import os
from typing import Any


IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


# ----------------------------------------------------------------------------------------------
# Tokenizer and chat template


def _load_tokenizer(path: str, tokenizer_config: dict[str, Any]):
    """tokenizer.json with the `tokenizers` library, normalized to what HF's Qwen2Tokenizer builds.

    HF v5's `Qwen2Tokenizer` keeps only the vocabulary, merges and added tokens of tokenizer.json
    and rebuilds the pipeline: NFC normalizer, Qwen's split regex then byte-level (no regex), no
    special tokens added around the text. Real Qwen checkpoints ship exactly that pipeline; doing
    the same here keeps ids identical to HF for any tokenizer.json.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
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


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value

