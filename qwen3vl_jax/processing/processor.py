"""`Qwen3VLProcessor`: text + images + videos -> model inputs, as HF's `Qwen3VLProcessor`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .chat import _CALL_KEYS, _compile_chat_template, _drop_none
from .image import ImageProcessor
from .media import _batch_videos, _flatten_images
from .prompt import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, _load_tokenizer, _token_str
from .video import VideoProcessor


class Qwen3VLProcessor:
    """Text + images + videos -> model inputs, with HF `Qwen3VLProcessor`'s values.

    >>> processor = Qwen3VLProcessor.from_pretrained(checkpoint_dir)
    >>> prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    >>> inputs = processor(text=prompt, images=[image], videos=[frames],
    ...                    video_metadata=[{"fps": 30, "total_num_frames": len(frames)}], return_tensors="np")
    """

    def __init__(self, tokenizer, image_processor: ImageProcessor, video_processor: VideoProcessor,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 padding_side: str = "right"):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.padding_side = padding_side
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

        def read_json(name):
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return None
            with open(file) as f:
                return json.load(f)

        tok_config = read_json("tokenizer_config.json") or {}
        image_dict = read_json("preprocessor_config.json")
        if image_dict is None:
            raise FileNotFoundError(f"no preprocessor_config.json in {path}")
        video_dict = read_json("video_preprocessor_config.json")
        if video_dict is None:  # older checkpoints keep the video settings with the image ones
            video_dict = dict(image_dict)
        image_dict = {**image_dict, **(images_kwargs or {})}
        video_dict = {**video_dict, **(videos_kwargs or {})}

        chat_template = None
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                chat_template = f.read()
        elif (ct := read_json("chat_template.json")) is not None:
            chat_template = ct.get("chat_template")
        elif isinstance(tok_config.get("chat_template"), str):
            chat_template = tok_config["chat_template"]

        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = _token_str(tok_config.get(key))
            if value is not None:
                special[key] = value
        if tok_config.get("tokenizer_class", "Qwen2Tokenizer").startswith("Qwen2Tokenizer"):
            # Qwen2Tokenizer's defaults for keys absent from tokenizer_config.json
            special.setdefault("eos_token", "<|endoftext|>")
            special.setdefault("pad_token", "<|endoftext|>")
        return cls(
            tokenizer=_load_tokenizer(path, tok_config),
            image_processor=ImageProcessor.from_dict(image_dict),
            video_processor=VideoProcessor.from_dict(video_dict),
            chat_template=chat_template,
            special_tokens=special,
            padding_side=tok_config.get("padding_side", "right"),
        )

    # -- prompt expansion

    def image_placeholder(self, grid_thw: Sequence[int]) -> str:
        t, h, w = (int(x) for x in grid_thw)
        return self.image_token * (t * h * w // self.image_processor.merge_size ** 2)

    def video_placeholder(self, timestamps: Sequence[float], tokens_per_frame: Sequence[int]) -> str:
        """`<t.t seconds><|vision_start|>` + pads + `<|vision_end|>` per temporal patch.

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

    def _expand(self, texts: list[str], image_repl: list[str], video_repl: list[str]) -> list[str]:
        """Replace the i-th image / video pad token across the batch with the i-th expansion."""
        pattern = re.compile(re.escape(IMAGE_TOKEN) + "|" + re.escape(VIDEO_TOKEN))
        images, videos = iter(image_repl), iter(video_repl)

        def sub(match):
            return next(images) if match.group() == IMAGE_TOKEN else next(videos)

        return [pattern.sub(sub, text) for text in texts]

    # -- tokenization

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def _pad(self, ids: list[list[int]], padding, padding_side: str | None):
        side = padding_side or self.padding_side
        longest = max((len(x) for x in ids), default=0)
        if padding in (False, None, "do_not_pad") or all(len(x) == longest for x in ids):
            return ids, [[1] * len(x) for x in ids]
        if padding not in (True, "longest"):
            raise ValueError(f"padding must be True, 'longest' or False, got {padding!r}")
        if self.pad_token_id is None:
            raise ValueError("padding needs a pad token, and the tokenizer config names none")
        padded, mask = [], []
        for x in ids:
            n = longest - len(x)
            if side == "left":
                padded.append([self.pad_token_id] * n + x)
                mask.append([0] * n + [1] * len(x))
            else:
                padded.append(x + [self.pad_token_id] * n)
                mask.append([1] * len(x) + [0] * n)
        return padded, mask

    # -- the call

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Any = None,
        videos: Any = None,
        *,
        video_metadata: Any = None,
        return_tensors: str | None = None,
        padding: bool | str = False,
        padding_side: str | None = None,
        return_metadata: bool = False,
        video_tokens_per_frame: Sequence[Sequence[int] | None] | None = None,
        video_pruning: tuple[str, float] | None = None,
        images_kwargs: dict[str, Any] | None = None,
        videos_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ) -> dict[str, Any]:
        """Process a prompt (or a batch) with its images and videos, in order of their pad tokens.

        Args:
          text: prompt(s) holding one `<|image_pad|>` per image and one `<|video_pad|>` per video
            (as the chat template writes them, each inside `<|vision_start|> ... <|vision_end|>`).
          images: PIL images, numpy arrays (H, W, C) or paths, flat across the batch.
          videos: frames arrays (T, H, W, C), lists of frames, or video file paths.
          video_metadata: per video, {"fps": source fps, "total_num_frames": ..., "frames_indices": ...}
            (or a VideoMetadata); without it an array's fps counts as 24, as in HF.
          return_tensors: "np" for int64 / float32 arrays, "jax" for jax arrays, None for lists.
          padding: True / "longest" to pad a batch of prompts (with the pad token, on `padding_side`).
          video_tokens_per_frame: per video, None (the full count) or one token count per temporal patch.
          video_pruning: `(method, rate)` ("evs" or "vidcom2", rate in [0, 1), 0 = off): size each video's
            placeholder for the tokens the method keeps, all in frame 0 (vLLM's layout); the model, given
            the same option, moves each kept token to its own frame after encoding.
          images_kwargs / videos_kwargs / other keywords: call-time settings; `size`, `min_pixels`,
            `max_pixels` (and other pixel settings) apply to both images and videos, `fps`,
            `num_frames`, `do_sample_frames`, `min_frames`, `max_frames` to videos.
        """
        video_keys = {"fps", "num_frames", "do_sample_frames", "min_frames", "max_frames",
                      "cap_pixels_per_frame", "max_video_tokens"}
        pixel_keys = {"size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                      "rescale_factor", "resample", "do_resize", "do_rescale", "do_normalize",
                      "do_convert_rgb", "image_mean", "image_std", "input_data_format", "num_threads"}
        unknown = set(kwargs) - video_keys - pixel_keys
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {sorted(unknown)}")
        img_kw = {k: v for k, v in kwargs.items() if k in pixel_keys}
        img_kw.update(images_kwargs or {})
        vid_kw = dict(kwargs)
        vid_kw.update(videos_kwargs or {})

        if text is None and images is None and videos is None:
            raise ValueError("nothing to process: pass text, images or videos")
        if return_tensors not in (None, "np", "jax"):
            raise ValueError(f"return_tensors must be None, 'np' or 'jax', got {return_tensors!r}")
        texts = None
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("`text` must be a string or a list of strings")

        image_list = _flatten_images(images)
        video_list = _batch_videos(videos) if videos is not None else []
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
            out = self.video_processor(video_list, video_metadata=video_metadata, **vid_kw)
            data["pixel_values_videos"] = out["pixel_values_videos"]
            data["video_grid_thw"] = out["video_grid_thw"]
            data["video_timestamps"] = out["video_timestamps"]
            if return_metadata:
                data["video_metadata"] = out["video_metadata"]
        if video_pruning is not None and video_list:
            if video_tokens_per_frame is not None:
                raise ValueError("pass video_pruning or video_tokens_per_frame, not both")
            video_tokens_per_frame = self.pruned_tokens_per_frame(data["video_grid_thw"], video_pruning)
        if texts is not None:
            data.update(self.expand_and_tokenize(
                texts, image_grid_thw=data.get("image_grid_thw"), video_grid_thw=data.get("video_grid_thw"),
                video_timestamps=data.get("video_timestamps"), video_tokens_per_frame=video_tokens_per_frame,
                padding=padding, padding_side=padding_side))
        return self._to_tensors(data, return_tensors)

    def pruned_tokens_per_frame(self, video_grid_thw, video_pruning) -> list[list[int] | None]:
        """Per video, `[K, 0, ..., 0]` under `video_pruning=(method, rate)`, or None (full) when off."""
        from ..pruning import retained_count, validate_video_pruning

        spec = validate_video_pruning(*video_pruning)
        if spec is None:
            return [None] * len(video_grid_thw)
        merge = self.video_processor.merge_size ** 2
        counts = []
        for t, h, w in video_grid_thw:
            keep = retained_count(spec[0], int(h) * int(w) // merge, int(t), spec[1])
            counts.append([keep] + [0] * (int(t) - 1))
        return counts

    def expand_and_tokenize(self, text: str | Sequence[str], image_grid_thw=None, video_grid_thw=None,
                            video_timestamps=None, video_tokens_per_frame=None, padding: bool | str = False,
                            padding_side: str | None = None,
                            return_tensors: str | None = None) -> dict[str, Any]:
        """The text half of `__call__`: expand the pad tokens for the given grids and tokenize.

        This is the pruning hook without re-processing any pixels: after the vision encoder and a
        pruning method have decided how many tokens each temporal patch keeps, call it with the
        first call's grids and timestamps and `video_tokens_per_frame=[[n_0, ..., n_{t-1}], ...]`
        (None for a video keeps its full count) to get the prompt the language model sees.
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
        image_repl = [self.image_placeholder(g) for g in image_grids]
        merge = self.video_processor.merge_size ** 2
        video_repl = []
        for i, ((t, h, w), stamps) in enumerate(zip(video_grids, video_timestamps or [])):
            counts = None if video_tokens_per_frame is None else video_tokens_per_frame[i]
            counts = [h * w // merge] * t if counts is None else counts
            video_repl.append(self.video_placeholder(stamps, counts))
        ids = self.encode(self._expand(texts, image_repl, video_repl))
        ids, mask = self._pad(ids, padding, padding_side)
        types = []
        for row in ids:
            row = np.asarray(row, dtype=np.int64)
            kind = np.where(row == self.image_token_id, 1, np.where(row == self.video_token_id, 2, 0))
            types.append(kind.tolist())
        data = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types}
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

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False,
                            chat_template: str | None = None, **kwargs):
        """Render `messages` (one conversation, or a list of them) with the checkpoint's template.

        With `tokenize=True`, the image and video parts' payloads ("image" / "url" / "path" keys of
        image parts; "video" / "url" / "path" of video parts) are processed too and the processor's
        output dict is returned; other keywords go to `__call__` (e.g. return_tensors, fps).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this checkpoint has no chat template; pass chat_template=...")
        batched = (isinstance(messages, (list, tuple)) and bool(messages)
                   and isinstance(messages[0], (list, tuple)))
        conversations = list(messages) if batched else [messages]
        if chat_template is None:
            if self._template is None:
                self._template = _compile_chat_template(template)
            compiled = self._template
        else:
            compiled = _compile_chat_template(chat_template)
        template_vars = {k: v for k, v in kwargs.items() if k not in _CALL_KEYS}
        call_kwargs = {k: v for k, v in kwargs.items() if k in _CALL_KEYS}
        prompts = []
        for conv in conversations:
            conv = [_drop_none(m) for m in conv]
            prompts.append(compiled.render(messages=conv, add_generation_prompt=add_generation_prompt,
                                           **{**self.special_tokens, **template_vars}))
        if not tokenize:
            return prompts if batched else prompts[0]
        images, videos = [], []
        for conv in conversations:
            for message in conv:
                content = message.get("content")
                if not isinstance(content, (list, tuple)):
                    continue
                for part in content:
                    kind = part.get("type")
                    if kind == "image":
                        images.extend(part[k] for k in ("image", "url", "path") if k in part)
                    elif kind == "video":
                        videos.extend(part[k] for k in ("video", "url", "path") if k in part)
        return self(text=prompts, images=images or None, videos=videos or None, **call_kwargs)

