"""CPU benchmark: our jitted JAX model against HF torch eager, same weights, same run.

    .venv/bin/python scripts/bench_cpu.py [--repeats 5] [--llm-layers 4]

Vision part: the 2B vision tower's dimensions (random weights, the real architecture), one
448x448 image (grid 1x28x28) and one 8-frame 448x448 video (grid 4x28x28). Prints the median
wall time of each side and the ratio HF / ours (above 1 means we are faster). Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (jit compile on our side, allocator warm-up on HF's)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--llm-layers", type=int, default=4, help="decoder layers kept from the 2B preset")
    args = parser.parse_args(argv)

    import jax
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from qwen3vl_jax import Qwen3VL, preset

    torch.manual_seed(0)
    config = preset("2b").replace(text={"num_hidden_layers": args.llm_layers})
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"2B widths: vision depth {config.vision.depth}, hidden {config.vision.hidden_size}; "
          f"LLM layers kept {config.text.num_hidden_layers}")
    with tempfile.TemporaryDirectory() as tmp:
        hf = Qwen3VLForConditionalGeneration(config.to_hf_config()).eval()
        hf.save_pretrained(tmp)
        ours = Qwen3VL.from_pretrained(tmp)

    rows = []
    rng = np.random.default_rng(0)
    for name, grid in (("image 448x448", [[1, 28, 28]]), ("video 8x448x448", [[4, 28, 28]])):
        grid = np.asarray(grid)
        pix = rng.standard_normal((int(grid.prod(1).sum()), config.vision.patch_dim)).astype(np.float32)
        pix_t, grid_t = torch.from_numpy(pix), torch.from_numpy(grid)

        def run_hf():
            with torch.no_grad():
                return hf.model.visual(pix_t, grid_t).pooler_output

        def run_ours():
            merged, deepstack = ours.encode_vision(pix, grid)
            return jax.block_until_ready((merged, deepstack))

        diff = float(np.abs(np.asarray(run_ours()[0]) - run_hf().numpy()).max())
        t_hf, t_ours = _median_seconds(run_hf, args.repeats), _median_seconds(run_ours, args.repeats)
        rows.append((name, int(grid.prod()), t_hf, t_ours, diff))

    print(f"\n{'vision tower':<18}{'patches':>9}{'HF eager s':>12}{'ours jit s':>12}{'HF/ours':>9}{'max|diff|':>11}")
    for name, patches, t_hf, t_ours, diff in rows:
        print(f"{name:<18}{patches:>9}{t_hf:>12.3f}{t_ours:>12.3f}{t_hf / t_ours:>9.2f}{diff:>11.2e}")


if __name__ == "__main__":
    main()
