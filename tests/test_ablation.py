"""The pruning ablation on the tiny checkpoint: rows, files, and resuming without recomputing."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from qwen3vl_jax.processing import Qwen3VLProcessor
from qwen3vl_jax.pruning.ablation import builtin_videos, run_ablation


@pytest.fixture(scope="module")
def setup(tiny_dir, jax_model):
    clip = builtin_videos(frames=16, height=64, width=96)["two_objects"]
    return jax_model, Qwen3VLProcessor.from_pretrained(tiny_dir), {"clip": clip}


def test_ablation_rows_files_and_resume(setup, tmp_path):
    model, processor, videos = setup
    kw = dict(out_dir=str(tmp_path), methods=("evs", "vidcom2"), continuation=4, timing_repeats=1, progress=False)
    first = run_ablation(model, processor, videos, rates=(0.0, 0.5), **kw)
    assert [(r.method, r.rate) for r in first] == [("evs", 0.0), ("evs", 0.5), ("vidcom2", 0.5)]
    base = first[0]
    assert base.retained_tokens == base.video_tokens and base.next_token_kl == 0 and base.top1_agree
    assert base.matching_continuation == base.continuation_length == 4
    for row in first[1:]:
        assert row.retained_tokens < row.video_tokens and row.next_token_kl > 0
        assert 0 <= row.matching_continuation <= 4 and row.vision_prefill_s > 0

    seen = []
    second = run_ablation(model, processor, videos, rates=(0.0, 0.5, 0.75), on_row=seen.append, **kw)
    assert [(r.method, r.rate) for r in seen] == [("evs", 0.75), ("vidcom2", 0.75)]  # only the new rows ran
    assert len(second) == 5
    lines = (tmp_path / "ablation.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["rate"] == 0.0
    with open(tmp_path / "ablation.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 5 and {"retained_tokens", "next_token_kl", "matching_continuation"} <= set(table[0])
    png = (tmp_path / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    np.testing.assert_array_equal([r.retained_tokens for r in second if r.method == "evs"],
                                  sorted([r.retained_tokens for r in second if r.method == "evs"], reverse=True))
