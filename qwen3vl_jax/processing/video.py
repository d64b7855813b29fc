"""Videos: frame sampling, timestamps, smart_resize for videos and `VideoProcessor`.

Mirrors HF's `Qwen3VLVideoProcessor` (video_processing_qwen3_vl.py) and the processor's
`_calculate_timestamps`. HF resizes videos with torchvision's antialiased bicubic, this module with
PIL's bicubic (same kernel; rounding in the separable passes differs, see tests/test_processing.py).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .image import (check_aspect_ratio, default_threads, map_threads, patchify, PixelConfig, pixel_config_from_dict,
                    resize_frame, size_overrides)
from .media import (VideoMetadata, array_to_rgb, batch_videos, is_video, is_positive_int, load_image,
                    load_video)

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
    check_aspect_ratio(height, width)
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



# Keywords HF's video processor takes (`VideosKwargs` + `Qwen3VLVideoProcessorInitKwargs`), plus ours
# (`num_threads`).
VIDEO_KEYS = frozenset({
    "do_convert_rgb", "do_resize", "size", "default_to_square", "resample", "do_rescale", "rescale_factor",
    "do_normalize", "image_mean", "image_std", "do_center_crop", "do_pad", "crop_size", "data_format",
    "input_data_format", "device", "do_sample_frames", "video_metadata", "fps", "num_frames", "return_metadata",
    "return_tensors", "patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames",
    "cap_pixels_per_frame", "max_video_tokens", "num_threads",
})


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

    def __init__(self, config: PixelConfig, video: _VideoConfig):
        self.config = config
        self.video = video

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoProcessor:
        # Defaults for absent keys are those of HF's Qwen3VLVideoProcessor class.
        defaults = PixelConfig(patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                                image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
        video = _VideoConfig()
        video = replace(video, **{f.name: d[f.name] for f in fields(_VideoConfig)
                                  if f.name in d and d[f.name] is not None})
        return cls(pixel_config_from_dict(d, defaults), video)

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
            if do_sample and any(isinstance(f, (str, os.PathLike)) for f in video):
                raise ValueError("Sampling frames from a list of images is not supported! Set "
                                 "`do_sample_frames=False`. (HF's refusal, for a video given as frame files)")
            frames = [load_image(f, input_data_format) for f in video]
            if len({f.shape for f in frames}) > 1:
                raise ValueError(f"the frames of a video must share one size, got {sorted({f.shape for f in frames})}")
            frames = np.stack(frames)
        else:
            frames = np.asarray(video)
            if frames.ndim != 4:
                raise ValueError(
                    f"a video array must have 4 dimensions (T, H, W, C), got shape {frames.shape}")
            frames = array_to_rgb(frames, input_data_format, num_channels=(1, 3))
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

    def process_one(self, video: Any, metadata: Any = None, *, config: PixelConfig | None = None,
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
                chunk = [resize_frame(f, h, w, config.resample) for f in chunk]
            patchify(np.stack(chunk), config, out=out[g0:g1])

        pieces = max(1, min(gt, 2 * num_threads))
        bounds = np.linspace(0, gt, pieces + 1).round().astype(int)
        map_threads(work, [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a], num_threads)
        patches = out.reshape(gt * (h // p) * (w // p), frames.shape[-1] * tp * p * p)
        grid = (gt, h // p, w // p)
        fps_for_time = 24 if meta.fps is None else meta.fps
        meta.fps = fps_for_time
        timestamps = frame_timestamps(meta.frames_indices, fps_for_time, config.temporal_patch_size)
        return patches, grid, timestamps, meta

    def __call__(self, videos: Any, video_metadata: Any = None, input_data_format: str | None = None,
                 fps: float | None = None, num_frames: int | None = None, num_threads: int | None = None,
                 **kwargs) -> dict[str, Any]:
        """Keywords as HF's `Qwen3VLVideoProcessor` takes them (`VIDEO_KEYS`). As in HF 5.x,
        `min_frames` and `max_frames` are the processor's own (its config, or
        `from_pretrained(videos_kwargs=...)`): given at call time they are accepted and have no effect.
        `max_video_tokens` (the per-frame cap under `cap_pixels_per_frame`) is honoured at call time,
        as in HF >= 5.25."""
        unknown = set(kwargs) - VIDEO_KEYS
        if unknown:
            raise TypeError(f"unexpected video processor keyword argument(s): {sorted(unknown)}")
        config = size_overrides(self.config, kwargs)
        vc = replace(self.video, **{k: kwargs[k] for k in ("do_sample_frames", "cap_pixels_per_frame",
                                                           "max_video_tokens")
                                    if kwargs.get(k) is not None})
        if not is_positive_int(vc.max_video_tokens):
            raise ValueError(f"max_video_tokens must be a positive int, got {vc.max_video_tokens!r}")
        if isinstance(videos, (list, tuple)) and videos and not is_video(videos) and all(
                isinstance(v, (str, os.PathLike, list, tuple)) or is_video(v) for v in videos):
            videos = list(videos)  # one entry per video already (what the processor passes)
        else:
            videos = batch_videos(videos)
        if video_metadata is None:
            metas = [None] * len(videos)
        elif isinstance(video_metadata, (list, tuple)):
            metas = list(video_metadata)
            if metas and isinstance(metas[0], (list, tuple)):  # nested per prompt, as HF's tests pass it
                metas = [m for group in metas for m in group]
        else:
            metas = [video_metadata]
        if len(metas) != len(videos):
            raise ValueError(
                f"got {len(videos)} videos but {len(metas)} video_metadata entries; pass one per video")
        for i, meta in enumerate(metas):
            if meta is not None:
                try:
                    VideoMetadata.coerce(meta, 1)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"video_metadata[{i}]: {e}") from e
        threads = default_threads() if num_threads is None else num_threads
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

