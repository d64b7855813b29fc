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

`train(...)` runs the updates, appends one JSON line per update to `metrics.jsonl` (after the
update's checkpoint, when one is due, is written), and shows a tqdm bar with loss, learning rate and
tokens/s.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

__all__ = ["RunCheckpoints", "train", "read_metrics", "plot_losses"]


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
        self.manager.save(trainer.step_count, args=ocp.args.Composite(
            state=ocp.args.StandardSave(trainer.state()),
            data=ocp.args.JsonSave(iterator_state),
            meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, trainer, *, seed: int) -> dict | None:
        """Load the latest checkpoint into `trainer`; returns the iterator state (None: nothing saved).
        Raises ValueError when the checkpoint was written with another seed or accumulation."""
        step = self.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trainer.state())
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        meta = out["meta"]
        expected = {"seed": int(seed), "grad_accum_steps": int(trainer.config.grad_accum_steps)}
        if meta != expected:
            raise ValueError(f"{self.directory}: checkpoint {step} was written with {meta}, this run has "
                             f"{expected}; resume with the same settings or start a new output directory")
        trainer.load_state(out["state"])
        return out["data"]

    def close(self) -> None:
        self.manager.close()


def train(trainer, data, *, steps: int, out_dir: str | os.PathLike, seed: int = 0, save_every: int = 50,
          keep: int = 3, resume: bool = False, progress: bool = True, on_step=None) -> list[dict]:
    """Run `trainer` for `steps` updates over `data` (an `SFTDataset`), checkpointing under
    `out_dir/checkpoints` every `save_every` updates and at the end; returns this call's metrics.

    With `resume`, continues from the latest checkpoint (a finished run does nothing more).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    checkpoints = RunCheckpoints(os.path.join(out_dir, "checkpoints"), max_to_keep=keep)
    iterator = data.iterator()
    if resume:
        state = checkpoints.restore(trainer, seed=seed)
        if state is not None:
            iterator.set_state(state)
    elif checkpoints.latest_step() is not None:
        raise ValueError(f"{out_dir} already holds checkpoints; pass resume=True (--resume) or use a new "
                         "output directory")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
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
            if trainer.step_count % save_every == 0 or trainer.step_count == steps:
                checkpoints.save(trainer, iterator.get_state(), seed=seed)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
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
             export_merged: str | None = None, progress: bool = True) -> dict:
    """The `qwen3vl-jax finetune` run (see `qwen3vl_jax/cli.py`); returns a summary.

    Writes `out/checkpoints/`, `out/metrics.jsonl`, `out/loss.png` and, for LoRA runs, `out/adapter/`
    (PEFT's format); `export_merged` writes a plain HF checkpoint (adapters merged). Raises ValueError
    naming the problem for bad input (an unknown `freeze` part, a malformed JSONL line, ...).
    """
    import jax.numpy as jnp

    from ..model import Qwen3VL
    from ..processing import Qwen3VLProcessor
    from . import lora as lora_lib
    from .data import SFTDataset
    from .optim import PARTS, OptimConfig
    from .trainer import Trainer

    parts = tuple(p.strip() for p in freeze.split(",") if p.strip())
    for part in parts:
        if part not in PARTS:
            raise ValueError(f"--freeze: unknown part {part!r}; the parts are {', '.join(PARTS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    config = OptimConfig(learning_rate=learning_rate, freeze=parts, warmup_steps=warmup_steps,
                         total_steps=steps, grad_accum_steps=grad_accum)
    processor = Qwen3VLProcessor.from_pretrained(model)
    dataset = SFTDataset(data, processor, batch_size=batch_size, max_length=max_length, seed=seed,
                         strict=strict)
    # f32 master weights; bf16 is the compute dtype only.
    net = Qwen3VL.from_pretrained(model, dtype=jnp.dtype(dtype).type, param_dtype=jnp.float32, remat=remat)
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
        from ..convert import copy_side_files

        if lora_rank:
            lora_lib.export_merged(net, export_merged)
        else:
            net.save_hf(export_merged)
        copy_side_files(model, export_merged, skip=("config.json",))
        summary["merged"] = export_merged
    return summary
