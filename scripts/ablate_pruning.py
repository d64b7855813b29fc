"""Pruning-ratio ablation (any registered method: EVS, VidCom2, the baselines, VisionZip, DivPrune,
your own, and the in-LLM FastV and PyramidDrop) on the built-in default (`qwen3vl_jax.default`,
trained on the synthetic tasks) or a real checkpoint: accuracy with bootstrap intervals, per task
family, and fidelity against the unpruned run.

    .venv/bin/python scripts/ablate_pruning.py [--model DIR] [--out runs/ablation]
        [--items 30 --task-seed 2028 | --dataset FILE.jsonl | --synthetic N | --video FILE ... | --builtin-clips]
        [--methods evs vidcom2 random spatial_grid temporal divprune fastv fastv@8 pyramiddrop]
        [--rates 0 0.25 0.5 0.75 0.9]
        [--score option|loglik|generate] [--fps 2] [--max-frames 768] [--continuation 16] [--timing-repeats 3]
        [--bucketed]

With no data argument: `--items` held-out items per video family (direction, order, hidden) of
`qwen3vl_jax.pruning.synthetic`, drawn from `--task-seed` (never one the default trained on:
`default.training_seeds()`), written to OUT/tasks/ (dataset.jsonl, open.jsonl, the clips), scored by
option, with the accuracy per family in summary.csv, the plot and a Markdown table (OUT/accuracy.md).
--score: "option" (the question without options, each option's text scored as the first answer
token: the cloze form of the items; the default for the held-out tasks, which carry their open
questions), "loglik" (the option letter as the first answer token; the default for --dataset and
--synthetic) or "generate" (a few greedy tokens, the letter parsed); `pruning.ablation`.
--dataset: one multiple-choice item per line, {"video": "clip.mp4", "question": "...",
"options": ["A. ...", "B. ..."], "answer": "B"} ("image" instead of "video" also works; optional
"fps", "max_frames", "id"; format in docs/pruning.md §10). --synthetic N writes the older set of N
square clips (colour and direction; OUT/synthetic/) and uses it. --video files or --builtin-clips
give the fidelity figures only.

Methods prune the items of the media they handle (video methods leave images whole, VisionZip leaves
videos whole); in-LLM methods are named `fastv[@K]` (default K = 2) and `pyramiddrop[@K1,K2,...]`
(default: a quarter, a half and three quarters of the depth), the rate applying at each stage. Every
row records the language model's prefill FLOPs beside the vision + prefill time, since an in-LLM
method saves compute only after its first layer (docs/pruning.md §10, §11).

Writes OUT/ablation.jsonl (one row per item x method x rate, appended as rows finish: rerunning skips
finished rows), OUT/ablation.csv, OUT/summary.csv (per method x rate, and per family: accuracy with a
95% bootstrap interval, retained tokens, prefill FLOPs, vision + prefill time, peak memory, KL, top-1
agreement, matching greedy tokens, fps and frame cap) and OUT/ablation.png (accuracy and fidelity
against the rate, one line per method).
"""

from __future__ import annotations

import argparse
import os


def _span(values: str) -> str:
    """A summary's "/"-joined distinct values, as "low-high" when there are more than two."""
    parts = values.split("/")
    return values if len(parts) <= 2 else f"{parts[0]}-{parts[-1]}"


def accuracy_table(summary) -> str:
    """A Markdown table: one row per (method, rate), one column per family (and all): accuracy with
    its 95% bootstrap interval."""
    families = list(dict.fromkeys(s.family for s in summary if s.accuracy is not None))
    cells = {(s.method, s.rate, s.family): s for s in summary}
    lines = ["| method | rate | " + " | ".join(families) + " |", "|---|---|" + "---|" * len(families)]
    for method, rate in dict.fromkeys((s.method, s.rate) for s in summary if s.family == "all"):
        row = []
        for family in families:
            s = cells.get((method, rate, family))
            row.append("-" if s is None or s.accuracy is None else
                       f"{s.accuracy:.2f} [{s.accuracy_low:.2f}, {s.accuracy_high:.2f}]")
        lines.append(f"| {method} | {rate:g} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in default model)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", help="multiple-choice JSONL file")
    source.add_argument("--synthetic", type=int, metavar="N", help="generate N of the older square clips")
    source.add_argument("--video", nargs="+", help="video files (fidelity only)")
    source.add_argument("--builtin-clips", action="store_true", help="the built-in clips (fidelity only)")
    parser.add_argument("--items", type=int, default=30, help="held-out items per video family (no data argument)")
    parser.add_argument("--task-seed", type=int, default=2028, help="seed of the held-out items")
    parser.add_argument("--out", default=os.path.join("runs", "ablation"))
    parser.add_argument("--methods", nargs="+", default=["evs", "vidcom2", "random", "spatial_grid", "temporal"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--score", choices=("option", "loglik", "generate"),
                        help="default: option on the held-out tasks, loglik on --dataset / --synthetic")
    parser.add_argument("--fps", type=float, default=2.0, help="sampling fps for items that set none")
    parser.add_argument("--max-frames", type=int, default=768, help="frame cap for items that set none")
    parser.add_argument("--continuation", type=int, default=16, help="greedy tokens compared per row")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--bucketed", action="store_true",
                        help="encode through EncoderRunner's fixed token budgets (compiled once per budget)")
    args = parser.parse_args(argv)
    if args.items < 1:
        parser.error("--items must be >= 1")

    from qwen3vl_jax import EncoderRunner, Qwen3VL, Qwen3VLProcessor
    from qwen3vl_jax.default import default_checkpoint, training_seeds
    from qwen3vl_jax.pruning import synthetic
    from qwen3vl_jax.pruning.ablation import builtin_videos, run_ablation, summarize
    from qwen3vl_jax.pruning.tasks import load_dataset, synthetic_dataset

    families = None
    if args.synthetic:
        args.dataset = synthetic_dataset(os.path.join(args.out, "synthetic"), args.synthetic, fps=args.fps)
    if args.dataset:
        items = load_dataset(args.dataset)  # checked before the model loads
    elif args.video or args.builtin_clips:
        items = {os.path.basename(v): v for v in args.video} if args.video else builtin_videos()
    else:
        if args.task_seed in training_seeds():
            parser.error(f"--task-seed {args.task_seed} is a seed the default was trained on; held-out items need "
                         "another")
        tasks = synthetic.make_set(args.items * len(synthetic.VIDEO_FAMILIES), seed=args.task_seed,
                                   families=synthetic.VIDEO_FAMILIES)
        items = load_dataset(synthetic.write_jsonl(tasks, os.path.join(args.out, "tasks")))
        families = {item.id: task.family for item, task in zip(items, tasks)}
    score = args.score or ("option" if families is not None else "loglik")
    path = args.model or default_checkpoint()
    model = Qwen3VL.from_pretrained(path)
    processor = Qwen3VLProcessor.from_pretrained(path)
    rows = run_ablation(model, processor, items, out_dir=args.out, methods=args.methods, rates=args.rates,
                        score=score, continuation=args.continuation, fps=args.fps,
                        max_frames=args.max_frames, timing_repeats=args.timing_repeats,
                        vision_encoder=EncoderRunner(model).encode if args.bucketed else None, families=families)
    summary = summarize(rows, families)
    print(f"\n{'method':<16}{'rate':>6}{'items':>6}{'accuracy (95% CI)':>22}{'kept':>8}{'GFLOP':>9}{'vis+pre s':>11}"
          f"{'peak MB':>9}{'KL':>10}{'top1':>6}{'match':>7}{'fps':>10}{'cap':>8}")
    for s in summary:
        if s.family != "all":
            continue
        acc = "-" if s.accuracy is None else f"{s.accuracy:.3f} [{s.accuracy_low:.2f}, {s.accuracy_high:.2f}]"
        flops = "-" if s.prefill_flops is None else f"{s.prefill_flops / 1e9:.3f}"
        print(f"{s.method:<16}{s.rate:>6.2f}{s.items:>6}{acc:>22}{s.retained_tokens:>8.1f}{flops:>9}{s.vision_prefill_s:>11.4f}"
              f"{s.peak_memory_mb:>9.0f}{s.next_token_kl:>10.2e}{s.top1_agree:>6.2f}{s.matching_continuation:>7.2f}"
              f"{_span(s.fps):>10}{_span(s.max_frames):>8}")
    if families is not None:
        table = accuracy_table(summary)
        with open(os.path.join(args.out, "accuracy.md"), "w") as f:
            f.write(table)
        print(f"\naccuracy per family (95% bootstrap interval over items):\n{table}")
    print(f"\nwrote {args.out}/ablation.jsonl, ablation.csv, summary.csv, ablation.png")


if __name__ == "__main__":
    main()
