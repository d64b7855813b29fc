"""The shipped default (`qwen3vl_jax/default_model/`, trained by scripts/train_tiny_default.py):
it loads in ours and in HF, HF's greedy ids equal ours on task prompts, its held-out accuracy on
what it has learned (colour and `position` on images, `direction` on clips, docs/tasks.md §8) stays
above a bound on a fresh set, and the demo answers its questions of `position` and `direction`.

The held-out items come from seeds the default was never trained on (it saw items of
`default.training_seeds()`), and the truth is the generator's, which tests/test_synthetic_tasks.py
checks against numpy oracles on the pixels: nothing here is a value copied from the model's output.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import load_script

from qwen3vl_jax import Qwen3VL, Qwen3VLProcessor, default
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.pruning import synthetic

HELD_OUT_SEED = 4242  # not in default.training_seeds()
PER_FAMILY = 6
LEARNED = ("position", "direction")  # an image and a clip family the default answers (docs/tasks.md §8)
ANSWERED = ("color", *LEARNED)  # the families it answers 24 times in 24 (docs/tasks.md §8)


@pytest.fixture(scope="module")
def shipped():
    path = default.default_checkpoint()
    return path, Qwen3VL.from_pretrained(path), Qwen3VLProcessor.from_pretrained(path)


def test_the_shipped_default_is_a_small_hf_checkpoint_with_every_feature(shipped):
    path, model, _ = shipped
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 20 * 2**20
    config = model.config
    assert len(config.vision.deepstack_visual_indexes) >= 1  # deepstack
    assert config.text.num_key_value_heads < config.text.num_attention_heads  # GQA
    assert sum(config.text.mrope_section) * 2 == config.text.head_dim  # interleaved mRoPE over the head
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3VLForConditionalGeneration"]


def test_held_out_answers_on_a_fresh_set(shipped):
    """What the shipped default has learned (docs/tasks.md §8: every held-out open answer of colour,
    `position` and `direction`; the letter form is at chance): on 6 fresh items of each it
    answers the open question right at least 5 times, and the option form too (a model that ignores the
    pixels answers 1 in 4 on average, and 5 of 6 with probability 0.005); the scoring covers every form."""
    _, model, processor = shipped
    items = synthetic.make_set(PER_FAMILY * len(ANSWERED), seed=HELD_OUT_SEED, families=ANSWERED)
    assert sorted(item.family for item in items) == sorted(ANSWERED * PER_FAMILY)
    scored = default.evaluate(model, processor, items)
    assert [(s.index, s.form) for s in scored] == [
        (i, f) for i in range(len(items)) for f in default.SCORED_FORMS]
    table = default.accuracy(scored)
    for family in ANSWERED:
        assert table[family]["open"] >= 5 / 6, (family, table)
        assert table[family]["option"] >= 5 / 6, (family, table)  # the same knowledge, over the four options
    assert all(s.prediction in items[s.index].options for s in scored if s.form in ("open", "option"))
    assert all(s.prediction in "ABCD" for s in scored if s.form == "mc")


def test_option_scoring_in_the_ablation_agrees_with_evaluate(shipped, tmp_path):
    """The ablation's score="option" on the items written as its JSONL (the open question carried as
    `open_question`) picks the same options as `default.evaluate`'s "option" form, and so keeps the
    default's `position` knowledge: at least 5 of 6 fresh images right, unpruned and with half the image
    tokens kept by DivPrune."""
    from qwen3vl_jax.pruning.ablation import run_ablation, summarize
    from qwen3vl_jax.pruning.tasks import load_dataset

    _, model, processor = shipped
    items = synthetic.make_set(PER_FAMILY, seed=HELD_OUT_SEED + 2, families=("position",))
    tasks = load_dataset(synthetic.write_jsonl(items, tmp_path / "set"))
    rows = run_ablation(model, processor, tasks, out_dir=str(tmp_path / "out"), methods=("divprune",),
                        rates=(0.0, 0.5), score="option", continuation=1, timing_repeats=1, progress=False)
    unpruned = {r.item: r for r in rows if r.method == "none"}
    expected = default.evaluate(model, processor, items, forms=("option",))
    for task, scored in zip(tasks, expected):
        assert task.words[task.letters.index(unpruned[task.id].prediction)] == scored.prediction
    for s in summarize(rows):
        assert s.accuracy >= 5 / 6, s


def test_evaluate_refuses_an_unknown_form(shipped):
    _, model, processor = shipped
    with pytest.raises(ValueError, match="form must be one of"):
        default.evaluate(model, processor, synthetic.make_set(1, seed=1), forms=("essay",))


@pytest.mark.needs_torch
def test_hf_loads_the_shipped_default_and_greedy_ids_match_ours(shipped):
    """HF's `Qwen3VLForConditionalGeneration` and `AutoProcessor` on the shipped directory: the same
    greedy ids as ours on an image and a video item in both forms (so the same answers)."""
    import torch
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    path, model, _ = shipped
    hf_processor = AutoProcessor.from_pretrained(path)
    hf_model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(HELD_OUT_SEED + 1)
    items = [synthetic.make_item(family, rng) for family in LEARNED]
    for item in items:
        for form in default.FORMS:
            batch = default.item_inputs(hf_processor, item, form)
            if item.kind == "video":
                assert int(batch["video_grid_thw"][0, 0]) >= 2
            with torch.no_grad():
                ref = hf_model.generate(**{k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()
                                           if k in MODEL_INPUTS}, do_sample=False, max_new_tokens=4)
            ours = model.generate(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, max_new_tokens=4)
            np.testing.assert_array_equal(ours, ref.numpy(), err_msg=f"{item.family} {form}")
            length = batch["input_ids"].shape[1]
            assert ours.shape[1] - length < 4  # the trained model stops (EOS) after its one-word answer


def test_the_demo_answers_its_questions(capsys):
    """The demo's questions come from a fresh seed; on the seeds whose questions are of the families
    the default has learned (picked from the items alone, before the model runs) it answers both right."""
    from qwen3vl_jax import cli

    seeds = [seed for seed in range(1, 200) if [i.family for i in cli.demo_items(seed)] == list(LEARNED)][:2]
    assert len(seeds) == 2
    for seed in seeds:
        assert cli.main(["demo", "--task-seed", str(seed), "--max-new-tokens", "4"]) == 0
        out = capsys.readouterr().out
        assert "built-in default" in out and out.count("question:") == out.count("truth:") == 2
        image, video = out[out.index("[image: position]"):out.index("[video: ")], out[out.index("[video: "):]
        assert "(right)" in image and "(right)" in video, out


def test_training_conversations_carry_the_exact_pixels_and_both_forms(tmp_path):
    """`write_sft_dataset`: one conversation per item, the media decoded back pixel for pixel (PNG,
    lossless .mov at the item's fps), the replies the letter (mc) or the word (open)."""
    from PIL import Image

    from qwen3vl_jax.processing.media import load_video
    from qwen3vl_jax.training import read_jsonl

    items = synthetic.make_set(14, seed=7)
    rows = read_jsonl(default.write_sft_dataset(items, tmp_path, mc_fraction=0.5, seed=3))
    assert len(rows) == len(items)
    forms = set()
    for (_, messages), item in zip(rows, items):
        part, text = messages[0]["content"]
        reply = messages[1]["content"][0]["text"]
        if item.kind == "video":
            frames, meta = load_video(part["video"])
            assert meta.fps == pytest.approx(item.fps, abs=1e-3)
        else:
            frames = np.asarray(Image.open(part["image"]))
        np.testing.assert_array_equal(frames, item.media)
        form = "mc" if "A. " in text["text"] else "open"
        forms.add(form)
        assert (text["text"], reply) == default.item_prompt(item, form)
        assert reply == (item.answer if form == "open" else "ABCD"[item.options.index(item.answer)])
    assert forms == {"mc", "open"}
    with pytest.raises(ValueError, match="mc_fraction"):
        default.write_sft_dataset(items, tmp_path, mc_fraction=1.5)


def test_extra_questions_ask_the_items_facts_about_the_same_media(tmp_path):
    """`write_sft_dataset(extra_questions=2)`: the item's own question first (as with 0), then its
    facts (colour; shape on images only) as further turns with no media, answered right in either form."""
    from qwen3vl_jax.training import read_jsonl

    items = synthetic.make_set(28, seed=7)
    rows = read_jsonl(default.write_sft_dataset(items, tmp_path / "more", mc_fraction=0.5, seed=3,
                                                extra_questions=2))
    extra_turns = 0
    for (_, messages), item in zip(rows, items):
        assert messages[0]["content"][1]["text"].startswith(item.question)
        asked = []
        for user, reply in zip(messages[2::2], messages[3::2]):
            (part,) = user["content"]
            question, answer = part["text"], reply["content"][0]["text"]
            family = next(f for f in ("color", "shape") if question.startswith(synthetic.QUESTIONS[f]))
            asked.append(family)
            if "A. " in question:  # mc: the letter of the fact among the options
                lines = question.split("\n")[1:5]
                assert f"{answer}. {item.facts[family]}" in lines, (question, answer)
            else:
                assert answer == item.facts[family]
        expected = {f for f in item.facts if f != item.family and (f == "color" or item.kind == "image")}
        assert set(asked) == expected and len(asked) == len(expected)
        extra_turns += len(asked)
    assert extra_turns > len(items) // 2


def test_letter_drills_point_at_the_option_naming_the_word(tmp_path):
    """`write_sft_dataset(letter_drills=n)`: n text-only conversations after the items, each asking for
    the letter of the option that is the named word, in the ablation's multiple-choice prompt, with
    options from one family's answer words; `default.letter_drill` draws one."""
    from qwen3vl_jax.pruning.tasks import ANSWER_INSTRUCTION
    from qwen3vl_jax.training import read_jsonl

    items = synthetic.make_set(7, seed=7)
    rows = read_jsonl(default.write_sft_dataset(items, tmp_path, seed=3, letter_drills=40))
    assert len(rows) == len(items) + 40
    letters = set()
    for _, messages in rows[len(items):]:
        (user, reply) = messages
        (part,) = user["content"]
        assert part["type"] == "text"  # no media
        question, *options, instruction = part["text"].split("\n")
        assert instruction == ANSWER_INSTRUCTION and len(options) == 4
        word = question.removeprefix("Which option is ").removesuffix("?")
        words = [line.split(". ", 1)[1] for line in options]
        assert [line[0] for line in options] == list("ABCD") and len(set(words)) == 4
        assert any(set(words) <= set(vocabulary) for vocabulary in default.ANSWER_WORDS), words
        letter = reply["content"][0]["text"]
        assert words["ABCD".index(letter)] == word
        letters.add(letter)
    assert letters == set("ABCD")  # the answer's place is drawn, not fixed
    with pytest.raises(ValueError, match="letter_drills"):
        default.write_sft_dataset(items, tmp_path / "bad", letter_drills=-1)


def test_initial_weight_choices_of_the_training_script():
    """`initial_tensors`: the defaults are `testing.random_params` as drawn (the script's defaults);
    "chroma" makes the patch embedding blind to any achromatic (R = G = B) input, grey or noisy, and
    keeps its variance; the q/k-norm gain scales exactly the language model's q/k-norm weights."""
    from qwen3vl_jax.convert import export_hf_tensors
    from qwen3vl_jax.testing import SPECIAL_TOKENS, random_params, tiny_config

    script = load_script("train_tiny_default")
    config = tiny_config(384, {token: 300 + i for i, token in enumerate(SPECIAL_TOKENS)})
    drawn = export_hf_tensors(random_params(config, seed=3), config)
    plain = script.initial_tensors(config, 3)
    assert plain.keys() == drawn.keys()
    for name in drawn:
        np.testing.assert_array_equal(plain[name], drawn[name], err_msg=name)

    changed = script.initial_tensors(config, 3, patch_init="chroma", qk_norm_gain=2.0)
    patch = "model.visual.patch_embed.proj.weight"
    weight = changed[patch]  # [out, channels, time, height, width]
    assert weight.shape == drawn[patch].shape and weight.dtype == drawn[patch].dtype
    rng = np.random.default_rng(0)
    grey = rng.uniform(-1, 1, (5, 1, *weight.shape[2:])).repeat(3, axis=1)  # normalised R = G = B pixels
    colour = rng.uniform(-1, 1, (5, *weight.shape[1:]))
    assert np.abs(np.einsum("octhw,bcthw->bo", weight, grey)).max() < 1e-5
    assert np.abs(np.einsum("octhw,bcthw->bo", weight, colour)).max() > 0.1
    assert weight.std() == pytest.approx(drawn[patch].std(), rel=0.05)
    gained = [n for n in drawn if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    assert len(gained) == 2 * config.text.num_hidden_layers
    for name in drawn:
        if name in gained:
            np.testing.assert_array_equal(changed[name], 2.0 * drawn[name], err_msg=name)
        elif name != patch:
            np.testing.assert_array_equal(changed[name], drawn[name], err_msg=name)
    with pytest.raises(ValueError, match="patch_init"):
        script.initial_tensors(config, 3, patch_init="grey")
    with pytest.raises(ValueError, match="qk_norm_gain"):
        script.initial_tensors(config, 3, qk_norm_gain=0.0)


def test_sequence_phases_of_the_training_script(tmp_path):
    """`--sequence FAMILY:UPDATES ...`: parsed strictly; phase k holds its family's items and, after the
    first, half a replay of the earlier phases' families; `all` is the full mix; bad entries and
    options the sequence replaces are refused naming them."""
    from qwen3vl_jax.pruning import synthetic

    script = load_script("train_tiny_default")
    families = synthetic.FAMILIES
    phases = script.parse_sequence(["position:3", "direction:2", "position:1", "all:2"], families)
    assert phases == [("position", 3), ("direction", 2), ("position", 1), ("all", 2)]
    first = script.sequence_items(phases, 0, 6, families, seed=0)
    assert [item.family for item in first] == ["position"] * 6
    second = script.sequence_items(phases, 1, 6, families, seed=0)
    assert sorted(item.family for item in second) == ["direction"] * 3 + ["position"] * 3
    again = script.sequence_items(phases, 2, 4, families, seed=0)  # replays direction, not itself
    assert sorted(item.family for item in again) == ["direction"] * 2 + ["position"] * 2
    mixed = script.sequence_items(phases, 3, 14, families, seed=0)
    assert {item.family for item in mixed} == set(families)
    for bad, message in ((["position"], "FAMILY:UPDATES"), (["position:0"], "UPDATES >= 1"),
                         (["size:3"], "'size' is not one of")):
        with pytest.raises(ValueError, match=message):
            script.parse_sequence(bad, families)
    for argv in (["--sequence", "position:x"], ["--sequence", "position:3", "--steps", "5"],
                 ["--sequence", "position:3", "--plain-steps", "1"]):
        with pytest.raises(SystemExit):
            script.main(["--out", str(tmp_path / "out"), *argv])


@pytest.mark.slow  # a whole (tiny) training run with its evaluations: compiles train and inference steps
def test_the_training_script_end_to_end_with_each_phase_measured(tmp_path):
    """The script as a user runs it, at toy size: a two-phase `--sequence` trains, writes every
    phase's model (`--eval-phases`) and the final one as HF checkpoints that load in ours, and
    `eval.json` holds each phase's held-out accuracy per family and form, within [0, 1]."""
    script = load_script("train_tiny_default")
    out = tmp_path / "run"
    assert script.main(["--out", str(out), "--sequence", "position:2", "all:1", "--batch-size", "4",
                        "--learning-rate", "1e-3", "--warmup-steps", "1", "--length-buckets", "320",
                        "--eval-items", "1", "--eval-phases", "1", "--width", "0.5"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["steps"] == 3 and report["sequence"] == ["position:2", "all:1"]
    assert list(report["phases"]) == ["0-position", "1-all"]
    for measured in [*report["phases"].values(), report["heldout"]]:
        assert measured["items_per_family"] == 1 and measured["heldout_seed"] == 1001
        assert set(measured["accuracy"]) == set(synthetic.FAMILIES)
        for accuracy in measured["accuracy"].values():
            assert set(accuracy) == set(default.SCORED_FORMS)
            assert all(0.0 <= value <= 1.0 for value in accuracy.values())
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [1, 2, 3]
    for model_dir in (out / "run" / "0-position" / "model", out / "final"):
        model = Qwen3VL.from_pretrained(str(model_dir))
        assert model.config.text.hidden_size == 64  # --width 0.5 of the default's 128
    with pytest.raises(SystemExit):  # the output directory is not empty now
        script.main(["--out", str(out), "--sequence", "position:2"])
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "other"), "--eval-phases", "-1"])
