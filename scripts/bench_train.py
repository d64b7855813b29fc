"""Train-step benchmark: our jitted `Trainer.step` against HF torch (loss, backward, AdamW), same
config, batch and weights, float32, in one run.

    .venv/bin/python scripts/bench_train.py [--repeats 7] [--layers 4] [--hidden 64 256 512] [--batch 2]
        [--also-python .venv312/bin/python]

Each `--hidden` width is one model: the tiny architecture (`qwen3vl_jax.testing.make_tiny_checkpoint`)
widened to that hidden size (vision tower at half of it, head dim 64) with `--layers` decoder
layers; the batch is `--batch` image conversations (the processor's output, assistant-only labels).
Both sides do full fine-tuning with AdamW and global-norm clipping at 1.0. Per width it prints the
median step time of each side, the ratio HF / ours (above 1 means we are faster), tokens/s, the
step's model FLOP rate as a fraction of the machine's f32 matmul rate measured at the start of the
same run (`bench_cpu.machine_limits`), what 1.5x HF's speed would ask of that rate, and each side's
peak host memory (`ru_maxrss`), ours with and without `remat`; every measurement runs in its own
subprocess, since the peak only grows. Model FLOPs are 3x the forward's matmul FLOPs (the backward
does two matmuls per forward one): the linear layers, attention over each frame and over the causal
half of each row, the LM head (`step_flops`). `--also-python` runs our side once more under another
interpreter (e.g. the Python 3.12 environment with the newest jax, which has no torch), on the same
checkpoint and batch. Writes nothing outside a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

import numpy as np
from bench_cpu import _median_seconds, machine_limits, vision_flops  # this script's directory


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux


def _checkpoint(directory: str, hidden: int, layers: int) -> str:
    from qwen3vl_jax.testing import make_tiny_checkpoint

    heads = max(2, hidden // 64)
    return make_tiny_checkpoint(
        directory,
        text={"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
              "mrope_section": (12, 10, 10)},
        vision={"hidden_size": hidden // 2, "intermediate_size": hidden, "num_heads": max(2, heads // 2),
                "out_hidden_size": hidden})


def _batch(path: str, size: int) -> dict:
    from qwen3vl_jax import Qwen3VLProcessor
    from qwen3vl_jax.cli import demo_image
    from qwen3vl_jax.training import assistant_labels

    processor = Qwen3VLProcessor.from_pretrained(path)
    conversations = [[
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe picture {i}."}]},
        {"role": "assistant", "content": "A coloured square on a plain background, seen from above. " * 4},
    ] for i in range(size)]
    texts = processor.apply_chat_template(conversations)
    images = [demo_image(224, 224, seed=i) for i in range(size)]
    out = processor(text=texts, images=images, padding=True, return_tensors="np")
    out["labels"] = assistant_labels(out["input_ids"], out["attention_mask"], processor, conversations)
    return dict(out)


def step_flops(path: str, batch: dict) -> float:
    """Model FLOPs of one train step on `batch`: 3x the forward's matmul FLOPs (vision tower,
    decoder layers with attention over the causal half of each row, LM head)."""
    from qwen3vl_jax.config import Qwen3VLConfig

    config = Qwen3VLConfig.from_hf_config(path)
    t = config.text
    rows, length = batch["input_ids"].shape
    tokens = rows * length
    projections = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim \
        + t.num_attention_heads * t.head_dim * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    attention = 2 * 2 * rows * (length * (length + 1) // 2) * t.num_attention_heads * t.head_dim
    text = t.num_hidden_layers * (2 * tokens * projections + attention) + 2 * tokens * t.hidden_size * t.vocab_size
    vision = vision_flops(config, np.asarray(batch["image_grid_thw"])) if "image_grid_thw" in batch else 0.0
    return 3.0 * (text + vision)


def run_side(side: str, path: str, batch_size: int, repeats: int) -> dict:
    batch = _batch(path, batch_size)
    tokens = int(batch["attention_mask"].sum())
    if side == "hf":
        import torch
        from transformers import Qwen3VLForConditionalGeneration

        from qwen3vl_jax.model import MODEL_INPUTS

        model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        inputs = {k: torch.from_numpy(np.asarray(batch[k])) for k in MODEL_INPUTS if k in batch}
        labels = torch.from_numpy(batch["labels"])

        def step():
            loss = model(**inputs, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        from qwen3vl_jax import Qwen3VL
        from qwen3vl_jax.training import OptimConfig, Trainer

        model = Qwen3VL.from_pretrained(path, remat=side == "ours_remat")
        trainer = Trainer(model, OptimConfig(learning_rate=1e-5, max_grad_norm=1.0))

        def step():
            trainer.step([batch])  # returns floats: the step has finished
    seconds = _median_seconds(step, repeats)
    import jax

    return {"side": side, "seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "flops": step_flops(path, batch), "peak_gib": _peak_gib(), "jax": jax.__version__}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256, 512],
                        help="decoder widths, one model each")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--also-python", help="run our side also under this interpreter")
    parser.add_argument("--side", choices=("hf", "ours", "ours_remat"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # a child process: one side, one JSON line
        print(json.dumps(run_side(args.side, args.path, args.batch, args.repeats)))
        return
    limits = machine_limits(args.repeats)
    print(f"{args.layers} decoder layers, batch {args.batch} image conversations; f32, AdamW + clipping; "
          f"median of {args.repeats} steps; each side in its own process")
    for hidden in args.hidden:
        with tempfile.TemporaryDirectory() as tmp:
            path = _checkpoint(f"{tmp}/ckpt", hidden, args.layers)
            results, runs = {}, [("hf", sys.executable), ("ours", sys.executable), ("ours_remat", sys.executable)]
            if args.also_python:
                runs.append(("ours", args.also_python))
            for side, python in runs:
                out = subprocess.run([python, __file__, "--side", side, "--path", path, "--batch",
                                      str(args.batch), "--repeats", str(args.repeats)],
                                     capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                label = f"{side} (jax {result['jax']})" if side != "hf" else "hf"
                results[label] = result
        hf = results["hf"]
        needed = 1.5 * hf["flops"] / hf["seconds"] / limits["flops"]
        print(f"\nhidden {hidden}: {hf['tokens']} tokens, {hf['flops'] / 1e9:.2f} GFLOP per step; "
              f"1.5x HF's speed = {hf['seconds'] / 1.5 * 1e3:.1f} ms/step = {needed:.0%} of the matmul rate")
        for side, r in results.items():
            rate = r["flops"] / r["seconds"]
            print(f"{side:>24}: {r['seconds'] * 1e3:8.1f} ms/step  HF / this {hf['seconds'] / r['seconds']:.2f}x  "
                  f"{r['tokens_per_second']:7.0f} tokens/s  {rate / 1e9:5.1f} GFLOP/s = "
                  f"{rate / limits['flops']:4.0%} of matmul  peak host memory {r['peak_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
