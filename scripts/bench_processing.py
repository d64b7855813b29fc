"""Preprocessing throughput: qwen3vl_jax.processing vs HF's Qwen3VLProcessor, in the same run.

    .venv/bin/python scripts/bench_processing.py [--checkpoint DIR] [--images 32] [--image-size 480x640]
        [--video-frames 32] [--video-fps 2] [--video-size 360x640] [--repeats 3] [--threads N]

Without --checkpoint it writes a tiny checkpoint to a temporary directory with Qwen3-VL's released
pixel budgets (images 256^2 .. 4096^2 pixels, videos 64^2 .. 24 * 1024^2 pixels), so the sizes
processed are those of the real model. Prints images/s and (sampled) video frames/s for ours, HF's
`AutoProcessor` (torchvision-backed image and video processors) and HF's PIL image processor, and
the ratios. Each timing is a full processor call (prompt expansion and tokenization included), the
best of --repeats after one warm-up, the contenders taking turns so that a change of machine load
hits all alike. The video-file row decodes an mp4 written (with PyAV, into a temporary directory)
from the same frames: ours takes the path; HF, whose default decoder (torchcodec) may be absent,
decodes with its own PyAV reader (`load_video(backend="pyav")`) and then processes the frames, both
inside the timing. `--threads N` sets our thread pool and torch's intra-op threads alike. Prints the
load average: on a shared machine, torch's spinning worker threads slow down much more than ours
under contention, so compare figures taken at low load. Writes nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qwen3vl_jax.processing import Qwen3VLProcessor

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
RELEASED_IMAGE_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}
RELEASED_VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}


def parse_hw(text: str) -> tuple[int, int]:
    h, w = text.lower().split("x")
    return int(h), int(w)


def best_times(fns, repeats: int) -> list[float]:
    """Best wall time of each function; the functions take turns, so load changes hit all alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return [min(t) for t in times]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="HF checkpoint dir (default: a tiny one with released budgets)")
    parser.add_argument("--images", type=int, default=32, help="images per timed call")
    parser.add_argument("--image-size", type=parse_hw, default=(480, 640))
    parser.add_argument("--video-frames", type=int, default=32, help="frames of the source video")
    parser.add_argument("--video-fps", type=float, default=2.0, help="source fps (2: every frame sampled)")
    parser.add_argument("--video-size", type=parse_hw, default=(360, 640))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for ours (default min(8, cores)) and torch.set_num_threads for HF")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tmp = None
    path = args.checkpoint
    if path is None:
        from qwen3vl_jax.testing import make_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory()
        path = make_tiny_checkpoint(os.path.join(tmp.name, "tiny"), image_size=RELEASED_IMAGE_SIZE,
                                    video_size=RELEASED_VIDEO_SIZE)
    ours = Qwen3VLProcessor.from_pretrained(path)
    hf = AutoProcessor.from_pretrained(path)
    hf_pil = Qwen2VLImageProcessorPil.from_pretrained(path)

    rng = np.random.default_rng(0)
    h, w = args.image_size
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(args.images)]
    text = "<|im_start|>user\n" + IMG * len(images) + "Describe.<|im_end|>\n"
    vh, vw = args.video_size
    video = rng.integers(0, 256, (args.video_frames, vh, vw, 3), dtype=np.uint8)
    meta = [{"fps": args.video_fps, "total_num_frames": args.video_frames}]
    vtext = "<|im_start|>user\n" + VID + "Describe.<|im_end|>\n"

    out = ours(text=vtext, videos=[video], video_metadata=meta, return_metadata=True)
    sampled = len(out["video_metadata"][0].frames_indices)
    grid = out["video_grid_thw"][0].tolist()
    igrid = ours(images=images[:1])["image_grid_thw"][0].tolist()

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        ours_call = ours.__call__
        ours = lambda *a, **k: ours_call(*a, num_threads=args.threads, **k)
    print(f"checkpoint: {path}")
    print(f"cpu cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f}, torch threads: "
          f"{torch.get_num_threads()}, our threads: {args.threads or 'min(8, cores)'}")
    print(f"images: {len(images)} x {h}x{w} -> grid {igrid} each; "
          f"video: {args.video_frames} frames {vh}x{vw} "
          f"@ {args.video_fps} fps -> {sampled} sampled, grid {grid}")

    rows = []
    t_ours, t_hf, t_pil = best_times([lambda: ours(text=text, images=images, return_tensors="np"),
                                      lambda: hf(text=text, images=images, return_tensors="np"),
                                      lambda: hf_pil(images=images, return_tensors="np")], args.repeats)
    rows.append(("images/s", len(images) / t_ours, len(images) / t_hf, len(images) / t_pil))
    v_ours, v_hf = best_times(
        [lambda: ours(text=vtext, videos=[video], video_metadata=meta, return_tensors="np"),
         lambda: hf(text=vtext, videos=[video], video_metadata=meta, return_tensors="np")], args.repeats)
    rows.append(("video frames/s", sampled / v_ours, sampled / v_hf, None))

    from fractions import Fraction

    import av
    from transformers.video_utils import load_video as hf_load_video

    work = tempfile.TemporaryDirectory()
    clip = os.path.join(work.name, "clip.mp4")
    with av.open(clip, "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(args.video_fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = vw, vh, "yuv420p"
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)

    def hf_file():
        frames, m = hf_load_video(clip, backend="pyav")
        file_meta = [{"fps": m.fps, "total_num_frames": m.total_num_frames}]
        return hf(text=vtext, videos=[frames], video_metadata=file_meta, return_tensors="np")

    f_ours, f_hf = best_times([lambda: ours(text=vtext, videos=[clip], return_tensors="np"), hf_file],
                              args.repeats)
    rows.append(("video file fr/s", sampled / f_ours, sampled / f_hf, None))
    work.cleanup()

    print(f"{'':16s} {'ours':>10s} {'HF (torchvision)':>17s} {'HF PIL images':>14s} {'ours/HF':>8s} "
          f"{'ours/HF PIL':>11s}")
    for name, a, b, c in rows:
        c_text = f"{c:14.1f}" if c is not None else f"{'-':>14s}"
        r_pil = f"{a / c:11.2f}" if c is not None else f"{'-':>11s}"
        print(f"{name:16s} {a:10.1f} {b:17.1f} {c_text} {a / b:8.2f} {r_pil}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
