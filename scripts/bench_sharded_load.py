"""Host memory while loading a sharded checkpoint: peak RSS per process against its share.

Synthesizes an HF checkpoint (a tiny vision tower and a decoder of 2B-like widths, f32, ~1.6 GB),
then loads it three ways, each in fresh processes on CPU devices (whose memory *is* host memory):
  - one process, one device, unsharded (the whole model is the process's share);
  - one process, 8 devices, mesh fsdp=8;
  - two processes joined by `jax.distributed` (loopback), 4 devices each, mesh fsdp=8 across both.
For each process: the bytes its devices hold (its share), the peak RSS growth over loading
(VmHWM after the load minus VmRSS before it, jax already initialized), and that growth split into
its anonymous part (host copies: the device buffers, blocks being read) and its file-backed part
(checkpoint pages mapped by safetensors: the kernel's page cache, shared and reclaimable), both
sampled every 2 ms since the kernel keeps no peak for them.

    python scripts/bench_sharded_load.py [--workdir DIR] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

GIB = 1024**3


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(args) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.coordinator:
        from qwen3vl_jax.sharding import initialize_distributed

        initialize_distributed(args.coordinator, args.processes, args.process_id)
    import jax.numpy as jnp
    from flax import nnx

    from qwen3vl_jax import Qwen3VL
    from qwen3vl_jax.sharding import make_mesh

    jnp.zeros(1).block_until_ready()  # the runtime is up before the baseline
    before = {field: _status(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    peaks = dict(before)
    done = threading.Event()

    def sample():  # the kernel keeps no peak of the anonymous / file-backed parts: sample them
        while not done.is_set():
            for field in ("RssAnon", "RssFile"):
                peaks[field] = max(peaks[field], _status(field))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    mesh = make_mesh(args.mesh) if args.mesh else None
    model = Qwen3VL.from_pretrained(args.checkpoint, mesh=mesh, attention_implementation="xla")
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    done.set()
    sampler.join()
    share = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    print(json.dumps({"process": args.process_id or 0, "share": share,
                      "growth": _status("VmHWM") - before["VmRSS"],
                      "anon": peaks["RssAnon"] - before["RssAnon"],
                      "file": peaks["RssFile"] - before["RssFile"]}), flush=True)
    if args.coordinator:
        jax.distributed.shutdown()


def _run(cmds: list[list[str]]) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=900"}
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(stderr[-4000:])
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--mesh")
    parser.add_argument("--coordinator")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from qwen3vl_jax.testing import make_tiny_checkpoint

    work = args.workdir or tempfile.mkdtemp(prefix="bench_sharded_load_")
    checkpoint = os.path.join(work, "ckpt")
    if not os.path.isdir(checkpoint):
        make_tiny_checkpoint(checkpoint, text=dict(hidden_size=2048, intermediate_size=6144,
                                                   num_hidden_layers=args.layers, num_attention_heads=16,
                                                   num_key_value_heads=8, head_dim=128, mrope_section=(24, 20, 20)),
                             vision=dict(out_hidden_size=2048), max_shard_bytes=512 * 1024**2)
    size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
               if f.endswith(".safetensors"))
    base = [sys.executable, os.path.abspath(__file__), "--child", "--checkpoint", checkpoint]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = [("1 process, 1 device, unsharded", _run([base]))]
    rows.append(("1 process, 8 devices, fsdp=8", _run([base + ["--devices", "8", "--mesh", "fsdp=8"]])))
    rows.append(("2 processes x 4 devices, fsdp=8", _run([
        base + ["--devices", "4", "--mesh", "fsdp=8", "--coordinator", f"127.0.0.1:{port}", "--processes", "2",
                "--process-id", str(i)] for i in range(2)])))
    print(f"checkpoint: {size / GIB:.2f} GiB of safetensors ({args.layers} decoder layers, f32)")
    print("| run | process | its devices hold | peak RSS growth | peak anonymous growth | anonymous - share "
          "| peak file-backed (mapped checkpoint pages) |")
    print("|---|---|---|---|---|---|---|")
    for name, results in rows:
        for r in results:
            print(f"| {name} | {r['process']} | {r['share'] / GIB:.2f} GiB | {r['growth'] / GIB:.2f} GiB | "
                  f"{r['anon'] / GIB:.2f} GiB | {(r['anon'] - r['share']) / GIB:+.2f} GiB | {r['file'] / GIB:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
