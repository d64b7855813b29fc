"""Sharding on real meshes of host CPU devices, and across two processes.

The meshes run in subprocesses (`tests/sharding_worker.py`): this process has one device. Each
mesh must give the single-device results: logits, generated ids, vision features, the train
step's gradients and updated parameters; every large parameter's addressable shard is the
fraction its partition spec implies. Two processes joined by `jax.distributed` (loopback
coordinator, gloo collectives) on a mesh spanning both must agree with the single device too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import assert_close, worker_env

from qwen3vl_jax.sharding import ShardingError, check_mesh, make_mesh, param_spec, parse_mesh

WORKER = os.path.join(os.path.dirname(__file__), "sharding_worker.py")
# Heads the tensor axis (4) divides; widths fsdp = 8 divides.
SHARDABLE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, mrope_section=(4, 2, 2))
# Each case compiles the model about five times on 8 devices (~25 s). Plain "fsdp=2,tensor=4" is
# the mesh of the two-process test below, and tensor parallelism of the unrolled language model is
# checked there too, so the single-process cases are these four. All are `slow` (.ci/run): the
# lightest, "fsdp=2,tensor=4 scan orbax", took 55 s of the fast tier's budget with its reference.
MESH_CASES = ["data=8", "fsdp=8", "fsdp=2,tensor=4 scan orbax", "data=2,tensor=4 vision=tensor pallas"]
MESH_PARAMS = [pytest.param(c, id=c, marks=pytest.mark.slow) for c in MESH_CASES]


def _env() -> dict[str, str]:
    # Eight virtual devices share two cores: give a late collective participant time.
    return worker_env("--xla_cpu_collective_call_terminate_timeout_seconds=900")


@pytest.fixture(scope="module")
def shardable_dir(tmp_path_factory):
    from qwen3vl_jax.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("shardable") / "ckpt", text=SHARDABLE)


@pytest.fixture(scope="module")
def mesh_results(request, shardable_dir, once_per_run):
    """The single-device reference and the meshes of the selected tests, in one subprocess per run
    (the xdist workers share its results: each collects the same tests, so the same cases)."""
    params = [getattr(item, "callspec", None) for item in request.session.items if item.module is request.module]
    cases = sorted({p.params["case"] for p in params if p is not None and "case" in p.params})

    def run_meshes(out: str) -> None:
        proc = subprocess.run([sys.executable, WORKER, "meshes", shardable_dir, out, "--cases", *cases],
                              env=_env(), capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    return dict(np.load(once_per_run("sharding-meshes.npz", run_meshes)))


@pytest.mark.parametrize("case", MESH_PARAMS)
def test_mesh_matches_single_device(mesh_results, case):
    r = mesh_results
    assert_close(r[f"{case}/logits"], r["single/logits"], "f32_logits", f"{case} logits")
    unpruned_tokens, pruned_tokens = r["single/real_tokens"]
    assert pruned_tokens < unpruned_tokens, "EVS should shorten the prompts"
    assert_close(r[f"{case}/pruned_logits"], r["single/pruned_logits"], "f32_logits", f"{case} EVS-pruned logits")
    if "pallas" not in case:  # greedy ids: exact
        np.testing.assert_array_equal(r[f"{case}/ids"], r["single/ids"], err_msg=f"{case} generate ids")
    assert_close(r[f"{case}/vision"], r["single/vision"], "f32_tower", f"{case} vision features")
    assert_close(r[f"{case}/deepstack"], r["single/deepstack"], "f32_tower", f"{case} deepstack features")
    assert_close(r[f"{case}/runner_vision"], r["single/vision"], "f32_tower", f"{case} EncoderRunner features")
    assert int(r[f"{case}/runner_compiles"]) == 1, "the encode call compiled again after warmup"
    assert float(r[f"{case}/loss"]) == pytest.approx(float(r["single/loss"]), rel=1e-5)
    assert_close(r[f"{case}/grads"], r["single/grads"], "f32_logits", f"{case} loss gradients")
    assert_close(r[f"{case}/params"], r["single/params"], "f32_logits", f"{case} parameters after a step")
    # a step that changed nothing would pass the line above vacuously
    assert float(r["single/step_change"]) > 1e-4 and np.abs(r["single/grads"]).max() > 0


@pytest.mark.parametrize("case", MESH_PARAMS)
def test_addressable_shards_are_the_spec_fraction(mesh_results, case):
    fractions = {k.split("fraction ", 1)[1]: v for k, v in mesh_results.items() if k.startswith(f"{case}/fraction ")}
    assert "language_model.layers.0.self_attn.q_proj.kernel" in fractions
    for name, (actual, implied) in fractions.items():
        assert actual == pytest.approx(implied), f"{case}: {name} holds {actual} of the tensor, spec says {implied}"
    sizes = parse_mesh(case.split()[0])
    q = fractions["language_model.layers.0.self_attn.q_proj.kernel"][0]  # (fsdp, tensor)
    assert q == pytest.approx(1 / (sizes["fsdp"] * sizes["tensor"])), case
    vision = fractions["visual.blocks.0.attn.qkv.kernel"][0]
    assert vision == pytest.approx(1 / 4 if "vision=tensor" in case else 1.0), case


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_with_one(shardable_dir, mesh_results, tmp_path):
    """`jax.distributed` on loopback: 2 processes x 4 CPU devices, mesh fsdp=2,tensor=4 across
    both; each process loads only its slices and gets the single-device logits, gradients and
    parameters after a train step."""
    coordinator = f"127.0.0.1:{_free_port()}"
    outs = [str(tmp_path / f"process{i}.npz") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, "process", shardable_dir, outs[i], "--coordinator", coordinator,
                               "--process-id", str(i)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=1200) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stdout[-2000:] + stderr[-5000:]
    single = mesh_results
    for i, out in enumerate(outs):
        r = dict(np.load(out))
        assert_close(r["logits"], single["single/logits"], "f32_logits", f"process {i} logits")
        assert_close(r["pruned_logits"], single["single/pruned_logits"], "f32_logits", f"process {i} pruned logits")
        assert_close(r["grads"], single["single/grads"], "f32_logits", f"process {i} gradients")
        assert_close(r["params"], single["single/params"], "f32_logits", f"process {i} parameters after a step")
        # each process holds half of an fsdp x tensor-split weight's rows... of its 4 devices' shards
        actual, implied = r["fraction language_model.layers.0.self_attn.q_proj.kernel"]
        assert implied == pytest.approx(1 / 8) and actual == pytest.approx(implied)


# ---------------------------------------------------------------------- bad input (no devices needed)


def test_unknown_axis_and_bad_sizes_are_named():
    with pytest.raises(ShardingError, match="unknown mesh axis.*'model'"):
        parse_mesh("data=2,model=4")
    with pytest.raises(ShardingError, match="not AXIS=SIZE"):
        parse_mesh("data")
    with pytest.raises(ShardingError, match="'tensor'.*positive integer"):
        parse_mesh({"tensor": 0})
    with pytest.raises(ShardingError, match="needs 8 devices, but 1"):
        make_mesh("data=2,tensor=4")


def test_indivisible_heads_name_the_parameter_and_axis():
    from qwen3vl_jax.config import PRESETS

    mesh = jax.sharding.AbstractMesh((1, 1, 1, 3), ("data", "expert", "fsdp", "tensor"))
    with pytest.raises(ShardingError, match=r"k_proj.*8 kv heads.*'tensor' of size 3"):
        check_mesh(PRESETS["8b"], mesh)
    with pytest.raises(ShardingError, match=r"q_proj\.kernel: dimension 1 \(4096\).*'tensor' of size 3"):
        param_spec("language_model.layers.0.self_attn.q_proj.kernel", (4096, 4096), mesh)
