"""Encoder buckets against exact-shape jit on a stream of randomly sized images, same run.

    .venv/bin/python scripts/bench_buckets.py [--requests 50] [--vision-depth 4] [--max-side 448]

The vision tower has the 2B model's widths (random weights) and `--vision-depth` blocks, so the
run stays short on a CPU while compile and run costs keep their real proportions. Each request is
one image with random height and width in [64, max-side] pixels, preprocessed to patches by the
project's processor rules (smart resize to multiples of 32). Prints, for both paths: total wall
time, number of compilations, steady-state latency per image (the second half of the stream) and,
for the buckets, the padding overhead per budget. Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--max-side", type=int, default=448)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    from qwen3vl_jax import Qwen3VL, preset
    from qwen3vl_jax.buckets import EncoderRunner
    from qwen3vl_jax.model import _run_vision
    from qwen3vl_jax.processing import smart_resize

    config = preset("2b").replace(vision={"depth": args.vision_depth, "deepstack_visual_indexes": (0,)},
                                  text={"num_hidden_layers": 1, "vocab_size": 1024},
                                  image_token_id=1000, video_token_id=1001, vision_start_token_id=1002,
                                  vision_end_token_id=1003)
    model = nnx.merge(*nnx.split(Qwen3VL(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(args.seed)
    factor = config.vision.patch_size * config.vision.spatial_merge_size
    grids = []
    for _ in range(args.requests):
        h, w = rng.integers(64, args.max_side + 1, size=2)
        rh, rw = smart_resize(int(h), int(w), factor=factor, min_pixels=factor * factor, max_pixels=args.max_side**2)
        grids.append(np.asarray([[1, rh // config.vision.patch_size, rw // config.vision.patch_size]]))
    inputs = [(rng.standard_normal((int(g.prod()), config.vision.patch_dim)).astype(np.float32), g) for g in grids]
    largest = max(int(g.prod()) // config.vision.merge_unit for g in grids)
    print(f"jax {jax.__version__} ({jax.default_backend()}); vision: 2B widths, depth {args.vision_depth}; "
          f"{args.requests} images, {sorted(set(int(g.prod()) for g in grids)).__len__()} distinct patch counts, "
          f"largest {largest} merged tokens")

    def stream(encode):
        latencies = []
        start = time.perf_counter()
        for pixels, grid in inputs:
            t0 = time.perf_counter()
            jax.block_until_ready(encode(pixels, grid))
            latencies.append(time.perf_counter() - t0)
        return time.perf_counter() - start, statistics.median(latencies[len(latencies) // 2 :])

    before = _run_vision._cache_size()
    exact_total, exact_steady = stream(model.encode_vision)
    exact_compiles = _run_vision._cache_size() - before

    runner = EncoderRunner(model, max_budget=max(256, 1 << (largest - 1).bit_length()))
    t0 = time.perf_counter()
    runner.warmup()
    warmup = time.perf_counter() - t0
    warm_compiles = runner.num_compiles
    bucket_total, bucket_steady = stream(runner.encode)

    print(f"\n{'path':<26}{'total s':>9}{'compiles':>10}{'steady ms/img':>15}")
    print(f"{'exact-shape jit':<26}{exact_total:>9.2f}{exact_compiles:>10}{exact_steady * 1e3:>15.1f}")
    print(f"{'buckets (after warm-up)':<26}{bucket_total:>9.2f}{runner.num_compiles - warm_compiles:>10}"
          f"{bucket_steady * 1e3:>15.1f}")
    print(f"{'buckets warm-up':<26}{warmup:>9.2f}{warm_compiles:>10}")
    print(f"ratios: total exact/buckets {exact_total / bucket_total:.2f} "
          f"(with warm-up {exact_total / (bucket_total + warmup):.2f}), "
          f"steady buckets/exact {bucket_steady / exact_steady:.2f}")
    print("\npadding per budget\n" + runner.report())


if __name__ == "__main__":
    main()
