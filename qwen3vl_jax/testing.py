"""Tiny HF-format Qwen3-VL checkpoints, synthesized on the spot (no downloads, no torch).

`make_tiny_checkpoint(path)` writes a directory that HF itself loads with
`Qwen3VLForConditionalGeneration.from_pretrained` and `AutoProcessor.from_pretrained`:

- `config.json` (v5 `rope_parameters` form, or the legacy `rope_scaling` form on request),
- `model.safetensors` with deterministic random weights under HF's tensor names (or shards plus
  `model.safetensors.index.json`),
- a byte-level BPE tokenizer trained on a built-in corpus, carrying Qwen's special tokens, with a
  chat template,
- `preprocessor_config.json`, `video_preprocessor_config.json`, `generation_config.json`.

It is the fixture of the parity tests (the built-in default of the demo is the trained
`qwen3vl_jax/default_model/`, `qwen3vl_jax.default`).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from .config import Qwen3VLConfig, TextConfig, VisionConfig
from .convert import copy_side_files, export_hf_tensors, iter_hf_tensors, storage_dtype, write_safetensors
from .model import expected_params
from .params import hf_rule
from .quant import TEXT_KINDS, VISION_KINDS, QuantSpec, dequantize, quantize, quantized_path

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "tiny_config", "make_tiny_checkpoint", "random_params", "bpe_tokenizer",
           "write_checkpoint_files"]

# Qwen's special tokens, in Qwen's id order (they follow the BPE vocabulary).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen3-VL's chat layout: each image part becomes <|vision_start|><|image_pad|><|vision_end|>,
# each video part <|vision_start|><|video_pad|><|vision_end|>, in the order of the parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# A small fixed corpus so the BPE merges (and so the token ids) are the same on every machine.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image. What is in the picture? What happens in the video?",
    "A red square and a blue circle move across a gray background.",
    "Qwen3-VL is a vision-language model: it reads images, videos and text.",
    "user assistant system The the a an of in on at to is are was were be this that these those",
    "0 1 2 3 4 5 6 7 8 9 10 seconds frame frames second time <0.5 seconds> <1.0 seconds>",
    "Hello, world! How are you today? I am fine, thank you.",
    "left right top bottom center color shape size moving static object background foreground",
]

_BPE_VOCAB_SIZE = 480


def bpe_tokenizer(corpus, vocab_size: int):
    """A byte-level BPE tokenizer in Qwen's pipeline, as its tokenizer.json carries it (NFC, Qwen's
    split regex, byte-level), trained on `corpus` (strings) up to `vocab_size` entries, with
    `SPECIAL_TOKENS` appended after the BPE vocabulary (Qwen's id order). Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _build_tokenizer():
    return bpe_tokenizer(_CORPUS * 4, _BPE_VOCAB_SIZE)


def tiny_config(vocab_size: int, special_ids: dict[str, int]) -> Qwen3VLConfig:
    """The tiny architecture: every structural feature of the real model at toy widths."""
    return Qwen3VLConfig(
        vision=VisionConfig(
            depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
            deepstack_visual_indexes=(0, 2), num_position_embeddings=256, patch_size=16,
            temporal_patch_size=2, spatial_merge_size=2,
        ),
        text=TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
            mrope_section=(6, 5, 5), max_position_embeddings=32768,
        ),
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def random_params(config: Qwen3VLConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Deterministic random parameters `{our path: array}` with activations of order one.

    Each parameter is a function of (seed, its path) only. Linear kernels ~ N(0, 1/fan_in); biases ~ N(0, 0.02^2); norm scales ~ 1 + N(0, 0.1^2);
    embeddings ~ N(0, 1).
    """
    shapes = expected_params(config)
    params = {}
    for path in sorted(shapes):
        shape, _ = shapes[path]
        # One stream per parameter, so variants (tied, other depth) share the weights they have in common.
        rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
        leaf = path.rsplit(".", 1)[-1]
        if leaf == "kernel":
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif leaf in ("gate_up_proj", "down_proj"):  # MoE experts [E, in, out]
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif leaf == "bias":
            value = 0.02 * rng.standard_normal(shape)
        elif leaf in ("scale", "weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf == "embedding":
            value = rng.standard_normal(shape)
        else:
            raise AssertionError(f"no initializer for parameter {path}")
        params[path] = value.astype(dtype)
    return params


def _write_json(directory: str, name: str, content: dict[str, Any]) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(content, f, indent=2)


def make_tiny_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    rope_form: str = "v5",
    max_shard_bytes: int | None = None,
    expert_layout: str = "released",
    vision: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
    image_size: dict[str, int] | None = None,
    video_size: dict[str, int] | None = None,
) -> str:
    """Write a tiny HF-format Qwen3-VL checkpoint directory at `path` and return its path.

    Args:
      seed: weights are a deterministic function of the seed (and the architecture).
      dtype: "float32" or "bfloat16" storage in the safetensors.
      tie_word_embeddings: drop `lm_head.weight` and reuse the embeddings (as the 2B/4B do).
      rope_form: "v5" (`rope_parameters`) or "legacy" (`rope_theta` + `rope_scaling`).
      max_shard_bytes: if set, shard the weights (with `model.safetensors.index.json`).
      expert_layout: MoE configs (`text={"num_experts": ...}`): the experts' HF layout, "released"
        (`[E, H, 2I]`) or "module" (transformers 5's `[E, 2I, H]`).
      vision, text: overrides of `VisionConfig` / `TextConfig` fields.
      image_size, video_size: the processors' `size` ({"shortest_edge": min pixels,
        "longest_edge": max pixels}).
    """
    if rope_form not in ("v5", "legacy"):
        raise ValueError(f"rope_form must be 'v5' or 'legacy', got {rope_form!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    np_dtype = storage_dtype(dtype)
    directory = os.fspath(path)
    os.makedirs(directory, exist_ok=True)

    tokenizer = _build_tokenizer()
    special_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64  # padded, as Qwen pads its vocabulary
    config = tiny_config(vocab_size, special_ids).replace(
        tie_word_embeddings=tie_word_embeddings, vision=vision or {}, text=text or {}
    )

    # -- weights
    params = random_params(config, seed=seed)
    tensors = {name: value.astype(np_dtype) for name, value in export_hf_tensors(params, config, expert_layout=expert_layout).items()}
    write_safetensors(tensors, directory, max_shard_bytes)
    write_checkpoint_files(directory, config, tokenizer, dtype=dtype, rope_form=rope_form,
                           image_size=image_size or {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 256},
                           video_size=video_size or {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 1024})
    return directory


def write_checkpoint_files(directory: str | os.PathLike, config: Qwen3VLConfig, tokenizer, *, dtype: str,
                           image_size: dict[str, int], video_size: dict[str, int], rope_form: str = "v5",
                           video_sampling: dict[str, Any] | None = None) -> None:
    """Everything of an HF-format checkpoint but the weights: `config.json`, `generation_config.json`,
    the tokenizer files (`tokenizer` from `bpe_tokenizer`, with Qwen's chat template) and the image and
    video processor configs (Qwen3-VL's released values with `image_size` / `video_size` as their
    `size`; `video_sampling` overrides the video processor's fps = 2, min_frames = 4, max_frames = 64)."""
    if rope_form not in ("v5", "legacy"):
        raise ValueError(f"rope_form must be 'v5' or 'legacy', got {rope_form!r}")
    directory = os.fspath(directory)
    special_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    missing = [tok for tok, i in special_ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks Qwen's special tokens {missing}; build it with bpe_tokenizer")

    # -- config
    hf = config.to_hf_dict()
    hf["dtype"] = dtype
    hf["text_config"]["bos_token_id"] = special_ids["<|endoftext|>"]
    hf["text_config"]["eos_token_id"] = special_ids["<|im_end|>"]
    if rope_form == "legacy":
        rope = hf["text_config"].pop("rope_parameters")
        hf["text_config"]["rope_theta"] = rope.pop("rope_theta")
        hf["text_config"]["rope_scaling"] = rope
        hf["vision_config"].pop("rope_parameters")
    _write_json(directory, "config.json", hf)
    _write_json(directory, "generation_config.json", {
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        "pad_token_id": special_ids["<|endoftext|>"],
        "do_sample": False,
    })

    # -- tokenizer
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    tokenizer.model.save(directory)  # vocab.json + merges.txt, for slow-path loaders
    added = {
        str(special_ids[tok]): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": True}
        for tok in SPECIAL_TOKENS
    }
    _write_json(directory, "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": config.text.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    })
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)

    # -- processors (Qwen3-VL's released values, with a smaller default pixel budget)
    common = {
        "patch_size": config.vision.patch_size,
        "temporal_patch_size": config.vision.temporal_patch_size,
        "merge_size": config.vision.spatial_merge_size,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "processor_class": "Qwen3VLProcessor",
    }
    _write_json(directory, "preprocessor_config.json", {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": image_size,
    })
    _write_json(directory, "video_preprocessor_config.json", {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": video_size,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,  # explicit: HF warns while its default is unset
        "fps": 2,
        "min_frames": 4,
        "max_frames": 64,
        "return_metadata": True,
        **(video_sampling or {}),
    })


# ----------------------------------------------------------------------------------------------
# A tiny fine-tuning data set: media files plus a JSONL of conversations

__all__ += ["write_video", "make_tiny_dataset"]


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float, codec: str = "mpeg4") -> str:
    """Encode uint8 frames `(T, H, W, 3)` to a video file with PyAV; returns the path.

    `codec="png"` (in a `.mov` file) is lossless: PyAV decodes the very pixels back, at `fps`."""
    from fractions import Fraction

    import av

    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return os.fspath(path)


_QUESTIONS = ["What is in the picture?", "Describe this image.", "What happens in the video?",
              "How are you today?", "What color is the square?"]
_ANSWERS = ["A red square and a blue circle.", "The quick brown fox jumps over the lazy dog.",
            "A red square moves across a gray background.", "I am fine, thank you.",
            "It is red, on the left.", "A static object in the center."]


def make_tiny_dataset(directory: str | os.PathLike, *, num_rows: int = 12, seed: int = 0,
                      name: str = "train.jsonl") -> str:
    """Write a small fine-tuning set under `directory` and return the JSONL path.

    Rows cycle through four kinds: one image, one short video (mp4), text only, and a two-turn
    conversation with a system prompt and an image; media have seeded sizes and contents (a
    background with a moving square), so the rows fall into a few length buckets. Media paths in
    the JSONL are relative to it, as `qwen3vl_jax.training.data` expects.
    """
    from PIL import Image

    directory = os.fspath(directory)
    os.makedirs(os.path.join(directory, "media"), exist_ok=True)
    rng = np.random.default_rng(seed)

    def picture(height, width):
        image = np.full((height, width, 3), rng.integers(60, 200, 3), np.uint8)
        top, left = rng.integers(0, height - 16), rng.integers(0, width - 16)
        image[top:top + 16, left:left + 16] = rng.integers(0, 256, 3)
        return image

    rows = []
    for i in range(num_rows):
        kind = i % 4
        question, answer = _QUESTIONS[i % len(_QUESTIONS)], _ANSWERS[i % len(_ANSWERS)]
        if kind in (0, 3):
            file = f"media/image_{i}.png"
            height, width = (int(s) for s in rng.choice([48, 64, 96, 128], 2))
            Image.fromarray(picture(height, width)).save(os.path.join(directory, file))
            user = [{"type": "image", "image": file}, {"type": "text", "text": question}]
        elif kind == 1:
            file = f"media/clip_{i}.mp4"
            frames = int(rng.integers(4, 9))
            video = np.repeat(picture(48, 64)[None], frames, axis=0)
            for t in range(frames):  # the square moves one step per frame
                video[t, 16:32, 4 * t:4 * t + 16] = (255, 32, 32)
            write_video(os.path.join(directory, file), video, fps=4)
            user = [{"type": "video", "video": file}, {"type": "text", "text": question}]
        else:
            user = [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if kind == 3:
            messages = ([{"role": "system", "content": "You are a helpful assistant."}] + messages
                        + [{"role": "user", "content": [{"type": "text", "text": "And the background?"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "It is gray."}]}])
        rows.append({"messages": messages})
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


__all__ += ["make_fp8_checkpoint"]

# The modules HF's FP8 releases keep in high precision besides the embeddings and norms.
FP8_NOT_CONVERTED = ["lm_head", "model.visual"]


def make_fp8_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *, block: tuple[int, int] = (128, 128),
                        scale_dtype: str = "float32", dequantized: bool = False, vision: bool = False,
                        modules_to_not_convert: list[str] | None = None) -> str:
    """An HF fine-grained FP8 checkpoint (the layout of Qwen's FP8 releases) made from the
    full-precision checkpoint `source`: every language-model linear weight `[out, in]` quantized to
    `float8_e4m3fn` in blocks of `block = [out, in]` (HF's `weight_block_size`; partial edge blocks
    where the widths are not multiples), with its `weight_scale_inv [ceil(out/B0), ceil(in/B1)]`
    (float32 or bfloat16, "multiply to dequantize"); a MoE layer's fused experts likewise, expert by
    expert, in the checkpoint's own layout (`gate_up_proj` with `gate_up_proj_scale_inv [E, ...]`,
    the grid's axes in the weight's order: HF's `FP8Experts` parameters in the module layout); every
    other tensor as it is, and `quantization_config` in config.json. `vision`: the vision tower's
    linears too (each ViT block's `attn.qkv` / `attn.proj` / `mlp.linear_fc1` / `linear_fc2` and the
    mergers'; `modules_to_not_convert` then lists `lm_head` only). `dequantized`: write instead the
    full-precision checkpoint of the dequantized weights (float32; what HF computes from the FP8
    one), no `quantization_config`."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    text = Qwen3VLConfig.from_hf_config(source).text
    ours_block = (int(block[1]), int(block[0]))  # [out, in] -> our [in, out] orientation
    spec = QuantSpec("fp8", ours_block, frozenset(TEXT_KINDS + (VISION_KINDS if vision else ())))
    tensors = {}
    for _, name, value in iter_hf_tensors(source):
        found = hf_rule(name)
        if found is None or quantized_path(found[0], spec) is None:
            tensors[name] = value
            continue
        if found[0].endswith(".kernel"):
            in_major = lambda a: a.T  # noqa: E731  (a linear's [out, in] <-> our [in, out])
        else:  # a layer's experts, in either layout
            gate_up = name.endswith("gate_up_proj")
            module = value.shape[1:] == ((2 * text.moe_intermediate_size, text.hidden_size) if gate_up
                                         else (text.hidden_size, text.moe_intermediate_size))
            in_major = (lambda a: np.swapaxes(a, -1, -2)) if module else (lambda a: a)  # noqa: E731
        kernel, scale = quantize(in_major(np.asarray(value, np.float32)), "fp8", ours_block)
        if scale_dtype == "bfloat16":
            scale = scale.astype(ml_dtypes.bfloat16)
        if dequantized:
            tensors[name] = np.ascontiguousarray(in_major(dequantize(kernel, scale, "fp8", ours_block)))
        else:
            tensors[name] = np.ascontiguousarray(in_major(kernel))
            tensors[name + "_scale_inv"] = np.ascontiguousarray(in_major(scale))
    write_safetensors(tensors, out)
    copy_side_files(source, out, skip=("config.json",))
    with open(os.path.join(os.fspath(source), "config.json")) as f:
        config = json.load(f)
    if not dequantized:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])],
            "modules_to_not_convert": modules_to_not_convert if modules_to_not_convert is not None
            else ["lm_head"] if vision else FP8_NOT_CONVERTED}
    _write_json(out, "config.json", config)
    return out
