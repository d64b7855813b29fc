"""Media decoding: images and videos (PIL, arrays, torch tensors, frame lists, files) to uint8 RGB.

Every loader returns channels-last uint8 RGB, (H, W, 3) for an image and (T, H, W, 3) for a video,
converted as HF's `convert_to_rgb` / `load_image` / `read_video_pyav` do, so the pixel stages after it
see what HF's see.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from PIL import Image, ImageOps


def is_positive_int(value) -> bool:
    """A count given by the caller: an int or numpy integer >= 1 (a bool is not a count)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and bool(value >= 1)


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
            return replace(value).checked()
        if isinstance(value, dict) or hasattr(value, "keys"):
            names = {f.name for f in fields(cls)}
            kwargs = {k: value[k] for k in value if k in names}
            if kwargs.get("total_num_frames") is None:
                if total_num_frames is None:
                    raise ValueError("video metadata needs total_num_frames")
                kwargs["total_num_frames"] = total_num_frames
            if kwargs.get("frames_indices") is not None:
                kwargs["frames_indices"] = [int(i) for i in kwargs["frames_indices"]]
            return cls(**kwargs).checked()
        raise TypeError(f"video metadata must be a dict or VideoMetadata, got {type(value).__name__}")

    def checked(self) -> VideoMetadata:
        """Self, if its numbers can time frames: fps positive and finite (HF divides by it: 0 raises
        ZeroDivisionError there, NaN a cast error, and a negative fps gives negative timestamps)."""
        fps = self.fps
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float, np.number))
                                or not math.isfinite(fps) or fps <= 0):
            raise ValueError(f"fps must be a positive finite number of source frames per second, got {fps!r}")
        n = self.total_num_frames
        if not is_positive_int(n):
            raise ValueError(f"total_num_frames must be a positive integer, got {n!r}")
        return self


def _is_torch_tensor(x: Any) -> bool:
    """A `torch.Tensor` (or subclass), told by its type's name so that torch is never imported."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(x).__mro__)


def from_torch(x: Any) -> Any:
    """Torch tensors in `x` (a tensor, or lists / tuples of them) as numpy arrays, detached and on
    the host; a bfloat16 tensor (numpy has no bfloat16) as float32. Anything else is unchanged.

    HF's processors take torch images and videos; so do ours, with the same layouts: an image is
    (C, H, W) or (H, W, C), a video (T, C, H, W) or (T, H, W, C), a batch one more axis in front.
    """
    if _is_torch_tensor(x):
        tensor = x.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    if isinstance(x, (list, tuple)) and any(_is_torch_tensor(i) or isinstance(i, (list, tuple)) for i in x):
        return [from_torch(i) for i in x]
    return x


def _is_image_like(x: Any) -> bool:
    return isinstance(x, Image.Image) or (isinstance(x, np.ndarray) and x.ndim in (2, 3))


# PIL modes holding more than 8 bits per pixel (16-bit PNGs open as "I;16" or "I").
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _wide_to_8bit(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image as 8-bit ("L"), each level v -> round(v * 255 / 65535).

    PIL's own convert("RGB") clips these at 255, so a 16-bit PNG comes out nearly white (HF's
    loaders do exactly that); scaling keeps the picture, and equals the 8-bit export of the image.
    """
    if image.mode not in _WIDE_MODES:
        return image
    levels = np.asarray(image, dtype=np.float64)
    if levels.size and (levels.min() < 0 or levels.max() > 65535):
        raise ValueError(f"a {image.mode} image with values outside the 16-bit range [0, 65535] "
                         f"([{levels.min():g}, {levels.max():g}]) has no known scale")
    return Image.fromarray(np.round(levels * (255 / 65535)).astype(np.uint8), mode="L")


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    image = _wide_to_8bit(image)
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
    if array.dtype == np.uint16:  # a 16-bit image: scaled to 8 bits as a 16-bit PNG is (see _wide_to_8bit)
        return np.round(array * (255 / 65535)).astype(np.uint8)
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


def array_to_rgb(array: np.ndarray, data_format: str | None, num_channels=(1, 3, 4)) -> np.ndarray:
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
    """A PIL image, numpy array, torch tensor or path -> uint8 RGB array (H, W, 3)."""
    image = from_torch(image)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"image file not found: {path}")
        try:
            with Image.open(path) as opened:
                # As HF's load_image: upright by EXIF, then plain RGB conversion.
                return np.asarray(_wide_to_8bit(ImageOps.exif_transpose(opened)).convert("RGB"))
        except (OSError, Image.UnidentifiedImageError, ValueError) as e:
            raise ValueError(f"could not read image file {path}: {e}") from e
    if isinstance(image, Image.Image):
        return _pil_to_rgb(image)
    if isinstance(image, np.ndarray):
        if image.ndim not in (2, 3):
            raise ValueError(f"an image array must have 2 or 3 dimensions, got shape {image.shape}")
        return array_to_rgb(image, input_data_format)
    if hasattr(image, "__array__") and not isinstance(image, (list, tuple)):  # jax arrays and the like
        return load_image(np.asarray(image), input_data_format)
    raise TypeError(f"unsupported image type {type(image).__name__}: pass a PIL image, a numpy array, "
                    "a torch tensor or a path")


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



def flatten_images(images: Any) -> list[Any]:
    images = from_torch(images)
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        out = []
        for item in images:
            out.extend(flatten_images(item))
        return out
    if isinstance(images, np.ndarray) and images.ndim == 4:  # a batch of images
        return list(images)
    return [images]


def is_video(x: Any) -> bool:
    """A 4-D array, or a non-empty list of frames (PIL images or 2-/3-D arrays): HF's `is_valid_video`."""
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_image_like(f) for f in x)
    return isinstance(x, np.ndarray) and x.ndim == 4


def batch_videos(videos: Any) -> list[Any]:
    """The list of videos in `videos`, nested as HF's `make_batched_videos` reads it.

    A video is a file path, a 4-D array, a list of frames, or a list of frame image paths. A flat
    list of paths is several video files; one of frame image paths is a video only one level
    deeper than a list of videos (`[[[a.png, b.png]]]`, what the chat template collects per
    conversation: HF's early exit). A 5-D array is a batch. Torch tensors count as arrays.
    """
    videos = from_torch(videos)
    try:  # HF's early exit: a nested list of image paths is a batch of frame-path videos
        if isinstance(videos[0][0], (list, tuple)) and isinstance(videos[0][0][0], (str, os.PathLike)):
            return [list(paths) for sublist in videos for paths in sublist]
    except (IndexError, TypeError, KeyError):
        pass
    if isinstance(videos, (str, os.PathLike)) or is_video(videos):
        return [list(videos) if isinstance(videos, (list, tuple)) else videos]
    if isinstance(videos, np.ndarray):
        if videos.ndim == 5:
            return list(videos)
        raise ValueError(f"a video array must have 4 dimensions (T, H, W, C), got shape {videos.shape}")
    if _is_image_like(videos):
        raise ValueError("a single image is not a video: pass a list of frames or a (T, H, W, C) array")
    if not isinstance(videos, (list, tuple)):
        raise TypeError(f"unsupported video type {type(videos).__name__}: pass a (T, H, W, C) array, a list of "
                        "frames or a file path")
    out = []
    for item in videos:
        if isinstance(item, (str, os.PathLike)) or is_video(item):
            out.append(list(item) if isinstance(item, (list, tuple)) else item)
        elif isinstance(item, (list, tuple)) and item:
            out.extend(batch_videos(item))
        elif isinstance(item, np.ndarray):
            raise ValueError(f"a video array must have 4 dimensions (T, H, W, C), got shape {item.shape}")
        elif not isinstance(item, (list, tuple)):
            raise TypeError(f"unsupported video type {type(item).__name__}")
    return out
