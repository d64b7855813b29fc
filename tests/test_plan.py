"""`qwen3vl_jax.plan`: per-device memory from the partition rules, against real shards and compiled
executables."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from qwen3vl_jax import Qwen3VL, count_params, preset
from qwen3vl_jax.cli import main
from qwen3vl_jax.config import Qwen3VLConfig, TextConfig, VisionConfig
from qwen3vl_jax.plan import GiB, check, parse_bytes, plan, smallest_mesh
from qwen3vl_jax.sharding import ShardingError
from qwen3vl_jax.text import KVCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TEXT = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, mrope_section=(4, 2, 2))


@pytest.mark.parametrize("name", ["2b", "8b"])
@pytest.mark.parametrize("mesh,vision", [("tensor=8", "data"), ("fsdp=4,tensor=2", "data"),
                                         ("data=2,fsdp=2,tensor=2", "tensor"), ("", "data")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_parameter_bytes_add_up_to_the_model(name, mesh, vision, dtype):
    """Each parameter's per-device bytes times the devices it is split over is the parameter; the
    sum is the model's parameter count x dtype size, and one device holds all of it."""
    config = preset(name)
    n = count_params(Qwen3VL.abstract(config))
    size = jnp.dtype(dtype).itemsize
    p = plan(name, mesh, dtype=dtype, vision=vision)
    assert p.parameters == n
    assert sum(r.bytes_per_device * r.split for r in p.param_rows) == n * size
    assert sum(r.bytes_per_device for r in p.param_rows) == p.params_bytes
    if mesh == "":
        assert p.devices == 1 and p.params_bytes == n * size


def test_kv_cache_is_split_over_batch_and_kv_heads():
    config = preset("8b")
    cache = jax.eval_shape(lambda: KVCache.empty(config.text, 4, 32768, jnp.bfloat16))
    full = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert plan("8b", "", 4, 32768).kv_cache_bytes == full
    assert plan("8b", "tensor=8", 4, 32768).kv_cache_bytes == full // 8
    assert plan("8b", "data=2,tensor=4", 4, 32768).kv_cache_bytes == full // 8
    assert plan("8b", "fsdp=8", 4, 32768).kv_cache_bytes == full  # 4 rows do not split 8 ways: left whole
    assert plan("8b", "tensor=8", 4, 32768, train=True).kv_cache_bytes == 0


def test_training_keeps_float32_master_weights_and_two_moments():
    p = plan("2b", "tensor=2", 1, 1024, train=True)
    assert p.param_dtype == "float32"  # finetune's master weights; bf16 is the compute dtype
    assert p.optimizer_bytes == 2 * p.params_bytes and p.gradient_bytes == 2 * p.params_bytes
    bf16 = plan("2b", "tensor=2", 1, 1024, train=True, param_dtype="bfloat16")
    assert bf16.params_bytes * 2 == p.params_bytes and bf16.optimizer_bytes * 2 == p.optimizer_bytes
    remat = plan("2b", "tensor=2", 1, 1024, train=True, remat=True)
    assert remat.activation_bytes < p.activation_bytes


def test_fits_and_smallest_mesh():
    p = plan("8b", "tensor=8", 4, 32768, device_memory="80GB")
    assert p.device_memory == 80 * 10**9 and p.fits and p.headroom_bytes == p.device_memory - p.total_bytes
    assert not plan("32b", "", 1, 4096, train=True, device_memory="80GB").fits
    best = smallest_mesh("32b", 1, 4096, train=True, remat=True, device_memory="80GB")
    assert best is not None and best.fits
    for tp in (1, 2, 4, 8):  # nothing on half the devices fits
        half = best.devices // 2
        if half % tp == 0:
            assert not plan("32b", f"fsdp={half // tp},tensor={tp}", 1, 4096, train=True, remat=True,
                            device_memory="80GB").fits
    assert parse_bytes("96GiB") == 96 * GiB and parse_bytes(1000) == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_bad_meshes_name_the_axis_and_parameter():
    with pytest.raises(ShardingError, match="unknown mesh axis"):
        plan("8b", "model=8")
    with pytest.raises(ShardingError, match="needs 4 devices, but 8"):
        plan("8b", "tensor=4", devices=8)
    with pytest.raises(ShardingError, match=r"k_proj.*kv heads.*'tensor' of size 3"):
        plan(_small_config(text=dict(num_attention_heads=12, num_key_value_heads=4)), "tensor=3")
    with pytest.raises(ShardingError, match=r"embed_tokens\.embedding: dimension 1 \(4096\).*'fsdp' of size"):
        plan("8b", "fsdp=3")
    assert plan("8b", "fsdp=-1,tensor=2", devices=8).mesh == {"data": 1, "expert": 1, "fsdp": 4, "tensor": 2}


def test_cli(capsys, tmp_path):
    argv = ["plan", "--preset", "2b", "--mesh", "tensor=2", "--context", "1024", "--device-memory", "80GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV cache (1024 slots)" in out and "fits in 74.51 GiB per device" in out
    assert main(["plan", "--preset", "2b", "--train", "--remat", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer_bytes"] > 0
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(_small_config(text=dict(num_attention_heads=12, num_key_value_heads=4))
                                      .to_hf_dict()))
    for argv, message in [
        (["--preset", "8b", "--mesh", "model=8"], "unknown mesh axis name(s) ['model']"),
        (["--preset", "8b", "--mesh", "tensor=4", "--devices", "8"], "needs 4 devices, but 8 are given"),
        (["--config", str(config_file), "--mesh", "tensor=3"],
         "language_model.layers.*.self_attn.k_proj.kernel: 4 kv heads cannot be split over mesh axis "
         "'tensor'"),
        (["--preset", "8b", "--mesh", "fsdp=3"],
         "embed_tokens.embedding: dimension 1 (4096) cannot be split over mesh axis 'fsdp'"),
        (["--preset", "9b"], "unknown preset '9b'"),
        (["--preset", "8b", "--mesh", "auto"], "--mesh auto needs --device-memory"),
        (["--preset", "8b", "--device-memory", "lots"], "is not a size"),
        (["--preset", "8b", "--batch", "0"], "batch must be a positive integer"),
    ]:
        assert main(["plan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("qwen3vl-jax plan: error: ") and message in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:  # argparse's own errors exit 2 as well
        main(["plan", "--mesh", "tensor=2"])
    assert e.value.code == 2


SHARDED_WORKER = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
from flax import nnx
from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.sharding import make_mesh
out = {}
for name, mesh, options in json.loads(sys.argv[2]):
    model = Qwen3VL.from_pretrained(sys.argv[1], mesh=make_mesh(mesh), **options)
    per_device = {d.id: 0 for d in jax.devices()}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] += shard.data.nbytes
    out[name] = sorted(per_device.values())
print(json.dumps(out))
"""


def test_plan_matches_the_shards_of_a_sharded_model(tmp_path):
    """On 8 CPU devices, each device's addressable shards of a model loaded with `mesh=` add up to
    the plan's per-device parameter bytes."""
    from qwen3vl_jax.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", text=TINY_TEXT)
    cases = [("data=2,tensor=4", "data=2,tensor=4", {}), ("fsdp=2,tensor=4", "fsdp=2,tensor=4", {}),
             ("fsdp=8", "fsdp=8", {}), ("fsdp=4,tensor=2 scan", "fsdp=4,tensor=2", {"scan_layers": True}),
             ("data=2,tensor=4 vision=tensor", "data=2,tensor=4", {"vision": "tensor"})]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SHARDED_WORKER, str(path), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    for name, mesh, options in cases:
        p = plan(str(path), mesh, dtype="float32", vision=options.get("vision", "data"))
        assert measured[name] == [p.params_bytes] * 8, (name, measured[name], p.params_bytes)


def _small_config(text=None) -> Qwen3VLConfig:
    """Small, with the full model's proportions (GQA, MLP 3x hidden, a vocabulary much wider than hidden)."""
    config = Qwen3VLConfig(
        vision=VisionConfig(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=512,
                            deepstack_visual_indexes=(0,), num_position_embeddings=256),
        text=TextConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                        mrope_section=(12, 10, 10)),
        image_token_id=8000, video_token_id=8001, vision_start_token_id=8002, vision_end_token_id=8003)
    return config.replace(text=text) if text else config


# Arguments and outputs are exact layouts (up to a few scalars and tuple tables); temporaries are
# XLA's buffer assignment, which the activation model approximates: within 30% here (float32, so
# the CPU's float32 copies of bfloat16 matmul operands do not enter), the peak within 20%.
EXACT_SLACK = 1024
TEMP_TOLERANCE = 0.30
PEAK_TOLERANCE = 0.20


@pytest.mark.parametrize("mesh,batch,train", [
    ("fsdp=2,tensor=2", 2, False),
    pytest.param("tensor=4", 1, True, marks=pytest.mark.slow),
])
def test_plan_against_the_compiled_memory_analysis(mesh, batch, train):
    p = plan(_small_config(), mesh, batch, 1024, train=train, remat=train, dtype="float32")
    result = check(p, timeout=600)
    rows = {label.strip(): (analytic, compiled) for label, analytic, compiled in result["rows"]}
    for label, (analytic, compiled) in rows.items():
        exact = ("prefill arguments", "prefill outputs", "micro-step arguments", "micro-step outputs",
                 "update arguments")
        if label.startswith(exact):
            assert abs(analytic - compiled) <= EXACT_SLACK, (label, analytic, compiled)
    temp = "micro-step temporaries" if not train else "the same without the vision tower's gradient"
    temp = "prefill temporaries" if not train else temp
    (analytic, compiled), = [v for k, v in rows.items() if k.startswith(temp)]
    assert abs(analytic / compiled - 1) <= TEMP_TOLERANCE, (analytic, compiled)
    (analytic, compiled), = [v for k, v in rows.items() if k.startswith("peak")]
    assert abs(analytic / compiled - 1) <= PEAK_TOLERANCE, (analytic, compiled)
