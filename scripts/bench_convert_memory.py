"""Peak host memory of `qwen3vl-jax convert` against model depth: it must not grow with the layers.

    .venv/bin/python scripts/bench_convert_memory.py [--layers 2 8] [--workdir DIR] [--repo DIR]

For each `--layers` count it synthesizes an HF checkpoint of the 8B preset's widths (hidden 4096,
intermediate 12288, 32 heads / 8 KV heads, head_dim 128, the real vocabulary of 151,936, untied
`lm_head`) in bfloat16, with that many decoder layers and a small vision tower (the 8B tower's
widths, `--vision-depth` blocks, default 2; its deepstack mergers are full size). Then it runs,
each in its own subprocess, `convert HF ORBAX --dtype bfloat16` and `convert ORBAX HF2 --to hf
--dtype bfloat16`, and reports each one's peak resident memory (the child's own `VmHWM`; the
synthesis runs in a subprocess of its own too), its wall time, and the checkpoint sizes, as a
Markdown table. A streaming converter
needs about the same peak at every depth (the difference should be within one or two of the
largest tensors: the 1.24 GB embedding and `lm_head`); one that holds the model grows by about
386 MB per layer.

The synthesized weights are written with the same streaming writer (`convert.write_safetensors`),
so synthesis itself never holds the model either. `--repo DIR` runs `convert` from another
checkout (e.g. an older commit, for a before/after comparison). Everything is written under
`--workdir` (default: a temporary directory next to the system's) and deleted case by case unless
`--keep`. Needs about 3 x the checkpoint size of free disk at a time (~18 GB for 8 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def bench_config(layers: int, vision_depth: int, vocab: int):
    from qwen3vl_jax.config import preset

    base = preset("8b")
    return base.replace(
        text={"num_hidden_layers": layers, "vocab_size": vocab},
        vision={"depth": vision_depth,
                "deepstack_visual_indexes": tuple(range(min(vision_depth, layers, 3)))},
    )


def synthesize(directory: str, config, seed: int = 0) -> None:
    """An HF checkpoint (config.json, safetensors in ~5 GB shards, tokenizer side files) of random
    bfloat16 weights, generated and written one tensor at a time."""
    from qwen3vl_jax.model import expected_params
    from qwen3vl_jax.convert import DEFAULT_MAX_SHARD_BYTES, LazyTensor, export_hf_lazy, write_safetensors
    from qwen3vl_jax.testing import make_tiny_checkpoint

    import ml_dtypes

    side = make_tiny_checkpoint(os.path.join(directory, ".side"))  # tokenizer and processor files
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(side):
        if name not in ("config.json",) and not name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(side, name), os.path.join(directory, name))
    shutil.rmtree(side)

    bf16 = np.dtype(ml_dtypes.bfloat16)

    def make(path: str, shape: tuple[int, ...], i: int):
        def load():
            rng = np.random.default_rng(seed + i)
            scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 1.0
            return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(bf16)
        return LazyTensor(shape, bf16, load, path)

    params = {path: make(path, tuple(shape), i) for i, (path, (shape, _)) in
              enumerate(sorted(expected_params(config).items()))}
    write_safetensors(export_hf_lazy(params, config), directory, DEFAULT_MAX_SHARD_BYTES)
    hf = config.to_hf_dict()
    hf["dtype"] = "bfloat16"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _env(repo: str) -> dict:
    return dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
                JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))


# The child reports its own VmHWM: the peak of its own address space since exec. (`ru_maxrss`, also
# from `os.wait4`, would count the pages the forked child shared with this process before exec.)
_CONVERT = """
import sys
from qwen3vl_jax.cli import main
code = main(sys.argv[1:])
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print("VmHWM", int(line.split()[1]) * 1024)
sys.exit(code)
"""


def run_convert(args: list[str], repo: str) -> tuple[int, float, str]:
    """(peak resident bytes, seconds, the CLI's summary line) of one `convert` in a fresh subprocess."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CONVERT, "convert", *args], env=_env(repo), cwd=repo,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"convert {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    lines = out.stdout.strip().splitlines()
    peak = int(lines[-1].split()[1])
    return peak, seconds, lines[-2] if len(lines) > 1 else ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--synthesize"]:
        directory, layers, vision_depth, vocab = argv[1:]
        synthesize(directory, bench_config(int(layers), int(vision_depth), int(vocab)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--repo", default=REPO, help="the checkout whose `convert` is measured")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    from qwen3vl_jax.model import expected_params

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(workdir, exist_ok=True)
    print(f"free disk under {workdir}: {shutil.disk_usage(workdir).free / 1e9:.1f} GB; measuring {args.repo}")
    rows = []
    try:
        for layers in args.layers:
            config = bench_config(layers, args.vision_depth, args.vocab)
            shapes = expected_params(config)
            n = sum(int(np.prod(s)) for s, _ in shapes.values())
            largest = max(int(np.prod(s)) for s, _ in shapes.values()) * 2
            case = os.path.join(workdir, f"L{layers}")
            hf, orbax, back = (os.path.join(case, name) for name in ("hf", "orbax", "hf_back"))
            start = time.perf_counter()
            # in a subprocess, so that this process stays small
            subprocess.run([sys.executable, os.path.abspath(__file__), "--synthesize", hf, str(layers),
                            str(args.vision_depth), str(args.vocab)], check=True, env=_env(REPO))
            print(f"[{layers} layers] synthesized {n:,} parameters ({du(hf) / 1e9:.2f} GB) in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            to_orbax = run_convert([hf, orbax, "--dtype", "bfloat16"], args.repo)
            print(f"  HF -> Orbax: {to_orbax[0] / 2**30:.2f} GiB peak, {to_orbax[1]:.0f} s | {to_orbax[2]}",
                  flush=True)
            to_hf = run_convert([orbax, back, "--to", "hf", "--dtype", "bfloat16"], args.repo)
            print(f"  Orbax -> HF: {to_hf[0] / 2**30:.2f} GiB peak, {to_hf[1]:.0f} s | {to_hf[2]}",
                  flush=True)
            rows.append(dict(layers=layers, params=n, hf_bytes=du(hf), orbax_bytes=du(orbax),
                             back_bytes=du(back), largest_tensor_bytes=largest, to_orbax_peak=to_orbax[0],
                             to_orbax_s=to_orbax[1], to_hf_peak=to_hf[0], to_hf_s=to_hf[1]))
            if not args.keep:
                shutil.rmtree(case)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n8B widths (vocab {args.vocab:,}, untied lm_head), {args.vision_depth}-block vision tower, "
          f"bfloat16; largest tensor {rows[0]['largest_tensor_bytes'] / 1e9:.2f} GB\n")
    print("| decoder layers | parameters | HF checkpoint | Orbax checkpoint | HF -> Orbax peak RSS | "
          "Orbax -> HF peak RSS |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layers']} | {r['params'] / 1e9:.2f} B | {r['hf_bytes'] / 1e9:.2f} GB | "
              f"{r['orbax_bytes'] / 1e9:.2f} GB | "
              f"{r['to_orbax_peak'] / 2**30:.2f} GiB ({r['to_orbax_s']:.0f} s) | "
              f"{r['to_hf_peak'] / 2**30:.2f} GiB ({r['to_hf_s']:.0f} s) |")
    if len(rows) > 1:
        grow = [(rows[-1][k] - rows[0][k]) / 2**30 for k in ("to_orbax_peak", "to_hf_peak")]
        largest = rows[0]["largest_tensor_bytes"] / 2**30
        print(f"\npeak growth from {rows[0]['layers']} to {rows[-1]['layers']} layers: "
              f"HF -> Orbax {grow[0]:+.2f} GiB, Orbax -> HF {grow[1]:+.2f} GiB "
              f"(largest tensor {largest:.2f} GiB; "
              f"the checkpoint grows by {(rows[-1]['hf_bytes'] - rows[0]['hf_bytes']) / 2**30:.2f} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
