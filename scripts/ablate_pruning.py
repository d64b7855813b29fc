"""Pruning-ratio ablation (EVS, VidCom2) on the tiny default or a real checkpoint.

    .venv/bin/python scripts/ablate_pruning.py [--model DIR] [--video FILE ...] [--out runs/ablation]
        [--methods evs vidcom2] [--rates 0 0.25 0.5 0.75 0.9] [--continuation 16]

Writes OUT/ablation.jsonl (one row per video x method x rate, appended as rows finish: rerunning
skips finished rows), OUT/ablation.csv and OUT/ablation.png (retained tokens, vision + prefill time,
next-token KL and matching greedy tokens against the unpruned run, per rate). Without --video it
uses the built-in generated clips (static backgrounds with moving objects, and a still clip).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in tiny one)")
    parser.add_argument("--video", nargs="*", default=None, help="video files (default: built-in clips)")
    parser.add_argument("--out", default=os.path.join("runs", "ablation"))
    parser.add_argument("--methods", nargs="+", default=["evs", "vidcom2"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--continuation", type=int, default=16, help="greedy tokens compared per row")
    args = parser.parse_args(argv)

    from qwen3vl_jax import Qwen3VL
    from qwen3vl_jax.cli import ensure_tiny_checkpoint
    from qwen3vl_jax.processing import Qwen3VLProcessor
    from qwen3vl_jax.pruning.ablation import builtin_videos, run_ablation

    path = args.model or ensure_tiny_checkpoint()
    model = Qwen3VL.from_pretrained(path)
    processor = Qwen3VLProcessor.from_pretrained(path)
    videos = {os.path.basename(v): v for v in args.video} if args.video else builtin_videos()
    rows = run_ablation(model, processor, videos, out_dir=args.out, methods=args.methods, rates=args.rates,
                        continuation=args.continuation)
    print(f"\n{'video':<14}{'method':<9}{'rate':>6}{'tokens':>8}{'kept':>6}{'vis+pre s':>11}{'KL':>10}"
          f"{'top1':>6}{'match':>7}")
    for r in rows:
        print(f"{r.video:<14}{r.method:<9}{r.rate:>6.2f}{r.video_tokens:>8}{r.retained_tokens:>6}"
              f"{r.vision_prefill_s:>11.4f}{r.next_token_kl:>10.2e}{str(r.top1_agree):>6}"
              f"{r.matching_continuation:>4}/{r.continuation_length}")
    print(f"\nwrote {args.out}/ablation.jsonl, ablation.csv, ablation.png")


if __name__ == "__main__":
    main()
