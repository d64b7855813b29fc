"""`qwen3vl-jax finetune` end to end: a run killed with SIGKILL and resumed gives the same losses as an
uninterrupted one; the outputs are written; bad input is a clear error or a counted skip."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from qwen3vl_jax.training.run import read_metrics

STEPS = 5


def text_rows(path, n: int, extra: list[str] = ()) -> str:
    """Text-only conversations (one length bucket, so each run compiles once), plus `extra` lines."""
    with open(path, "w") as f:
        for i in range(n):
            row = {"messages": [{"role": "user", "content": f"Count to {i + 2}."},
                                {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 3))}]}
            f.write(json.dumps(row) + "\n")
        for line in extra:
            f.write(line + "\n")
    return str(path)


def finetune_cmd(tiny_dir, data, out, *extra) -> list[str]:
    return [sys.executable, "-m", "qwen3vl_jax.cli", "finetune", "--model", str(tiny_dir), "--data", data,
            "--out", str(out), "--lora-rank", "4", "--lora-dropout", "0.1", "--steps", str(STEPS),
            "--batch-size", "2", "--max-length", "64", "--save-every", "1", "--keep", "2",
            "--learning-rate", "1e-2", *extra]


def run(cmd, **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.slow  # (the fast tier keeps the resume after a refused second run, below)
def test_killed_run_resumes_to_the_same_losses(tiny_dir, tmp_path):
    missing = json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.jpg"}]},
                                       {"role": "assistant", "content": "x"}]})
    data = text_rows(tmp_path / "train.jsonl", 6, [missing])
    whole = run(finetune_cmd(tiny_dir, data, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "(1 skipped)" in whole.stdout  # the missing image is a counted skip
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "metrics.jsonl", "loss.png"):
        assert os.path.exists(tmp_path / "whole" / name), name
    assert len(os.listdir(tmp_path / "whole" / "checkpoints")) == 2  # keep the last 2
    expected = [r["loss"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    assert len(expected) == STEPS

    out = tmp_path / "killed"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(finetune_cmd(tiny_dir, data, out), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(read_metrics(metrics))
    assert 2 <= done < STEPS
    before = metrics.read_text().splitlines()
    saved = max(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    resumed = run(finetune_cmd(tiny_dir, data, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # metrics.jsonl is crash-consistent: the lines after the checkpoint (written before it, when the
    # kill came between them) were dropped and recomputed, so the file has each update once, in order.
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
    # It continued from the checkpoint: the lines it covers are the killed run's own (their wall-clock
    # tokens/s would differ had the run started again from scratch).
    assert lines[:saved] == before[:saved]
    whole_lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    for ours, ref in zip(map(json.loads, lines), whole_lines):
        assert ours.keys() == ref.keys()
        for key in ours.keys() - {"tokens_per_second", "seconds"}:  # everything but the wall clock
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=0), (ours["step"], key)
    losses = [r["loss"] for r in read_metrics(metrics)]
    print(f"killed after {done} updates (checkpoint {saved}); losses {losses} vs uninterrupted {expected}")
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)
    assert losses[-1] < losses[0]

    # A second --resume of a finished run changes nothing; a run into a used directory must say --resume.
    again = run(finetune_cmd(tiny_dir, data, out))
    assert again.returncode == 2 and "--resume" in again.stderr


def test_bad_input_is_a_clear_error(tiny_dir, tmp_path):
    data = text_rows(tmp_path / "bad.jsonl", 2, ['{"messages": [oops'])
    bad_line = run(finetune_cmd(tiny_dir, data, tmp_path / "a"))
    assert bad_line.returncode == 2 and "line 3: not valid JSON" in bad_line.stderr, bad_line.stderr[-2000:]
    good = text_rows(tmp_path / "good.jsonl", 2)
    bad_part = run(finetune_cmd(tiny_dir, good, tmp_path / "b", "--freeze", "vision,lm"))
    assert bad_part.returncode == 2 and "unknown part 'lm'" in bad_part.stderr, bad_part.stderr[-2000:]


def test_two_runs_on_one_out_the_second_is_refused_and_resumes_after(tiny_dir, tmp_path):
    data = text_rows(tmp_path / "train.jsonl", 4)
    out = tmp_path / "shared"
    cmd = [sys.executable, "-m", "qwen3vl_jax.cli", "finetune", "--model", str(tiny_dir), "--data", data,
           "--out", str(out), "--steps", "500", "--max-length", "64", "--save-every", "1", "--keep", "1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None and not (
                (out / "checkpoints").exists() and any(n.isdigit() for n in os.listdir(out / "checkpoints"))):
            time.sleep(0.1)
        assert first.poll() is None, first.stderr.read()[-3000:]
        second = run(cmd + ["--resume"])
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"being written by another run (pid {first.pid} on" in second.stderr
    finally:
        first.kill()
        first.wait()
    # the first run is gone (killed: its lock stays behind, and is taken over); the second resumes
    after = run(cmd + ["--resume", "--steps", "2", "--allow-change", "steps"])
    assert after.returncode == 0, after.stderr[-3000:]
    assert "taking over the stale lock" in after.stdout and not (out / ".lock").exists()
