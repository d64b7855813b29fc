"""Fine-tuning runs that cannot go wrong quietly: every argument checked before a model is loaded
(the CLI and the API with the same words), a run directory that knows its settings and its writer,
a loss that stops being finite, adapters checked whole, and filesystem errors named."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from test_training_run import text_rows

from qwen3vl_jax import cli
from qwen3vl_jax.checks import ArgumentError
from qwen3vl_jax.params import CheckpointError, canonical_params
from qwen3vl_jax.training import lora as lora_lib
from qwen3vl_jax.training.lora import LoRAConfig
from qwen3vl_jax.training.optim import OptimConfig
from qwen3vl_jax.training.run import RunLock, TrainingDiverged, finetune

NO_MODEL = "/nonexistent/model"  # an argument error must come before the model is looked at


def _args(data, out, **overrides):
    args = dict(model=NO_MODEL, data=data, out=str(out), steps=2, batch_size=1, max_length=64, save_every=1,
                keep=1, learning_rate=1e-3, progress=False)
    return {**args, **overrides}


@pytest.mark.parametrize("overrides,words", [
    (dict(learning_rate=float("nan")), "--learning-rate must be a finite number > 0, got nan"),
    (dict(learning_rate=float("inf")), "--learning-rate must be a finite number > 0, got inf"),
    (dict(learning_rate=-1e-4), "--learning-rate must be a finite number > 0"),
    (dict(learning_rate=0.0), "--learning-rate must be a finite number > 0"),
    (dict(keep=0), "--keep must be a positive integer"),
    (dict(save_every=0), "--save-every must be a positive integer"),
    (dict(steps=0), "--steps must be a positive integer"),
    (dict(batch_size=-2), "--batch-size must be a positive integer"),
    (dict(grad_accum=0), "--grad-accum must be a positive integer"),
    (dict(lora_rank=-1), "--lora-rank must be an integer >= 0"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout must be a number in [0, 1)"),
    (dict(lora_rank=4, lora_alpha=float("nan")), "--lora-alpha must be a finite number > 0"),
    (dict(lora_rank=4, freeze="language"), "freezes every part that gets LoRA adapters"),
    (dict(lora_rank=4, lora_vision=True, freeze="vision,language"), "nothing would train"),
    (dict(freeze="vision,merger,language"), "every part is frozen"),
    (dict(warmup_steps=5), "--warmup-steps must be below --steps"),
])
def test_bad_arguments_are_refused_before_the_model_is_loaded(tmp_path, overrides, words):
    data = text_rows(tmp_path / "d.jsonl", 2)
    with pytest.raises(ArgumentError, match=re.escape(words)):
        finetune(**_args(data, tmp_path / "out", **overrides))
    assert not os.path.exists(tmp_path / "out")  # nothing was written


def test_paths_are_checked_before_the_model_is_loaded(tmp_path, tiny_dir):
    data = text_rows(tmp_path / "d.jsonl", 2)
    with pytest.raises(ArgumentError, match="--model: no such checkpoint directory"):
        finetune(**_args(data, tmp_path / "out"))
    with pytest.raises(ArgumentError, match="--data names a directory"):
        finetune(**_args(str(tmp_path), tmp_path / "out", model=str(tiny_dir)))
    with pytest.raises(ArgumentError, match="--data: no such file"):
        finetune(**_args(str(tmp_path / "missing.jsonl"), tmp_path / "out", model=str(tiny_dir)))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ArgumentError, match="--out names a file"):
        finetune(**_args(data, tmp_path / "a_file", model=str(tiny_dir)))
    with pytest.raises(ArgumentError, match="--resume: .* holds no checkpoint to resume from"):
        finetune(**_args(data, tmp_path / "fresh", model=str(tiny_dir), resume=True))
    with pytest.raises(ArgumentError, match="allow_changes: 'batch_size' cannot change"):
        finetune(**_args(data, tmp_path / "fresh2", model=str(tiny_dir), allow_change="batch_size"))


def test_the_api_refuses_the_same_things_with_the_same_words():
    for bad in (float("nan"), -1.0, 0.0):
        with pytest.raises(ArgumentError, match="learning_rate must be a finite number > 0"):
            OptimConfig(learning_rate=bad)
    with pytest.raises(ArgumentError, match="grad_accum_steps must be a positive integer"):
        OptimConfig(grad_accum_steps=0)
    with pytest.raises(ArgumentError, match="LoRA rank must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ArgumentError, match="LoRA alpha must be a finite number > 0"):
        LoRAConfig(alpha=float("inf"))
    with pytest.raises(ArgumentError, match=r"LoRA dropout must be a number in \[0, 1\)"):
        LoRAConfig(dropout=-0.1)


@pytest.mark.parametrize("argv,words", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["generate", "--prompt", "hi", "--image", "/no/such.png"], "--image: no such file"),
    (["demo", "--model", "/no/such/dir"], "--model: no such checkpoint directory"),
    (["plan", "--preset", "2b", "--batch", "-4"], "--batch must be a positive integer"),
    (["plan", "--preset", "2b", "--devices", "0"], "--devices must be a positive integer"),
    (["plan", "--preset", "2b", "--context", "10000000"], "past the model's context"),
    (["plan", "--preset", "2b", "--mesh", "data=2,data=4"], "axis 'data' is given twice"),
    (["convert", "/no/such/dir", "/tmp/x", "--max-shard-bytes", "0"], "--max-shard-bytes must be a positive integer"),
])
def test_cli_arguments_are_named(capsys, argv, words):
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_a_run_directory_knows_its_settings_and_its_writer(tiny_dir, tmp_path):
    data = text_rows(tmp_path / "d.jsonl", 4)
    out = tmp_path / "run"
    args = _args(data, out, model=str(tiny_dir), lora_rank=4)
    summary = finetune(**args)
    assert summary["steps"] == 2
    saved = json.loads((out / "run.json").read_text())
    assert saved["lora_rank"] == 4 and saved["learning_rate"] == 1e-3 and saved["data"] == os.path.abspath(data)
    assert not (out / ".lock").exists()  # released at the end
    with pytest.raises(ArgumentError, match="already holds checkpoints; pass resume=True"):
        finetune(**args)
    # every difference named at once, before the model is loaded
    with pytest.raises(ArgumentError) as e:
        finetune(**{**args, "resume": True, "learning_rate": 2e-3, "batch_size": 2, "lora_rank": 8})
    assert all(w in str(e.value) for w in ("batch_size: 1 -> 2", "learning_rate: 0.001 -> 0.002", "lora_rank: 4 -> 8"))
    # a changed schedule is accepted when asked for, and recorded
    out_steps = finetune(**{**args, "resume": True, "steps": 3, "allow_change": "steps"})
    assert out_steps["steps"] == 3 and json.loads((out / "run.json").read_text())["steps"] == 3
    # a lock held by a live process (pid 1 on this host) refuses a second writer, naming it
    (out / ".lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname()}))
    with pytest.raises(ArgumentError, match=r"being written by another run \(pid 1 on"):
        finetune(**{**args, "resume": True, "steps": 3})
    # a lock left by a dead process on this host is named and taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with RunLock(out) as lock:
        assert lock.owned and json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    assert not (out / ".lock").exists()


def test_a_loss_that_is_not_finite_stops_the_run_without_saving(tiny_dir, tmp_path):
    data = text_rows(tmp_path / "d.jsonl", 4)
    out = tmp_path / "diverge"
    # a finite but absurd learning rate: the first update sends the weights to inf, the second loss is nan
    with pytest.raises(TrainingDiverged, match=r"update 2: the loss is nan; .* last good checkpoint is step 1"):
        finetune(**_args(data, out, model=str(tiny_dir), learning_rate=1e30, steps=4))
    assert sorted(n for n in os.listdir(out / "checkpoints") if n.isdigit()) == ["1"]  # not saved over
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (out / ".lock").exists()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_dir):
    from qwen3vl_jax import Qwen3VL

    model = Qwen3VL.from_pretrained(tiny_dir)
    lora_lib.add_lora(model, LoRAConfig(rank=4, alpha=8.0))
    return lora_lib.save_adapter(model, tmp_path_factory.mktemp("adapter") / "good")


def _tampered(adapter_dir, tmp_path, edit_config=None, edit_tensors=None) -> str:
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "tampered"
    out.mkdir()
    config = json.loads(open(os.path.join(adapter_dir, "adapter_config.json")).read())
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return str(out)


def _first(tensors, factor):
    return next(k for k in sorted(tensors) if k.endswith(f"{factor}.weight"))


@pytest.mark.parametrize("case", ["rank_in_config", "a_against_b", "missing_factor", "other_width", "target"])
def test_adapters_are_checked_whole_before_any_weight_changes(adapter_dir, tiny_dir, tmp_path, case):
    from qwen3vl_jax import Qwen3VL

    def drop_b(t):
        del t[_first(t, "lora_B")]

    def narrow_a(t):
        k = _first(t, "lora_A")
        t[k] = np.ascontiguousarray(t[k][:2])

    def wider(t):
        for k in [k for k in t if "q_proj" in k and k.endswith("lora_A.weight")]:
            t[k] = np.zeros((t[k].shape[0], t[k].shape[1] + 8), t[k].dtype)

    edits = {
        "rank_in_config": (lambda c: c.update(r=8), None, "lora_A has rank 4 and lora_B rank 4, adapter_config r is 8"),
        "a_against_b": (None, narrow_a, "lora_A has rank 2 and lora_B rank 4"),
        "missing_factor": (None, drop_b, "lora_B is missing"),
        "other_width": (None, wider, "an adapter for another model?"),
        "target": (lambda c: c.update(target_modules=list(c["target_modules"]) + ["not_a_layer"]), None,
                   "target_modules lists 'not_a_layer'"),
    }
    edit_config, edit_tensors, words = edits[case]
    model = Qwen3VL.from_pretrained(tiny_dir)
    before = {k: np.asarray(v) for k, v in canonical_params(model).items()}
    with pytest.raises(CheckpointError, match=re.escape(words)):
        lora_lib.load_adapter(model, _tampered(adapter_dir, tmp_path, edit_config, edit_tensors))
    assert not lora_lib.lora_modules(model)  # nothing was added
    after = canonical_params(model)
    assert all(np.array_equal(before[k], np.asarray(after[k])) for k in before)


def test_a_full_disk_during_a_save_is_named(tiny_dir, tmp_path):
    """A real write limit (RLIMIT_FSIZE in a subprocess: EFBIG on the first large write)."""
    data = text_rows(tmp_path / "d.jsonl", 2)
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from qwen3vl_jax.training.run import finetune
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    finetune(model={str(tiny_dir)!r}, data={data!r}, out={str(tmp_path / 'full')!r}, steps=1, max_length=64,
             progress=False)
except Exception as e:
    print(type(e).__name__ + ': ' + str(e))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "CheckpointError" in out.stdout and "could not write checkpoint 1" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "size limit" in out.stdout or "disk is full" in out.stdout, out.stdout


def test_a_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    from qwen3vl_jax.training.data import read_jsonl

    path = tmp_path / "latin1.jsonl"
    row = {"messages": [{"role": "user", "content": "caf\u00e9"}, {"role": "assistant", "content": "ok"}]}
    path.write_bytes((json.dumps(row) + "\n").encode() + json.dumps(row, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match=r"line 2: not UTF-8 text \(byte b'\\xe9'"):
        read_jsonl(path)


def test_a_damaged_cached_tiny_checkpoint_is_named_and_rebuilt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QWEN3VL_JAX_CACHE", str(tmp_path))
    path = cli.ensure_tiny_checkpoint()
    (tmp_path / cli.TINY_NAME / "tokenizer.json").write_text("{ not json")  # damaged
    loaded, model, processor = cli.load_tiny_checkpoint()
    assert loaded == path and "is damaged" in capsys.readouterr().out
    assert processor.decode(processor("hello")["input_ids"][0]) == "hello"
    assert json.loads((tmp_path / cli.TINY_NAME / "tokenizer.json").read_text())  # rebuilt whole


def test_the_trainer_refuses_adapters_that_are_all_frozen(jax_model):
    import copy

    from qwen3vl_jax.training import Trainer

    model = copy.deepcopy(jax_model)
    lora_lib.add_lora(model, LoRAConfig(rank=2, alpha=4.0))  # language-model adapters only
    with pytest.raises(ArgumentError, match=r"nothing would train: every trainable variable is in a frozen "
                                            r"part \(language; freeze=\['language'\]\)"):
        Trainer(model, OptimConfig(freeze=("language",)), trainable=lora_lib.LoRAWeight)
    Trainer(model, OptimConfig(freeze=("vision",)), trainable=lora_lib.LoRAWeight)  # this one trains


@pytest.mark.slow  # (the fast tier keeps the non-finite loss and the full disk stopping a run cleanly)
def test_killed_between_a_metrics_line_and_its_checkpoint(tiny_dir, tmp_path):
    """The metrics line of update 3 is on disk, its checkpoint not (what a kill between the two
    leaves): the resume drops that line, recomputes update 3, and the file equals an uninterrupted run's."""
    import shutil

    data = text_rows(tmp_path / "d.jsonl", 4)
    args = _args(data, tmp_path / "whole", model=str(tiny_dir), steps=3, keep=3)
    finetune(**args)
    finetune(**{**args, "out": str(tmp_path / "cut")})
    cut = tmp_path / "cut"
    shutil.rmtree(cut / "checkpoints" / "3")
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 3
    finetune(**{**args, "out": str(cut), "resume": True})
    whole = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for ours, ref in zip(resumed, whole):
        for key in ours.keys() - {"tokens_per_second", "seconds"}:
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=0), (ours["step"], key)
