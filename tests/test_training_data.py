"""The JSONL fine-tuning pipeline on the synthetic data set: buckets, labels, seeded shuffling,
resumable iteration, skipped rows, malformed lines, and the loss of a pipeline batch against HF."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from conftest import assert_close

from qwen3vl_jax import Qwen3VLProcessor
from qwen3vl_jax.model import MODEL_INPUTS
from qwen3vl_jax.testing import make_tiny_dataset
from qwen3vl_jax.training import IGNORE_INDEX, SFTDataset, causal_lm_loss, read_jsonl

BATCH = 2
SETTINGS = dict(batch_size=BATCH, max_length=128, length_buckets=(64, 128), vision_buckets=(8, 16))


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Qwen3VLProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("data"), num_rows=12, seed=0)


@pytest.fixture(scope="module")
def dataset(data_path, processor):
    return SFTDataset(data_path, processor, **SETTINGS)


def answers(messages) -> list[str]:
    out = []
    for m in messages:
        if m["role"] == "assistant":
            content = m["content"]
            out.append(content if isinstance(content, str) else "".join(p["text"] for p in content))
    return out


def supervised_spans(processor, ids, labels) -> list[str]:
    edges = np.diff(np.concatenate([[0], (labels != IGNORE_INDEX).astype(int), [0]]))
    return [processor.decode(ids[a:b], skip_special_tokens=False)
            for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def test_an_epoch_covers_every_row_once_in_few_shapes(dataset, data_path, processor):
    conversations = dict(read_jsonl(data_path))
    assert not dataset.skipped and len(dataset.rows) == 12
    kinds = {r.bucket for r in dataset.rows}
    assert len(kinds) >= 2, "the synthetic set should span more than one bucket"
    seen, shapes = [], set()
    for step in range(dataset.batches_per_epoch):
        batch = dataset.batch(step)
        length, vision = batch["bucket"]
        assert batch["input_ids"].shape == (BATCH, length)
        assert (BATCH, length, vision) in dataset.shapes()
        shapes.add((BATCH, length, vision))
        image_or_video = np.isin(batch["input_ids"], [processor.image_token_id, processor.video_token_id])
        assert image_or_video.sum() <= BATCH * vision
        real = batch["num_real_rows"]
        seen += batch["lines"][:real]
        for row, line in enumerate(batch["lines"]):
            spans = supervised_spans(processor, batch["input_ids"][row], batch["labels"][row])
            if row < real:
                assert spans == [a + "<|im_end|>" for a in answers(conversations[line])], (step, line)
            else:  # a filler row keeps the shape and teaches nothing
                assert spans == []
    assert sorted(seen) == sorted(conversations)
    assert shapes == set(dataset.shapes())
    print(f"{dataset.batches_per_epoch} batches, {len(shapes)} distinct shapes: {sorted(shapes)}")


def test_seeded_shuffling(dataset, data_path, processor):
    def order(ds, epoch):
        return [lines for _, lines, _ in ds.epoch_plan(epoch)]

    again = SFTDataset(data_path, processor, **SETTINGS)
    other = SFTDataset(data_path, processor, **SETTINGS, seed=1)
    assert order(again, 0) == order(dataset, 0)
    assert order(dataset, 1) != order(dataset, 0)
    assert order(other, 0) != order(dataset, 0)


def test_iterator_position_is_saved_and_restored(dataset):
    it = dataset.iterator(num_epochs=2)
    head = [next(it) for _ in range(3)]
    state = it.get_state()
    tail = [next(it) for _ in range(3)]
    resumed = dataset.iterator(num_epochs=2)
    resumed.set_state(json.loads(json.dumps(state)))  # the state is plain JSON (a run checkpoint stores it)
    for a, b in zip(tail, [next(resumed) for _ in range(3)]):
        assert a["lines"] == b["lines"]
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    # Threads prefetch, but the order is the plan's: batch k of the iterator is dataset.batch(k).
    for step, batch in enumerate(head + tail):
        assert batch["lines"] == dataset.batch(step)["lines"]
    assert tail[-1]["epoch"] == 5 // dataset.batches_per_epoch


def write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")


def test_unusable_rows_are_skipped_and_counted(tmp_path, processor, caplog):
    path = make_tiny_dataset(tmp_path, num_rows=4)
    (tmp_path / "media" / "broken.png").write_bytes(b"not an image")
    rows = [json.loads(line) for line in open(path)]

    def with_image(file):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": file}]},
                             {"role": "assistant", "content": "A cat."}]}

    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    rows += [with_image("media/missing.png"), with_image("media/broken.png"),
             {"messages": [{"role": "user", "content": long_text}, {"role": "assistant", "content": "Yes."}]}]
    write_rows(path, rows)
    with caplog.at_level(logging.WARNING, logger="qwen3vl_jax.training.data"):
        dataset = SFTDataset(path, processor, **SETTINGS)
    assert len(dataset.rows) == 4
    assert [s.line for s in dataset.skipped] == [5, 6, 7]
    reasons = [s.reason for s in dataset.skipped]
    assert reasons[0].startswith("image file not found: ") and reasons[0].endswith("missing.png")
    assert reasons[1].startswith("could not process: could not read image file ")
    assert "broken.png" in reasons[1]
    assert reasons[2].endswith("tokens, longer than max_length 128")
    assert sum("skipped" in r.message for r in caplog.records) == 3
    with pytest.raises(ValueError, match=r"line 5: image file not found: .*missing.png"):
        SFTDataset(path, processor, **SETTINGS, strict=True)


def test_rows_beyond_the_vision_ladder_are_skipped(data_path, processor):
    dataset = SFTDataset(data_path, processor, **{**SETTINGS, "vision_buckets": (8,)})
    reason = "vision tokens, more than the largest vision bucket 8"
    too_many = [r for r in dataset.skipped if reason in r.reason]
    assert too_many and len(too_many) == len(dataset.skipped)
    assert all(row.vision_tokens <= 8 for row in dataset.rows) and dataset.rows


@pytest.mark.parametrize("bad,match", [
    ('{"messages": [', r"line 2: not valid JSON"),
    ({"conversation": []}, r"line 2: expected an object with a non-empty 'messages' list"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, r"line 2, message 0: role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
     r"line 2, message 0, part 0: an image part needs a file path under 'image'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"line 2: no assistant message"),
])
def test_malformed_lines_are_errors_naming_the_line(tmp_path, processor, bad, match):
    good = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]}
    path = tmp_path / "bad.jsonl"
    write_rows(path, [good, bad, good])
    with pytest.raises(ValueError, match=match):
        SFTDataset(path, processor, **SETTINGS)


def test_loss_of_a_pipeline_batch_equals_hf(dataset, hf_model, jax_model):
    """A right-padded pipeline batch with media: HF's labels loss on the same weights."""
    step = next(s for s in range(dataset.batches_per_epoch) if dataset.epoch_plan(0)[s][0][1])
    batch = dataset.batch(step)
    inputs = {k: torch.from_numpy(np.asarray(batch[k])) for k in MODEL_INPUTS if k in batch}
    with torch.no_grad():
        ref = float(hf_model(**inputs, labels=torch.from_numpy(batch["labels"])).loss)
    assert_close(float(causal_lm_loss(jax_model, batch)), ref, "f32_logits", "pipeline batch loss")


def test_no_compiles_after_the_first_epoch(dataset, jax_model):
    """With the vision tower at the data set's encoder budgets and the loss on bucketed batches,
    the first epoch compiles every shape there is and the second compiles nothing."""
    from pallas_kernels._shapes import pow2_at_least
    from qwen3vl_jax import EncoderRunner
    from qwen3vl_jax.training.loss import COMPILE_COUNTS, _loss_from_inputs

    _loss_from_inputs.clear_cache()  # other tests compiled some of these shapes already
    runner = EncoderRunner(jax_model, budgets=dataset.encoder_budgets())
    n = dataset.batches_per_epoch
    start = COMPILE_COUNTS["loss"]
    expected = set()
    for step in range(2 * n):
        batch = dataset.batch(step)
        visual = int((batch["mm_token_type_ids"] != 0).sum())
        expected.add((batch["input_ids"].shape, pow2_at_least(visual) if visual else 0))
        loss = float(causal_lm_loss(jax_model, batch, vision_encoder=runner.encode))
        assert np.isfinite(loss) and loss > 0
        if step == n - 1:
            first_epoch = (COMPILE_COUNTS["loss"] - start, runner.num_compiles)
    assert first_epoch == (COMPILE_COUNTS["loss"] - start, runner.num_compiles)
    assert first_epoch[0] == len(expected)
    assert first_epoch[1] <= len(dataset.encoder_budgets())
    print(f"loss compiles {first_epoch[0]} for shapes {sorted(expected)}; encoder compiles {first_epoch[1]} "
          f"for budgets {dataset.encoder_budgets()}")
