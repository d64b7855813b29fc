"""Pruning-ratio ablation (any registered method: EVS, VidCom2, the baselines, VisionZip, DivPrune,
your own, and the in-LLM FastV and PyramidDrop) on the tiny default or a real checkpoint, for fidelity
against the unpruned run and, with a data set, accuracy.

    .venv/bin/python scripts/ablate_pruning.py [--model DIR] [--out runs/ablation]
        [--dataset FILE.jsonl | --synthetic N | --video FILE ...]
        [--methods evs vidcom2 random spatial_grid temporal divprune fastv fastv@8 pyramiddrop]
        [--rates 0 0.25 0.5 0.75 0.9]
        [--score loglik|generate] [--fps 2] [--max-frames 768] [--continuation 16] [--timing-repeats 3]
        [--bucketed]

--dataset: one multiple-choice item per line, {"video": "clip.mp4", "question": "...",
"options": ["A. ...", "B. ..."], "answer": "B"} ("image" instead of "video" also works; optional
"fps", "max_frames", "id"; format in docs/pruning.md §10). --synthetic N writes a generated set of N
clips whose answers are knowable from the frames (OUT/synthetic/) and uses it. Without either, the
built-in clips (or --video files) give the fidelity figures only.

Methods prune the items of the media they handle (video methods leave images whole, VisionZip leaves
videos whole); in-LLM methods are named `fastv[@K]` (default K = 2) and `pyramiddrop[@K1,K2,...]`
(default: a quarter, a half and three quarters of the depth), the rate applying at each stage. Every
row records the language model's prefill FLOPs beside the vision + prefill time, since an in-LLM
method saves compute only after its first layer (docs/pruning.md §10, §11).

Writes OUT/ablation.jsonl (one row per item x method x rate, appended as rows finish: rerunning skips
finished rows), OUT/ablation.csv, OUT/summary.csv (per method x rate: accuracy with a 95% bootstrap
interval, retained tokens, prefill FLOPs, vision + prefill time, peak memory, KL, top-1 agreement, matching greedy
tokens, fps and frame cap) and OUT/ablation.png (accuracy and fidelity against the rate, one line per
method).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in tiny one)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="multiple-choice JSONL file")
    source.add_argument("--synthetic", type=int, metavar="N", help="generate N synthetic multiple-choice clips")
    source.add_argument("--video", nargs="+", help="video files (fidelity only; default: built-in clips)")
    parser.add_argument("--out", default=os.path.join("runs", "ablation"))
    parser.add_argument("--methods", nargs="+", default=["evs", "vidcom2"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--score", choices=("loglik", "generate"), default="loglik")
    parser.add_argument("--fps", type=float, default=2.0, help="sampling fps for items that set none")
    parser.add_argument("--max-frames", type=int, default=768, help="frame cap for items that set none")
    parser.add_argument("--continuation", type=int, default=16, help="greedy tokens compared per row")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--bucketed", action="store_true",
                        help="encode through EncoderRunner's fixed token budgets (compiled once per budget)")
    args = parser.parse_args(argv)

    from qwen3vl_jax import EncoderRunner, Qwen3VL, Qwen3VLProcessor
    from qwen3vl_jax.cli import ensure_tiny_checkpoint
    from qwen3vl_jax.pruning.ablation import builtin_videos, run_ablation, summarize
    from qwen3vl_jax.pruning.tasks import load_dataset, synthetic_dataset

    if args.synthetic:
        args.dataset = synthetic_dataset(os.path.join(args.out, "synthetic"), args.synthetic, fps=args.fps)
    if args.dataset:
        items = load_dataset(args.dataset)  # checked before the model loads
    else:
        items = {os.path.basename(v): v for v in args.video} if args.video else builtin_videos()
    path = args.model or ensure_tiny_checkpoint()
    model = Qwen3VL.from_pretrained(path)
    processor = Qwen3VLProcessor.from_pretrained(path)
    rows = run_ablation(model, processor, items, out_dir=args.out, methods=args.methods, rates=args.rates,
                        score=args.score, continuation=args.continuation, fps=args.fps,
                        max_frames=args.max_frames, timing_repeats=args.timing_repeats,
                        vision_encoder=EncoderRunner(model).encode if args.bucketed else None)
    print(f"\n{'method':<16}{'rate':>6}{'items':>6}{'accuracy (95% CI)':>22}{'kept':>8}{'GFLOP':>9}{'vis+pre s':>11}"
          f"{'peak MB':>9}{'KL':>10}{'top1':>6}{'match':>7}{'fps':>6}{'cap':>6}")
    for s in summarize(rows):
        acc = "-" if s.accuracy is None else f"{s.accuracy:.3f} [{s.accuracy_low:.2f}, {s.accuracy_high:.2f}]"
        flops = "-" if s.prefill_flops is None else f"{s.prefill_flops / 1e9:.3f}"
        print(f"{s.method:<16}{s.rate:>6.2f}{s.items:>6}{acc:>22}{s.retained_tokens:>8.1f}{flops:>9}{s.vision_prefill_s:>11.4f}"
              f"{s.peak_memory_mb:>9.0f}{s.next_token_kl:>10.2e}{s.top1_agree:>6.2f}{s.matching_continuation:>7.2f}"
              f"{s.fps:>6}{s.max_frames:>6}")
    print(f"\nwrote {args.out}/ablation.jsonl, ablation.csv, summary.csv, ablation.png")


if __name__ == "__main__":
    main()
