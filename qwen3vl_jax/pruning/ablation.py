"""Pruning-ratio ablation: methods x rates x items, against the unpruned run of the same model.

Each row is one (item, method, rate): the retained visual tokens, vision + prefill time (the fastest
of a few warm runs), the process's peak memory so far, the fps and frame cap the clip was sampled
with, the fidelity figures against the unpruned run of the same prompt (KL divergence and top-1
agreement of the next-token distribution, greedy tokens matching the unpruned continuation before
the first difference) and, for multiple-choice items, the predicted letter and whether it is right.
Rate 0 is the unpruned run itself, recorded once per item under the method name "none".

Methods: any registered post-encoder method (a method prunes the items of the media it handles,
`registry.media`; items of the other kind run whole, as the unpruned run) and the in-LLM methods,
named `fastv[@K]` or `pyramiddrop[@K1,K2,...]` (`llm.llm_option`: the default layers, the rate per
stage). Every row also records the language model's prefill FLOPs (`llm.prefill_flops`: each
layer over the tokens it holds), since in-LLM methods save compute only after their first layer.

Scoring (`score=`): "loglik" picks the option letter with the highest log-probability as the first
answer token (deterministic, one forward pass); "generate" decodes a few greedy tokens and parses
the letter (`tasks.parse_letter`; no letter counts as wrong); "option" asks the question without
its options (`TaskItem.open_question`, else the question) and picks the option whose text has the
highest log-probability as the answer's first token (a cloze form of the same item: it needs each
option's text to be one token, and measures what the model knows without asking it to point at a
letter).

Rows are appended to `ablation.jsonl` as they finish, so an interrupted run resumes where it
stopped; `ablation.csv` (rows), `summary.csv` (per method x rate: accuracy with a 95% bootstrap
interval over items, and the means of the other figures) and `ablation.png` (accuracy and fidelity
against the rate, one line per method) are rewritten from the JSONL at the end.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import resource
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from ..generate import next_token_logits
from ..model import MODEL_INPUTS
from .llm import llm_option, prefill_flops
from .registry import get_method, media, method_kind, validate_llm_pruning, validate_video_pruning
from .tasks import TaskItem, mc_prompt, parse_letter, single_token_ids

__all__ = ["AblationRow", "SummaryRow", "builtin_videos", "video_items", "run_ablation", "summarize",
           "bootstrap_ci", "write_csv", "plot", "DEFAULT_RATES", "DEFAULT_METHODS", "SCORES"]

DEFAULT_RATES = (0.0, 0.25, 0.5, 0.75, 0.9)
DEFAULT_METHODS = ("evs", "vidcom2")
UNPRUNED = "none"  # the method name of the rate-0 rows
DEFAULT_PROMPT = "Describe what happens in this video."
SCORES = ("loglik", "generate", "option")


@dataclasses.dataclass
class AblationRow:
    item: str
    method: str
    rate: float
    score: str  # "loglik", "generate" or "option"
    fps: float
    max_frames: int
    video_tokens: int  # visual tokens of the unpruned prompt
    retained_tokens: int  # visual tokens after pruning
    vision_prefill_s: float
    peak_memory_mb: float
    next_token_kl: float
    top1_agree: bool
    matching_continuation: int
    continuation_length: int
    answer: str | None = None
    prediction: str | None = None
    correct: bool | None = None
    prefill_flops: float | None = None  # the language model's prefill matmul FLOPs (rows of older runs: None)

    @property
    def key(self) -> tuple[str, str, float]:
        return (self.item, self.method, float(self.rate))


@dataclasses.dataclass
class SummaryRow:
    method: str
    rate: float
    items: int
    accuracy: float | None  # None without multiple-choice items
    accuracy_low: float | None  # 95% percentile-bootstrap interval over items
    accuracy_high: float | None
    retained_tokens: float
    video_tokens: float
    vision_prefill_s: float
    peak_memory_mb: float
    next_token_kl: float
    top1_agree: float
    matching_continuation: float
    fps: str  # the distinct values, "/"-joined
    max_frames: str
    prefill_flops: float | None = None
    family: str = "all"  # the task family of the items (`summarize(rows, families=...)`), or all of them


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


def video_items(videos: dict[str, np.ndarray | str], prompt: str = DEFAULT_PROMPT) -> list[TaskItem]:
    """Open-ended items (fidelity figures only) from named clips: frames arrays or file paths."""
    return [TaskItem(name, "video", video, prompt) for name, video in videos.items()]


def bootstrap_ci(values, confidence: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of `values` (seeded, so reruns agree)."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, (resamples, values.size))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def _read_rows(path: str) -> list[AblationRow]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [AblationRow(**json.loads(line)) for line in f if line.strip()]


def _peak_memory_mb() -> float:
    """The device's peak bytes in use where the backend reports it (GPU), else the process's peak
    resident memory (CPU: host memory is device memory). Both are high-water marks since start."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def run_ablation(
    model,
    processor,
    items: Sequence[TaskItem] | dict[str, np.ndarray | str],
    *,
    out_dir: str,
    methods: Sequence[str] = DEFAULT_METHODS,
    rates: Sequence[float] = DEFAULT_RATES,
    score: str = "loglik",
    continuation: int = 16,
    fps: float = 8.0,
    max_frames: int = 768,
    answer_tokens: int = 4,
    timing_repeats: int = 3,
    vision_encoder=None,
    progress: bool = True,
    on_row: Callable[[AblationRow], None] | None = None,
    families: dict[str, str] | None = None,
) -> list[AblationRow]:
    """Run every missing row, append it to `out_dir/ablation.jsonl`, then write the CSVs and the plot.

    `items`: `TaskItem`s (`tasks.load_dataset`, `tasks.synthetic_dataset`) or a dict of named clips
    (open-ended, `video_items`). `fps` / `max_frames`: sampling defaults for items that set none.
    `continuation`: greedy tokens compared with the unpruned run (0 skips that figure).
    `vision_encoder`: as in `Qwen3VL.prepare_inputs`, e.g. `EncoderRunner(model).encode` (bucketed).
    `families`: item id -> task family; `summary.csv` and the plot then break accuracy down by family
    (`summarize`).
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    layers = model.config.text.num_hidden_layers

    def in_llm(method):  # "fastv@2" names the registered "fastv"
        return method_kind(method.partition("@")[0]) == "llm"

    for method in methods:  # unknown names and bad layers fail before any work
        if in_llm(method):
            name, stages = validate_llm_pruning(llm_option(method, 0.0, layers))
            if stages[-1].layer >= layers:
                raise ValueError(f"in-LLM pruning method {method!r} drops at layer {stages[-1].layer}, but the model "
                                 f"has {layers} decoder layers (layers 1 .. {layers - 1} can be pruned)")
        else:
            get_method(method)
    for rate in rates:
        if rate != 0:
            validate_video_pruning(None, rate)  # the rate alone
    if isinstance(items, dict):
        items = video_items(items)
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f"item ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, "ablation.jsonl")
    done = {row.key: row for row in _read_rows(jsonl)}
    plan = [(item, UNPRUNED, 0.0) for item in items if 0 in rates]
    plan += [(item, m, float(r)) for item in items for m in methods for r in rates if r != 0]
    todo = [(item, m, r) for item, m, r in plan if (item.id, m, r) not in done]
    # The token each option is scored by: its letter ("loglik") or its text ("option"); every item's
    # options checked (one token each) before any work.
    answer_ids = {}
    if score != "generate":
        for item in items:
            if item.options:
                texts, what = ((item.words, f"item {item.id}: option") if score == "option"
                               else (item.letters, "option letter"))
                answer_ids[item.id] = single_token_ids(processor.tokenizer, texts, what)

    def options(item: TaskItem, method, rate):
        """The model's keywords for `method` at `rate` on `item` (empty: the item runs whole)."""
        if method is None:
            return {}
        if in_llm(method):
            return {"llm_pruning": llm_option(method, rate, layers)}
        if item.kind not in media(method):
            return {}
        if item.kind == "video":
            return {"video_pruning": validate_video_pruning(method, rate)}
        return {"image_pruning": (method, rate)}

    def inputs_for(item: TaskItem, pruning: dict):
        if not item.options:
            text = item.question
        elif score == "option":
            text = item.open_question or item.question
        else:
            text = mc_prompt(item.question, item.options)
        content = [{"type": item.kind}, {"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        rate_fps, cap = item.fps or fps, item.max_frames or max_frames
        if item.kind == "image":
            batch = processor(text=[prompt], images=[item.media], return_tensors="np",
                              image_pruning=pruning.get("image_pruning"))
        else:
            video, meta, sampling = item.media, None, {"fps": rate_fps}
            if isinstance(video, (str, os.PathLike)) and os.fspath(video).endswith(".npy"):
                video = np.load(video)
            if not isinstance(video, (str, os.PathLike)):  # decoded frames, recorded at the sampling fps
                meta = [{"fps": rate_fps, "total_num_frames": len(video)}]
                # Sampling at the recorded fps keeps every frame up to the cap. Asked by count: by fps,
                # int(T / fps * fps) is T - 1 for some fps (float rounding), which drops a frame.
                sampling = {"num_frames": min(len(video), cap)}
            batch = processor(text=[prompt], videos=[video], video_metadata=meta, return_tensors="np",
                              video_pruning=pruning.get("video_pruning"), max_frames=cap, **sampling)
        return {k: batch[k] for k in MODEL_INPUTS if k in batch}, rate_fps, cap

    def run(item: TaskItem, pruning: dict):
        batch, rate_fps, cap = inputs_for(item, pruning)
        kw = {**pruning, "vision_encoder": vision_encoder}
        # The prefill generation runs (prompt buckets: one compile per bucket, not one per prompt
        # length); in-LLM pruning through the forward, which also returns the stages' kept rows.
        in_llm = "llm_pruning" in pruning
        out = model(**batch, **kw) if in_llm else None
        visual = (batch["input_ids"] == model.config.video_token_id) | (batch["input_ids"] == model.config.image_token_id)
        tokens_per_layer = [batch["input_ids"].shape[1]] * layers
        kept = int(visual.sum())
        if in_llm:  # the stages' rows: input positions, -1 padding
            out, stages = out
            starts = [s.layer for s in validate_llm_pruning(pruning["llm_pruning"])[1]]
            for start, rows in zip(starts, stages):
                rows = np.asarray(rows)[0]
                tokens_per_layer[start:] = [int((rows >= 0).sum())] * (layers - start)
            rows = np.asarray(stages[-1])[0]
            kept = int(visual[0][rows[rows >= 0]].sum())
        if in_llm:
            logits = np.asarray(out[0, -1], np.float64)
        else:
            logits = next_token_logits(model, **batch, **kw)[0].astype(np.float64)
        length = batch["input_ids"].shape[1]
        new = max(continuation, answer_tokens if score == "generate" else 0, 1)
        tokens = model.generate(**batch, max_new_tokens=new, eos_token_id=[], **kw)[0, length:]
        seconds = []
        for _ in range(timing_repeats):  # the fastest of a few warm runs: robust to a busy machine
            timings = {}
            model.generate(**batch, max_new_tokens=1, timings=timings, **kw)
            seconds.append(timings["prepare"] + timings["prefill"])
        prediction = None
        if item.options:
            letters = item.letters
            if score != "generate":  # the option whose letter / text is the likeliest first token
                prediction = letters[int(np.argmax(logits[answer_ids[item.id]]))]
            else:
                prediction = parse_letter(processor.decode(tokens[:answer_tokens]), letters)
        return dict(logits=logits, tokens=tokens[:continuation], kept=kept, fps=rate_fps, cap=cap,
                    seconds=min(seconds) if seconds else float("nan"), prediction=prediction,
                    flops=prefill_flops(model.config.text, tokens_per_layer))

    baselines: dict[str, dict] = {}
    bar = tqdm(todo, disable=not progress, desc="ablation", unit="row")
    with open(jsonl, "a") as sink:
        for item, method, rate in bar:
            bar.set_postfix_str(f"{item.id} {method} {rate}")
            if item.id not in baselines:
                baselines[item.id] = run(item, {})
            base = baselines[item.id]
            out = base if method == UNPRUNED else run(item, options(item, method, rate))
            p, q = _softmax(base["logits"]), _softmax(out["logits"])
            matching = int(np.argmin(np.append(out["tokens"] == base["tokens"], False)))
            row = AblationRow(
                item=item.id, method=method, rate=rate, score=score, fps=out["fps"], max_frames=out["cap"],
                video_tokens=base["kept"], retained_tokens=out["kept"], vision_prefill_s=out["seconds"],
                peak_memory_mb=_peak_memory_mb(),
                next_token_kl=float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)))),
                top1_agree=bool(np.argmax(out["logits"]) == np.argmax(base["logits"])),
                matching_continuation=matching, continuation_length=int(len(base["tokens"])),
                answer=item.answer, prediction=out["prediction"],
                correct=None if item.answer is None else out["prediction"] == item.answer,
                prefill_flops=out["flops"],
            )
            sink.write(json.dumps(dataclasses.asdict(row)) + "\n")
            sink.flush()
            done[row.key] = row
            if on_row is not None:
                on_row(row)
    wanted = {(item.id, m, r) for item, m, r in plan}
    rows = sorted((r for r in done.values() if r.key in wanted), key=lambda r: (r.item, r.method, r.rate))
    write_csv(rows, os.path.join(out_dir, "ablation.csv"))
    summary = summarize(rows, families)
    write_csv(summary, os.path.join(out_dir, "summary.csv"))
    plot(summary, os.path.join(out_dir, "ablation.png"))
    return rows


def summarize(rows: Iterable[AblationRow], families: dict[str, str] | None = None) -> list[SummaryRow]:
    """Per (method, rate), the unpruned row first: accuracy with its 95% bootstrap interval over items,
    and the means of the other figures (the peak memory's maximum). With `families` (item id -> task
    family), the same per family too, after the rows over all items (`SummaryRow.family`)."""
    rows = list(rows)
    if families is not None:
        missing = sorted({r.item for r in rows} - set(families))
        if missing:
            raise ValueError(f"families: no family for item(s) {missing[:5]}")
        out = summarize(rows)
        present = {families[r.item] for r in rows}
        for family in (f for f in dict.fromkeys(families.values()) if f in present):  # the caller's order
            out += [dataclasses.replace(s, family=family) for s in summarize([r for r in rows
                                                                               if families[r.item] == family])]
        return out
    groups: dict[tuple[str, float], list[AblationRow]] = {}
    for row in rows:
        groups.setdefault((row.method, float(row.rate)), []).append(row)
    out = []
    for (method, rate), group in sorted(groups.items(), key=lambda kv: (kv[0][0] != UNPRUNED, kv[0])):
        graded = [r.correct for r in group if r.correct is not None]
        acc = low = high = None
        if graded:
            acc = float(np.mean(graded))
            low, high = bootstrap_ci(np.asarray(graded, np.float64))

        def mean(field, group=group):
            return float(np.mean([getattr(r, field) for r in group]))

        out.append(SummaryRow(
            method=method, rate=rate, items=len(group), accuracy=acc, accuracy_low=low, accuracy_high=high,
            retained_tokens=mean("retained_tokens"), video_tokens=mean("video_tokens"),
            vision_prefill_s=mean("vision_prefill_s"), peak_memory_mb=max(r.peak_memory_mb for r in group),
            next_token_kl=mean("next_token_kl"), top1_agree=mean("top1_agree"),
            matching_continuation=mean("matching_continuation"),
            fps="/".join(f"{v:g}" for v in sorted({r.fps for r in group})),
            max_frames="/".join(str(v) for v in sorted({r.max_frames for r in group})),
            prefill_flops=None if any(r.prefill_flops is None for r in group) else mean("prefill_flops"),
        ))
    return out


def write_csv(rows: Iterable, path: str) -> None:
    """Dataclass rows (`AblationRow` or `SummaryRow`) as a CSV with a header."""
    rows = list(rows)
    if not rows:
        open(path, "w").close()
        return
    fields = [f.name for f in dataclasses.fields(rows[0])]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))


def plot(summary: Sequence[SummaryRow], path: str | None = None):
    """Panels against the pruning rate, one line per method (the unpruned point starts each line):
    accuracy with its interval (when items have answers; one panel per task family too when the
    summary has families), retained tokens, time, KL, matching tokens."""
    import matplotlib.pyplot as plt

    panels = [("retained_tokens", "retained visual tokens", "all"), ("prefill_flops", "LLM prefill FLOPs", "all"),
              ("vision_prefill_s", "vision + prefill (s)", "all"),
              ("next_token_kl", "next-token KL vs unpruned", "all"),
              ("matching_continuation", "greedy tokens matching", "all")]
    if any(s.accuracy is not None for s in summary):
        families = [f for f in dict.fromkeys(s.family for s in summary) if f != "all"]
        panels[:0] = [("accuracy", "accuracy (95% bootstrap CI)", "all")] + [
            ("accuracy", f"accuracy: {family}", family) for family in families]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    methods = sorted({s.method for s in summary} - {UNPRUNED})
    for ax, (field, title, family) in zip(axes[0], panels):
        rows = [s for s in summary if s.family == family]
        base = [s for s in rows if s.method == UNPRUNED]
        for method in methods or [UNPRUNED]:
            series = base + sorted((s for s in rows if s.method == method), key=lambda s: s.rate)
            if not series or getattr(series[0], field) is None:
                continue
            rates = [s.rate for s in series]
            line, = ax.plot(rates, [getattr(s, field) for s in series], marker="o", label=method)
            if field == "accuracy":
                ax.fill_between(rates, [s.accuracy_low for s in series], [s.accuracy_high for s in series],
                                color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("pruning rate")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
