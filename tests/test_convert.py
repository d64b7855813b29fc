"""HF -> Orbax -> HF round trips through the real CLI, sharded checkpoints, and strict errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import assert_close

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.cli import main as cli
from qwen3vl_jax.convert import CheckpointError
from qwen3vl_jax.testing import make_tiny_checkpoint


def _text_inputs(vocab):
    ids = np.random.default_rng(0).integers(0, 400, size=(2, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def _vision_batch(model):
    grid = np.asarray([[1, 4, 6]])
    pix = np.random.default_rng(1).standard_normal((24, model.config.vision.patch_dim)).astype(np.float32)
    return pix, grid


@pytest.mark.needs_torch
def test_round_trip_hf_orbax_hf(tiny_dir, tmp_path, hf_model):
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    orbax_dir, hf_dir = tmp_path / "orbax", tmp_path / "hf"
    cli(["convert", str(tiny_dir), str(orbax_dir), "--dtype", "float32"])
    assert os.path.isdir(orbax_dir / "orbax") and os.path.isfile(orbax_dir / "tokenizer.json")
    restored = Qwen3VL.from_pretrained(orbax_dir)
    cli(["convert", str(orbax_dir), str(hf_dir), "--to", "hf", "--dtype", "float32", "--max-shard-bytes", "400000"])
    assert os.path.isfile(hf_dir / "model.safetensors.index.json")  # sharded on the way back
    hf_back, info = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    ids, mask = _text_inputs(hf_model.config.text_config.vocab_size)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
        back = hf_back.eval()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    np.testing.assert_array_equal(back, ref)  # the same f32 weights went around the loop exactly
    real = mask.astype(bool)
    assert_close(np.asarray(restored(ids, mask))[real], ref[real], "f32_logits", "orbax-restored logits")
    pix, grid = _vision_batch(restored)
    with torch.no_grad():
        vis = hf_back.model.visual(torch.from_numpy(pix), torch.from_numpy(grid)).pooler_output.numpy()
    assert_close(restored.encode_vision(pix, grid)[0], vis, "f32_tower", "orbax-restored vision")


def test_orbax_bf16_restores_bf16(tiny_dir, tmp_path):
    import jax.numpy as jnp

    cli(["convert", str(tiny_dir), str(tmp_path / "o"), "--dtype", "bfloat16"])
    model = Qwen3VL.from_pretrained(tmp_path / "o", dtype=jnp.bfloat16)
    assert model.language_model.layers[0].mlp.up_proj.kernel.dtype == jnp.bfloat16


def test_orbax_checkpoint_of_another_architecture_is_refused(tiny_dir, tmp_path):
    cli(["convert", str(tiny_dir), str(tmp_path / "o"), "--dtype", "float32"])
    stored = tmp_path / "o" / "orbax" / "0" / "config" / "metadata"
    config = json.loads(stored.read_text())
    config["text_config"]["intermediate_size"] = 96  # the params no longer fit the stated architecture
    stored.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match the model"):
        Qwen3VL.from_pretrained(tmp_path / "o")


@pytest.mark.needs_torch
def test_sharded_checkpoint_and_missing_shard(tmp_path, hf_model, jax_model):
    d = make_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=300_000)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    model = Qwen3VL.from_pretrained(d)
    ids, mask = _text_inputs(None)
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), np.asarray(jax_model(ids, mask)))
    os.remove(os.path.join(d, shards[1]))
    with pytest.raises(CheckpointError, match=rf"shards named in model.safetensors.index.json are missing: \['{shards[1]}'\]"):
        Qwen3VL.from_pretrained(d)


# ---------------------------------------------------------------------- atomic writing

# Every function through which convert writes, moves or deletes checkpoint files.
_WRITE_POINTS = (("os", "replace"), ("os", "rename"), ("shutil", "copyfile"), ("shutil", "rmtree"),
                 ("safetensors.numpy", "save_file"), ("json", "dump"),
                 ("qwen3vl_jax.convert", "_write_safetensors_file"),  # the streamed safetensors writer
                 ("orbax.checkpoint", "CheckpointManager.save"),
                 ("orbax.checkpoint", "CheckpointManager.wait_until_finished"))


class _Killed(BaseException):
    """Raised at the kill point; from then on no write point touches the disk, as after SIGKILL."""


def _convert_killed_at(monkeypatch, kill_at: int, *args) -> list[str]:
    """Run `qwen3vl-jax convert ARGS` in this process, dying just before the `kill_at`-th call of a
    write point (-1: never); returns the write points called before it.

    Once killed, every write point (the cleanup's `shutil.rmtree` included) is a no-op, so the
    disk is left as a SIGKILL at that moment would leave it (`test_sigkill_...` checks one such
    point with a real SIGKILL).
    """
    import importlib

    calls, dead = [], []

    def point(name, fn):
        def wrapped(*a, **k):
            if dead:
                return None
            if len(calls) == kill_at:
                dead.append(name)
                raise _Killed(name)
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    with monkeypatch.context() as m:
        for module, attr in _WRITE_POINTS:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            m.setattr(owner, name, point(attr, getattr(owner, name)))
        try:
            cli(["convert", *map(str, args)])
        except _Killed:
            pass
    assert bool(dead) == (0 <= kill_at < len(calls) + len(dead))
    return calls


def _assert_complete(path, layout, source):
    """A loadable checkpoint of the given layout with all the source's side files (EOS ids included)."""
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        with open(os.path.join(source, name), "rb") as a, open(os.path.join(path, name), "rb") as b:
            assert a.read() == b.read(), f"{name} was not carried along"
    Qwen3VL.from_pretrained(path)
    files = set(os.listdir(path))
    if layout == "orbax":
        assert "orbax" in files and not any(f.endswith(".safetensors") for f in files)
    elif layout == "hf sharded":
        assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    else:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files


def _stage_starts(calls: list[str], *keep: int) -> list[int]:
    """The first write of each run of same-kind writes (one kill per stage keeps the test short)."""
    return sorted({i for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name} | set(keep))


@pytest.mark.slow
def test_convert_killed_at_every_stage_leaves_nothing_or_a_complete_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """Killed before each stage of writes (weights, the Orbax commit, side files, each rename, the
    deletion of the replaced directory): the target is then absent, or the complete old
    checkpoint, or the complete new one, never a mix."""
    # Orbax into a fresh directory: nothing is visible under its name until the last rename.
    calls = _convert_killed_at(monkeypatch, -1, tiny_dir, tmp_path / "orbax")
    _assert_complete(tmp_path / "orbax", "orbax", tiny_dir)
    assert "CheckpointManager.save" in calls and "copyfile" in calls
    for k in _stage_starts(calls, len(calls) - 2):  # and before the last side file
        target = tmp_path / f"orbax-killed-{k}"
        _convert_killed_at(monkeypatch, k, tiny_dir, target)
        assert not os.path.exists(target), f"killed before {calls[k]} (write {k}) left {os.listdir(target)}"

    # An HF export over an earlier sharded one (--overwrite): the old one or the new one, whole.
    def old_export(target):
        cli(["convert", str(tiny_dir), str(target), "--to", "hf", "--max-shard-bytes", "300000"])

    new = ("--to", "hf", "--overwrite")
    old_export(tmp_path / "hf")
    calls = _convert_killed_at(monkeypatch, -1, tiny_dir, tmp_path / "hf", *new)
    _assert_complete(tmp_path / "hf", "hf single", tiny_dir)
    final = len(calls) - 1 - calls[::-1].index("replace")  # the rename of the new directory into place
    for k in _stage_starts(calls, final, len(calls) - 1):
        target = tmp_path / f"hf-killed-{k}"
        old_export(target)
        _convert_killed_at(monkeypatch, k, tiny_dir, target, *new)
        if k == final:  # between moving the old one aside and renaming the new one in
            assert not os.path.exists(target)
        else:
            _assert_complete(target, "hf single" if k > final else "hf sharded", tiny_dir)


def test_sigkill_after_the_orbax_commit_leaves_no_directory(tiny_dir, tmp_path):
    """The real thing once: a convert SIGKILLed after Orbax committed, before the side files."""
    import subprocess
    import sys

    code = (
        "import os, shutil, signal, sys\n"
        "shutil.copyfile = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from qwen3vl_jax.cli import main\n"
        "main(['convert', sys.argv[1], sys.argv[2]])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_dir), str(tmp_path / "o")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == -9, out.stderr[-3000:]
    assert not os.path.exists(tmp_path / "o")
    # what it left is the hidden temporary directory, with an Orbax commit but no side files
    (left,) = [n for n in os.listdir(tmp_path) if n.startswith(".o.tmp-")]
    assert os.path.isdir(tmp_path / left / "orbax") and not os.path.exists(tmp_path / left / "tokenizer.json")


def test_convert_refuses_a_non_empty_target_unless_overwrite(tiny_dir, tmp_path):
    out = tmp_path / "o"
    cli(["convert", str(tiny_dir), str(out), "--to", "hf", "--dtype", "float32", "--max-shard-bytes", "300000"])
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match=rf"{out} is not empty.*--overwrite"):
        cli(["convert", str(tiny_dir), str(out), "--to", "hf"])
    assert sorted(os.listdir(out)) == before
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".o.")], "a temporary directory was left"
    # --overwrite replaces the whole directory: no shard or index of the earlier sharded export is left
    cli(["convert", str(tiny_dir), str(out), "--to", "hf", "--dtype", "float32", "--overwrite"])
    assert sorted(os.listdir(out)) == sorted(
        {"model.safetensors", "config.json"} | (set(before) - {"model.safetensors.index.json", "config.json"}
                                                 - {n for n in before if n.startswith("model-")}))
    _assert_complete(out, "hf single", tiny_dir)
    # an empty directory is fine; a file in the way is not
    (tmp_path / "empty").mkdir()
    cli(["convert", str(tiny_dir), str(tmp_path / "empty")])
    _assert_complete(tmp_path / "empty", "orbax", tiny_dir)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        cli(["convert", str(tiny_dir), str(tmp_path / "file")])


def test_truncated_shard_and_corrupt_index_name_the_file(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=300_000)
    index = os.path.join(d, "model.safetensors.index.json")
    shard = os.path.join(d, sorted(set(json.load(open(index))["weight_map"].values()))[1])
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{shard}: cannot read the safetensors file"):
        Qwen3VL.from_pretrained(d)
    with open(index, "w") as f:
        f.write('{"weight_map": {')
    with pytest.raises(CheckpointError, match=rf"{index} is not a valid safetensors index"):
        Qwen3VL.from_pretrained(d)


def test_model_save_methods_refuse_a_non_empty_directory(tiny_dir, tmp_path, jax_model):
    (tmp_path / "old.txt").write_text("an earlier checkpoint")
    for save in (jax_model.save_orbax, jax_model.save_hf):
        with pytest.raises(ValueError, match=rf"{tmp_path} is not empty"):
            save(tmp_path)
    assert os.listdir(tmp_path) == ["old.txt"]  # nothing written, no temporary directory left
