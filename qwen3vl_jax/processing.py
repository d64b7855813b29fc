"""Host-side processing for Qwen3-VL: images, videos, timestamps, prompt expansion, chat template.

Mirrors HF transformers' `Qwen3VLProcessor` (processing_qwen3_vl.py), `Qwen2VLImageProcessorPil`
(image_processing_pil_qwen2_vl.py) and `Qwen3VLVideoProcessor` (video_processing_qwen3_vl.py) with
numpy + PIL only (no torch at run time). Token ids, grids and timestamps are identical to HF's;
image pixels are bit-identical to HF's PIL image processor; video pixels (and images against HF's
torchvision-backed image processor) differ only by resampling noise, since HF resizes videos with
torchvision's antialiased bicubic while this module uses PIL's bicubic (same kernel; rounding in
the separable passes differs, mostly where one axis shrinks and the other grows: mean < 0.3 of a
uint8 level, max a few levels, see the tests).

Speed: rescale + normalize run as float32 arithmetic verified at start-up to give the same bits as
HF's op order for all 256 levels (else a per-level lookup table); uint8 pixels are rearranged into
patch order before conversion; images and temporal-patch chunks of a video run on a thread pool
(`num_threads`, default min(8, cores)); outputs are written in place.

Deliberate differences from HF: non-integer float pixel arrays are refused (HF round-trips them
through uint8 and rescales twice); 2-D arrays are grayscale images; a list of PIL frames can be
sampled; an empty image raises a ValueError (HF: ZeroDivisionError); `num_frames` alone needs no
`fps=None`.

Axis glossary (one letter per axis):
  P  flattened patches of all items, in (t, h-block, w-block, h-in-block, w-in-block) order
  D  patch vector C*T*p*p, ordered (channel, temporal, row, col)
  T  frames (videos) / temporal patch size
  H, W  pixel rows / columns;  C  channels (RGB)
  t, h, w  grid sizes in patches (grid_thw)

Output of `Qwen3VLProcessor.__call__` (same keys as HF's, plus `video_timestamps`):
  input_ids, attention_mask, mm_token_type_ids   [B, L] (0 text, 1 image, 2 video)
  pixel_values [P, D] float32, image_grid_thw [N_img, 3] int64
  pixel_values_videos [P, D] float32, video_grid_thw [N_vid, 3] int64
  video_timestamps: per video, the time in seconds of each temporal patch (the `<t.t seconds>` text)
  video_metadata: per video, a `VideoMetadata` (only with `return_metadata=True`, as in HF)

Research hook: `video_tokens_per_frame=[[n_0, ..., n_{t-1}], ...]` expands each video's placeholder
with caller-given per-frame token counts instead of h*w/merge^2 per frame (video pruning keeps
the per-frame timestamps and vision start/end markers; e.g. vLLM's EVS puts all retained tokens
in frame 0). `Qwen3VLProcessor.expand_and_tokenize` does the same from a first call's grids and
timestamps without touching pixels; `Qwen3VLProcessor.video_placeholder` builds one video's string.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from PIL import Image, ImageOps

__all__ = [
    "ImageProcessor",
    "Qwen3VLProcessor",
    "VideoMetadata",
    "VideoProcessor",
    "frame_timestamps",
    "load_image",
    "load_video",
    "sample_frame_indices",
    "smart_resize",
    "smart_resize_video",
]

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

# HF's hard limit on max(h, w) / min(h, w) in both smart_resize functions.
MAX_ASPECT_RATIO = 200

_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


# ----------------------------------------------------------------------------------------------
# Resizing rules (numerics mirror HF exactly: Python round/floor/ceil on floats)


def _check_aspect_ratio(height: float, width: float) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio} "
            f"(image of height {height} and width {width})"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width) of an image: multiples of `factor`, pixel count within [min, max].

    Mirrors `transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image is too small: height {height} and width {width} must be at least 1 pixel")
    _check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target per-frame (height, width) of a video; the pixel budget counts all frames.

    Mirrors `transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize`.
    """
    if num_frames < temporal_factor:
        raise ValueError(
            f"video is too short: {num_frames} frame(s) sampled, at least temporal_patch_size="
            f"{temporal_factor} are needed "
            f"(t:{num_frames} must be larger than temporal_factor:{temporal_factor})"
        )
    if height < 1 or width < 1:
        raise ValueError(f"video frames are too small: height {height} and width {width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    _check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(total_num_frames: int, video_fps: float | None, *, fps: float | None = None,
                         num_frames: int | None = None, min_frames: int = 4,
                         max_frames: int = 768) -> np.ndarray:
    """Indices of the frames to keep, as `Qwen3VLVideoProcessor.sample_frames` picks them.

    With `fps` (and no `num_frames`): int(duration * fps) frames clamped to [min_frames, max_frames]
    and to the video length; with `num_frames`: exactly that many; spread uniformly (rounded
    linspace over [0, total - 1]). A missing source fps counts as 24, as in HF.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
    if total_num_frames < 1:
        raise ValueError(f"video has no frames (total_num_frames={total_num_frames})")
    if num_frames is None and fps is not None:
        video_fps = 24 if video_fps is None else video_fps
        num_frames = int(total_num_frames / video_fps * fps)
        num_frames = min(max(num_frames, min_frames), max_frames, total_num_frames)
    if num_frames is None:
        num_frames = min(max(total_num_frames, min_frames), max_frames)
    return np.linspace(0, total_num_frames - 1, num_frames).round().astype(int)


def frame_timestamps(frames_indices: Sequence[int], video_fps: float,
                     temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch: mean time of its first and last frame.

    Mirrors `Qwen3VLProcessor._calculate_timestamps` (the index list is padded with its last entry
    to a multiple of `temporal_patch_size`, as the frames are).
    """
    indices = [int(i) for i in frames_indices]
    if len(indices) % temporal_patch_size:
        indices.extend([indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size))
    seconds = [i / video_fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


# ----------------------------------------------------------------------------------------------
# Loading and colour conversion (to uint8 HWC RGB)


@dataclass
class VideoMetadata:
    """What HF's `VideoMetadata` carries: source frame count and fps, and the sampled frame indices."""

    total_num_frames: int
    fps: float | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    video_backend: str | None = None
    frames_indices: list[int] | None = None

    @classmethod
    def coerce(cls, value: Any, total_num_frames: int | None = None) -> VideoMetadata:
        """A copy of `value` (a VideoMetadata, HF's VideoMetadata or a dict); a missing
        total_num_frames is taken from `total_num_frames`."""
        if isinstance(value, cls):
            return replace(value)
        if isinstance(value, dict) or hasattr(value, "keys"):
            names = {f.name for f in fields(cls)}
            kwargs = {k: value[k] for k in value if k in names}
            if kwargs.get("total_num_frames") is None:
                if total_num_frames is None:
                    raise ValueError("video metadata needs total_num_frames")
                kwargs["total_num_frames"] = total_num_frames
            if kwargs.get("frames_indices") is not None:
                kwargs["frames_indices"] = [int(i) for i in kwargs["frames_indices"]]
            return cls(**kwargs)
        raise TypeError(f"video metadata must be a dict or VideoMetadata, got {type(value).__name__}")


def _is_image_like(x: Any) -> bool:
    return isinstance(x, Image.Image) or (isinstance(x, np.ndarray) and x.ndim in (2, 3))


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    # As HF's convert_to_rgb: transparency is composited onto white.
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image).convert("RGB")
    elif image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image)


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return array
    if array.dtype == bool:
        raise ValueError("boolean arrays are not images")
    if np.issubdtype(array.dtype, np.integer) or np.allclose(array, np.round(array)):
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(f"pixel values must lie in [0, 255], got [{array.min()}, {array.max()}]")
        return array.astype(np.uint8)
    raise ValueError(
        "non-integer float pixel arrays are not supported (HF round-trips them through uint8 and "
        "rescales twice); "
        "pass uint8 arrays in [0, 255] or PIL images"
    )


def _channels_last(array: np.ndarray, num_channels: tuple[int, ...], data_format: str | None) -> np.ndarray:
    """Move channels last. Without `data_format`, infer as HF does (channels-first wins a tie)."""
    first, last = array.ndim - 3, array.ndim - 1
    if data_format is None:
        if array.shape[first] in num_channels:
            data_format = "channels_first"
        elif array.shape[last] in num_channels:
            data_format = "channels_last"
        else:
            raise ValueError(f"cannot infer the channel axis of an array of shape {array.shape}")
    if data_format == "channels_first":
        return np.moveaxis(array, first, last)
    if data_format != "channels_last":
        raise ValueError(
            f"input_data_format must be 'channels_first' or 'channels_last', got {data_format!r}")
    return array


def _array_to_rgb(array: np.ndarray, data_format: str | None, num_channels=(1, 3, 4)) -> np.ndarray:
    """Any (H, W), (H, W, C), (C, H, W) array (or stacks of them) -> uint8 (..., H, W, 3)."""
    if array.ndim == 2:
        array = array[..., None]
    else:
        array = _channels_last(array, num_channels, data_format)
    array = _to_uint8(array)
    c = array.shape[-1]
    if c == 1:
        return np.repeat(array, 3, axis=-1)
    if c == 4:  # composite onto white, rounding as HF's numpy convert_to_rgb does
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    if c != 3:
        raise ValueError(f"images must have 1, 3 or 4 channels, got {c}")
    return array


def load_image(image: Any, input_data_format: str | None = None) -> np.ndarray:
    """A PIL image, numpy array or path -> uint8 RGB array (H, W, 3)."""
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"image file not found: {path}")
        try:
            with Image.open(path) as opened:
                # As HF's load_image: upright by EXIF, then plain RGB conversion.
                return np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
        except (OSError, Image.UnidentifiedImageError, ValueError) as e:
            raise ValueError(f"could not read image file {path}: {e}") from e
    if isinstance(image, Image.Image):
        return _pil_to_rgb(image)
    if isinstance(image, np.ndarray):
        if image.ndim not in (2, 3):
            raise ValueError(f"an image array must have 2 or 3 dimensions, got shape {image.shape}")
        return _array_to_rgb(image, input_data_format)
    if hasattr(image, "__array__") and not isinstance(image, (list, tuple)):  # jax arrays and the like
        return load_image(np.asarray(image), input_data_format)
    raise TypeError(
        f"unsupported image type {type(image).__name__}: pass a PIL image, a numpy array or a path")


def load_video(path: str | os.PathLike, sample_fn=None) -> tuple[np.ndarray, VideoMetadata]:
    """Decode a video file with PyAV -> (uint8 frames (T, H, W, 3), metadata).

    `sample_fn(metadata) -> indices` picks the frames to keep (all if None); frames are decoded in
    order and the ones at those indices kept, as HF's `read_video_pyav` does.
    """
    import av

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video file not found: {path}")
    try:
        container = av.open(path)
    except av.FFmpegError as e:
        raise ValueError(f"could not read video file {path}: {e}") from e
    try:
        if not container.streams.video:
            raise ValueError(f"could not read video file {path}: it has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame/slice threads in the decoder; the decoded frames are the same
        total = int(stream.frames)
        rate = stream.average_rate
        if total <= 0:  # container without a frame count: count by decoding
            total = sum(1 for _ in container.decode(video=0))
            container.seek(0)
        video_fps = float(rate) if rate else None
        metadata = VideoMetadata(
            total_num_frames=total, fps=video_fps, width=stream.width, height=stream.height,
            duration=float(total / rate) if rate else 0.0, video_backend="pyav",
        )
        if total <= 0:
            raise ValueError(f"could not read video file {path}: no decodable frames")
        indices = np.arange(total) if sample_fn is None else np.asarray(sample_fn(metadata))
        wanted = {int(i) for i in indices}
        last = int(indices[-1])
        frames = []
        for i, frame in enumerate(container.decode(video=0)):
            if i > last:
                break
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
    except av.FFmpegError as e:
        raise ValueError(f"could not read video file {path}: {e}") from e
    finally:
        container.close()
    if len(frames) != len(wanted):
        raise ValueError(f"could not read video file {path}: it declares {total} frames but frame "
                         f"{max(wanted)} could not be decoded (truncated file?)")
    metadata.frames_indices = [int(i) for i in indices]
    return np.stack(frames), metadata


# ----------------------------------------------------------------------------------------------
# Pixel pipeline: resize (PIL) -> rescale + normalize (exact per-value lookup table) -> patchify


@dataclass(frozen=True)
class _PixelConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def lookup_table(self) -> np.ndarray:
        """float32 [3, 256]: the normalized value of each uint8 level, per channel.

        Computed with HF's exact op order and dtypes (rescale in float64 then cast to float32,
        normalize in float32), so the table lookup is bit-identical to HF's PIL pipeline.
        """
        return _lookup_table(self.do_rescale, self.rescale_factor, self.do_normalize,
                             self.image_mean, self.image_std)


_LUT_CACHE: dict[tuple, np.ndarray] = {}
_AFFINE_CACHE: dict[tuple, list | None] = {}


def _lookup_table(do_rescale, rescale_factor, do_normalize, mean, std) -> np.ndarray:
    key = (do_rescale, float(rescale_factor), do_normalize, tuple(mean), tuple(std))
    if key not in _LUT_CACHE:
        levels = np.arange(256, dtype=np.uint8)[None, :].repeat(3, axis=0)  # [C, 256]
        values = levels.astype(np.float32)
        if do_rescale:
            values = (levels.astype(np.float64) * rescale_factor).astype(np.float32)
        if do_normalize:
            m = np.broadcast_to(np.asarray(mean, dtype=np.float32), (3,))[:, None]
            s = np.broadcast_to(np.asarray(std, dtype=np.float32), (3,))[:, None]
            values = (values - m) / s
        _LUT_CACHE[key] = np.ascontiguousarray(values, dtype=np.float32)
    return _LUT_CACHE[key]


def _affine_path(config: _PixelConfig) -> list[tuple[np.float32, np.float32, np.float32]] | None:
    """Per channel (divisor, mean, std) such that float32 ((v / divisor) - mean) / std equals the
    lookup table for all 256 levels, or None if that arithmetic is not exact for this config.

    Three vectorized float32 passes are about twice as fast as a table gather, so they are used
    whenever they are verified to give the identical bits (they do for Qwen's 1/255, 0.5, 0.5).
    """
    key = (config.do_rescale, float(config.rescale_factor), config.do_normalize, config.image_mean,
           config.image_std)
    if key not in _AFFINE_CACHE:
        lut = config.lookup_table()
        levels = np.arange(256, dtype=np.float32)
        divisor = np.float32(1 / config.rescale_factor) if config.do_rescale else np.float32(1)
        means = np.broadcast_to(np.asarray(config.image_mean, np.float32), (3,))
        stds = np.broadcast_to(np.asarray(config.image_std, np.float32), (3,))
        if not config.do_normalize:
            means, stds = np.zeros(3, np.float32), np.ones(3, np.float32)
        params = [(divisor, means[c], stds[c]) for c in range(3)]
        exact = all(np.array_equal(((levels / d) - m) / sd, lut[c]) for c, (d, m, sd) in enumerate(params))
        _AFFINE_CACHE[key] = params if exact else None
    return _AFFINE_CACHE[key]


def _size_overrides(base: _PixelConfig, kwargs: dict[str, Any]) -> _PixelConfig:
    """Apply call-time overrides: size={'shortest_edge','longest_edge'}, min_pixels, max_pixels, ..."""
    updates = {}
    size = kwargs.get("size")
    if size is not None:
        if "shortest_edge" in size:
            updates["min_pixels"] = int(size["shortest_edge"])
        if "longest_edge" in size:
            updates["max_pixels"] = int(size["longest_edge"])
    for key in ("min_pixels", "max_pixels"):
        if kwargs.get(key) is not None:
            updates[key] = int(kwargs[key])
    for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample",
                "do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if kwargs.get(key) is not None:
            updates[key] = kwargs[key]
    for key in ("image_mean", "image_std"):
        if kwargs.get(key) is not None:
            value = kwargs[key]
            updates[key] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
    config = replace(base, **updates)
    if config.do_resize and (not config.min_pixels or not config.max_pixels):
        raise ValueError(f"size needs positive 'shortest_edge' and 'longest_edge', got "
                         f"min_pixels={config.min_pixels}, max_pixels={config.max_pixels}")
    return config


def _resize(frame: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (height, width, 3) with PIL, as HF's PIL backend resizes."""
    return np.asarray(Image.fromarray(frame).resize((width, height), resample=_RESAMPLE[int(resample)]))


def _patchify(frames: np.ndarray, config: _PixelConfig, out: np.ndarray | None = None):
    """uint8 (T, H, W, 3) -> float32 [t*h*w, C*T*p*p] patches (HF's order) and (t, h, w).

    T is a multiple of the temporal patch size, or 1 for an image (its frame then fills the whole
    temporal patch, as HF repeats it). The uint8 pixels are rearranged into patch order first (a
    quarter of the bytes of a float copy), then normalized straight into `out`
    [t, h/m, w/m, m, m, C, T, p, p] (allocated when not given), broadcasting an image over T.
    """
    tp, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    n, height, width, c = frames.shape
    gt, gh, gw = max(n // tp, 1), height // p, width // p
    src_t = tp if n > 1 else 1
    # (gt, T, bh, mh, ph, bw, mw, pw, C) -> (gt, bh, bw, mh, mw, C, T, ph, pw)
    pix = frames.reshape(gt, src_t, gh // m, m, p, gw // m, m, p, c).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    pix = np.ascontiguousarray(pix)
    if out is None:
        out = np.empty((gt, gh // m, gw // m, m, m, c, tp, p, p), dtype=np.float32)
    # An image is normalized once, then copied into each of the T slots.
    target = out if src_t == tp else np.empty(pix.shape, dtype=np.float32)
    affine = _affine_path(config)
    if affine is not None:
        shape = (1, 1, 1, 1, 1, c, 1, 1, 1)
        divisor = affine[0][0]
        means = np.array([a[1] for a in affine[:c]], dtype=np.float32).reshape(shape)
        stds = np.array([a[2] for a in affine[:c]], dtype=np.float32).reshape(shape)
        np.divide(pix, divisor, out=target, dtype=np.float32)
        np.subtract(target, means, out=target)
        np.divide(target, stds, out=target)
    else:
        lut = config.lookup_table()
        for ch in range(c):
            target[:, :, :, :, :, ch] = lut[ch][pix[:, :, :, :, :, ch]]
    if target is not out:
        out[...] = target
    return out.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def _map(fn, items: list, num_threads: int) -> list:
    """`list(map(fn, items))`, on a thread pool when it pays (PIL and numpy release the GIL)."""
    if num_threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(num_threads, len(items))) as pool:
        return list(pool.map(fn, items))


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class ImageProcessor:
    """Images -> `pixel_values` [P, C*T*p*p] and `image_grid_thw` [N, 3] (HF's Qwen2VLImageProcessorPil)."""

    def __init__(self, config: _PixelConfig):
        self.config = config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessor:
        # Defaults for absent keys are those of HF's Qwen2VLImageProcessor class.
        defaults = _PixelConfig(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                                image_mean=(0.48145466, 0.4578275, 0.40821073),
                                image_std=(0.26862954, 0.26130258, 0.27577711))
        return cls(_pixel_config_from_dict(d, defaults))

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    def target_size(self, height: int, width: int, **kwargs) -> tuple[int, int]:
        config = _size_overrides(self.config, kwargs)
        return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)

    def num_tokens(self, height: int, width: int, **kwargs) -> int:
        """Number of `<|image_pad|>` tokens for an image of this size."""
        config = _size_overrides(self.config, kwargs)
        h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        return (h // config.patch_size) * (w // config.patch_size) // config.merge_size ** 2

    def _target(self, rgb: np.ndarray, config: _PixelConfig) -> tuple[int, int]:
        height, width = rgb.shape[:2]
        if config.do_resize:
            return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        if height % config.factor or width % config.factor:
            raise ValueError(f"with do_resize=False the image size ({height}, {width}) must be a multiple of "
                             f"patch_size * merge_size = {config.factor}")
        return height, width

    def __call__(self, images: Any, input_data_format: str | None = None, num_threads: int | None = None,
                 **kwargs) -> dict[str, np.ndarray]:
        config = _size_overrides(self.config, kwargs)
        images = _flatten_images(images)
        if not images:
            raise ValueError("no images given")
        threads = _default_threads() if num_threads is None else num_threads
        rgbs = _map(lambda image: load_image(image, input_data_format), images, threads)
        targets = [self._target(rgb, config) for rgb in rgbs]  # all size checks before any work
        p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
        rows = [(h // p) * (w // p) for h, w in targets]
        offsets = np.concatenate([[0], np.cumsum(rows)]).astype(int)
        out = np.empty((offsets[-1], 3 * tp * p * p), dtype=np.float32)  # written in place, no concatenate

        def work(i):
            (h, w), rgb = targets[i], rgbs[i]
            if config.do_resize:  # HF resizes even at equal size (PIL then returns a copy)
                rgb = _resize(rgb, h, w, config.resample)
            rows_out = out[offsets[i]:offsets[i + 1]].reshape(1, h // p // m, w // p // m, m, m, 3, tp, p, p)
            # An image is one temporal patch: its frame repeated temporal_patch_size times.
            _patchify(rgb[None], config, out=rows_out)

        _map(work, list(range(len(images))), threads)
        grids = [(1, h // p, w // p) for h, w in targets]
        return {"pixel_values": out, "image_grid_thw": np.asarray(grids, dtype=np.int64)}


@dataclass(frozen=True)
class _VideoConfig:
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768


class VideoProcessor:
    """Videos -> `pixel_values_videos`, `video_grid_thw`, timestamps (HF's Qwen3VLVideoProcessor).

    A video is a frames array (T, H, W, C) (or (T, C, H, W)), a list of frames, or a file path
    (decoded with PyAV). Frames are sampled by fps (default from the config) or by `num_frames`,
    clamped to [min_frames, max_frames]; all sampled frames share one target size.
    """

    def __init__(self, config: _PixelConfig, video: _VideoConfig):
        self.config = config
        self.video = video

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoProcessor:
        # Defaults for absent keys are those of HF's Qwen3VLVideoProcessor class.
        defaults = _PixelConfig(patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                                image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
        video = _VideoConfig()
        video = replace(video, **{f.name: d[f.name] for f in fields(_VideoConfig)
                                  if f.name in d and d[f.name] is not None})
        return cls(_pixel_config_from_dict(d, defaults), video)

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    @property
    def temporal_patch_size(self) -> int:
        return self.config.temporal_patch_size

    def _sampler(self, video: _VideoConfig, fps, num_frames):
        def sample(metadata: VideoMetadata) -> np.ndarray:
            return sample_frame_indices(metadata.total_num_frames, metadata.fps, fps=fps,
                                        num_frames=num_frames,
                                        min_frames=video.min_frames, max_frames=video.max_frames)
        return sample

    def _decode(self, video: Any, metadata: Any, do_sample: bool, sampler, input_data_format):
        """-> uint8 (T, H, W, 3) sampled frames and their metadata (frames_indices set)."""
        if isinstance(video, (str, os.PathLike)):
            frames, meta = load_video(video, sampler if do_sample else None)
            if metadata is not None:  # a caller-given fps (e.g. a known frame rate) wins
                given = VideoMetadata.coerce(metadata, meta.total_num_frames)
                if given.fps is not None:
                    meta.fps = given.fps
            return frames, meta
        if isinstance(video, (list, tuple)):
            if not video:
                raise ValueError("a video given as a list of frames must have at least one frame")
            frames = np.stack([load_image(f, input_data_format) for f in video])
        else:
            frames = np.asarray(video)
            if frames.ndim != 4:
                raise ValueError(
                    f"a video array must have 4 dimensions (T, H, W, C), got shape {frames.shape}")
            frames = _array_to_rgb(frames, input_data_format, num_channels=(1, 3))
        total = len(frames)
        if metadata is None:
            meta = VideoMetadata(total_num_frames=total, fps=None, frames_indices=list(range(total)),
                                 height=frames.shape[1], width=frames.shape[2])
        else:
            meta = VideoMetadata.coerce(metadata, total)
            if meta.frames_indices is None:
                meta.frames_indices = list(range(total))
            elif not do_sample and len(meta.frames_indices) != total:
                raise ValueError(f"video metadata gives {len(meta.frames_indices)} frames_indices for "
                                 f"{total} frames")
        if do_sample:
            if meta.fps is None:
                meta.fps = 24  # HF's default when sampling by fps without a source fps
            indices = sampler(meta)
            if len(indices) and indices[-1] >= total:
                raise ValueError(
                    f"video metadata says {meta.total_num_frames} frames but the array has {total}")
            frames = frames[indices]
            meta.frames_indices = [int(i) for i in indices]
        return frames, meta

    def process_one(self, video: Any, metadata: Any = None, *, config: _PixelConfig | None = None,
                    video_config: _VideoConfig | None = None, fps=None, num_frames=None,
                    input_data_format: str | None = None, num_threads: int = 1):
        """One video -> (patches [t*h*w, D], (t, h, w), timestamps, metadata)."""
        config = config or self.config
        vc = video_config or self.video
        if num_frames is None and fps is None:
            fps, num_frames = vc.fps, vc.num_frames
            if num_frames is not None:
                fps = None
        frames, meta = self._decode(video, metadata, vc.do_sample_frames, self._sampler(vc, fps, num_frames),
                                    input_data_format)
        n, height, width = frames.shape[:3]
        h, w = height, width
        if config.do_resize:
            max_pixels = config.max_pixels
            if vc.cap_pixels_per_frame:  # HF's optional per-frame cap (qwen-vl-utils behaviour)
                frame_cap = vc.max_video_tokens * config.factor ** 2
                per_frame = max(min(frame_cap, config.max_pixels // n), int(config.min_pixels * 1.05))
                max_pixels = per_frame * n
            h, w = smart_resize_video(n, height, width, config.temporal_patch_size, config.factor,
                                      config.min_pixels, max_pixels)
        else:
            if height % config.factor or width % config.factor:
                raise ValueError(f"with do_resize=False the frame size ({height}, {width}) must be a "
                                 f"multiple of patch_size * merge_size = {config.factor}")
            if n < config.temporal_patch_size:
                raise ValueError(
                    f"video is too short: {n} frame(s), need at least {config.temporal_patch_size}")
        tp, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
        order = list(range(n)) + [n - 1] * (-n % tp)  # the last frame repeats to fill a patch, as in HF
        gt = len(order) // tp
        out = np.empty((gt, h // p // m, w // p // m, m, m, frames.shape[-1], tp, p, p), dtype=np.float32)

        def work(span):  # resize and patchify temporal patches [g0, g1) into their rows of `out`
            g0, g1 = span
            chunk = [frames[i] for i in order[g0 * tp:g1 * tp]]
            if config.do_resize:  # HF resizes even at equal size (PIL then returns the frame as is)
                chunk = [_resize(f, h, w, config.resample) for f in chunk]
            _patchify(np.stack(chunk), config, out=out[g0:g1])

        pieces = max(1, min(gt, 2 * num_threads))
        bounds = np.linspace(0, gt, pieces + 1).round().astype(int)
        _map(work, [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a], num_threads)
        patches = out.reshape(gt * (h // p) * (w // p), frames.shape[-1] * tp * p * p)
        grid = (gt, h // p, w // p)
        fps_for_time = 24 if meta.fps is None else meta.fps
        meta.fps = fps_for_time
        timestamps = frame_timestamps(meta.frames_indices, fps_for_time, config.temporal_patch_size)
        return patches, grid, timestamps, meta

    def __call__(self, videos: Any, video_metadata: Any = None, input_data_format: str | None = None,
                 fps: float | None = None, num_frames: int | None = None, num_threads: int | None = None,
                 **kwargs) -> dict[str, Any]:
        config = _size_overrides(self.config, kwargs)
        vc = replace(self.video, **{
            f.name: kwargs[f.name] for f in fields(_VideoConfig)
            if kwargs.get(f.name) is not None and f.name not in ("fps", "num_frames")})
        videos = _batch_videos(videos)
        if video_metadata is None:
            metas = [None] * len(videos)
        elif isinstance(video_metadata, (list, tuple)):
            metas = list(video_metadata)
        else:
            metas = [video_metadata]
        if len(metas) != len(videos):
            raise ValueError(
                f"got {len(videos)} videos but {len(metas)} video_metadata entries; pass one per video")
        threads = _default_threads() if num_threads is None else num_threads
        patches, grids, stamps, out_meta = [], [], [], []
        for video, meta in zip(videos, metas):
            x, grid, ts, m = self.process_one(video, meta, config=config, video_config=vc, fps=fps,
                                              num_frames=num_frames, input_data_format=input_data_format,
                                              num_threads=threads)
            patches.append(x)
            grids.append(grid)
            stamps.append(ts)
            out_meta.append(m)
        return {"pixel_values_videos": np.concatenate(patches, axis=0),
                "video_grid_thw": np.asarray(grids, dtype=np.int64),
                "video_timestamps": stamps, "video_metadata": out_meta}


def _pixel_config_from_dict(d: dict[str, Any], defaults: _PixelConfig) -> _PixelConfig:
    """Build from a preprocessor_config.json dict (HF's keys; min/max_pixels override size)."""
    keys = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample", "do_resize",
            "do_rescale", "do_normalize", "do_convert_rgb")
    kwargs = {k: d[k] for k in keys if d.get(k) is not None}
    for key in ("image_mean", "image_std"):
        if d.get(key) is not None:
            v = d[key]
            kwargs[key] = tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else (float(v),) * 3
    config = replace(defaults, **kwargs)
    return _size_overrides(config, {"size": d.get("size"), "min_pixels": d.get("min_pixels"),
                                    "max_pixels": d.get("max_pixels")})


def _flatten_images(images: Any) -> list[Any]:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        out = []
        for item in images:
            out.extend(_flatten_images(item))
        return out
    if isinstance(images, np.ndarray) and images.ndim == 4:  # a batch of images
        return list(images)
    return [images]


def _batch_videos(videos: Any) -> list[Any]:
    """One video or a list of videos -> a list of videos (a list of frames counts as one video)."""
    if isinstance(videos, (str, os.PathLike)):
        return [videos]
    if isinstance(videos, np.ndarray):
        if videos.ndim == 5:
            return list(videos)
        return [videos]
    if isinstance(videos, (list, tuple)):
        if not videos:
            return []
        if all(_is_image_like(v) for v in videos):  # frames of one video
            return [list(videos)]
        out = []
        for v in videos:
            out.extend(_batch_videos(v))
        return out
    return [videos]


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


def _compile_chat_template(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        from datetime import datetime
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


# ----------------------------------------------------------------------------------------------
# The processor


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
        from .pruning import retained_count, validate_video_pruning

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


_CALL_KEYS = {"video_metadata", "return_tensors", "padding", "padding_side", "return_metadata",
              "video_tokens_per_frame", "images_kwargs", "videos_kwargs", "fps", "num_frames",
              "do_sample_frames", "min_frames", "max_frames", "size", "min_pixels", "max_pixels",
              "input_data_format", "num_threads", "cap_pixels_per_frame", "max_video_tokens"}


def _drop_none(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                          for part in out["content"]]
    return out
