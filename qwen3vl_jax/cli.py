"""Command line: `qwen3vl-jax {demo, convert}`.

`qwen3vl-jax convert HF_DIR OUT_DIR [--dtype bfloat16]` reads an HF checkpoint (one safetensors
shard at a time, strictly checked) and writes an Orbax checkpoint plus the tokenizer / processor
files, which `Qwen3VL.from_pretrained(OUT_DIR)` and the processor read. `--to hf` exports
safetensors instead (e.g. after editing weights).

`qwen3vl-jax demo` with no arguments synthesizes the built-in tiny checkpoint into a cache
directory (`$QWEN3VL_JAX_CACHE`, default `~/.cache/qwen3vl-jax`), preprocesses a generated image
and a generated video, runs the vision tower and the whole model, and prints shapes, the most
likely next tokens and per-stage timings. `--model DIR` runs a real HF checkpoint instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

TINY_NAME = "tiny-v1"


def default_cache_dir() -> str:
    return os.environ.get("QWEN3VL_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "qwen3vl-jax"))


def ensure_tiny_checkpoint(cache_dir: str | None = None) -> str:
    """The built-in tiny default, synthesized on first use."""
    from .testing import make_tiny_checkpoint

    path = os.path.join(cache_dir or default_cache_dir(), TINY_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path + ".partial")
        os.replace(path + ".partial", path)
    return path


def demo_image(height: int = 224, width: int = 320, seed: int = 0) -> np.ndarray:
    """A generated RGB image: a gradient background with a few solid rectangles."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 96)], axis=-1).astype(np.uint8)
    for _ in range(4):
        top, left = rng.integers(0, height - 40), rng.integers(0, width - 40)
        image[top : top + 40, left : left + 40] = rng.integers(0, 256, 3)
    return image


def demo_video(frames: int = 8, height: int = 128, width: int = 160, seed: int = 0) -> np.ndarray:
    """A generated video `(T, H, W, 3)`: a static background with a square moving across it."""
    background = demo_image(height, width, seed)
    video = np.repeat(background[None], frames, axis=0)
    for t in range(frames):
        left = int(t * (width - 32) / max(frames - 1, 1))
        video[t, height // 2 - 16 : height // 2 + 16, left : left + 32] = (255, 32, 32)
    return video


class _Timer:
    def __init__(self):
        self.rows: list[tuple[str, float]] = []

    def __call__(self, name, fn, *args, **kwargs):
        import jax

        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.rows.append((name, time.perf_counter() - start))
        return out


def run_demo(args) -> None:
    import jax
    import jax.numpy as jnp

    from .model import Qwen3VL, count_params
    from .processing import Qwen3VLProcessor

    path = args.model or ensure_tiny_checkpoint()
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    timer = _Timer()
    print(f"checkpoint: {path}{'' if args.model else ' (built-in tiny default)'}")
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    model = timer("load", Qwen3VL.from_pretrained, path, dtype=dtype)
    processor = Qwen3VLProcessor.from_pretrained(path)
    print(f"parameters: {count_params(model):,} ({args.dtype})")

    image = demo_image() if args.image is None else args.image
    video = demo_video()
    requests = {
        "image": dict(content=[{"type": "image"}, {"type": "text", "text": args.prompt}], images=[image]),
        "video": dict(content=[{"type": "video"}, {"type": "text", "text": args.prompt}], videos=[video],
                      video_metadata=[{"fps": 4.0, "total_num_frames": len(video)}]),
    }
    for name, req in requests.items():
        text = processor.apply_chat_template([{"role": "user", "content": req.pop("content")}],
                                             add_generation_prompt=True)
        inputs = timer(f"{name}: preprocess", processor, text=[text], return_tensors="np", **req)
        pixels, grid = (("pixel_values", "image_grid_thw") if name == "image"
                        else ("pixel_values_videos", "video_grid_thw"))
        for label in ("vision encode (compile + run)", "vision encode"):
            merged, deepstack = timer(f"{name}: {label}", model.encode_vision, inputs[pixels], inputs[grid])
        model_inputs = {k: v for k, v in inputs.items() if k in (
            "input_ids", "attention_mask", "mm_token_type_ids", pixels, grid)}
        for label in ("forward (compile + run)", "forward"):
            logits = timer(f"{name}: {label}", model, **model_inputs)
        top = np.argsort(-np.asarray(logits[0, -1], np.float32))[:5]
        print(f"\n[{name}] grid_thw {inputs[grid].tolist()}, patches {inputs[pixels].shape}, "
              f"prompt tokens {inputs['input_ids'].shape[1]}")
        print(f"  merged features {tuple(merged.shape)} {merged.dtype}, deepstack {tuple(deepstack.shape)}")
        print(f"  logits {tuple(logits.shape)}; most likely next tokens: "
              + ", ".join(repr(processor.decode([int(t)], skip_special_tokens=False)) for t in top))
    print("\ntimings")
    for name, seconds in timer.rows:
        print(f"  {name:<42}{seconds * 1000:>10.1f} ms")


def run_convert(args) -> None:
    import resource

    import jax.numpy as jnp

    from .convert import copy_side_files
    from .model import Qwen3VL, count_params

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    start = time.perf_counter()
    model = Qwen3VL.from_pretrained(args.source, dtype=dtype, progress=True)
    os.makedirs(args.out, exist_ok=True)
    if args.to == "orbax":
        model.save_orbax(args.out)
    else:
        model.save_hf(args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes)
    # An HF export writes its own config.json; an Orbax directory keeps the source's beside the weights.
    copied = copy_side_files(args.source, args.out, skip=("config.json",) if args.to == "hf" else ())
    n = count_params(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
    print(f"wrote {args.to} checkpoint to {args.out}: {n:,} parameters in {args.dtype} "
          f"({n * jnp.dtype(dtype).itemsize / 2**30:.2f} GiB), {len(copied)} side files, "
          f"{time.perf_counter() - start:.1f} s, peak host memory {peak:.2f} GiB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qwen3vl-jax", description="Qwen3-VL in JAX, Flax NNX and Pallas")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the model end to end (built-in tiny default unless --model)")
    demo.add_argument("--model", help="an HF checkpoint directory (default: the built-in tiny one)")
    demo.add_argument("--image", help="an image file (default: a generated image)")
    demo.add_argument("--prompt", default="Describe what you see.")
    demo.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    convert = sub.add_parser("convert", help="HF safetensors -> Orbax (or back to HF with --to hf)")
    convert.add_argument("source", help="an HF checkpoint directory, or one written by convert")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    convert.add_argument("--to", choices=("orbax", "hf"), default="orbax")
    convert.add_argument("--max-shard-bytes", type=int, default=None, help="shard size for --to hf")
    args = parser.parse_args(argv)
    if args.command == "demo":
        run_demo(args)
    elif args.command == "convert":
        run_convert(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
