"""Images: smart_resize, the pixel pipeline (resize, rescale + normalize, patchify) and `ImageProcessor`.

Mirrors HF's `Qwen2VLImageProcessorPil` (image_processing_pil_qwen2_vl.py): pixels are bit-identical
to it. Speed: rescale + normalize run as float32 arithmetic verified at start-up to give the same
bits as HF's op order for all 256 levels (else a per-level lookup table); uint8 pixels are
rearranged into patch order before conversion; images run on a thread pool (`num_threads`, default
min(8, cores)); outputs are written in place.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from .media import flatten_images, load_image

# HF's hard limit on max(h, w) / min(h, w) in both smart_resize functions.
MAX_ASPECT_RATIO = 200

_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


# ----------------------------------------------------------------------------------------------
# Resizing rules (numerics mirror HF exactly: Python round/floor/ceil on floats)


def check_aspect_ratio(height: float, width: float) -> None:
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
    check_aspect_ratio(height, width)
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



# ----------------------------------------------------------------------------------------------
# Pixel pipeline: resize (PIL) -> rescale + normalize (exact per-value lookup table) -> patchify


@dataclass(frozen=True)
class PixelConfig:
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


def _affine_path(config: PixelConfig) -> list[tuple[np.float32, np.float32, np.float32]] | None:
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


# Keywords HF's image processor takes (`ImagesKwargs` + `Qwen2VLImageProcessorKwargs`), plus ours
# (`num_threads`). Those this port does not implement are accepted only at their "off" value.
IMAGE_KEYS = frozenset({
    "do_convert_rgb", "do_resize", "size", "default_to_square", "crop_size", "resample", "do_rescale",
    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_pad", "pad_size", "do_center_crop",
    "data_format", "input_data_format", "device", "return_tensors", "disable_grouping", "image_seq_length",
    "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "num_threads",
})
# Keys with no effect on the Qwen pixels (placement, grouping, output container).
_NO_EFFECT_KEYS = frozenset({"device", "disable_grouping", "data_format", "return_tensors", "image_seq_length",
                             "default_to_square", "return_metadata", "video_metadata"})
_UNSUPPORTED_KEYS = frozenset({"do_pad", "pad_size", "do_center_crop", "crop_size"})


def size_overrides(base: PixelConfig, kwargs: dict[str, Any], *, from_config: bool = False) -> PixelConfig:
    """Apply call-time overrides: size={'shortest_edge','longest_edge'}, min_pixels, max_pixels, ...

    As HF: a call-time `size` replaces the configured one whole, so it needs both edges when the
    images are resized (HF raises the same ValueError); `min_pixels` / `max_pixels` then override
    one edge each. (A config file's partial `size` keeps the class default for the missing edge.)
    """
    for key in _UNSUPPORTED_KEYS:
        if kwargs.get(key):
            raise ValueError(f"{key}={kwargs[key]!r} is not supported by this port (Qwen3-VL resizes, never "
                             "pads or crops)")
    updates = {}
    size = kwargs.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise ValueError(f"size must be a dict with 'shortest_edge' and 'longest_edge', got {size!r}")
        unknown = set(size) - {"shortest_edge", "longest_edge"}
        if unknown and not from_config:
            raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size} "
                             f"(the keys {sorted(unknown)} are not read)")
        for key, field in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if size.get(key) is not None:
                updates[field] = int(size[key])
            elif not from_config:
                updates[field] = None
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
        given = size if size is not None else {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels}
        raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {given} "
                         "(positive pixel counts)")
    return config


def resize_frame(frame: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (height, width, 3) with PIL, as HF's PIL backend resizes."""
    return np.asarray(Image.fromarray(frame).resize((width, height), resample=_RESAMPLE[int(resample)]))


def patchify(frames: np.ndarray, config: PixelConfig, out: np.ndarray | None = None):
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


def map_threads(fn, items: list, num_threads: int) -> list:
    """`list(map(fn, items))`, on a thread pool when it pays (PIL and numpy release the GIL)."""
    if num_threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(num_threads, len(items))) as pool:
        return list(pool.map(fn, items))


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class ImageProcessor:
    """Images -> `pixel_values` [P, C*T*p*p] and `image_grid_thw` [N, 3] (HF's Qwen2VLImageProcessorPil)."""

    def __init__(self, config: PixelConfig):
        self.config = config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessor:
        # Defaults for absent keys are those of HF's Qwen2VLImageProcessor class.
        defaults = PixelConfig(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                                image_mean=(0.48145466, 0.4578275, 0.40821073),
                                image_std=(0.26862954, 0.26130258, 0.27577711))
        return cls(pixel_config_from_dict(d, defaults))

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    def target_size(self, height: int, width: int, **kwargs) -> tuple[int, int]:
        config = size_overrides(self.config, kwargs)
        return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)

    def num_tokens(self, height: int, width: int, **kwargs) -> int:
        """Number of `<|image_pad|>` tokens for an image of this size."""
        config = size_overrides(self.config, kwargs)
        h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        return (h // config.patch_size) * (w // config.patch_size) // config.merge_size ** 2

    def _target(self, rgb: np.ndarray, config: PixelConfig) -> tuple[int, int]:
        height, width = rgb.shape[:2]
        if config.do_resize:
            return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        if height % config.factor or width % config.factor:
            raise ValueError(f"with do_resize=False the image size ({height}, {width}) must be a multiple of "
                             f"patch_size * merge_size = {config.factor}")
        return height, width

    def __call__(self, images: Any, input_data_format: str | None = None, num_threads: int | None = None,
                 **kwargs) -> dict[str, np.ndarray]:
        """Keywords as HF's Qwen2-VL image processor takes them (`IMAGE_KEYS`)."""
        unknown = set(kwargs) - IMAGE_KEYS
        if unknown:
            raise TypeError(f"unexpected image processor keyword argument(s): {sorted(unknown)}")
        config = size_overrides(self.config, kwargs)
        images = flatten_images(images)
        if not images:
            raise ValueError("no images given")
        threads = default_threads() if num_threads is None else num_threads
        rgbs = map_threads(lambda image: load_image(image, input_data_format), images, threads)
        targets = [self._target(rgb, config) for rgb in rgbs]  # all size checks before any work
        p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
        rows = [(h // p) * (w // p) for h, w in targets]
        offsets = np.concatenate([[0], np.cumsum(rows)]).astype(int)
        out = np.empty((offsets[-1], 3 * tp * p * p), dtype=np.float32)  # written in place, no concatenate

        def work(i):
            (h, w), rgb = targets[i], rgbs[i]
            if config.do_resize:  # HF resizes even at equal size (PIL then returns a copy)
                rgb = resize_frame(rgb, h, w, config.resample)
            rows_out = out[offsets[i]:offsets[i + 1]].reshape(1, h // p // m, w // p // m, m, m, 3, tp, p, p)
            # An image is one temporal patch: its frame repeated temporal_patch_size times.
            patchify(rgb[None], config, out=rows_out)

        map_threads(work, list(range(len(images))), threads)
        grids = [(1, h // p, w // p) for h, w in targets]
        return {"pixel_values": out, "image_grid_thw": np.asarray(grids, dtype=np.int64)}



def pixel_config_from_dict(d: dict[str, Any], defaults: PixelConfig) -> PixelConfig:
    """Build from a preprocessor_config.json dict (HF's keys; min/max_pixels override size)."""
    keys = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample", "do_resize",
            "do_rescale", "do_normalize", "do_convert_rgb")
    kwargs = {k: d[k] for k in keys if d.get(k) is not None}
    for key in ("image_mean", "image_std"):
        if d.get(key) is not None:
            v = d[key]
            kwargs[key] = tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else (float(v),) * 3
    config = replace(defaults, **kwargs)
    return size_overrides(config, {"size": d.get("size"), "min_pixels": d.get("min_pixels"),
                                    "max_pixels": d.get("max_pixels")}, from_config=True)

