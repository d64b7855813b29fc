"""The pruning ablation on the tiny checkpoint: the synthetic multiple-choice set, accuracy with
bootstrap intervals, rows and files, resuming without recomputing, and the data-set checks."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest
from conftest import load_script

from qwen3vl_jax import default, pruning
from qwen3vl_jax.processing import Qwen3VLProcessor
from qwen3vl_jax.pruning.ablation import AblationRow, bootstrap_ci, builtin_videos, run_ablation, summarize
from qwen3vl_jax.pruning.tasks import (
    SYNTHETIC_COLORS,
    load_dataset,
    mc_prompt,
    option_letters,
    parse_letter,
    synthetic_dataset,
)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


# ---------------------------------------------------------------------------------------------- synthetic set


def _oracle(frames: np.ndarray, task: str) -> str:
    """Read the answer off the frames: the square's colour, or the way its centroid moves."""
    grey = np.abs(frames.astype(int) - frames.astype(int).mean(-1, keepdims=True)).sum(-1) > 60  # saturated
    if task == "color":
        pixel = frames[0][grey[0]].mean(0)
        return min(SYNTHETIC_COLORS, key=lambda c: np.abs(np.subtract(SYNTHETIC_COLORS[c], pixel)).sum())
    (y0, x0), (y1, x1) = (np.argwhere(g).mean(0) for g in (grey[0], grey[-1]))
    dy, dx = y1 - y0, x1 - x0
    return ("down" if dy > 0 else "up") if abs(dy) > abs(dx) else ("right" if dx > 0 else "left")


def test_synthetic_answers_are_knowable_from_the_frames(tmp_path):
    items = load_dataset(synthetic_dataset(tmp_path, 16, frames=6, seed=3))
    assert len(items) == 16 and {i.id[:5] for i in items} == {"color", "direc"}
    letters = [item.answer for item in items]
    assert len(set(letters)) > 1  # the correct letter varies
    for item in items:
        frames = np.load(item.media)
        assert frames.shape == (6, 64, 64, 3) and frames.dtype == np.uint8
        truth = _oracle(frames, "color" if item.id.startswith("color") else "direction")
        chosen = item.options[item.letters.index(item.answer)]
        assert chosen.endswith(truth), (item.id, chosen, truth)


def test_prompt_letters_and_parsing():
    assert option_letters(["A. red", "B. blue"]) == ["A", "B"]
    assert option_letters(["red", "blue", "green"]) == ["A", "B", "C"]
    assert mc_prompt("Q?", ["red", "blue"]).splitlines() == [
        "Q?", "A. red", "B. blue", "Answer with the option's letter from the given choices directly."]
    assert parse_letter("B", ["A", "B"]) == "B" and parse_letter("B. blue", ["A", "B"]) == "B"
    assert parse_letter("The answer is A.", ["A", "B"]) == "A"
    assert parse_letter("Blue", ["A", "B"]) is None and parse_letter("", ["A"]) is None


def _write(tmp_path, records, name="set.jsonl"):
    (tmp_path / "clip.npy").write_bytes(b"")  # existence is all the loader checks
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"video": "clip.npy", "question": "Q?", "options": ["A. x", "B. y"], "answer": "B"}
DROP = object()  # a key left out of the line


@pytest.mark.parametrize("change,match", [
    ({"options": DROP}, r"set.jsonl:2: \"options\" must be a list of at least two"),
    ({"options": ["A. only"]}, r":2: \"options\" must be a list of at least two"),
    ({"answer": "C"}, r":2: answer 'C' is not among the option letters \['A', 'B'\]"),
    ({"answer": DROP}, r":2: answer None is not among"),
    ({"video": None}, r":2: \"video\" must be a path"),
    ({"image": "clip.npy"}, r":2: give exactly one of \"video\" or \"image\""),
    ({"video": "missing.mp4"}, r":2: video file .*missing.mp4 does not exist"),
    ({"fps": 0}, r":2: \"fps\" must be a positive number"),
    ({"max_frames": 1}, r":2: \"max_frames\" must be an integer >= 2"),
    ({"question": ""}, r":2: \"question\" must be a non-empty string"),
    ({"extra": 1}, r":2: unknown keys \['extra'\]"),
    ({"open_question": " "}, r":2: \"open_question\" must be a non-empty string"),
])
def test_bad_dataset_lines_name_the_line(tmp_path, change, match):
    bad = {k: v for k, v in {**GOOD, **change}.items() if v is not DROP}
    with pytest.raises(ValueError, match=match):
        load_dataset(_write(tmp_path, [GOOD, bad]))


def test_dataset_format_errors(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"video": \n')
    with pytest.raises(ValueError, match="set.jsonl:1: not valid JSON"):
        load_dataset(path)
    with pytest.raises(ValueError, match=r":2: duplicate id 'a'"):
        load_dataset(_write(tmp_path, [{**GOOD, "id": "a"}, {**GOOD, "id": "a"}]))
    items = load_dataset(_write(tmp_path, [GOOD, {**GOOD, "options": ["x", "y", "z"], "answer": "C"}]))
    assert [i.letters for i in items] == [["A", "B"], ["A", "B", "C"]] and items[1].answer == "C"


def test_bootstrap_interval():
    assert bootstrap_ci([1, 1, 1]) == (1.0, 1.0)
    low, high = bootstrap_ci(np.r_[np.ones(50), np.zeros(50)])
    # the normal approximation of a proportion's 95% interval, 0.5 -/+ 1.96 * 0.05
    assert abs(low - 0.402) < 0.03 and abs(high - 0.598) < 0.03
    with pytest.raises(ValueError):
        bootstrap_ci([])


# ---------------------------------------------------------------------------------------------- end to end


def test_accuracy_ablation_end_to_end_resumes_and_sits_at_chance(tiny_dir, jax_model, processor, tmp_path):
    """Random weights cannot read the frames: every method's 95% interval contains chance (1/4).

    36 items with uniformly drawn answer letters; with a 4-way guess the interval is about
    +-0.14, and the check fails if scoring leaked the answer (accuracy near 1) or mis-scored every
    item (near 0)."""
    dataset = synthetic_dataset(tmp_path / "set", 36, frames=4, height=32, width=32, seed=0)
    items = load_dataset(dataset)
    grid = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[np.load(items[0].media)],
                     video_metadata=[{"fps": 2.0, "total_num_frames": 4}], return_tensors="np")["video_grid_thw"][0]
    frames, tpf = int(grid[0]), int(grid[1] * grid[2]) // 4
    kw = dict(out_dir=str(tmp_path / "out"), continuation=2, timing_repeats=1, progress=False)
    first = run_ablation(jax_model, processor, items[:30], methods=("evs", "temporal"), rates=(0.0, 0.5), **kw)
    assert len(first) == 30 * 3
    seen = []
    rows = run_ablation(jax_model, processor, items, methods=("evs", "temporal"), rates=(0.0, 0.5),
                        on_row=seen.append, **kw)
    assert len(seen) == 6 * 3 and {r.item for r in seen} == {i.id for i in items[30:]}  # only new rows ran
    assert len(rows) == 36 * 3
    for row in rows:
        assert row.fps == 2.0 and row.max_frames == 4 and row.score == "loglik"
        assert row.prediction in ("A", "B", "C", "D") and row.correct == (row.prediction == row.answer)
        assert row.peak_memory_mb > 0 and row.vision_prefill_s > 0
        if row.method == "none":
            assert row.retained_tokens == row.video_tokens == frames * tpf
            assert row.next_token_kl == 0 and row.top1_agree
        else:
            assert row.retained_tokens == pruning.retained_count(row.method, tpf, frames, 0.5) < row.video_tokens
    summary = {(s.method, s.rate): s for s in summarize(rows)}
    assert set(summary) == {("none", 0.0), ("evs", 0.5), ("temporal", 0.5)}
    for s in summary.values():
        assert s.items == 36 and s.accuracy_low <= 0.25 <= s.accuracy_high, s
        assert s.accuracy_low <= s.accuracy <= s.accuracy_high
    out = tmp_path / "out"
    assert len((out / "ablation.jsonl").read_text().splitlines()) == 36 * 3
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 3 and {"accuracy", "accuracy_low", "accuracy_high", "retained_tokens", "vision_prefill_s",
                                "peak_memory_mb", "next_token_kl", "fps", "max_frames"} <= set(table[0])
    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_generate_scoring_and_open_ended_clips(jax_model, processor, tmp_path):
    items = load_dataset(synthetic_dataset(tmp_path / "set", 2, frames=4, height=32, width=32))
    rows = run_ablation(jax_model, processor, items, out_dir=str(tmp_path / "gen"), methods=("vidcom2",),
                        rates=(0.5,), score="generate", continuation=2, timing_repeats=1, progress=False)
    assert [r.method for r in rows] == ["vidcom2", "vidcom2"] and all(r.score == "generate" for r in rows)
    assert all(r.correct == (r.prediction == r.answer) for r in rows)  # a None prediction counts as wrong
    clips = {"clip": builtin_videos(frames=8, height=32, width=64)["two_objects"]}
    rows = run_ablation(jax_model, processor, clips, out_dir=str(tmp_path / "open"), methods=("evs",),
                        rates=(0.0, 0.75), continuation=3, timing_repeats=1, progress=False)
    assert [(r.method, r.rate) for r in rows] == [("evs", 0.75), ("none", 0.0)]
    assert all(r.correct is None and r.answer is None for r in rows)
    assert rows[1].matching_continuation == rows[1].continuation_length == 3
    assert summarize(rows)[0].accuracy is None


def test_ablation_refuses_bad_settings(jax_model, processor, tmp_path):
    clips = {"clip": np.zeros((4, 32, 32, 3), np.uint8)}
    with pytest.raises(ValueError, match=r"unknown pruning method 'nope'; registered methods"):
        run_ablation(jax_model, processor, clips, out_dir=str(tmp_path), methods=("nope",), rates=(0.5,))
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
        run_ablation(jax_model, processor, clips, out_dir=str(tmp_path), methods=("evs",), rates=(1.0,))
    with pytest.raises(ValueError, match="score must be"):
        run_ablation(jax_model, processor, clips, out_dir=str(tmp_path), score="vote")


def test_option_scoring_refuses_options_of_several_tokens(jax_model, processor, tmp_path):
    """score="option" scores each option's text as the first answer token: an option the tokenizer
    splits is refused, naming the item and the option, before any row runs."""
    (tmp_path / "clip.npy").write_bytes(b"")
    words = ["x", "y"]
    long = "zzqxj" * 3
    assert len(processor.tokenizer.encode(long, add_special_tokens=False).ids) > 1
    (tmp_path / "set.jsonl").write_text(json.dumps({"video": "clip.npy", "question": "Q?", "id": "q1",
                                                     "options": words + [long], "answer": "A"}) + "\n")
    with pytest.raises(ValueError, match=r"item q1: option 'zzqxjzzqxjzzqxj' is \d+ tokens"):
        run_ablation(jax_model, processor, load_dataset(tmp_path / "set.jsonl"), out_dir=str(tmp_path / "out"),
                     score="option", methods=("evs",), rates=(0.5,), progress=False)
    assert not (tmp_path / "out" / "ablation.jsonl").exists()


def test_image_items(jax_model, processor, tmp_path):
    from PIL import Image

    Image.fromarray(np.full((32, 48, 3), 200, np.uint8)).save(tmp_path / "img.png")
    (tmp_path / "set.jsonl").write_text(json.dumps(
        {"image": "img.png", "question": "Is it bright?", "options": ["yes", "no"], "answer": "A"}) + "\n")
    rows = run_ablation(jax_model, processor, load_dataset(tmp_path / "set.jsonl"), out_dir=str(tmp_path / "out"),
                        methods=("evs", "divprune"), rates=(0.0, 0.5), continuation=2, timing_repeats=1,
                        progress=False)
    assert [(r.method, r.rate) for r in rows] == [("divprune", 0.5), ("evs", 0.5), ("none", 0.0)]
    assert rows[1].retained_tokens == rows[1].video_tokens > 0  # a video method leaves an image whole
    assert rows[1].next_token_kl == 0 and rows[1].prediction in ("A", "B")
    assert rows[0].retained_tokens == max(1, int(rows[0].video_tokens * 0.5))  # an image method prunes it


def test_in_llm_methods_in_the_ablation(jax_model, processor, tmp_path):
    """FastV / PyramidDrop rows beside the unpruned one on a video item (DivPrune beside EVS:
    test_image_items). Each row's prefill FLOPs are `prefill_flops` over the tokens each layer holds:
    FastV at layer 2 of 3 saves only in its last layer, PyramidDrop at 1 and 2 in two."""
    from qwen3vl_jax.pruning.llm import prefill_flops

    np.save(tmp_path / "clip.npy", np.random.default_rng(1).integers(0, 255, (4, 64, 64, 3), np.uint8))
    lines = [{"video": "clip.npy", "question": "Q?", "options": ["a", "b"], "answer": "B", "fps": 2.0}]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = load_dataset(tmp_path / "set.jsonl")
    rows = run_ablation(jax_model, processor, items, out_dir=str(tmp_path / "out"), rates=(0.0, 0.5),
                        methods=("fastv", "pyramiddrop@1,2"), continuation=1,
                        timing_repeats=1, progress=False)
    by = {(r.item, r.method): r for r in rows}
    cfg = jax_model.config.text
    for item in (i.id for i in items):
        none = by[item, "none"]
        n = none.video_tokens
        dropped = n // 2  # floor(0.5 n) at each stage
        length = none.prefill_flops  # the unpruned prompt length, from its FLOPs
        tokens = next(t for t in range(1, 400) if prefill_flops(cfg, [t] * 3) == length)
        assert by[item, "fastv"].prefill_flops == prefill_flops(cfg, [tokens, tokens, tokens - dropped])
        second = (n - dropped) // 2
        assert by[item, "pyramiddrop@1,2"].prefill_flops == prefill_flops(
            cfg, [tokens, tokens - dropped, tokens - dropped - second])
        assert by[item, "fastv"].retained_tokens == n - dropped
        assert by[item, "pyramiddrop@1,2"].retained_tokens == n - dropped - second
    with pytest.raises(ValueError, match=r"'fastv@3' drops at layer 3, but the model has 3 decoder layers"):
        run_ablation(jax_model, processor, items, out_dir=str(tmp_path / "x"), methods=("fastv@3",), rates=(0.5,))
    with pytest.raises(ValueError, match=r"'fastv@a': the layers after '@' must be integers"):
        run_ablation(jax_model, processor, items, out_dir=str(tmp_path / "x"), methods=("fastv@a",), rates=(0.5,))


def _script():
    return load_script("ablate_pruning")


def test_script_synthetic_run_and_bad_dataset(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    _script().main(["--model", str(tiny_dir), "--synthetic", "2", "--out", str(out), "--methods", "spatial_grid",
                    "--rates", "0", "0.5", "--continuation", "1", "--timing-repeats", "1", "--bucketed"])
    printed = capsys.readouterr().out
    assert "spatial_grid" in printed and "none" in printed and "accuracy (95% CI)" in printed
    for name in ("ablation.jsonl", "ablation.csv", "summary.csv", "ablation.png", "synthetic/dataset.jsonl"):
        assert (out / name).is_file(), name
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"video": "x.mp4", "question": "Q?"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: \"options\" must be a list"):
        _script().main(["--model", str(tiny_dir), "--dataset", str(bad), "--out", str(tmp_path / "bad")])


def test_script_default_runs_held_out_task_families(tiny_dir, tmp_path, capsys):
    """No data argument: held-out items of the three video families, accuracy per family in
    summary.csv, the Markdown table and the plot. Scored by option unless --score says otherwise: the
    random tiny checkpoint's tokenizer splits the option words, so it is refused naming the item and
    runs with --score loglik."""
    out = tmp_path / "tasks"
    args = ["--model", str(tiny_dir), "--items", "1", "--out", str(out), "--methods", "temporal",
            "--rates", "0", "0.5", "--continuation", "1", "--timing-repeats", "1", "--bucketed"]
    with pytest.raises(ValueError, match=r"item direction0000: option '\w+' is \d+ tokens"):
        _script().main(args)
    _script().main([*args, "--score", "loglik"])
    printed = capsys.readouterr().out
    assert "accuracy per family" in printed
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert {(r["family"], r["method"]) for r in table} == {
        (family, method) for family in ("all", "direction", "order", "hidden") for method in ("none", "temporal")}
    assert all(int(r["items"]) == (3 if r["family"] == "all" else 1) for r in table)
    lines = (out / "accuracy.md").read_text().splitlines()
    assert lines[0] == "| method | rate | all | direction | order | hidden |" and len(lines) == 4
    assert (out / "tasks" / "dataset.jsonl").is_file() and (out / "ablation.png").is_file()
    with open(out / "ablation.jsonl") as f:
        assert {json.loads(line)["score"] for line in f} == {"loglik"}
    # the default's --seed, and its first and last --sequence phases by the documented layout (phase k at
    # SEQUENCE_SEED + 1000 k, its replay at + 500), so the test follows the shipped phase count
    first_phase = default.TRAIN_SEED + default.SEQUENCE_SEED
    last_replay = first_phase + 1000 * (default.SHIPPED_SEQUENCE_PHASES - 1) + 500
    for seed in (default.TRAIN_SEED, first_phase, last_replay):
        with pytest.raises(SystemExit):
            _script().main(["--model", str(tiny_dir), "--task-seed", str(seed),
                            "--out", str(tmp_path / "seed0")])
        assert f"--task-seed {seed} is a seed the default was trained on" in capsys.readouterr().err


def test_summaries_per_family_need_every_item_named(tmp_path):
    row = AblationRow(item="a", method="none", rate=0.0, score="loglik", fps=2.0, max_frames=4, video_tokens=4,
                      retained_tokens=4, vision_prefill_s=0.1, peak_memory_mb=1.0, next_token_kl=0.0,
                      top1_agree=True, matching_continuation=1, continuation_length=1, answer="A", prediction="A",
                      correct=True)
    wrong = dataclasses.replace(row, item="b", prediction="B", correct=False)
    summary = summarize([row, wrong], {"a": "x", "b": "y"})
    assert [(s.family, s.items, s.accuracy) for s in summary] == [("all", 2, 0.5), ("x", 1, 1.0), ("y", 1, 0.0)]
    with pytest.raises(ValueError, match=r"no family for item\(s\) \['b'\]"):
        summarize([row, wrong], {"a": "x"})
