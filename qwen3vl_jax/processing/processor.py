"""`Qwen3VLProcessor`: text + images + videos -> model inputs, as HF's `Qwen3VLProcessor`.

Call-time keywords are sorted into HF 5.x's groups (`ProcessorMixin._merge_kwargs`): a keyword
goes to every group that knows it (`size` to images and videos; `min_pixels` / `max_pixels` to
images only; `fps` to videos; `padding` to text; `return_tensors` to all), `text_kwargs=`,
`images_kwargs=`, `videos_kwargs=` target one group, `common_kwargs=` all of them. Passing a key
both in a group dict and as a keyword is HF's ValueError; a key a group dict does not know is HF's
TypeError. Unlike HF, a keyword no group knows is a TypeError too (HF warns and ignores it), so a
typo is never silently dropped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config import read_json
from ..pruning import placeholder_tokens, retained_count, validate_image_pruning, validate_video_pruning
from . import chat
from .image import IMAGE_KEYS, ImageProcessor
from .media import batch_videos, flatten_images
from .prompt import (IMAGE_TOKEN, TEXT_KEYS, VIDEO_TOKEN, VISION_END, VISION_START, load_tokenizer, token_str,
                     expand, image_placeholder, tokenize, video_placeholder)
from .video import VIDEO_KEYS, VideoProcessor

GROUPS = {"text_kwargs": TEXT_KEYS, "images_kwargs": IMAGE_KEYS, "videos_kwargs": VIDEO_KEYS}
# Processor-level keywords: HF's flat `ProcessingKwargs` keys, and this port's pruning hooks.
PROCESSOR_KEYS = frozenset({"return_mm_token_type_ids", "return_text_replacement_offsets",
                            "video_tokens_per_frame", "video_pruning", "image_pruning"})
# HF's `Qwen3VLProcessor` class defaults per group.
_DEFAULTS = {"text_kwargs": {"return_token_type_ids": False}, "images_kwargs": {},
             "videos_kwargs": {"return_metadata": True}}


def merge_kwargs(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{"text_kwargs": ..., "images_kwargs": ..., "videos_kwargs": ..., "processor": ...}` from a
    call's keywords, by HF 5.x's rules (see the module docstring)."""
    kwargs = dict(kwargs)
    out = {group: dict(defaults) for group, defaults in _DEFAULTS.items()}
    out["processor"] = {}
    common = kwargs.pop("common_kwargs", None) or {}
    audio = kwargs.pop("audio_kwargs", None)
    if audio:
        raise ValueError(f"audio_kwargs {sorted(audio)}: Qwen3-VL has no audio")
    for key, value in common.items():
        groups = [g for g, keys in GROUPS.items() if key in keys]
        if not groups:
            raise TypeError(f"common_kwargs: unexpected keyword argument {key!r}")
        for group in groups:
            out[group][key] = value
    for key, value in kwargs.items():
        if key in GROUPS:
            for sub, sub_value in (value or {}).items():
                if sub not in GROUPS[key]:
                    raise TypeError(f"{key}: unexpected keyword argument {sub!r}")
                if sub in kwargs:
                    raise ValueError(f"Keyword argument {sub} was passed two times:\n"
                                     f"in a dictionary for {key} and as a **kwarg.")
                out[key][sub] = sub_value
        elif key in PROCESSOR_KEYS:
            out["processor"][key] = value
        else:
            groups = [g for g, keys in GROUPS.items() if key in keys]
            if not groups:
                raise TypeError(f"unexpected keyword argument {key!r}")
            for group in groups:
                out[group][key] = value
    return out


class Qwen3VLProcessor:
    """Text + images + videos -> model inputs, with HF `Qwen3VLProcessor`'s values.

    >>> processor = Qwen3VLProcessor.from_pretrained(checkpoint_dir)
    >>> prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    >>> inputs = processor(text=prompt, images=[image], videos=[frames],
    ...                    video_metadata=[{"fps": 30, "total_num_frames": len(frames)}], return_tensors="np")
    """

    def __init__(self, tokenizer, image_processor: ImageProcessor, video_processor: VideoProcessor,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 padding_side: str = "right", truncation_side: str = "right",
                 model_max_length: int | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.model_max_length = model_max_length
        self.image_token, self.video_token = IMAGE_TOKEN, VIDEO_TOKEN
        self.vision_start_token, self.vision_end_token = VISION_START, VISION_END
        ids = {}
        for tok in (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END):
            ids[tok] = tokenizer.token_to_id(tok)
            if ids[tok] is None:
                raise ValueError(f"the tokenizer has no {tok} token")
        self.image_token_id, self.video_token_id = ids[IMAGE_TOKEN], ids[VIDEO_TOKEN]
        self.vision_start_token_id, self.vision_end_token_id = ids[VISION_START], ids[VISION_END]
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id = tokenizer.token_to_id(pad) if pad else None
        self._template = None

    # -- construction

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, images_kwargs: dict[str, Any] | None = None,
                        videos_kwargs: dict[str, Any] | None = None) -> Qwen3VLProcessor:
        """Load from an HF checkpoint directory (tokenizer.json, tokenizer_config.json, chat template,
        preprocessor_config.json, video_preprocessor_config.json). `images_kwargs` / `videos_kwargs`
        override config entries (e.g. {"size": {"shortest_edge": ..., "longest_edge": ...}})."""
        path = os.fspath(path)

        def read(name):  # None when absent; malformed JSON is an error naming the file
            file = os.path.join(path, name)
            return read_json(file) if os.path.isfile(file) else None

        tok_config = read("tokenizer_config.json") or {}
        image_dict = read("preprocessor_config.json")
        if image_dict is None:
            raise FileNotFoundError(f"no preprocessor_config.json in {path}")
        video_dict = read("video_preprocessor_config.json")
        if video_dict is None:  # older checkpoints keep the video settings with the image ones
            video_dict = dict(image_dict)
        image_dict = {**image_dict, **(images_kwargs or {})}
        video_dict = {**video_dict, **(videos_kwargs or {})}

        chat_template = None
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                chat_template = f.read()
        elif (ct := read("chat_template.json")) is not None:
            chat_template = ct.get("chat_template")
        elif isinstance(tok_config.get("chat_template"), str):
            chat_template = tok_config["chat_template"]

        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = token_str(tok_config.get(key))
            if value is not None:
                special[key] = value
        if tok_config.get("tokenizer_class", "Qwen2Tokenizer").startswith("Qwen2Tokenizer"):
            # Qwen2Tokenizer's defaults for keys absent from tokenizer_config.json
            special.setdefault("eos_token", "<|endoftext|>")
            special.setdefault("pad_token", "<|endoftext|>")
        return cls(
            tokenizer=load_tokenizer(path, tok_config),
            image_processor=ImageProcessor.from_dict(image_dict),
            video_processor=VideoProcessor.from_dict(video_dict),
            chat_template=chat_template,
            special_tokens=special,
            padding_side=tok_config.get("padding_side", "right"),
            truncation_side=tok_config.get("truncation_side", "right"),
            # HF's "no limit" sentinel (int(1e30)) counts as none
            model_max_length=m if isinstance(m := tok_config.get("model_max_length"), int) and m < 1e12 else None,
        )

    # -- prompt expansion

    def image_placeholder(self, grid_thw: Sequence[int]) -> str:
        return image_placeholder(grid_thw, self.image_processor.merge_size)

    @staticmethod
    def video_placeholder(timestamps: Sequence[float], tokens_per_frame: Sequence[int]) -> str:
        return video_placeholder(timestamps, tokens_per_frame)

    # -- tokenization

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # -- the call

    def __call__(self, text: str | Sequence[str] | None = None, images: Any = None, videos: Any = None,
                 **kwargs) -> dict[str, Any]:
        """Process a prompt (or a batch) with its images and videos, in order of their pad tokens.

        Args:
          text: prompt(s) holding one `<|image_pad|>` per image and one `<|video_pad|>` per video
            (as the chat template writes them, each inside `<|vision_start|> ... <|vision_end|>`; a
            video's wrapper gives way to its per-frame markers, as in HF transformers >= 5.25).
          images: PIL images, numpy arrays (H, W, C) or paths, flat across the batch.
          videos: frames arrays (T, H, W, C), lists of frames (images or image files), or video files.
          **kwargs: HF's keywords, by group (module docstring), among them
            text: `return_tensors` ("np" int64 / float32 arrays, "jax", None for lists), `padding`
              (True / "longest" / "max_length"), `padding_side`, `truncation`, `max_length`,
              `pad_to_multiple_of`;
            images: `size` ({"shortest_edge", "longest_edge"} pixel counts), `min_pixels`, `max_pixels`,
              `resample`, `do_resize`, `do_rescale`, `rescale_factor`, `do_normalize`, `image_mean`,
              `image_std`, `input_data_format`;
            videos: `video_metadata` (per video {"fps": source fps, "total_num_frames", "frames_indices"},
              or nested per prompt; without it an array's fps counts as 24, as in HF), `fps`,
              `num_frames`, `do_sample_frames`, `cap_pixels_per_frame`, `size` and the pixel keys;
              `return_metadata=True` returns each video's `VideoMetadata`;
            this port's: `num_threads` (images and videos), and
              `video_tokens_per_frame`: per video, None (the full count) or one token count per temporal patch;
              `video_pruning`: `(method, rate)` ("evs" or "vidcom2", rate in [0, 1), 0 = off): size each video's
              placeholder for the tokens the method keeps, all in frame 0 (vLLM's layout); the model, given
              the same option, moves each kept token to its own frame after encoding;
              `image_pruning`: `(method, rate)`, a method that prunes images: size each image's
              placeholder for the K tokens it keeps (the model, given the same option, picks them).
        """
        groups = merge_kwargs(kwargs)
        text_kw, img_kw, vid_kw, proc_kw = (groups["text_kwargs"], groups["images_kwargs"], groups["videos_kwargs"],
                                            groups["processor"])
        return_tensors = text_kw.get("return_tensors")
        if text is None and images is None and videos is None:
            raise ValueError("nothing to process: pass text, images or videos")
        if return_tensors not in (None, "np", "jax"):
            raise ValueError(f"return_tensors must be None, 'np' or 'jax', got {return_tensors!r}")
        texts = None
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            if not texts:
                raise ValueError("`text` is an empty list: pass at least one prompt")
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise ValueError(f"`text` must be a string or a list of strings; text[{i}] is a "
                                     f"{type(t).__name__}")
                if not t:
                    raise ValueError(f"text[{i}] is empty: a prompt needs at least one token")

        image_list = flatten_images(images)
        video_list = batch_videos(videos) if videos is not None else []
        if texts is not None:
            n_img = sum(t.count(IMAGE_TOKEN) for t in texts)
            n_vid = sum(t.count(VIDEO_TOKEN) for t in texts)
            if n_img != len(image_list):
                raise ValueError(f"the prompts hold {n_img} {IMAGE_TOKEN} placeholder(s) but "
                                 f"{len(image_list)} image(s) were passed; each image needs exactly one "
                                 f"placeholder")
            if n_vid != len(video_list):
                raise ValueError(f"the prompts hold {n_vid} {VIDEO_TOKEN} placeholder(s) but "
                                 f"{len(video_list)} video(s) were passed; each video needs exactly one "
                                 f"placeholder")

        data: dict[str, Any] = {}
        if image_list:
            data.update(self.image_processor(image_list, **img_kw))
        if video_list:
            out = self.video_processor(video_list, **vid_kw)
            data["pixel_values_videos"] = out["pixel_values_videos"]
            data["video_grid_thw"] = out["video_grid_thw"]
            data["video_timestamps"] = out["video_timestamps"]
            if kwargs.get("return_metadata"):  # as HF: only a top-level return_metadata returns them
                data["video_metadata"] = out["video_metadata"]
        video_tokens_per_frame = proc_kw.get("video_tokens_per_frame")
        if proc_kw.get("video_pruning") is not None and video_list:
            if video_tokens_per_frame is not None:
                raise ValueError("pass video_pruning or video_tokens_per_frame, not both")
            video_tokens_per_frame = self.pruned_tokens_per_frame(data["video_grid_thw"], proc_kw["video_pruning"])
        image_tokens = None
        if proc_kw.get("image_pruning") is not None and image_list:
            image_tokens = self.pruned_image_tokens(data["image_grid_thw"], proc_kw["image_pruning"])
        if texts is not None:
            data.update(self.expand_and_tokenize(
                texts, image_grid_thw=data.get("image_grid_thw"), video_grid_thw=data.get("video_grid_thw"),
                video_timestamps=data.get("video_timestamps"), video_tokens_per_frame=video_tokens_per_frame,
                image_tokens=image_tokens,
                **{k: v for k, v in text_kw.items() if k != "return_tensors"},
                return_mm_token_type_ids=proc_kw.get("return_mm_token_type_ids", True)))
        return self._to_tensors(data, return_tensors)

    def pruned_tokens_per_frame(self, video_grid_thw, video_pruning) -> list[list[int] | None]:
        """Per video, `[K, 0, ..., 0]` under `video_pruning=(method, rate)`, or None (full) when off."""
        spec = validate_video_pruning(*video_pruning)
        if spec is None:
            return [None] * len(video_grid_thw)
        merge = self.video_processor.merge_size ** 2
        counts = []
        for t, h, w in video_grid_thw:
            keep = retained_count(spec[0], int(h) * int(w) // merge, int(t), spec[1])
            counts.append([keep] + [0] * (int(t) - 1))
        return counts

    def pruned_image_tokens(self, image_grid_thw, image_pruning) -> list[int] | None:
        """Per image, the K tokens `image_pruning=(method, rate)` keeps, or None (all) when off."""
        spec = validate_image_pruning(image_pruning)
        if spec is None:
            return None
        return [placeholder_tokens([g], self.image_processor.merge_size, spec) for g in image_grid_thw]

    def expand_and_tokenize(self, text: str | Sequence[str], image_grid_thw=None, video_grid_thw=None,
                            video_timestamps=None, video_tokens_per_frame=None, return_tensors: str | None = None,
                            return_mm_token_type_ids: bool = True, image_tokens=None,
                            **text_kwargs) -> dict[str, Any]:
        """The text half of `__call__`: expand the pad tokens for the given grids and tokenize
        (`text_kwargs`: HF's text keywords, e.g. padding, padding_side, truncation, max_length).

        This is the pruning hook without re-processing any pixels: after the vision encoder and a
        pruning method have decided how many tokens each temporal patch keeps, call it with the
        first call's grids and timestamps and `video_tokens_per_frame=[[n_0, ..., n_{t-1}], ...]`
        (None for a video keeps its full count) to get the prompt the language model sees;
        `image_tokens=[k_0, ...]` sizes each image's placeholder likewise (None: the full counts).
        """
        texts = [text] if isinstance(text, str) else list(text)
        image_grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw]
        video_grids = [] if video_grid_thw is None else [tuple(int(x) for x in g) for g in video_grid_thw]
        n_img = sum(t.count(IMAGE_TOKEN) for t in texts)
        n_vid = sum(t.count(VIDEO_TOKEN) for t in texts)
        if n_img != len(image_grids) or n_vid != len(video_grids):
            raise ValueError(f"the prompts hold {n_img} image and {n_vid} video placeholder(s) for "
                             f"{len(image_grids)} image and {len(video_grids)} video grid(s)")
        if video_grids and (video_timestamps is None or len(video_timestamps) != len(video_grids)):
            raise ValueError("video_timestamps (one list per video) are needed to expand video placeholders")
        if video_tokens_per_frame is not None and len(video_tokens_per_frame) != len(video_grids):
            raise ValueError(f"video_tokens_per_frame has {len(video_tokens_per_frame)} entries for "
                             f"{len(video_grids)} video(s)")
        if image_tokens is not None and len(image_tokens) != len(image_grids):
            raise ValueError(f"image_tokens has {len(image_tokens)} entries for {len(image_grids)} image(s)")
        image_repl = [self.image_placeholder(g) if image_tokens is None else IMAGE_TOKEN * int(image_tokens[i])
                      for i, g in enumerate(image_grids)]
        merge = self.video_processor.merge_size ** 2
        video_repl = []
        for i, ((t, h, w), stamps) in enumerate(zip(video_grids, video_timestamps or [])):
            counts = None if video_tokens_per_frame is None else video_tokens_per_frame[i]
            counts = [h * w // merge] * t if counts is None else counts
            video_repl.append(video_placeholder(stamps, counts))
        expanded = expand(texts, image_repl, video_repl)
        text_kwargs.setdefault("padding_side", self.padding_side)
        if text_kwargs["padding_side"] is None:
            text_kwargs["padding_side"] = self.padding_side
        ids, mask = tokenize(self.tokenizer, expanded, pad_token_id=self.pad_token_id,
                             truncation_side=self.truncation_side, model_max_length=self.model_max_length,
                             **text_kwargs)
        # As HF's `_check_special_mm_tokens`: truncation must not cut into a placeholder.
        for kind, token, token_id in (("image", IMAGE_TOKEN, self.image_token_id),
                                      ("video", VIDEO_TOKEN, self.video_token_id)):
            in_ids = [row.count(token_id) for row in ids]
            in_text = [t.count(token) for t in expanded]
            if in_ids != in_text:
                raise ValueError(f"Mismatch in `{kind}` token count between text and `input_ids`. Got ids={in_ids} "
                                 f"and text={in_text}. Likely due to `truncation='max_length'`. Please disable "
                                 "truncation or increase `max_length`.")
        data = {"input_ids": ids}
        if text_kwargs.get("return_attention_mask") is not False:
            data["attention_mask"] = mask
        if return_mm_token_type_ids:
            data["mm_token_type_ids"] = [
                np.where(np.asarray(row) == self.image_token_id, 1,
                         np.where(np.asarray(row) == self.video_token_id, 2, 0)).astype(np.int64).tolist()
                for row in ids]
        return self._to_tensors(data, return_tensors)

    @staticmethod
    def _to_tensors(data: dict[str, Any], return_tensors: str | None) -> dict[str, Any]:
        if return_tensors is None:
            return data
        if return_tensors not in ("np", "jax"):
            raise ValueError(f"return_tensors must be None, 'np' or 'jax', got {return_tensors!r}")
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if key in data and not isinstance(data[key], np.ndarray):
                if len({len(row) for row in data[key]}) > 1:
                    raise ValueError(
                        "prompts of different lengths cannot be stacked into a tensor; pass padding=True")
                data[key] = np.asarray(data[key], dtype=np.int64).reshape(len(data[key]), -1)
        if return_tensors == "jax":
            import jax.numpy as jnp

            for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                        "pixel_values_videos", "video_grid_thw"):
                if key in data:
                    data[key] = jnp.asarray(data[key])
        return data

    # -- chat template

    def apply_chat_template(self, messages, chat_template: str | None = None, tools=None, documents=None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = False, return_tensors: str | None = "auto", return_dict: bool = False,
                            processor_kwargs: dict[str, Any] | None = None, **kwargs):
        """Render `messages` (one conversation, or a list of them) with the checkpoint's template,
        as HF's `ProcessorMixin.apply_chat_template`.

        Keywords the template reads are template variables; every other keyword (and
        `processor_kwargs`) goes to `__call__` when `tokenize=True`, which also processes the image
        and video parts' payloads ("image" / "url" / "path", "video" / "url" / "path"; a list of
        frame files is one video) and returns the token ids, or the whole output with
        `return_dict=True`. `continue_final_message=True` leaves the last message open.
        """
        for key in ("return_assistant_tokens_mask", "sanitize_control_tokens", "load_audio_from_video"):
            if kwargs.pop(key, False):
                raise ValueError(f"{key} is not supported by this port")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, and "
                             "add_generation_prompt when you want to add a header that will prompt it to start a "
                             "new assistant message instead.")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this checkpoint has no chat template; pass chat_template=...")
        if chat_template is None:
            if self._template is None:
                self._template = chat._compile_chat_template(template)
            compiled = self._template
        else:
            compiled = chat._compile_chat_template(chat_template)
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts) in this port")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        conversations, batched = chat.normalize_conversations(messages)
        variables = {**self.special_tokens, **kwargs}
        prompts = [chat.render(compiled, template, conv, continue_final_message=continue_final_message,
                               tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                               **variables)
                   for conv in conversations]
        if not tokenize:
            return prompts if batched else prompts[0]
        # As HF: keywords the template does not read are the processor's.
        template_vars = chat.template_variables(template)
        call_kwargs = {k: v for k, v in kwargs.items() if k not in template_vars}
        call_kwargs.update(processor_kwargs or {})
        if "do_sample_frames" not in call_kwargs and (call_kwargs.get("fps") is not None
                                                      or call_kwargs.get("num_frames") is not None):
            call_kwargs["do_sample_frames"] = True
        if return_tensors != "auto":
            call_kwargs["return_tensors"] = return_tensors
        images, videos = chat.media_of(conversations)
        has_images = any(x is not None for conv in images for x in conv)
        has_videos = any(x is not None for conv in videos for x in conv)
        out = self(text=prompts, images=images if has_images else None, videos=videos if has_videos else None,
                   **call_kwargs)
        return out if return_dict else out["input_ids"]
