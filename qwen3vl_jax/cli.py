"""Command line: `qwen3vl-jax {demo, generate, convert, finetune, plan}`.

`qwen3vl-jax demo` with no arguments uses the built-in default: a small Qwen3-VL shipped with the
package (`qwen3vl_jax/default_model/`, HF format), trained on the synthetic tasks of docs/tasks.md
(`qwen3vl_jax.default`). It asks one image and one video question drawn from a fresh seed (printed;
`--task-seed` repeats it) and prints each question, the model's answer and the true answer, token
counts and per-stage timings (preprocess, vision encode, prefill, decode tokens/s), cold (with
compilation) and warm. `--model DIR` runs a real checkpoint; `--image F` / `--video F` / `--prompt`
ask your own question (no known answer).

`qwen3vl-jax generate --prompt ... [--image F] [--video F]` answers one prompt, streaming tokens
(the built-in default unless `--model`).

The random tiny checkpoint of the parity tests (`testing.make_tiny_checkpoint`) is synthesized into a
cache directory (`$QWEN3VL_JAX_CACHE`, default `~/.cache/qwen3vl-jax`) and converted to Orbax on
first use by `ensure_tiny_checkpoint` / `load_tiny_checkpoint`.

`qwen3vl-jax convert HF_DIR OUT_DIR [--dtype bfloat16]` reads an HF checkpoint (strictly checked
from its headers first) and writes an Orbax checkpoint plus the tokenizer / processor files, which
`Qwen3VL.from_pretrained(OUT_DIR)` and the processor read. `--to hf` exports safetensors instead
(from an HF or a converted directory; shards of at most `--max-shard-bytes`). Either way it streams:
one tensor is read, transformed, cast and written at a time, so the host memory it needs does not
grow with the model (`convert.convert_checkpoint`).

`qwen3vl-jax plan --preset 8b --mesh data=1,fsdp=1,tensor=8 --batch 4 --context 32768 [--train]
[--device-memory 80GB] [--check]` prints the per-device memory of a mesh (parameters, optimizer
state, gradients, KV cache, activations) from the partition rules, whether it fits, and with
`--check` the compiled steps' memory analysis beside it (`qwen3vl_jax.plan`). `--mesh auto` finds
the smallest mesh that fits `--device-memory`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .checks import ArgumentError, existing_file, non_negative_int, non_negative_number, positive_int

TINY_NAME = "tiny-v1"


def default_cache_dir() -> str:
    return os.environ.get("QWEN3VL_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "qwen3vl-jax"))


def ensure_tiny_checkpoint(cache_dir: str | None = None, *, rebuild: bool = False) -> str:
    """The random tiny checkpoint (the parity fixture) as an Orbax directory, synthesized and converted
    on first use (and again with `rebuild`, for a damaged cache)."""
    from .convert import atomic_directory, copy_side_files
    from .model import Qwen3VL
    from .testing import make_tiny_checkpoint

    root = cache_dir or default_cache_dir()
    path = os.path.join(root, TINY_NAME)
    if rebuild or not os.path.isdir(os.path.join(path, "orbax")):
        hf_dir = make_tiny_checkpoint(os.path.join(root, TINY_NAME + "-hf"))
        with atomic_directory(path, overwrite=True) as tmp:  # an incomplete earlier one is replaced
            Qwen3VL.from_pretrained(hf_dir).save_orbax(tmp)
            copy_side_files(hf_dir, tmp)
    return path


def demo_image(height: int = 224, width: int = 320, seed: int = 0) -> np.ndarray:
    """A generated RGB image: a gradient background with a few solid rectangles."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 96)], axis=-1).astype(np.uint8)
    for _ in range(4):
        top, left = rng.integers(0, height - 40), rng.integers(0, width - 40)
        image[top : top + 40, left : left + 40] = rng.integers(0, 256, 3)
    return image


def demo_video(frames: int = 32, height: int = 128, width: int = 160, seed: int = 0) -> np.ndarray:
    """A generated video `(T, H, W, 3)`: a static background with a square moving across it."""
    background = demo_image(height, width, seed)
    video = np.repeat(background[None], frames, axis=0)
    for t in range(frames):
        left = int(t * (width - 32) / max(frames - 1, 1))
        video[t, height // 2 - 16 : height // 2 + 16, left : left + 32] = (255, 32, 32)
    return video


def load_tiny_checkpoint(dtype=None):
    """`(path, model, processor)` of the random tiny checkpoint in the cache (`ensure_tiny_checkpoint`);
    a damaged cache is named and rebuilt."""
    import jax.numpy as jnp

    from .model import Qwen3VL
    from .processing import Qwen3VLProcessor

    dtype = jnp.float32 if dtype is None else dtype
    path = ensure_tiny_checkpoint()
    try:
        return path, Qwen3VL.from_pretrained(path, dtype=dtype), Qwen3VLProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- the cache is ours to rebuild
        print(f"the cached tiny checkpoint at {path} is damaged ({type(e).__name__}: {str(e)[:200]}); "
              "rebuilding it", flush=True)
        path = ensure_tiny_checkpoint(rebuild=True)
        return path, Qwen3VL.from_pretrained(path, dtype=dtype), Qwen3VLProcessor.from_pretrained(path)


def _load(args):
    """`(path, model, processor, load seconds)`: `--model`, else the shipped default."""
    import jax.numpy as jnp

    from .default import default_checkpoint
    from .model import Qwen3VL
    from .processing import Qwen3VLProcessor

    path = args.model or default_checkpoint()
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    start = time.perf_counter()
    model, processor = Qwen3VL.from_pretrained(path, dtype=dtype), Qwen3VLProcessor.from_pretrained(path)
    return path, model, processor, time.perf_counter() - start


def _request(processor, prompt: str, image=None, video=None, fps: float = 8.0):
    """Processor inputs for one user turn with an optional image or video (array or file path); a
    video given as frames is taken as recorded at `fps`."""
    content, kwargs = [], {}
    if image is not None:
        content.append({"type": "image"})
        kwargs["images"] = [image]
    if video is not None:
        content.append({"type": "video"})
        kwargs["videos"] = [video]
        if not isinstance(video, (str, os.PathLike)):
            kwargs["video_metadata"] = [{"fps": fps, "total_num_frames": len(video)}]
    content.append({"type": "text", "text": prompt})
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], return_tensors="np", **kwargs)


def _generate(model, inputs, args, timings=None, callback=None):
    import jax

    from .model import MODEL_INPUTS

    sample = args.temperature > 0
    return model.generate(**{k: inputs[k] for k in MODEL_INPUTS if k in inputs}, max_new_tokens=args.max_new_tokens,
                          do_sample=sample, temperature=args.temperature if sample else 1.0,
                          rng=jax.random.key(args.seed), timings=timings, callback=callback)


def demo_items(task_seed: int):
    """The demo's two questions: an image item and a video item of the synthetic tasks, drawn from
    `np.random.default_rng([task_seed, 28])` (a stream apart from the `make_set` seeds the default
    trained on, `default.training_seeds()`), the families picked by the seed too."""
    from .pruning.synthetic import IMAGE_FAMILIES, VIDEO_FAMILIES, make_item

    rng = np.random.default_rng([task_seed, 28])
    image_family = IMAGE_FAMILIES[int(rng.integers(len(IMAGE_FAMILIES)))]
    video_family = VIDEO_FAMILIES[int(rng.integers(len(VIDEO_FAMILIES)))]
    return [make_item(image_family, rng), make_item(video_family, rng)]


def run_demo(args) -> list[dict]:
    """Print, and return per question: the question, the model's answer and the true answer (None for
    your own media or question), with the timings."""
    import secrets

    import jax

    from .default import item_inputs, item_prompt
    from .model import count_params

    path, model, processor, load_s = _load(args)
    print(f"checkpoint: {path}{'' if args.model else ' (built-in default, trained on the tasks of docs/tasks.md)'}")
    print(f"jax {jax.__version__} on {jax.default_backend()}; {count_params(model):,} parameters ({args.dtype}); "
          f"loaded in {load_s:.2f} s")
    task_seed = secrets.randbelow(2**31) + 1 if args.task_seed is None else args.task_seed
    print(f"task seed {task_seed} (fresh items; `--task-seed {task_seed}` asks them again)")
    rows, results = [], []
    for item, given in zip(demo_items(task_seed), (args.image, args.video)):
        name = item.kind
        start = time.perf_counter()
        if given is not None or args.prompt is not None:  # your own media or question: no known answer
            question, truth = args.prompt or item_prompt(item)[0], None
            media = given if given is not None else item.media
            inputs = _request(processor, question, **{name: media}, fps=item.fps or 8.0)
            label = f"{name}: {given}" if given is not None else f"{name}: {item.family}"
        else:
            (question, truth), label = item_prompt(item), f"{name}: {item.family}"
            inputs = item_inputs(processor, item)
        preprocess = time.perf_counter() - start
        runs = []
        for _ in range(2):  # cold (compiles) then warm
            timings = {}
            out = _generate(model, inputs, args, timings)
            runs.append(timings)
        prompt_len = inputs["input_ids"].shape[1]
        new = out[0, prompt_len:]
        grid_key = "image_grid_thw" if name == "image" else "video_grid_thw"
        answer = processor.decode(new, skip_special_tokens=True).strip()
        print(f"\n[{label}] grid_thw {inputs[grid_key].tolist()}, prompt {prompt_len} tokens, "
              f"generated {len(new)} tokens")
        print(f"  question: {question}")
        print(f"  answer:   {answer!r}")
        if truth is None:
            print("  truth:    unknown (your own media or question)")
        else:
            print(f"  truth:    {truth!r} ({'right' if answer == truth else 'wrong'})")
        results.append({"kind": name, "family": None if given is not None else item.family, "question": question,
                        "answer": answer, "truth": truth})
        for label, t in (("cold", runs[0]), ("warm", runs[1])):
            rows.append((f"{name} {label}", preprocess, t["prepare"], t["prefill"], t["decode"],
                         max(t["new_tokens"] - 1, 0) / t["decode"] if t["decode"] > 0 else float("nan")))
    print(f"\n{'stage timings':<14}{'preprocess ms':>15}{'vision+host ms':>16}{'prefill ms':>12}"
          f"{'decode ms':>11}{'decode tok/s':>14}")
    for name, pre, vis, prefill, decode, rate in rows:
        print(f"{name:<14}{pre * 1e3:>15.1f}{vis * 1e3:>16.1f}{prefill * 1e3:>12.1f}{decode * 1e3:>11.1f}{rate:>14.1f}")
    print("(cold runs include compilation; 'vision+host' is the vision encoder plus host bookkeeping)")
    return results


def run_generate(args) -> None:
    _, model, processor, _ = _load(args)
    inputs = _request(processor, args.prompt, image=args.image, video=args.video)
    prompt_len = inputs["input_ids"].shape[1]
    streamed = []

    def show(t, tokens):
        streamed.append(int(tokens[0]))
        print(processor.decode(streamed)[len(processor.decode(streamed[:-1])):], end="", flush=True)

    out = _generate(model, inputs, args, callback=show)
    print(f"\n[{prompt_len} prompt tokens, {out.shape[1] - prompt_len} generated]")


def peak_rss_bytes() -> int:
    """This process's peak resident memory: `VmHWM` where Linux has it (it starts afresh at exec,
    unlike `ru_maxrss`, which keeps the pages a forked child shared with its parent), else `ru_maxrss`."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _directory_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)


def run_convert(args) -> None:
    from tqdm.auto import tqdm

    from .convert import convert_checkpoint
    from .model import expected_params
    from .quant import QuantSpec

    spec = None if args.quantize is None else QuantSpec.make(args.quantize, group=args.group_size,
                                                             lm_head=args.quantize_lm_head)
    start = time.perf_counter()
    with tqdm(desc=f"converting {os.path.basename(os.path.abspath(args.source))}", unit=" tensors") as bar:
        _, n, copied = convert_checkpoint(
            args.source, args.out, expected_params, to=args.to, dtype=args.dtype,
            max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite,
            on_tensor=lambda name: bar.update(), quantize=spec)
    peak = peak_rss_bytes() / 2**30
    stored = (f"{args.dtype}, the language model's linears in {args.quantize}" if args.quantize
              else args.dtype)
    print(f"wrote {args.to} checkpoint to {args.out}: {n:,} parameters in {stored} "
          f"({_directory_bytes(args.out) / 2**30:.2f} GiB on disk), {len(copied)} side files, "
          f"{time.perf_counter() - start:.1f} s, peak host memory {peak:.2f} GiB")


def run_finetune(args) -> int:
    from .training.run import TrainingDiverged, finetune

    options = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        summary = finetune(**options)
    except (ValueError, FileNotFoundError, TrainingDiverged) as e:
        print(f"qwen3vl-jax finetune: error: {e}", file=sys.stderr)
        return 2
    print(f"finetune: {summary['steps']} updates, {summary['rows']} rows ({summary['skipped']} skipped), "
          f"last loss {summary['last_loss']}; wrote {args.out}")
    return 0


def run_plan(args) -> int:
    from .plan import check, check_table, plan, smallest_mesh

    options = dict(dtype=args.dtype, param_dtype=args.param_dtype, remat=args.remat, vision=args.vision,
                   device_memory=args.device_memory, quantize=args.quantize)
    source = args.config or args.preset
    try:
        if args.mesh == "auto":
            if args.device_memory is None:
                raise ValueError("--mesh auto needs --device-memory")
            result = smallest_mesh(source, args.batch, args.context, args.train, max_devices=args.max_devices,
                                   **options)
            if result is None:
                print(f"qwen3vl-jax plan: no mesh of up to {args.max_devices} devices fits "
                      f"{args.device_memory} per device", file=sys.stderr)
                return 1
        else:
            result = plan(source, args.mesh, args.batch, args.context, args.train, devices=args.devices,
                          **options)
    except ValueError as e:  # ShardingError and ConfigError are ValueErrors
        print(f"qwen3vl-jax plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(result.as_dict()))
    else:
        print(result.table())
    if args.check:
        print(f"\ncompiling the steps on {result.devices} host CPU devices ...", flush=True)
        print(check_table(check(result, context=args.check_context, dtype=args.check_dtype)))
    return 0


def check_arguments(args) -> None:
    """The arguments of demo / generate / convert / plan, before any model is loaded (finetune's are
    checked by `training.run.finetune`, which the API shares); raises `ArgumentError` naming one."""
    if args.command in ("demo", "generate"):
        positive_int("--max-new-tokens", args.max_new_tokens)
        non_negative_number("--temperature", args.temperature)
        non_negative_int("--seed", args.seed)
        if getattr(args, "task_seed", None) is not None:
            non_negative_int("--task-seed", args.task_seed)
        for name in ("image", "video"):
            if getattr(args, name) is not None:
                existing_file(f"--{name}", getattr(args, name))
        if args.model is not None and not os.path.isdir(args.model):
            raise ArgumentError(f"--model: no such checkpoint directory: {args.model}")
    elif args.command == "convert":  # (its paths are checked by `convert.convert_checkpoint`, before reading)
        positive_int("--max-shard-bytes", args.max_shard_bytes)
        positive_int("--group-size", args.group_size)
        if args.group_size % 2:
            raise ArgumentError(f"--group-size must be even (int4 packs two rows a byte), got {args.group_size}")
    elif args.command == "plan":
        positive_int("--batch", args.batch)
        positive_int("--context", args.context)
        positive_int("--max-devices", args.max_devices)
        if args.devices is not None:
            positive_int("--devices", args.devices)
        if args.check_context is not None:
            positive_int("--check-context", args.check_context)


def main(argv=None) -> int:
    from .convert import DEFAULT_MAX_SHARD_BYTES

    parser = argparse.ArgumentParser(prog="qwen3vl-jax", description="Qwen3-VL in JAX, Flax NNX and Pallas")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("demo", "an image and a video question end to end: the model's answer and the true one, with timings "
                 "(the built-in default unless --model)"),
        ("generate", "answer one prompt, streaming the tokens"),
    ):
        demo = name == "demo"
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--model", help="an HF or converted checkpoint directory (default: the built-in default "
                                         "model, trained on the synthetic tasks of docs/tasks.md)")
        cmd.add_argument("--image", help="an image file" + (" (default: a generated task image)" if demo else ""))
        cmd.add_argument("--video", help="a video file" + (" (default: a generated task video)" if demo else ""))
        cmd.add_argument("--prompt", default=None, required=not demo,
                         help="the question" + (" (default: the generated item's question)" if demo else ""))
        if demo:
            cmd.add_argument("--task-seed", type=int, default=None,
                             help="seed of the generated items (default: a fresh one, printed)")
        cmd.add_argument("--max-new-tokens", type=int, default=32)
        cmd.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples with --seed")
        cmd.add_argument("--seed", type=int, default=0)
        cmd.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    convert = sub.add_parser("convert", help="HF safetensors -> Orbax (or back to HF with --to hf)")
    convert.add_argument("source", help="an HF checkpoint directory, or one written by convert")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    convert.add_argument("--to", choices=("orbax", "hf"), default="orbax")
    convert.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                         help="quantize the language model's linears and experts (weight-only; int8 per output "
                              "channel, int4 in groups of --group-size input rows, fp8 in 128 x 128 blocks)")
    convert.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    convert.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (default: kept)")
    convert.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                         help="largest safetensors shard for --to hf (default 5e9; memory does not depend "
                              "on it: tensors are written one at a time)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty output directory (by default it is refused)")
    tune = sub.add_parser("finetune", help="supervised fine-tuning (full or LoRA) on a JSONL conversation file")
    tune.add_argument("--model", required=True, help="an HF or converted checkpoint directory")
    tune.add_argument("--data", required=True, help="JSONL, one conversation per line (media relative to it)")
    tune.add_argument("--out", required=True, help="output directory (checkpoints/, metrics.jsonl, loss.png, adapter/)")
    tune.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tuning")
    tune.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                      help="QLoRA: the language model's linears quantized and frozen under the adapters")
    tune.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    tune.add_argument("--lora-dropout", type=float, default=0.0)
    tune.add_argument("--lora-vision", action="store_true", help="adapters on the vision blocks too")
    tune.add_argument("--freeze", default="", help="comma-separated parts: vision, merger, language, router (MoE)")
    tune.add_argument("--learning-rate", type=float, default=1e-4)
    tune.add_argument("--warmup-steps", type=int, default=0)
    tune.add_argument("--steps", type=int, default=100)
    tune.add_argument("--batch-size", type=int, default=1)
    tune.add_argument("--grad-accum", type=int, default=1)
    tune.add_argument("--max-length", type=int, default=2048, help="longer rows are skipped, never truncated")
    tune.add_argument("--remat", action="store_true", help="recompute each block in the backward pass")
    tune.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="compute dtype (the master weights stay float32)")
    tune.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--save-every", type=int, default=50)
    tune.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    tune.add_argument("--strict", action="store_true", help="refuse rows that would be skipped")
    tune.add_argument("--export-merged", default=None, help="also write a plain HF checkpoint here")
    memo = sub.add_parser("plan", help="per-device memory of a mesh: parameters, optimizer, gradients, "
                                       "KV cache, activations; whether it fits")
    model_source = memo.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--preset", help="2b, 4b, 8b, 32b, 30b-a3b or 235b-a22b")
    model_source.add_argument("--config", help="an HF config.json or checkpoint directory")
    memo.add_argument("--mesh", default=None,
                      help="e.g. data=1,fsdp=1,tensor=8 (unnamed axes: 1; default one device); 'auto': the "
                           "smallest mesh that fits --device-memory")
    memo.add_argument("--batch", type=int, default=1)
    memo.add_argument("--context", type=int, default=4096,
                      help="tokens per row: the KV cache's slots, or the training sequence length")
    memo.add_argument("--train", action="store_true", help="a full fine-tuning micro-step with AdamW")
    memo.add_argument("--remat", action="store_true", help="recompute each block in the backward pass")
    memo.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="compute dtype")
    memo.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                      help="storage dtype (default: float32 with --train, as finetune's master weights; "
                           "else --dtype)")
    memo.add_argument("--vision", choices=("data", "tensor"), default="data",
                      help="the vision tower replicated (default) or tensor-parallel")
    memo.add_argument("--device-memory", default=None, help="e.g. 80GB (10^9 bytes), 141GB, 96GiB")
    memo.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                      help="the language model's linears and experts stored quantized (inference)")
    memo.add_argument("--devices", type=int, default=None, help="the device count the mesh must use")
    memo.add_argument("--max-devices", type=int, default=512, help="the largest mesh --mesh auto tries")
    memo.add_argument("--json", action="store_true", help="print the plan as JSON")
    memo.add_argument("--check", action="store_true",
                      help="also compile the steps on abstract shapes over that many host CPU devices and "
                           "print their memory analysis beside the plan (slow for large presets)")
    memo.add_argument("--check-context", type=int, default=None,
                      help="compile the check at this context instead (the plan is recomputed to match)")
    memo.add_argument("--check-dtype", choices=("float32", "bfloat16"), default=None,
                      help="compile the check at this compute dtype instead (the CPU multiplies bf16 in f32)")
    tune.add_argument("--allow-change", default="",
                      help="with --resume: comma-separated settings that may differ from the run's start "
                           "(learning_rate, warmup_steps, steps); any other difference is refused")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
    except ArgumentError as e:
        print(f"qwen3vl-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    if args.command == "finetune":
        return run_finetune(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "demo":
        run_demo(args)
    elif args.command == "generate":
        run_generate(args)
    elif args.command == "convert":
        run_convert(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
