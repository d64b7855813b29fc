"""Runs the model on a device mesh in a fresh process (the test process has one device).

    python tests/sharding_worker.py meshes CHECKPOINT OUT.npz
        8 host CPU devices: a single-device reference, then each mesh of `CASES`; saves logits,
        generated ids, vision features, train-step gradients and updated parameters per case, and
        each large parameter's addressable-shard fraction against the one its spec implies.
    python tests/sharding_worker.py process CHECKPOINT OUT.npz --coordinator HOST:PORT --process-id I
        one of two processes (4 CPU devices each) joined by `jax.distributed`, on the mesh
        `fsdp=2,tensor=4` spanning both: the forward and one train step, gathered on every process.

`tests/test_sharding.py` compares the saved arrays. The inputs (`batch`) are the same in every
process: a batch of 8 conversations, images and videos, left-padded, with assistant labels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# A case: (name, mesh, options of `from_pretrained`, loaded from the Orbax copy?)
CASES = [
    ("data=8", "data=8", {}, False),
    ("fsdp=8", "fsdp=8", {}, False),
    # tensor parallelism through the other layouts and paths: scanned stacks + Orbax, the vision
    # tower tensor-parallel + the Pallas kernels (interpreted) under shard_map (the unrolled stack on
    # fsdp=2,tensor=4 is the two-process run's)
    ("fsdp=2,tensor=4 scan orbax", "fsdp=2,tensor=4", {"scan_layers": True}, True),
    ("data=2,tensor=4 vision=tensor pallas", "data=2,tensor=4",
     {"vision": "tensor", "attention_implementation": "pallas"}, False),
]
NEW_TOKENS = 4
LARGE = ("language_model.embed_tokens.embedding", "lm_head.kernel",
         "language_model.layers.0.self_attn.q_proj.kernel", "language_model.layers.0.self_attn.k_proj.kernel",
         "language_model.layers.0.self_attn.o_proj.kernel", "language_model.layers.0.mlp.down_proj.kernel",
         "visual.blocks.0.attn.qkv.kernel", "visual.blocks.0.mlp.linear_fc2.kernel")


PRUNING = ("evs", 0.5)


def batch(checkpoint: str, video_pruning=None) -> dict:
    """8 left-padded conversations (4 with an image, 4 with a video) with assistant-only labels
    (`video_pruning`: the processor sizes the video placeholders for the kept tokens)."""
    from qwen3vl_jax import Qwen3VLProcessor
    from qwen3vl_jax.training import assistant_labels

    processor = Qwen3VLProcessor.from_pretrained(checkpoint)
    rng = np.random.default_rng(0)
    conversations, images, videos = [], [], []
    for i in range(4):
        conversations.append([
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Picture {i}?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A red square." * (i + 1)}]}])
        conversations.append([
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"It moves {i}."}]}])
        images.append((rng.random((64, 32 * (i + 2), 3)) * 255).astype(np.uint8))
        videos.append((rng.random((4, 64, 64, 3)) * 255).astype(np.uint8))
    texts = processor.apply_chat_template(conversations)
    out = processor(text=texts, images=images, videos=videos,
                    video_metadata=[{"fps": 2.0, "total_num_frames": 4}] * 4, padding=True, padding_side="left",
                    return_tensors="np", video_pruning=video_pruning)
    out["labels"] = assistant_labels(out["input_ids"], out["attention_mask"], processor, conversations)
    return dict(out)


def gather(x) -> np.ndarray:
    """The whole array on every process (its shards may live on other processes' devices)."""
    import jax
    from jax.experimental import multihost_utils

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def log(message: str) -> None:
    if os.environ.get("QWEN3VL_WORKER_VERBOSE"):
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def run(model, data: dict, pruned: dict, *, generate: bool = True) -> dict[str, np.ndarray]:
    """Logits (also with EVS video pruning), generated ids, vision features, and one train step's
    gradients and parameters."""
    from flax import nnx

    from qwen3vl_jax.buckets import EncoderRunner
    from qwen3vl_jax.model import MODEL_INPUTS, canonical_params
    from qwen3vl_jax.training import OptimConfig, Trainer

    inputs = {k: data[k] for k in MODEL_INPUTS if data.get(k) is not None}
    out = {"logits": gather(model(**inputs))}
    out["real_tokens"] = np.array([data["attention_mask"].sum(), pruned["attention_mask"].sum()])
    out["pruned_logits"] = gather(model(**{k: pruned[k] for k in MODEL_INPUTS if pruned.get(k) is not None},
                                        video_pruning=PRUNING))
    log("  logits")
    if generate:
        out["ids"] = gather(model.generate(**inputs, max_new_tokens=NEW_TOKENS))
        log("  generate")
    merged, deepstack = model.encode_vision(data["pixel_values"], data["image_grid_thw"])
    out["vision"], out["deepstack"] = gather(merged), gather(deepstack)
    # the bucketed encoder, compiled ahead of time for the parameters' shardings (one budget)
    runner = EncoderRunner(model, budgets=[1 << (merged.shape[0] - 1).bit_length()]).warmup()
    out["runner_vision"] = gather(runner.encode(data["pixel_values"], data["image_grid_thw"])[0])
    out["runner_compiles"] = np.int64(runner.num_compiles)
    log("  vision")
    # eps well above the gradients' rounding, so AdamW's g / (|g| + eps) stays continuous in g
    trainer = Trainer(model, OptimConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10, eps=1e-4))
    loss, grads = trainer.gradients([data])
    log("  gradients")
    out["loss"] = np.float64(loss)
    grads = canonical_params(nnx.State(grads))  # per-block names whatever the layout
    out["grads"] = np.concatenate([gather(grads[k]).ravel() for k in sorted(grads)])
    def flat_params():
        params = canonical_params(model)
        return np.concatenate([gather(params[k]).ravel() for k in sorted(params)])

    before = flat_params()
    trainer.step([data])
    out["params"] = flat_params()
    out["step_change"] = np.abs(out["params"] - before).max()
    return out


def shard_fractions(model, mesh) -> dict[str, np.ndarray]:
    """`[addressable shard fraction, the fraction its spec implies]` per large parameter."""
    from qwen3vl_jax.params import canonical_params

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    out = {}
    params = canonical_params(model)
    for name in LARGE:
        if name not in params:
            continue
        leaf = params[name]
        spec = leaf.sharding.spec
        implied = 1.0
        for axes in spec:
            for axis in (axes,) if isinstance(axes, str) else (axes or ()):
                implied /= sizes[axis]
        out[f"fraction {name}"] = np.array([leaf.addressable_shards[0].data.size / leaf.size, implied])
    return out


def meshes(checkpoint: str, out_path: str, cases: list[str] | None = None) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_default_matmul_precision", "highest")
    from qwen3vl_jax import Qwen3VL
    from qwen3vl_jax.sharding import make_mesh

    data, pruned = batch(checkpoint), batch(checkpoint, PRUNING)
    saved: dict[str, np.ndarray] = {}
    start = time.perf_counter()
    reference = Qwen3VL.from_pretrained(checkpoint, attention_implementation="xla")
    orbax_dir = os.path.join(os.path.dirname(out_path), "orbax_copy")
    reference.save_orbax(orbax_dir)
    for key, value in run(reference, data, pruned).items():
        saved[f"single/{key}"] = value
    print(f"single device: {time.perf_counter() - start:.1f}s", flush=True)
    for name, spec, options, from_orbax in CASES:
        if cases is not None and name not in cases:
            continue
        start = time.perf_counter()
        mesh = make_mesh(spec)
        options = {"attention_implementation": "xla", **options}
        model = Qwen3VL.from_pretrained(orbax_dir if from_orbax else checkpoint, mesh=mesh, **options)
        for key, value in shard_fractions(model, mesh).items():
            saved[f"{name}/{key}"] = value
        for key, value in run(model, data, pruned, generate="pallas" not in name).items():
            saved[f"{name}/{key}"] = value
        print(f"{name}: {time.perf_counter() - start:.1f}s", flush=True)
    np.savez(out_path, **saved)


def process(checkpoint: str, out_path: str, coordinator: str, process_id: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_default_matmul_precision", "highest")
    from qwen3vl_jax.sharding import initialize_distributed, make_mesh

    initialize_distributed(coordinator, 2, process_id)
    from qwen3vl_jax import Qwen3VL

    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    mesh = make_mesh("fsdp=2,tensor=4")
    model = Qwen3VL.from_pretrained(checkpoint, mesh=mesh, attention_implementation="xla")
    saved = {f"{k}": v for k, v in shard_fractions(model, mesh).items()}
    saved.update(run(model, batch(checkpoint), batch(checkpoint, PRUNING), generate=False))
    np.savez(out_path, **saved)
    jax.distributed.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("meshes", "process"))
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--coordinator")
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--cases", nargs="*", help="the names of the CASES to run (default: all)")
    args = parser.parse_args(argv)
    if args.mode == "meshes":
        unknown = set(args.cases or ()) - {name for name, *_ in CASES}
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}")
        meshes(args.checkpoint, args.out, args.cases)
    else:
        process(args.checkpoint, args.out, args.coordinator, args.process_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
