"""Parity of qwen3vl_jax.processing with HF's Qwen3VLProcessor on the tiny checkpoint.

Token ids, attention masks, mm_token_type_ids, grids and timestamps must be identical to HF's.
Image pixels must be bit-identical to HF's PIL image processor (`Qwen2VLImageProcessorPil`); against
HF's torchvision-backed image and video processors (what `AutoProcessor` loads) they may differ by
resampling noise only (PIL bicubic vs torchvision antialiased bicubic, both on uint8): the bounds
below are in normalized units (one uint8 level = 2/255 ~ 0.0078 with mean = std = 0.5).
"""

from __future__ import annotations

import os
import warnings
from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

from qwen3vl_jax.processing import (
    Qwen3VLProcessor,
    frame_timestamps,
    load_video,
    sample_frame_indices,
    smart_resize,
)
from qwen3vl_jax.testing import make_tiny_checkpoint

# The HF reference needs torch and torchvision (the test extra); PyAV is a runtime dependency. A
# missing one is an error here, never a skipped parity test.
import av  # noqa: E402
import torch  # noqa: E402, F401
import torchvision  # noqa: E402, F401

LEVEL = 2 / 255  # one uint8 step after rescale (1/255) and normalize (std 0.5)
# Resampling noise bound vs the torchvision-backed processors. torchvision's antialiased bicubic
# on uint8 follows Pillow's algorithm (a = -0.5 kernel, support scaled when shrinking), and both
# resample in two separable passes through a rounded uint8 intermediate; where they differ is in
# rounding, and most where one axis shrinks while the other grows (e.g. 2000x11 -> 1024x32,
# 40x56 -> 32x64), which neither pass order of Pillow reproduces. Measured on these test images
# (`pytest -s` prints each case): same-direction resizes mean < 0.01 level, max <= 2 levels;
# mixed-direction ones mean up to 0.28 level, max 5 levels.
TV_MEAN_BOUND, TV_MAX_BOUND = 0.4 * LEVEL, 6 * LEVEL

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"

warnings.filterwarnings("ignore", message=".*cap_pixels_per_frame.*")


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("proc") / "tiny")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def hf_pil(ckpt):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    return Qwen3VLProcessor.from_pretrained(ckpt)


def rand_image(h, w, seed=0, mode="RGB"):
    """A smooth-plus-noise image (resampling of pure noise would exaggerate the differences)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([127 + 100 * np.sin(x / 7.0 + c) * np.cos(y / 5.0 - c) for c in range(3)], -1)
    arr = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr)
    return img.convert(mode) if mode != "RGB" else img


def rand_video(t, h, w, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    frames = []
    for i in range(t):
        base = np.stack([127 + 100 * np.sin((x + 3 * i) / 6.0 + c) * np.cos(y / 4.0) for c in range(3)], -1)
        frames.append(np.clip(base + rng.normal(0, 15, (h, w, 3)), 0, 255))
    return np.stack(frames).astype(np.uint8)


def assert_same_text(a, b):
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def pixel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    d = np.abs(a - b)
    return float(d.mean()), float(d.max())


def assert_resampling_noise(a, b, what):
    """Assert (and print, for `pytest -s`) the pixel difference to a torchvision-backed processor."""
    mean, mx = pixel_diff(a, b)
    mean_bound, max_bound = TV_MEAN_BOUND, TV_MAX_BOUND
    print(f"pixel diff vs torchvision, {what}: mean {mean:.2e} ({mean / LEVEL:.4f} level), "
          f"max {mx:.2e} ({mx / LEVEL:.2f} levels)")
    assert mean <= mean_bound and mx <= max_bound + 1e-6, (
        f"{what}: mean |diff| {mean:.2e} (bound {mean_bound:.2e}), max {mx:.2e} (bound {max_bound:.2e})")
    return mean, mx


def hf_timestamps(hf, out):
    return [hf._calculate_timestamps(list(m.frames_indices), m.fps, hf.video_processor.temporal_patch_size)
            for m in out["video_metadata"]]


# ----------------------------------------------------------------------------------------------
# tokenizer and images


def test_tokenizer_matches_hf(hf, ours):
    texts = [
        "Hello, world!  How are   you?\n\nI'm fine 12345 ...",
        "ünïcödé 東京 😀 don't   \t tabs  ",
        "<|im_start|>user\nDescribe.<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces<|endoftext|>x<0.5 seconds><|vision_start|><|vision_end|>",
        "",
    ]
    for text in texts:
        assert ours.encode([text])[0] == hf.tokenizer(text)["input_ids"], text
    ids = hf.tokenizer(texts[0])["input_ids"]
    assert ours.decode(ids) == hf.tokenizer.decode(ids, skip_special_tokens=True)


IMAGE_SIZES = [
    (1, 1),        # very small: up-scaled to the min pixel budget
    (5, 1),
    (17, 23),
    (64, 64),
    (97, 203),
    (600, 900),    # larger than max_pixels (512 * 512): down-scaled
    (10, 1000),    # aspect ratio 100
    (4, 800),      # aspect ratio 200: the largest HF allows
    (2000, 11),    # tall, ratio ~182
]


@pytest.mark.parametrize("hw", IMAGE_SIZES, ids=[f"{h}x{w}" for h, w in IMAGE_SIZES])
def test_image_parity(hf, hf_pil, ours, hw):
    h, w = hw
    image = rand_image(h, w, seed=h * 7 + w)
    text = f"<|im_start|>user\nLook: {IMG} ok<|im_end|>\n"
    a = hf(text=text, images=[image], return_tensors="np")
    b = ours(text=text, images=[image], return_tensors="np")
    assert_same_text(a, b)
    np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])
    assert b["pixel_values"].dtype == np.float32
    # bit-identical to HF's PIL image processor
    p = hf_pil(images=[image], return_tensors="np")
    np.testing.assert_array_equal(p["image_grid_thw"], b["image_grid_thw"])
    np.testing.assert_array_equal(p["pixel_values"], b["pixel_values"])
    # the grid follows smart_resize
    rh, rw = smart_resize(h, w, 32, 32 * 32 * 4, 32 * 32 * 256)
    assert b["image_grid_thw"].tolist() == [[1, rh // 16, rw // 16]]
    # resampling noise against the torchvision-backed one
    assert_resampling_noise(a["pixel_values"], b["pixel_values"], f"image {h}x{w}")


def test_image_input_kinds(hf_pil, ours, tmp_path):
    """PIL (RGB, RGBA, L, P), numpy HWC / CHW / 2-D arrays and file paths give HF's PIL values."""
    base = rand_image(45, 70, seed=3)
    rgba = base.convert("RGBA")
    alpha = np.array(rgba)
    alpha[..., 3] = np.linspace(0, 255, 70, dtype=np.uint8)[None, :]
    rgba = Image.fromarray(alpha, "RGBA")
    path = tmp_path / "img.png"
    base.save(path)
    inputs = [base, rgba, base.convert("L"), base.convert("P"), np.array(base),
              np.array(base).transpose(2, 0, 1), np.array(base).astype(np.float32), np.array(base)[..., :1]]
    for image in inputs:
        p = hf_pil(images=[image], return_tensors="np")
        b = ours.image_processor([image])
        np.testing.assert_array_equal(p["image_grid_thw"], b["image_grid_thw"])
        np.testing.assert_array_equal(p["pixel_values"], b["pixel_values"])
    # a 2-D array (HF refuses it) is a grayscale image
    gray = hf_pil(images=[base.convert("L")], return_tensors="np")
    np.testing.assert_array_equal(ours.image_processor([np.array(base.convert("L"))])["pixel_values"],
                                  gray["pixel_values"])
    # a path is read like HF's load_image (EXIF-upright, RGB)
    p = hf_pil(images=[base], return_tensors="np")
    b = ours.image_processor([str(path)])
    np.testing.assert_array_equal(p["pixel_values"], b["pixel_values"])


def test_several_images_and_batch(hf, hf_pil, ours):
    sizes = [(40, 40), (300, 120), (33, 500), (700, 700)]
    images = [rand_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    texts = [f"<|im_start|>user\n{IMG} and {IMG}: which?<|im_end|>\n",
             f"{IMG}{IMG} x"]
    a = hf(text=texts, images=images, return_tensors="np", padding=True)
    b = ours(text=texts, images=images, return_tensors="np", padding=True)
    assert_same_text(a, b)
    np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])
    np.testing.assert_array_equal(hf_pil(images=images, return_tensors="np")["pixel_values"],
                                  b["pixel_values"])
    assert_resampling_noise(a["pixel_values"], b["pixel_values"], "several images")
    # the image tokens are typed 1, and their count per image is t*h*w / merge^2
    assert (b["mm_token_type_ids"] == 1).sum() == int(b["image_grid_thw"].prod(-1).sum()) // 4
    # left padding as well; and without padding a ragged batch cannot become a tensor
    a = hf(text=texts, images=images, return_tensors="np", padding=True, padding_side="left")
    b = ours(text=texts, images=images, return_tensors="np", padding=True, padding_side="left")
    assert_same_text(a, b)
    with pytest.raises(ValueError, match="padding"):
        ours(text=texts, images=images, return_tensors="np")
    # lists without return_tensors, as HF
    a = hf(text=texts, images=images)
    b = ours(text=texts, images=images)
    assert a["input_ids"] == b["input_ids"] and a["mm_token_type_ids"] == b["mm_token_type_ids"]


def test_min_max_pixel_overrides(hf, hf_pil, ours, tmp_path):
    image = rand_image(300, 420, seed=5)
    text = f"{IMG} hi"
    video = rand_video(6, 90, 120, seed=5)
    vtext = f"{VID} hi"
    for size in [{"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
                 {"shortest_edge": 256 * 256, "longest_edge": 1024 * 1024}]:
        a = hf(text=text, images=[image], images_kwargs={"size": size}, return_tensors="np")
        b = ours(text=text, images=[image], images_kwargs={"size": size}, return_tensors="np")
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])
        p = hf_pil(images=[image], size=size, return_tensors="np")
        np.testing.assert_array_equal(p["pixel_values"], b["pixel_values"])
        # top-level size: applies to images and videos, as in HF
        a = hf(text=vtext, videos=[video], size=size, return_tensors="np")
        b = ours(text=vtext, videos=[video], size=size, return_tensors="np")
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
    # overrides in the checkpoint's preprocessor configs
    small = make_tiny_checkpoint(tmp_path / "small",
                                 image_size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96},
                                 video_size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 8})
    from transformers import AutoProcessor

    hf_small, ours_small = AutoProcessor.from_pretrained(small), Qwen3VLProcessor.from_pretrained(small)
    text = f"{IMG}{VID}"
    a = hf_small(text=text, images=[image], videos=[video], return_tensors="np")
    b = ours_small(text=text, images=[image], videos=[video], return_tensors="np")
    assert_same_text(a, b)
    for key in ("image_grid_thw", "video_grid_thw"):
        np.testing.assert_array_equal(a[key], b[key])
    assert b["image_grid_thw"].prod() <= 96 * 96 // 256
    # and min/max overrides at from_pretrained time
    o = Qwen3VLProcessor.from_pretrained(small, images_kwargs={"min_pixels": 64 * 64, "max_pixels": 64 * 64})
    rh, rw = smart_resize(300, 420, 32, 64 * 64, 64 * 64)
    assert o(images=[image])["image_grid_thw"].tolist() == [[1, rh // 16, rw // 16]]
    hf_o = AutoProcessor.from_pretrained(small, min_pixels=64 * 64, max_pixels=64 * 64)
    np.testing.assert_array_equal(hf_o.image_processor(images=[image], return_tensors="np")["image_grid_thw"],
                                  o(images=[image])["image_grid_thw"])


def test_config_defaults_match_hf(tmp_path):
    """Keys missing from the preprocessor configs take HF's class defaults (patch 14 and CLIP
    mean/std for the image processor; patch 16, mean/std 0.5 for the video processor)."""
    import json

    from transformers import AutoProcessor

    path = make_tiny_checkpoint(tmp_path / "bare")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        with open(os.path.join(path, name)) as f:
            config = json.load(f)
        for key in ("size", "patch_size", "image_mean", "image_std", "fps", "min_frames", "max_frames"):
            config.pop(key, None)
        with open(os.path.join(path, name), "w") as f:
            json.dump(config, f)
    hf_bare, ours_bare = AutoProcessor.from_pretrained(path), Qwen3VLProcessor.from_pretrained(path)
    image, video = rand_image(150, 260, seed=8), rand_video(9, 70, 90, seed=8)
    meta = [{"fps": 5.0, "total_num_frames": 9}]
    a = hf_bare(text=f"{IMG}{VID}", images=[image], videos=[video], video_metadata=meta, return_tensors="np")
    b = ours_bare(text=f"{IMG}{VID}", images=[image], videos=[video], video_metadata=meta,
                  return_tensors="np")
    assert_same_text(a, b)
    for key in ("image_grid_thw", "video_grid_thw"):
        np.testing.assert_array_equal(a[key], b[key])
    assert b["pixel_values"].shape[-1] == 3 * 2 * 14 * 14
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pil_bare = Qwen2VLImageProcessorPil.from_pretrained(path)
    # CLIP mean/std: still bit-identical
    np.testing.assert_array_equal(pil_bare(images=[image], return_tensors="np")["pixel_values"],
                                  b["pixel_values"])
    assert_resampling_noise(a["pixel_values"], b["pixel_values"], "default-config image")
    assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], "default-config video")


# ----------------------------------------------------------------------------------------------
# videos


VIDEO_CASES = [
    # frames, source fps (None: no metadata), height, width
    (2, None, 40, 56),      # the fewest frames that make a temporal patch
    (7, 30.0, 33, 47),      # odd count, few frames: min_frames=4 from 7
    (37, 10.0, 50, 70),     # odd count, 7 sampled (odd): last frame repeated
    (65, 24.0, 24, 100),    # frames smaller than a 32-pixel factor
    (9, 2.5, 60, 45),
    (30, 29.97, 96, 128),
]


@pytest.mark.parametrize("case", VIDEO_CASES, ids=[f"{c[0]}f@{c[1]}" for c in VIDEO_CASES])
def test_video_array_parity(hf, ours, case):
    t, fps, h, w = case
    video = rand_video(t, h, w, seed=t)
    meta = None if fps is None else [{"fps": fps, "total_num_frames": t}]
    text = f"<|im_start|>user\n{VID} what happens?<|im_end|>\n"
    a = hf(text=text, videos=[video], video_metadata=meta, return_tensors="np", return_metadata=True)
    b = ours(text=text, videos=[video], video_metadata=meta, return_tensors="np", return_metadata=True)
    assert_same_text(a, b)
    np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
    assert list(a["video_metadata"][0].frames_indices) == b["video_metadata"][0].frames_indices
    assert b["video_timestamps"] == hf_timestamps(hf, a)
    assert b["pixel_values_videos"].dtype == np.float32
    assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], f"video {case}")
    # the prompt holds one "<t.t seconds>" per temporal patch
    decoded = ours.decode(b["input_ids"][0], skip_special_tokens=False)
    for ts in b["video_timestamps"][0]:
        assert f"<{ts:.1f} seconds><|vision_start|>" in decoded
    assert (b["mm_token_type_ids"] == 2).sum() == int(b["video_grid_thw"].prod()) // 4


def test_video_sampling_options(hf, ours):
    video = rand_video(21, 40, 40, seed=1)
    text = f"{VID}"
    meta = [{"fps": 7.0, "total_num_frames": 21}]
    cases = [{"num_frames": 5, "fps": None}, {"fps": 1.0}, {"fps": 6.0}, {"do_sample_frames": False}]
    for kw in cases:
        # HF needs frames_indices in the metadata when it does not sample
        hf_meta = [{**meta[0], "frames_indices": list(range(21))}] if "do_sample_frames" in kw else meta
        a = hf(text=text, videos=[video], video_metadata=hf_meta, return_tensors="np", return_metadata=True,
               **kw)
        ours_kw = {k: v for k, v in kw.items() if v is not None}
        b = ours(text=text, videos=[video], video_metadata=meta, return_tensors="np", return_metadata=True,
                 **ours_kw)
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
        assert b["video_timestamps"] == hf_timestamps(hf, a), kw
    # HF's optional per-frame pixel cap (qwen-vl-utils' budget rule)
    long_video = rand_video(40, 120, 160, seed=3)
    long_meta = [{"fps": 4.0, "total_num_frames": 40}]
    grids = {}
    for cap in (True, False):  # this budget's per-frame floor (1.05 * shortest_edge) binds with the cap
        kw = {"cap_pixels_per_frame": cap, "size": {"shortest_edge": 96 * 96, "longest_edge": 64 * 64 * 20}}
        a = hf(text=text, videos=[long_video], video_metadata=long_meta, return_tensors="np", **kw)
        b = ours(text=text, videos=[long_video], video_metadata=long_meta, return_tensors="np", **kw)
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
        grids[cap] = b["video_grid_thw"].tolist()
    assert grids[True] != grids[False]
    # pre-sampled frames with their source indices and fps (no sampling): timestamps from the indices
    meta_pre = [{"fps": 25.0, "total_num_frames": 500, "frames_indices": [0, 50, 100, 150, 200, 250, 300]}]
    clip = video[:7]
    a = hf(text=text, videos=[clip], video_metadata=meta_pre, do_sample_frames=False, return_tensors="np",
           return_metadata=True)
    b = ours(text=text, videos=[clip], video_metadata=meta_pre, do_sample_frames=False, return_tensors="np")
    assert_same_text(a, b)
    assert b["video_timestamps"] == hf_timestamps(hf, a) == [[1.0, 5.0, 9.0, 12.0]]
    # two videos (and an image) in one prompt
    frames = rand_video(6, 36, 52, seed=2)
    image = rand_image(50, 50)
    text = f"{VID} then {IMG} then {VID}"
    metas = [{"fps": 7.0, "total_num_frames": 21}, {"fps": 3.0, "total_num_frames": 6}]
    a = hf(text=text, images=[image], videos=[video, frames], video_metadata=metas, return_tensors="np")
    b = ours(text=text, images=[image], videos=[video, frames], video_metadata=metas, return_tensors="np")
    # a video given as a list of PIL frames (HF cannot sample those) is the same as the array
    c = ours(text=text, images=[image], videos=[video, [Image.fromarray(f) for f in frames]],
             video_metadata=metas, return_tensors="np")
    np.testing.assert_array_equal(b["pixel_values_videos"], c["pixel_values_videos"])
    assert_same_text(b, c)
    assert_same_text(a, b)
    np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
    assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], "two videos")


def test_return_tensors_jax_and_lists(ours):
    import jax.numpy as jnp
    out = ours(text=f"{IMG} x", images=[rand_image(40, 40)], return_tensors="jax")
    assert isinstance(out["input_ids"], jnp.ndarray) and isinstance(out["pixel_values"], jnp.ndarray)
    assert out["input_ids"].shape == out["mm_token_type_ids"].shape
    out = ours(text=f"{IMG} x", images=[rand_image(40, 40)])
    assert isinstance(out["input_ids"], list) and isinstance(out["pixel_values"], np.ndarray)


def test_normalize_fast_path_is_the_lookup_table(ours, monkeypatch):
    """The float32 arithmetic path gives the same bits as the per-level table (HF's op order)."""
    from qwen3vl_jax import processing

    images = [rand_image(70, 90, seed=1)]
    video = rand_video(5, 40, 60, seed=1)
    fast_i = ours.image_processor(images)["pixel_values"]
    fast_v = ours.video_processor([video])["pixel_values_videos"]
    assert processing.image._affine_path(ours.image_processor.config) is not None
    monkeypatch.setattr(processing.image, "_affine_path", lambda config: None)
    np.testing.assert_array_equal(fast_i, ours.image_processor(images)["pixel_values"])
    np.testing.assert_array_equal(fast_v, ours.video_processor([video])["pixel_values_videos"])
    # threads do not change anything either
    threaded = ours.image_processor(images * 3, num_threads=3)["pixel_values"]
    np.testing.assert_array_equal(fast_i, threaded[:len(fast_i)])
    np.testing.assert_array_equal(fast_v, ours.video_processor([video], num_threads=1)["pixel_values_videos"])


def test_sampling_and_timestamp_helpers():
    assert sample_frame_indices(100, 25.0, fps=2, min_frames=4, max_frames=768).tolist() == \
        np.linspace(0, 99, 8).round().astype(int).tolist()
    assert len(sample_frame_indices(3, 30.0, fps=2)) == 3          # never more than the video has
    assert len(sample_frame_indices(10_000, 1.0, fps=2, max_frames=64)) == 64
    assert frame_timestamps([0, 6, 12], 10.0, 2) == [0.3, 1.2]     # last index repeated to fill a patch
    with pytest.raises(ValueError, match="mutually exclusive"):
        sample_frame_indices(10, 1.0, fps=2, num_frames=4)


def write_video(path, frames, fps, codec="mpeg4"):
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize("n,fps", [(23, 12), (40, 30)])
def test_video_file_parity(hf, ours, tmp_path, n, fps):
    """A real mp4 written with PyAV: HF decodes it with its PyAV reader (its default reader,
    torchcodec, is not installed here), then samples; we take the path."""
    from transformers.video_utils import load_video as hf_load_video

    path = tmp_path / f"clip_{n}.mp4"
    write_video(path, rand_video(n, 48, 64, seed=n), fps)
    hf_frames, hf_meta = hf_load_video(str(path), backend="pyav")
    our_frames, our_meta = load_video(path)
    np.testing.assert_array_equal(hf_frames, our_frames)
    assert (our_meta.total_num_frames, our_meta.fps) == (hf_meta.total_num_frames, hf_meta.fps)

    text = f"<|im_start|>user\n{VID} describe<|im_end|>\n"
    meta = [{"fps": hf_meta.fps, "total_num_frames": hf_meta.total_num_frames}]
    a = hf(text=text, videos=[hf_frames], video_metadata=meta, return_tensors="np", return_metadata=True)
    b = ours(text=text, videos=[str(path)], return_tensors="np", return_metadata=True)
    assert_same_text(a, b)
    np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
    assert b["video_timestamps"] == hf_timestamps(hf, a)
    assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], f"video file {n}@{fps}")


def test_video_file_without_frame_count(ours, tmp_path):
    """A Matroska file declares no frame count (HF's PyAV reader then sees 0 frames): we count by
    decoding. A truncated file is refused with a clear error."""
    path = tmp_path / "clip.mkv"
    write_video(path, rand_video(11, 32, 48), 5, codec="ffv1")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    frames, meta = load_video(path)
    np.testing.assert_array_equal(frames, decoded)
    assert (meta.total_num_frames, meta.fps) == (11, 5.0)
    out = ours(text=VID, videos=[str(path)], return_metadata=True)
    assert out["video_metadata"][0].frames_indices == np.linspace(0, 10, 4).round().astype(int).tolist()
    full = tmp_path / "full.mp4"
    write_video(full, rand_video(30, 48, 64), 10)
    data = full.read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="could not read video file"):
        ours(text=VID, videos=[str(tmp_path / "cut.mp4")])


# ----------------------------------------------------------------------------------------------
# chat template


def test_chat_template(hf, ours, tmp_path):
    image = rand_image(64, 96, seed=9)
    video = rand_video(8, 40, 40, seed=9)
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [
            {"type": "image", "image": image},
            {"type": "text", "text": "What is this? And this:"},
            {"type": "video", "video": video},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "A fox."}]},
        {"role": "user", "content": [{"type": "text", "text": "Again"}, {"type": "image", "image": image}]},
    ]
    for gen in (False, True):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    # batched conversations render one prompt each
    assert ours.apply_chat_template([messages, messages[:1]]) == hf.apply_chat_template(
        [messages, messages[:1]], tokenize=False)
    # tokenize=True processes the parts' payloads, as HF does
    a = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                               return_tensors="np")
    b = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                 return_tensors="np")
    assert_same_text(a, b)
    for key in ("image_grid_thw", "video_grid_thw"):
        np.testing.assert_array_equal(a[key], b[key])
    assert_resampling_noise(a["pixel_values"], b["pixel_values"], "chat image")
    # a rendered prompt through __call__ gives the same as tokenize=True
    prompt = ours.apply_chat_template(messages, add_generation_prompt=True)
    c = ours(text=prompt, images=[image, image], videos=[video], return_tensors="np")
    assert_same_text(b, c)


def test_chat_template_jinja_features(hf, ours):
    """A richer template (namespaces, counters, template variables, tojson, loop controls,
    whitespace control, raise_exception) renders as HF renders it."""
    template = (
        "{% set counts = namespace(image=0, video=0) %}"
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for message in messages %}\n"
        "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
        "<|im_start|>{{ message['role'] }}\n"
        "  {%- if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{% set counts.image = counts.image + 1 %}"
        "{% if add_vision_id %}Picture {{ counts.image }}: {% endif %}"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif part['type'] == 'video' %}{% set counts.video = counts.video + 1 %}"
        "{% if add_vision_id %}Video {{ counts.video }}: {% endif %}"
        "<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% if loop.last %}{% break %}{% endif %}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{{ eos_token | length }}{% endif %}"
    )
    image = rand_image(40, 40)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "  one  "},
                                     {"type": "image", "image": image}, {"type": "video", "video": "x.mp4"}]},
    ]
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {"x": "ünï"}}}]
    for kwargs in ({}, {"add_vision_id": True}, {"tools": tools, "add_generation_prompt": True}):
        assert ours.apply_chat_template(messages, chat_template=template, **kwargs) == hf.apply_chat_template(
            messages, chat_template=template, tokenize=False, **kwargs), kwargs
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="unknown role"):
        ours.apply_chat_template([{"role": "robot", "content": "hi"}], chat_template=template)


# ----------------------------------------------------------------------------------------------
# the pruning hook


def test_video_tokens_per_frame_hook(ours):
    video = rand_video(12, 64, 64, seed=4)
    meta = [{"fps": 4.0, "total_num_frames": 12}]
    text = f"<|im_start|>user\n{VID} hm<|im_end|>\n"
    full = ours(text=text, videos=[video], video_metadata=meta, return_tensors="np")
    t, h, w = full["video_grid_thw"][0].tolist()
    per_frame = h * w // 4
    # the full counts reproduce the default expansion
    same = ours(text=text, videos=[video], video_metadata=meta, return_tensors="np",
                video_tokens_per_frame=[[per_frame] * t])
    assert_same_text(full, same)
    # vLLM-style EVS layout: all retained tokens in frame 0, timestamps and markers kept per frame
    kept = (t * per_frame) // 3
    pruned = ours(text=text, videos=[video], video_metadata=meta, return_tensors="np",
                  video_tokens_per_frame=[[kept] + [0] * (t - 1)])
    ids = pruned["input_ids"][0]
    assert (ids == ours.video_token_id).sum() == kept
    assert (pruned["mm_token_type_ids"][0] == 2).sum() == kept
    assert (ids == ours.vision_start_token_id).sum() == t  # one per frame, no outer wrapper
    expected = text.replace(VID, ours.video_placeholder(full["video_timestamps"][0],
                                                                    [kept] + [0] * (t - 1)))
    assert ids.tolist() == ours.encode([expected])[0]
    # pixels are not touched by the hook
    np.testing.assert_array_equal(full["pixel_values_videos"], pruned["pixel_values_videos"])
    # the text-only hook (no pixel work) gives the same, from the first call's grids and timestamps
    again = ours.expand_and_tokenize(text, video_grid_thw=full["video_grid_thw"],
                                     video_timestamps=full["video_timestamps"],
                                     video_tokens_per_frame=[[kept] + [0] * (t - 1)], return_tensors="np")
    assert_same_text(pruned, again)
    unpruned = ours.expand_and_tokenize(text, video_grid_thw=full["video_grid_thw"],
                                        video_timestamps=full["video_timestamps"], return_tensors="np")
    assert_same_text(full, unpruned)
    with pytest.raises(ValueError, match="video_timestamps"):
        ours.expand_and_tokenize(text, video_grid_thw=full["video_grid_thw"])
    with pytest.raises(ValueError, match="one count per temporal patch"):
        ours(text=text, videos=[video], video_metadata=meta, video_tokens_per_frame=[[1, 2]])
    with pytest.raises(ValueError, match="non-negative"):
        ours(text=text, videos=[video], video_metadata=meta, video_tokens_per_frame=[[-1] * t])


# ----------------------------------------------------------------------------------------------
# refusals


def test_errors_match_hf(hf, ours, tmp_path):
    # aspect ratio above HF's limit of 200 (images and video frames)
    for image in (rand_image(3, 700), rand_image(1, 201)):
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            hf(text=IMG, images=[image])
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            ours(text=IMG, images=[image])
    video = np.zeros((4, 2, 500, 3), np.uint8)
    for proc in (hf, ours):
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            proc(text=VID, videos=[video])
    # too small: a video with fewer frames than a temporal patch (HF: "t:1 must be larger ...")
    for proc in (hf, ours):
        with pytest.raises(ValueError, match="must be larger than temporal_factor"):
            proc(text=VID, videos=[np.zeros((1, 64, 64, 3), np.uint8)])
    # too small: an empty image (HF fails with a ZeroDivisionError; we say what is wrong)
    with pytest.raises(ZeroDivisionError):
        hf(text=IMG, images=[np.zeros((0, 0, 3), np.uint8)])
    with pytest.raises(ValueError, match="too small"):
        ours(text=IMG, images=[np.zeros((0, 0, 3), np.uint8)])
    # placeholders not matching the inputs
    image = rand_image(40, 40)
    with pytest.raises(ValueError, match="number of"):
        hf(text=IMG + IMG, images=[image])
    with pytest.raises(ValueError, match=r"2 <\|image_pad\|> placeholder\(s\) but 1 image"):
        ours(text=IMG + IMG, images=[image])
    for proc in (hf, ours):
        with pytest.raises(ValueError):
            proc(text="no placeholder", images=[image])
        with pytest.raises(ValueError):
            proc(text=VID, videos=[rand_video(4, 32, 32)] * 2)
    with pytest.raises(ValueError, match=r"1 <\|image_pad\|> placeholder\(s\) but 2 image"):
        ours(text=IMG, images=[image, image])
    with pytest.raises(ValueError, match="video_pad"):
        ours(text=IMG, images=[image], videos=[rand_video(4, 32, 32)])
    # unreadable / missing files
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"this is not a video" * 50)
    with pytest.raises(ValueError, match="could not read video file"):
        ours(text=VID, videos=[str(bad)])
    with pytest.raises(FileNotFoundError):
        ours(text=VID, videos=[str(tmp_path / "missing.mp4")])
    bad_img = tmp_path / "bad.png"
    bad_img.write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match="could not read image file"):
        ours(text=IMG, images=[str(bad_img)])
    with pytest.raises(FileNotFoundError):
        ours(text=IMG, images=[str(tmp_path / "missing.png")])
    # other misuse
    with pytest.raises(TypeError, match="unexpected keyword"):
        ours(text="x", bogus=1)
    with pytest.raises(ValueError, match="non-integer float"):
        ours(text=IMG, images=[np.full((8, 8, 3), 0.5, np.float32)])


def test_torch_images_and_videos_as_in_hf(hf, ours):
    """Torch tensors (what HF's processors take besides PIL and numpy) give HF's outputs: uint8
    images (C, H, W) and (H, W, C), a float one with integer levels, a (B, C, H, W) batch; videos
    (T, C, H, W) and (T, H, W, C), a list of (C, H, W) frames."""
    base = np.array(rand_image(45, 70, seed=5))
    chw = torch.from_numpy(base).permute(2, 0, 1)
    images = [chw, torch.from_numpy(base), chw.float(), torch.stack([chw, chw.flip(-1)])]
    video = rand_video(6, 40, 56, seed=6)
    tchw = torch.from_numpy(video).permute(0, 3, 1, 2)
    videos = [tchw, torch.from_numpy(video), list(tchw)]
    meta = [{"fps": 6.0, "total_num_frames": 6}]
    for i, image in enumerate(images):
        text = IMG * (2 if image.ndim == 4 else 1)
        a, b = hf(text=text, images=image, return_tensors="np"), ours(text=text, images=image, return_tensors="np")
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])
        assert_resampling_noise(a["pixel_values"], b["pixel_values"], f"torch image {i}")
        # the same values as the numpy array of the same layout
        np.testing.assert_array_equal(b["pixel_values"], ours(text=text, images=image.numpy(),
                                                              return_tensors="np")["pixel_values"])
    for i, clip in enumerate(videos):
        a = hf(text=VID, videos=[clip], video_metadata=meta, return_tensors="np")
        b = ours(text=VID, videos=[clip], video_metadata=meta, return_tensors="np")
        assert_same_text(a, b)
        np.testing.assert_array_equal(a["video_grid_thw"], b["video_grid_thw"])
        assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], f"torch video {i}")


def test_no_torch_at_run_time(ckpt, tmp_path):
    """A full run (image, video array, video file) imports neither torch nor torchvision."""
    import subprocess
    import sys

    path = tmp_path / "clip.mp4"
    write_video(path, rand_video(9, 32, 48), 8)
    code = (
        "import sys, numpy as np\n"
        "from qwen3vl_jax.processing import Qwen3VLProcessor\n"
        "p = Qwen3VLProcessor.from_pretrained(sys.argv[1])\n"
        "v = np.zeros((5, 40, 40, 3), np.uint8)\n"
        "t = '<|image_pad|><|video_pad|><|video_pad|>'\n"
        "out = p(text=t, images=[np.zeros((30, 30, 3), np.uint8)], videos=[v, sys.argv[2]],\n"
        "        return_tensors='np')\n"
        "p.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "bad = [m for m in ('torch', 'torchvision') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code, str(ckpt), str(path)], check=True, cwd=root)


# ----------------------------------------------------------------------------------------------
# HF 5.x keyword semantics, each compared with HF's processor on the same input


def assert_same_grids(a, b, *keys):
    for key in keys:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_keyword_groups_are_hfs():
    """Our groups hold exactly the keys of HF's TypedDicts for this processor (plus num_threads)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessorKwargs
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessorInitKwargs
    from transformers.processing_utils import ImagesKwargs, TextKwargs, VideosKwargs

    from qwen3vl_jax.processing.image import IMAGE_KEYS
    from qwen3vl_jax.processing.prompt import TEXT_KEYS
    from qwen3vl_jax.processing.video import VIDEO_KEYS

    assert TEXT_KEYS == set(TextKwargs.__annotations__)
    assert IMAGE_KEYS - {"num_threads"} == set(ImagesKwargs.__annotations__) | set(
        Qwen2VLImageProcessorKwargs.__annotations__)
    assert VIDEO_KEYS - {"num_threads"} == set(VideosKwargs.__annotations__) | set(
        Qwen3VLVideoProcessorInitKwargs.__annotations__)


def test_call_time_min_max_pixels_resize_images_only(hf, ours):
    image, video = rand_image(300, 420, seed=11), rand_video(8, 90, 120, seed=11)
    meta = [{"fps": 4.0, "total_num_frames": 8}]
    text = f"{IMG}{VID}"
    base = ours(text=text, images=[image], videos=[video], video_metadata=meta, return_tensors="np")
    for kw in ({"max_pixels": 64 * 64}, {"min_pixels": 400 * 400}, {"images_kwargs": {"max_pixels": 64 * 64}}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # HF deprecates call-time min/max_pixels
            a = hf(text=text, images=[image], videos=[video], video_metadata=meta, return_tensors="np", **kw)
        b = ours(text=text, images=[image], videos=[video], video_metadata=meta, return_tensors="np", **kw)
        assert_same_text(a, b)
        assert_same_grids(a, b, "image_grid_thw", "video_grid_thw")
        assert b["image_grid_thw"].tolist() != base["image_grid_thw"].tolist(), kw
        assert b["video_grid_thw"].tolist() == base["video_grid_thw"].tolist(), kw  # videos untouched


def test_call_time_min_max_frames_are_ignored_as_in_hf(hf, ours):
    """HF 5.x samples with the processor's own min_frames / max_frames (its config); at call time
    they are accepted and change nothing. Set them at from_pretrained. A call-time max_video_tokens
    caps the frames under cap_pixels_per_frame (HF >= 5.25)."""
    video = rand_video(21, 40, 56, seed=12)
    meta = [{"fps": 7.0, "total_num_frames": 21}]
    base = ours(text=VID, videos=[video], video_metadata=meta, return_tensors="np")
    for kw in ({"min_frames": 12}, {"max_frames": 2}, {"videos_kwargs": {"min_frames": 12}},
               {"cap_pixels_per_frame": True, "max_video_tokens": 2}):
        a = hf(text=VID, videos=[video], video_metadata=meta, return_tensors="np", return_metadata=True, **kw)
        b = ours(text=VID, videos=[video], video_metadata=meta, return_tensors="np", **kw)
        assert_same_text(a, b)
        assert_same_grids(a, b, "video_grid_thw")
        assert b["video_timestamps"] == hf_timestamps(hf, a)
        if "cap_pixels_per_frame" not in kw:
            assert_same_text(base, b)
    large, meta = rand_video(8, 240, 320, seed=12), [{"fps": 4.0, "total_num_frames": 8}]
    grids = set()
    for kw in ({"cap_pixels_per_frame": True}, {"cap_pixels_per_frame": True, "max_video_tokens": 20},
               {"videos_kwargs": {"cap_pixels_per_frame": True, "max_video_tokens": 20}}):
        a = hf(text=VID, videos=[large], video_metadata=meta, return_tensors="np", **kw)
        b = ours(text=VID, videos=[large], video_metadata=meta, return_tensors="np", **kw)
        assert_same_text(a, b)
        assert_same_grids(a, b, "video_grid_thw")
        assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], f"capped video {kw}")
        grids.add(tuple(b["video_grid_thw"][0].tolist()))
    assert len(grids) == 2  # the call-time cap changed the frame size
    for bad in (0, -3, 2.5, "20", True):
        with pytest.raises(ValueError, match="max_video_tokens"):
            ours(text=VID, videos=[large], video_metadata=meta, cap_pixels_per_frame=True, max_video_tokens=bad)


def test_from_pretrained_frame_limits_are_honoured(ckpt, ours):
    from transformers import AutoProcessor

    video = rand_video(21, 40, 56, seed=12)
    meta = [{"fps": 7.0, "total_num_frames": 21}]
    a = AutoProcessor.from_pretrained(ckpt, min_frames=12)(text=VID, videos=[video], video_metadata=meta,
                                                           return_tensors="np")
    b = Qwen3VLProcessor.from_pretrained(ckpt, videos_kwargs={"min_frames": 12})(
        text=VID, videos=[video], video_metadata=meta, return_tensors="np")
    assert_same_text(a, b)
    assert b["video_grid_thw"][0, 0] == 6  # 12 frames sampled, not the 4 of 3 s at 2 fps (fps clamped up)


def test_conflicting_and_unknown_keywords_raise_as_in_hf(hf, ours):
    image, video = rand_image(60, 80, seed=13), rand_video(4, 40, 40, seed=13)
    cases = [
        (ValueError, "passed two times", dict(text=IMG, images=[image], do_rescale=True,
                                              images_kwargs={"do_rescale": True})),
        (ValueError, "passed two times", dict(text="hi", return_tensors="np", text_kwargs={"return_tensors": "np"})),
        (ValueError, "must contain 'shortest_edge' and 'longest_edge'",
         dict(text=IMG, images=[image], size={"longest_edge": 64 * 64})),
        (ValueError, "must contain 'shortest_edge' and 'longest_edge'",
         dict(text=VID, videos=[video], size={"longest_edge": 64 * 64 * 8})),
        (ValueError, "must contain 'shortest_edge' and 'longest_edge'",
         dict(text=IMG, images=[image], size={"min_pixels": 64 * 64, "max_pixels": 128 * 128})),
        (TypeError, "max_pixels", dict(text=VID, videos=[video], videos_kwargs={"max_pixels": 64 * 64})),
        (TypeError, "fps", dict(text=IMG, images=[image], images_kwargs={"fps": 2})),
    ]
    for error, message, kw in cases:
        with pytest.raises(error, match=message):
            hf(**kw)
        with pytest.raises(error, match=message):
            ours(**kw)


def test_text_and_common_kwargs_and_max_length_as_in_hf(hf, ours):
    image = rand_image(60, 80, seed=14)
    texts = [f"{IMG} one two three", "a"]
    cases = [
        dict(text_kwargs={"padding": "max_length", "max_length": 40}),
        dict(padding="max_length", max_length=40, padding_side="left"),
        dict(padding=True, pad_to_multiple_of=8),
        dict(common_kwargs={"return_tensors": "np"}, padding=True),
        dict(padding=True, max_length=3),  # max_length without truncation: no effect
    ]
    for kw in cases:
        kw = {"return_tensors": "np", **kw} if "common_kwargs" not in kw else kw
        a = hf(text=texts, images=[image], **kw)
        b = ours(text=texts, images=[image], **kw)
        assert_same_text(a, b)
        assert isinstance(b["input_ids"], np.ndarray)
    # truncation without a placeholder in the way, and into one (HF's refusal)
    a = hf(text=["one two three four five six"], truncation=True, max_length=3, return_tensors="np")
    b = ours(text=["one two three four five six"], truncation=True, max_length=3, return_tensors="np")
    assert_same_text(a, b)
    assert b["input_ids"].shape == (1, 3)
    for proc in (hf, ours):
        with pytest.raises(ValueError, match="Mismatch in `image` token count"):
            proc(text=[texts[0]], images=[image], truncation=True, max_length=4)


def test_nested_video_metadata_as_in_hf(hf, ours):
    videos = [rand_video(9, 40, 40, seed=15), rand_video(6, 40, 40, seed=16)]
    metas = [[{"fps": 3.0, "total_num_frames": 9}], [{"fps": 2.0, "total_num_frames": 6}]]
    a = hf(text=[VID, VID], videos=videos, video_metadata=metas, return_tensors="np", return_metadata=True)
    b = ours(text=[VID, VID], videos=videos, video_metadata=metas, return_tensors="np")
    assert_same_text(a, b)
    assert_same_grids(a, b, "video_grid_thw")
    assert b["video_timestamps"] == hf_timestamps(hf, a)


def test_chat_template_tokenize_as_in_hf(hf, ours):
    image, video = rand_image(64, 96, seed=17), rand_video(8, 40, 40, seed=17)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "video", "video": video},
                                             {"type": "text", "text": "What is this?"}]}]
    meta = [{"fps": 4.0, "total_num_frames": 8}]
    # without return_dict: the token ids (lists, or an array with return_tensors)
    a = hf.apply_chat_template(messages, tokenize=True, video_metadata=meta)
    b = ours.apply_chat_template(messages, tokenize=True, video_metadata=meta)
    assert a == b and isinstance(b, list)
    a = hf.apply_chat_template(messages, tokenize=True, video_metadata=meta, return_tensors="np")
    b = ours.apply_chat_template(messages, tokenize=True, video_metadata=meta, return_tensors="np")
    np.testing.assert_array_equal(a, b)
    # every processor keyword is forwarded (none becomes a template variable)
    for kw in (dict(padding="max_length", max_length=120), dict(max_pixels=64 * 64),
               dict(processor_kwargs={"max_pixels": 64 * 64}), dict(fps=1.0), dict(size={"shortest_edge": 32 * 32,
                                                                                       "longest_edge": 64 * 64})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            a = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="np",
                                       video_metadata=meta, **kw)
        b = ours.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="np",
                                     video_metadata=meta, **kw)
        assert_same_text(a, b)
        assert_same_grids(a, b, "image_grid_thw", "video_grid_thw")
    for proc in (hf, ours):
        with pytest.raises(ValueError, match="Mismatch in `(image|video)` token count"):
            proc.apply_chat_template(messages, tokenize=True, video_metadata=meta, truncation=True, max_length=10)
    # our own keywords reach the call too: the pruned prompt equals the direct call's
    prompt = ours.apply_chat_template(messages)
    direct = ours(text=prompt, images=[image], videos=[video], video_metadata=meta, video_pruning=("evs", 0.5),
                  return_tensors="np")
    chat = ours.apply_chat_template(messages, tokenize=True, return_dict=True, video_metadata=meta,
                                    video_pruning=("evs", 0.5), return_tensors="np")
    assert_same_text(direct, chat)
    assert (chat["mm_token_type_ids"] == 2).sum() < int(chat["video_grid_thw"].prod()) // 4


def test_continue_final_message_as_in_hf(hf, ours):
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    for last in ({"role": "assistant", "content": [{"type": "text", "text": "Hello the"}]},
                 {"role": "assistant", "content": "Hello the "}):
        a = hf.apply_chat_template([user, last], continue_final_message=True)
        b = ours.apply_chat_template([user, last], continue_final_message=True)
        assert a == b and b.endswith("Hello the" + (" " if isinstance(last["content"], str) else ""))
        assert ours.apply_chat_template([user, last]) == hf.apply_chat_template([user, last])
        for proc in (hf, ours):
            with pytest.raises(ValueError, match="not compatible"):
                proc.apply_chat_template([user, last], continue_final_message=True, add_generation_prompt=True)


def test_video_of_frame_files_as_in_hf(hf, ours, tmp_path):
    frames = rand_video(4, 48, 64, seed=18)
    paths = []
    for i, frame in enumerate(frames):
        paths.append(str(tmp_path / f"frame{i}.png"))
        Image.fromarray(frame).save(paths[-1])
    messages = [{"role": "user", "content": [{"type": "video", "url": paths}, {"type": "text", "text": "hi"}]}]
    a = hf.apply_chat_template(messages, tokenize=True, return_dict=True, do_sample_frames=False,
                               return_tensors="np")
    b = ours.apply_chat_template(messages, tokenize=True, return_dict=True, do_sample_frames=False,
                                 return_tensors="np")
    assert_same_text(a, b)
    assert_same_grids(a, b, "video_grid_thw")
    assert len(b["video_grid_thw"]) == 1 and b["video_grid_thw"][0, 0] == 2  # one video of 4 frames
    assert_resampling_noise(a["pixel_values_videos"], b["pixel_values_videos"], "frame files")
    for proc in (hf, ours):  # sampling frames from files is HF's refusal
        with pytest.raises(ValueError, match="Sampling frames from a list of images is not supported"):
            proc.apply_chat_template(messages, tokenize=True)


# ----------------------------------------------------------------------------------------------
# bad input at the processor's boundary


def test_16_bit_images_are_scaled_not_clipped(hf_pil, ours, tmp_path):
    """A 16-bit grayscale PNG (PIL mode I;16, or as a path) equals its 8-bit version (v * 255 / 65535,
    rounded) in HF's PIL processor. HF itself clips the 16-bit levels at 255: nearly white."""
    levels = np.linspace(0, 65535, 40 * 56).reshape(40, 56).astype(np.uint16)
    image16 = Image.fromarray(levels)
    assert image16.mode == "I;16"
    path = tmp_path / "deep.png"
    image16.save(path)
    assert Image.open(path).mode in ("I;16", "I")
    eight = Image.fromarray(np.round(levels * (255 / 65535)).astype(np.uint8))
    want = hf_pil(images=[eight], return_tensors="np")["pixel_values"]
    for given in (image16, str(path), levels):
        np.testing.assert_array_equal(ours.image_processor([given])["pixel_values"], want)
    clipped = hf_pil(images=[image16], return_tensors="np")["pixel_values"]
    assert clipped.mean() > 0.95 > abs(want.mean())  # what HF gives: nearly white


@pytest.mark.parametrize("fps", [0, float("nan"), -3.0, float("inf"), "30"])
def test_bad_fps_in_video_metadata_names_the_video(ours, fps):
    video = rand_video(6, 40, 40, seed=19)
    metas = [{"fps": 3.0, "total_num_frames": 6}, {"fps": fps, "total_num_frames": 6}]
    with pytest.raises(ValueError, match=r"video_metadata\[1\]: fps must be a positive finite number"):
        ours(text=VID + VID, videos=[video, video], video_metadata=metas)


def test_empty_text_is_refused(hf, ours):
    for text, message in (("", r"text\[0\] is empty"), (["hi", ""], r"text\[1\] is empty"), ([], "empty list")):
        with pytest.raises(ValueError, match=message):
            ours(text=text)
    assert hf(text="")["input_ids"] == [[]]  # HF returns a prompt no model can run


def test_corrupt_processor_json_names_the_file(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "preprocessor_config.json").write_text('{"patch_size": 16,')
    with pytest.raises(ValueError, match=rf"{bad / 'preprocessor_config.json'} is not valid JSON"):
        Qwen3VLProcessor.from_pretrained(bad)
    shutil.copy(os.path.join(ckpt, "preprocessor_config.json"), bad)
    text = (bad / "tokenizer.json").read_text()
    (bad / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{bad / 'tokenizer.json'}: cannot read the tokenizer"):
        Qwen3VLProcessor.from_pretrained(bad)
