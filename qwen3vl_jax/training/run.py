"""A fine-tuning run: the loop, its metrics and its resumable Orbax checkpoints.

`RunCheckpoints` wraps an Orbax `CheckpointManager` (keep the last N). A checkpoint holds, per step:
  state  the trainable parameters (all of them, or only the LoRA adapters), the optimizer state and
         the update count (`Trainer.state()`),
  data   the grain iterator's position (`get_state()`),
  meta   the seed (the Trainer's dropout keys are a function of (seed, step), so the seed *is* the RNG
         state) and the micro-batches per update, checked on resume.
Orbax writes each step to a temporary directory and renames it into place, so a run killed at any
moment leaves the previous complete checkpoint; `resume` restores the latest one and the loop goes on
with the same batches, the same keys and the same optimizer state, hence the same losses.

`train(...)` runs the updates, appends one JSON line per update to `metrics.jsonl` (flushed to disk
before the checkpoint that covers it is written; a resume drops the lines after its checkpoint, so a
killed and resumed run ends with the same lines as an uninterrupted one), and shows a tqdm bar with
loss, learning rate and tokens/s. A loss that is not finite stops the run before anything is saved,
naming the step and the last good checkpoint.

A run directory knows what it is and who writes it:
  run.json  the run's settings (model, data, hyperparameters, LoRA, seed); `--resume` compares
            them and refuses every difference by name, except those it is told to accept
            (`allow_changes`, e.g. the learning rate or the step count)
  .lock     the writer's pid and host: a second writer is refused while the first lives; a lock
            left by a dead process on this host is named and taken over
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import ArgumentError, existing_file, fraction, non_negative_int, output_directory, positive_int
from ..checks import positive_number
from ..convert import copy_side_files
from ..model import Qwen3VL
from ..params import CheckpointError
from ..processing import Qwen3VLProcessor
from . import lora as lora_lib
from .data import SFTDataset
from .optim import PARTS, OptimConfig, is_frozen
from .trainer import Trainer

__all__ = ["RunCheckpoints", "RunLock", "TrainingDiverged", "check_run_config", "train", "read_metrics",
           "plot_losses", "RUN_CONFIG", "CHANGEABLE"]

RUN_CONFIG = "run.json"
LOCK = ".lock"
# Settings a resume may change when asked to (`allow_changes`): the schedule, not what is trained.
CHANGEABLE = ("learning_rate", "warmup_steps", "steps")


class TrainingDiverged(RuntimeError):
    """The loss stopped being finite; nothing was saved after the last good checkpoint."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """One writer per run directory: `directory/.lock` holds the writer's pid and host.

    Taken with `O_CREAT | O_EXCL`; held by a live process (or one on another host, whose liveness
    cannot be checked here) it is refused naming the owner; left by a dead process on this host it
    is named (a warning) and taken over. Re-entrant within one process."""

    def __init__(self, directory: str | os.PathLike):
        self.path = os.path.join(os.fspath(directory), LOCK)
        self.owned = False

    def _owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def acquire(self) -> RunLock:
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner == me:
                    return self  # this process already holds it (finetune, then train)
                if owner is None or owner.get("host") != me["host"] or _pid_alive(int(owner.get("pid", -1))):
                    raise ArgumentError(
                        f"{os.path.dirname(self.path)} is being written by another run "
                        f"(pid {owner and owner.get('pid')} on {owner and owner.get('host')}, lock {self.path}); "
                        "wait for it to end, or use another output directory (delete the lock only if that "
                        "run is gone)")
                print(f"qwen3vl-jax: taking over the stale lock {self.path} of pid {owner['pid']} "
                      f"(no longer running on {owner['host']})", flush=True)
                os.unlink(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.owned = True
            return self
        raise ArgumentError(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self.owned:
            self.owned = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _write_json_atomically(path: str, content: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_run_config(out_dir: str | os.PathLike, config: dict, *, resume: bool,
                     allow_changes: tuple[str, ...] = ()) -> None:
    """Write `out_dir/run.json` for a new run; on `resume`, refuse a run directory without a
    checkpoint, or whose settings differ from `config` in anything but `allow_changes` (every
    difference named at once), then record the accepted changes."""
    out_dir = os.fspath(out_dir)
    for name in allow_changes:
        if name not in CHANGEABLE:
            raise ArgumentError(f"allow_changes: {name!r} cannot change on resume; only {', '.join(CHANGEABLE)}")
    path = os.path.join(out_dir, RUN_CONFIG)
    checkpoints = os.path.join(out_dir, "checkpoints")
    has_checkpoint = os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))
    if not resume:
        if has_checkpoint:
            raise ArgumentError(f"{out_dir} already holds checkpoints; pass resume=True (--resume) or use a new "
                                "output directory")
        os.makedirs(out_dir, exist_ok=True)
        _write_json_atomically(path, config)
        return
    if not has_checkpoint:
        raise ArgumentError(f"--resume: {out_dir} holds no checkpoint to resume from (start without --resume)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise ArgumentError(f"--resume: {path} is missing, so this run's settings cannot be compared") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not readable JSON (a damaged run directory?): {e}") from None
    differences = [f"{key}: {saved.get(key)!r} -> {config.get(key)!r}" for key in sorted(set(saved) | set(config))
                   if saved.get(key) != config.get(key) and key not in allow_changes]
    if differences:
        raise ArgumentError(f"--resume: this run's settings differ from those {out_dir} was started with: "
                            + "; ".join(differences) + f" (a resume may change only {', '.join(CHANGEABLE)}, "
                            "when asked with --allow-change)")
    if saved != config:
        _write_json_atomically(path, config)


class RunCheckpoints:
    """Orbax checkpoints of a `Trainer` and its data iterator under `directory` (keep `max_to_keep`)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, trainer, iterator_state: dict, *, seed: int) -> None:
        ocp = self._ocp
        meta = {"seed": int(seed), "grad_accum_steps": int(trainer.config.grad_accum_steps)}
        try:
            self.manager.save(trainer.step_count, args=ocp.args.Composite(
                state=ocp.args.StandardSave(trainer.state()),
                data=ocp.args.JsonSave(iterator_state),
                meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
        except Exception as e:  # Orbax wraps the filesystem's errors in its own
            raise CheckpointError(f"{self.directory}: could not write checkpoint {trainer.step_count}: "
                                  f"{_cause(e)}") from e

    def restore(self, trainer, *, seed: int) -> dict | None:
        """Load the latest checkpoint into `trainer`; returns the iterator state (None: nothing saved).
        Raises ValueError when the checkpoint was written with another seed or accumulation."""
        step = self.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trainer.state())
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore()))
        except Exception as e:  # a tree of another shape: Orbax dumps both trees
            raise CheckpointError(
                f"{self.directory}/{step}: the checkpoint does not match this run's trainable parameters "
                f"(written for another model, LoRA rank or freeze setting, or damaged): "
                f"{type(e).__name__}") from None
        meta = out["meta"]
        expected = {"seed": int(seed), "grad_accum_steps": int(trainer.config.grad_accum_steps)}
        if meta != expected:
            raise ValueError(f"{self.directory}: checkpoint {step} was written with {meta}, this run has "
                             f"{expected}; resume with the same settings or start a new output directory")
        trainer.load_state(out["state"])
        return out["data"]

    def close(self) -> None:
        self.manager.close()


def _cause(error: BaseException) -> str:
    """The likely cause of a failed write, from the chain of exceptions Orbax raised."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return f"the disk is full or a size limit was reached ({seen.strerror})"
        if isinstance(seen, OSError):
            return f"{seen.strerror or seen} ({getattr(seen, 'filename', '') or 'a file of the checkpoint'})"
        # tensorstore reports the filesystem's errno inside its message
        for code, words in ((errno.ENOSPC, "No space left"), (errno.EDQUOT, "quota"), (errno.EFBIG, "File too large")):
            if f"os_error_code='{code}'" in str(seen) or words in str(seen):
                return f"the disk is full or a size limit was reached ({os.strerror(code)}); {str(error)[:200]}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(error).__name__}: {str(error)[:300]}"


def _keep_metrics_through(path: str, step: int) -> None:
    """Drop the lines of `metrics.jsonl` after `step` (a resume recomputes those updates)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def train(trainer, data, *, steps: int, out_dir: str | os.PathLike, seed: int = 0, save_every: int = 50,
          keep: int = 3, resume: bool = False, progress: bool = True, on_step=None) -> list[dict]:
    """Run `trainer` for `steps` updates over `data` (an `SFTDataset`), checkpointing under
    `out_dir/checkpoints` every `save_every` updates and at the end; returns this call's metrics.

    With `resume`, continues from the latest checkpoint (a finished run does nothing more).
    """
    steps, save_every, keep = positive_int("steps", steps), positive_int("save_every", save_every), \
        positive_int("keep", keep)
    out_dir = output_directory("out_dir", out_dir)
    os.makedirs(out_dir, exist_ok=True)
    lock = RunLock(out_dir).acquire()
    checkpoints = RunCheckpoints(os.path.join(out_dir, "checkpoints"), max_to_keep=keep)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    iterator = data.iterator()
    try:
        if resume:
            state = checkpoints.restore(trainer, seed=seed)
            if state is None:
                raise ArgumentError(f"resume: {out_dir} holds no checkpoint to resume from")
            iterator.set_state(state)
            _keep_metrics_through(metrics_path, trainer.step_count)
        elif checkpoints.latest_step() is not None:
            raise ArgumentError(f"{out_dir} already holds checkpoints; pass resume=True (--resume) or use a new "
                                "output directory")
    except BaseException:
        checkpoints.close()
        lock.release()
        raise
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=trainer.step_count, desc="finetune", unit="step")
    records = []
    try:
        while trainer.step_count < steps:
            micro = [next(iterator) for _ in range(trainer.config.grad_accum_steps)]
            start = time.perf_counter()
            record = trainer.step(micro)
            record["tokens_per_second"] = sum(int(np.asarray(b["attention_mask"]).sum()) for b in micro) / (
                time.perf_counter() - start)
            if not math.isfinite(record["loss"]):
                last = checkpoints.latest_step()
                raise TrainingDiverged(
                    f"update {trainer.step_count}: the loss is {record['loss']}; stopped without saving. The last "
                    f"good checkpoint is " + (f"step {last} in {checkpoints.directory}" if last is not None
                                              else "none (no checkpoint was written yet)"))
            with open(metrics_path, "a") as f:  # on disk before the checkpoint that covers it
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if trainer.step_count % save_every == 0 or trainer.step_count == steps:
                checkpoints.save(trainer, iterator.get_state(), seed=seed)
            records.append(record)
            if on_step is not None:
                on_step(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['learning_rate']:.2e}",
                                tok_s=f"{record['tokens_per_second']:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        checkpoints.close()
        lock.release()
    return records


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of `metrics.jsonl`, the last one per step (a resumed run repeats the steps after
    its checkpoint)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_losses(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> str:
    """The loss curve of `metrics.jsonl` as a PNG (written to a temporary name, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set_xlabel("update")
    ax.set_ylabel("loss (mean over supervised tokens)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = os.fspath(png_path)
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path


def finetune(*, model: str, data: str, out: str, lora_rank: int = 0, lora_alpha: float | None = None,
             lora_dropout: float = 0.0, lora_vision: bool = False, freeze: str = "",
             learning_rate: float = 1e-4,
             warmup_steps: int = 0, steps: int = 100, batch_size: int = 1, grad_accum: int = 1,
             max_length: int = 2048, remat: bool = False, dtype: str = "float32", resume: bool = False,
             seed: int = 0, save_every: int = 50, keep: int = 3, strict: bool = False,
             export_merged: str | None = None, progress: bool = True, allow_change: str = "",
             quantize: str | None = None) -> dict:
    """The `qwen3vl-jax finetune` run (see `qwen3vl_jax/cli.py`); returns a summary.

    Writes `out/checkpoints/`, `out/metrics.jsonl`, `out/loss.png` and, for LoRA runs, `out/adapter/`
    (PEFT's format); `export_merged` writes a plain HF checkpoint (adapters merged). Raises ValueError
    naming the problem for bad input (an unknown `freeze` part, a malformed JSONL line, ...): every
    argument is checked before the model is loaded. `allow_change`: comma-separated settings a
    `resume` may change (of `CHANGEABLE`). `quantize` ("int8", "int4", "fp8"): QLoRA, the LoRA
    adapters trained over the language model's linears quantized and frozen (`quant.py`); needs
    `lora_rank`; the adapter loads on the full-precision base (no merged export).
    """
    # Every argument first, before anything is loaded or written.
    parts = tuple(p.strip() for p in freeze.split(",") if p.strip())
    for part in parts:
        if part not in PARTS:
            raise ArgumentError(f"--freeze: unknown part {part!r}; the parts are {', '.join(PARTS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ArgumentError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    for name, value in (("--steps", steps), ("--batch-size", batch_size), ("--grad-accum", grad_accum),
                        ("--max-length", max_length), ("--save-every", save_every), ("--keep", keep)):
        positive_int(name, value)
    for name, value in (("--lora-rank", lora_rank), ("--warmup-steps", warmup_steps), ("--seed", seed)):
        non_negative_int(name, value)
    positive_number("--learning-rate", learning_rate)
    fraction("--lora-dropout", lora_dropout)
    if lora_alpha is not None:
        positive_number("--lora-alpha", lora_alpha)
    if lora_rank:
        lora_parts = ("language",) + (("vision",) if lora_vision else ())
        if all(p in parts for p in lora_parts):
            raise ArgumentError(f"--freeze {','.join(parts)} freezes every part that gets LoRA adapters "
                                f"({', '.join(lora_parts)}): nothing would train")
    elif all(is_frozen(p, parts) for p in PARTS):
        raise ArgumentError("--freeze: every part is frozen: nothing would train")
    if quantize is not None:
        if quantize not in ("int8", "int4", "fp8"):
            raise ArgumentError(f"--quantize must be int8, int4 or fp8, got {quantize!r}")
        if not lora_rank:
            raise ArgumentError("--quantize trains LoRA adapters over a frozen quantized base (QLoRA): "
                                "give --lora-rank")
        if export_merged:
            raise ArgumentError("--export-merged with --quantize: the adapter loads on the full-precision "
                                "base instead (merging would requantize the weights)")
    if not 0 <= warmup_steps < steps:
        raise ArgumentError(f"--warmup-steps must be below --steps, got {warmup_steps} and {steps}")
    changes = tuple(c.strip() for c in allow_change.split(",") if c.strip())
    if not os.path.isdir(model):
        raise ArgumentError(f"--model: no such checkpoint directory: {model}")
    existing_file("--data", data)
    output_directory("--out", out)
    if export_merged:
        output_directory("--export-merged", export_merged)
    run_config = {"model": os.path.abspath(model), "data": os.path.abspath(data), "lora_rank": lora_rank,
                  "lora_alpha": lora_alpha, "lora_dropout": lora_dropout, "lora_vision": lora_vision,
                  "freeze": sorted(parts), "learning_rate": learning_rate, "warmup_steps": warmup_steps,
                  "steps": steps, "batch_size": batch_size, "grad_accum": grad_accum, "max_length": max_length,
                  "remat": remat, "dtype": dtype, "seed": seed, "strict": strict}
    if quantize is not None:
        run_config["quantize"] = quantize
    os.makedirs(out, exist_ok=True)
    with RunLock(out):
        check_run_config(out, run_config, resume=resume, allow_changes=changes)
        return _finetune(model=model, data=data, out=out, parts=parts, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         lora_dropout=lora_dropout, lora_vision=lora_vision, learning_rate=learning_rate,
                         warmup_steps=warmup_steps, steps=steps, batch_size=batch_size, grad_accum=grad_accum,
                         max_length=max_length, remat=remat, dtype=dtype, resume=resume, seed=seed,
                         save_every=save_every, keep=keep, strict=strict, export_merged=export_merged,
                         progress=progress, quantize=quantize)


def _finetune(*, model, data, out, parts, lora_rank, lora_alpha, lora_dropout, lora_vision, learning_rate,
              warmup_steps, steps, batch_size, grad_accum, max_length, remat, dtype, resume, seed, save_every,
              keep, strict, export_merged, progress, quantize=None) -> dict:
    config = OptimConfig(learning_rate=learning_rate, freeze=parts, warmup_steps=warmup_steps,
                         total_steps=steps, grad_accum_steps=grad_accum)
    processor = Qwen3VLProcessor.from_pretrained(model)
    dataset = SFTDataset(data, processor, batch_size=batch_size, max_length=max_length, seed=seed,
                         strict=strict)
    # f32 master weights; bf16 is the compute dtype only.
    net = Qwen3VL.from_pretrained(model, dtype=jnp.dtype(dtype).type, param_dtype=jnp.float32, remat=remat,
                                  quantize=quantize)
    trainable = None
    if lora_rank:
        targets = lora_lib.LANGUAGE_TARGETS + (lora_lib.VISION_TARGETS if lora_vision else ())
        lora_lib.add_lora(net, lora_lib.LoRAConfig(rank=lora_rank, alpha=lora_alpha or 2.0 * lora_rank,
                                                   dropout=lora_dropout, target_modules=targets), seed=seed)
        trainable = lora_lib.LoRAWeight
    trainer = Trainer(net, config, trainable=trainable, seed=seed)
    records = train(trainer, dataset, steps=steps, out_dir=out, seed=seed, save_every=save_every, keep=keep,
                    resume=resume, progress=progress)
    metrics = os.path.join(out, "metrics.jsonl")
    summary = {"steps": trainer.step_count, "rows": len(dataset.rows), "skipped": len(dataset.skipped),
               "last_loss": records[-1]["loss"] if records else None}
    if os.path.exists(metrics):
        plot_losses(metrics, os.path.join(out, "loss.png"))
    if lora_rank:
        summary["adapter"] = lora_lib.save_adapter(net, os.path.join(out, "adapter"),
                                                   base_model_name_or_path=os.path.abspath(model))
    if export_merged:
        if lora_rank:
            lora_lib.export_merged(net, export_merged)
        else:
            net.save_hf(export_merged)
        copy_side_files(model, export_merged, skip=("config.json",))
        summary["merged"] = export_merged
    return summary
