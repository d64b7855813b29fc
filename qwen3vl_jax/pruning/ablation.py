"""Pruning-ratio ablation: methods x rates x videos against the unpruned run of the same model.

For every (video, method, rate) row: the retained video tokens, the vision + prefill time (the
fastest of a few warm runs),
the KL divergence and top-1 agreement of the next-token distribution against the unpruned run, and
how many greedy tokens match the unpruned continuation before the first difference. Rows are
appended to a JSONL file as they finish, so an interrupted run resumes where it stopped; the CSV
and the PNG plot are rewritten from the JSONL at the end.

Built-in videos (generated, so no data set is needed): static backgrounds with moving objects at
different speeds, plus a fully static clip, where pruning should be nearly free.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["AblationRow", "builtin_videos", "run_ablation", "write_csv", "plot"]

DEFAULT_RATES = (0.0, 0.25, 0.5, 0.75, 0.9)
DEFAULT_METHODS = ("evs", "vidcom2")


@dataclasses.dataclass
class AblationRow:
    video: str
    method: str
    rate: float
    video_tokens: int
    retained_tokens: int
    vision_prefill_s: float
    next_token_kl: float
    top1_agree: bool
    matching_continuation: int
    continuation_length: int

    @property
    def key(self) -> tuple[str, str, float]:
        return (self.video, self.method, float(self.rate))


def builtin_videos(frames: int = 32, height: int = 128, width: int = 160) -> dict[str, np.ndarray]:
    """Generated clips `(T, H, W, 3)` uint8: static backgrounds, moving objects, one still clip."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    background = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    background = (background + rng.integers(0, 24, background.shape)).clip(0, 255).astype(np.uint8)
    clips = {}
    still = np.repeat(background[None], frames, axis=0)
    clips["static"] = still.copy()
    slow = still.copy()
    for t in range(frames):
        left = int(t * (width - 24) / (frames - 1) / 3)
        slow[t, 36:60, left : left + 24] = (230, 40, 40)
    clips["slow_square"] = slow
    busy = still.copy()
    for t in range(frames):
        a = int(t * (width - 24) / (frames - 1))
        b = int((frames - 1 - t) * (height - 24) / (frames - 1))
        busy[t, 8:32, a : a + 24] = (40, 220, 40)
        busy[t, b : b + 24, width // 2 : width // 2 + 24] = (40, 40, 230)
    clips["two_objects"] = busy
    return clips


def _read_rows(path: str) -> list[AblationRow]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [AblationRow(**json.loads(line)) for line in f if line.strip()]


def run_ablation(
    model,
    processor,
    videos: dict[str, np.ndarray | str],
    *,
    out_dir: str,
    methods: Sequence[str] = DEFAULT_METHODS,
    rates: Sequence[float] = DEFAULT_RATES,
    prompt: str = "Describe what happens in this video.",
    continuation: int = 16,
    fps: float = 8.0,
    timing_repeats: int = 3,
    progress: bool = True,
    on_row: Callable[[AblationRow], None] | None = None,
) -> list[AblationRow]:
    """Run every missing row, append it to `out_dir/ablation.jsonl`, then write the CSV and the plot."""
    from tqdm.auto import tqdm

    from ..model import MODEL_INPUTS

    from . import validate_video_pruning

    for method in methods:
        validate_video_pruning(method, 0.0)
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, "ablation.jsonl")
    done = {row.key: row for row in _read_rows(jsonl)}
    todo = [(v, m, float(r)) for v in videos for m in methods for r in rates
            if (v, m, float(r)) not in done and not (r == 0 and m != methods[0])]
    baselines: dict[str, tuple] = {}

    def inputs_for(name, pruning):
        video = videos[name]
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
            add_generation_prompt=True)
        meta = None if isinstance(video, (str, os.PathLike)) else [{"fps": fps, "total_num_frames": len(video)}]
        batch = processor(text=[text], videos=[video], video_metadata=meta, return_tensors="np",
                          video_pruning=pruning)
        return {k: batch[k] for k in MODEL_INPUTS if k in batch}

    def run(name, pruning):
        batch = inputs_for(name, pruning)
        logits = np.asarray(model(**batch, video_pruning=pruning)[0, -1], np.float64)
        model.generate(**batch, max_new_tokens=1, video_pruning=pruning)  # warm the compiled stages
        tokens = model.generate(**batch, max_new_tokens=continuation, video_pruning=pruning, eos_token_id=[])
        seconds = []
        for _ in range(timing_repeats):  # the fastest of a few warm runs: robust to a busy machine
            timings = {}
            model.generate(**batch, max_new_tokens=1, video_pruning=pruning, timings=timings)
            seconds.append(timings["prepare"] + timings["prefill"])
        video_tokens = int((batch["input_ids"] == model.config.video_token_id).sum())
        return logits, tokens[0, batch["input_ids"].shape[1]:], video_tokens, min(seconds)

    bar = tqdm(todo, disable=not progress, desc="ablation", unit="row")
    with open(jsonl, "a") as sink:
        for name, method, rate in bar:
            bar.set_postfix_str(f"{name} {method} {rate}")
            if name not in baselines:
                baselines[name] = run(name, None)
            base_logits, base_tokens, full_tokens, base_seconds = baselines[name]
            pruning = (method, rate) if rate > 0 else None
            logits, tokens, kept, seconds = baselines[name] if pruning is None else run(name, pruning)
            p, q = _softmax(base_logits), _softmax(logits)
            matching = int(np.argmin(np.append(tokens == base_tokens, False)))
            row = AblationRow(
                # rate-0 rows are the shared unpruned baseline, recorded under the first method
                video=name, method=method, rate=rate, video_tokens=full_tokens,
                retained_tokens=kept, vision_prefill_s=seconds,
                next_token_kl=float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)))),
                top1_agree=bool(np.argmax(logits) == np.argmax(base_logits)),
                matching_continuation=matching, continuation_length=int(len(base_tokens)),
            )
            sink.write(json.dumps(dataclasses.asdict(row)) + "\n")
            sink.flush()
            done[row.key] = row
            if on_row is not None:
                on_row(row)
    rows = sorted(done.values(), key=lambda r: (r.video, r.method, r.rate))
    write_csv(rows, os.path.join(out_dir, "ablation.csv"))
    plot(rows, os.path.join(out_dir, "ablation.png"))
    return rows


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def write_csv(rows: Iterable[AblationRow], path: str) -> None:
    rows = list(rows)
    fields = [f.name for f in dataclasses.fields(AblationRow)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))


def plot(rows: Sequence[AblationRow], path: str | None = None):
    """Four panels against the pruning rate: retained tokens, time, KL, matching continuation."""
    import matplotlib.pyplot as plt

    panels = [
        ("retained_tokens", "retained video tokens"),
        ("vision_prefill_s", "vision + prefill (s)"),
        ("next_token_kl", "next-token KL vs unpruned"),
        ("matching_continuation", "greedy tokens matching unpruned"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    methods = sorted({r.method for r in rows})
    videos = sorted({r.video for r in rows})
    baseline = {r.video: r for r in rows if r.rate == 0}
    for ax, (field, title) in zip(axes, panels):
        for method in methods:
            for video in videos:
                series = sorted([r for r in rows if r.video == video and r.method == method and r.rate > 0],
                                key=lambda r: r.rate)
                if video in baseline:
                    series = [baseline[video]] + series
                if series:
                    ax.plot([r.rate for r in series], [getattr(r, field) for r in series], marker="o",
                            linestyle="-" if method == methods[0] else "--", label=f"{method} / {video}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("pruning rate")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
