"""The Mixture-of-Experts models (Qwen3-VL-30B-A3B / 235B-A22B) against HF's
`Qwen3VLMoeForConditionalGeneration` on tiny MoE checkpoints (same weights, f32).

Two tiny configs: "mixed" (6 experts, top-2, layer 1 dense through `mlp_only_layers`, experts
stored in transformers 5's module layout `[E, 2I, H]`) and "sparse" (8 experts, top-3, every layer
sparse, the released layout `[E, H, 2I]`, loaded with stacked layers). Prompts: an image, a video
and a left-padded text row in one batch.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, hf_processor_batch, user_prompt, worker_env
from flax import nnx

from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.config import ConfigError, Qwen3VLConfig, preset
from qwen3vl_jax.convert import convert_checkpoint, iter_hf_tensors
from qwen3vl_jax.model import MODEL_INPUTS, canonical_params, expected_params
from qwen3vl_jax.moe import (Routing, expert_ffn, load_balancing_loss, resolve_implementation, route, tile_rows,
                             tokamax_installed)
from qwen3vl_jax.params import CheckpointError, ours_to_hf_name
from qwen3vl_jax.testing import make_tiny_checkpoint
from qwen3vl_jax.training.loss import causal_lm_loss

CONFIGS = {
    "mixed": (dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=(1,)),
              "module", dict(scan_layers=False)),
    "sparse": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40), "released",
               dict(scan_layers=True)),
}
CASE = dict(
    prompts=[user_prompt("image", "video", "What is shown?"), user_prompt("Short.")],
    images=[(64, 96)],
    videos=[(4, 64, 64, 2.0)],
)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_tiny_checkpoint(root / name, seed=7, text=text, expert_layout=layout)
            for name, (text, layout, _) in CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_moe(moe_dirs):
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    return {name: Qwen3VLMoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            for name, d in moe_dirs.items()}


@pytest.fixture(scope="module")
def batch(hf_processor):
    return {k: v for k, v in hf_processor_batch(hf_processor, CASE).items() if k in MODEL_INPUTS}


def _np(batch):
    return {k: v.numpy() for k, v in batch.items()}


# ---------------------------------------------------------------------- the block itself


def _dense_reference(x, experts, weights, gate_up, down):
    """Each token through each of its chosen experts, one at a time (numpy float64)."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t], np.float64)):
            g, u = np.split(x[t] @ gate_up[e], 2)
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


# tokamax needs Python >= 3.12: the second CI lane installs it (the `tokamax` extra). On a CPU it
# runs its XLA kernel: this checks our use of it (sorted rows, group sizes, rows of other experts);
# its Mosaic GPU kernel was checked against "ragged" on an H200 by scripts/bench_gpu.py --moe.
TOKAMAX = pytest.param("tokamax", marks=pytest.mark.skipif(not tokamax_installed(), reason="tokamax not installed"))


@pytest.mark.parametrize("tokens", [3, 200])  # one row per tile (decoding), and tiles of many rows
@pytest.mark.parametrize("implementation", ["tiled", "ragged", TOKAMAX])
def test_grouped_matmul_equals_per_token_reference(tokens, implementation):
    rng = np.random.default_rng(0)
    e, h, i, k = 5, 16, 12, 2
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * i)) / 4, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, i, h)) / 4, jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32)
    logits = logits.at[:, 4].add(-9.0)  # expert 4 is (almost) never chosen: an empty group
    routing = route(logits, k)
    probs = np.exp(np.asarray(logits, np.float64))
    probs /= probs.sum(-1, keepdims=True)
    top = np.sort(probs, -1)[:, ::-1][:, :k]
    np.testing.assert_allclose(np.asarray(routing.weights), top / top.sum(-1, keepdims=True), rtol=1e-6)
    ours = expert_ffn(x, routing, gate_up, down, implementation=implementation)
    ref = _dense_reference(x, routing.experts, routing.weights, gate_up, down)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-5, atol=1e-5)
    # Expert parallelism: each of two "devices" holds part of the experts; their parts sum to the whole.
    halves = [expert_ffn(x, routing, gate_up[a:b], down[a:b], implementation=implementation, local=(a, b - a))
              for a, b in ((0, 2), (2, 5))]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), ref, rtol=1e-5, atol=1e-5)
    assert tile_rows(tokens * k, e) == (1 if tokens * k < 4 * e else 64)
    if implementation == "tokamax":  # training through it: its gradients are the spec's
        def loss(impl):
            return lambda x, gu, d: jnp.sum(jnp.sin(expert_ffn(x, routing, gu, d, implementation=impl)))

        ours, spec = (jax.grad(loss(impl), argnums=(0, 1, 2))(x, gate_up, down) for impl in ("tokamax", "ragged"))
        for a, b, name in zip(ours, spec, ("x", "gate_up", "down")):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


def test_implementation_choice():
    assert resolve_implementation("auto") == ("tiled" if jax.default_backend() == "cpu" else
                                              "tokamax" if tokamax_installed() else "ragged")
    assert resolve_implementation("ragged") == "ragged"
    with pytest.raises(ValueError, match="moe implementation must be one of .*'grouped'"):
        resolve_implementation("grouped")


@pytest.mark.needs_torch
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("implementation", ["tiled", "ragged"])
def test_one_expert_takes_every_token_as_hf(k, implementation):
    """A router that sends every token to expert 0 (and, for k = 2, expert 1), so that the other
    experts get no token: HF's sparse block and ours agree, with no NaN and no token dropped."""
    import torch
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    from qwen3vl_jax.config import TextConfig
    from qwen3vl_jax.moe import MoEBlock

    e, h, i, tokens = 6, 16, 12, 40
    hf_config = Qwen3VLMoeTextConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=i)
    rng = np.random.default_rng(5)
    router = 0.1 * rng.standard_normal((e, h)).astype(np.float32)
    router[0, 0], router[1, 0] = 8.0, 4.0  # feature 0 is large and positive in every token
    gate_up = (rng.standard_normal((e, h, 2 * i)) / 4).astype(np.float32)
    down = (rng.standard_normal((e, i, h)) / 4).astype(np.float32)
    x = rng.standard_normal((1, tokens, h)).astype(np.float32)
    x[..., 0] = 3.0 + np.abs(x[..., 0])
    block = Qwen3VLMoeTextSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up.transpose(0, 2, 1)))
        block.experts.down_proj.copy_(torch.from_numpy(down.transpose(0, 2, 1)))
        ref = block(torch.from_numpy(x)).numpy()

    ours = MoEBlock(TextConfig(vocab_size=8, hidden_size=h, intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, mrope_section=(2, 1, 1),
                               num_experts=e, num_experts_per_tok=k, moe_intermediate_size=i),
                    dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ours.gate.kernel[...] = jnp.asarray(router.T)
    ours.experts.gate_up_proj[...] = jnp.asarray(gate_up)
    ours.experts.down_proj[...] = jnp.asarray(down)
    out, logits = ours(jnp.asarray(x), implementation=implementation)
    chosen = np.asarray(route(logits, k).experts)
    assert set(chosen.reshape(-1)) == set(range(k))  # every token to the same expert(s); the rest idle
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_unknown_implementation_is_refused():
    routing = Routing(jnp.zeros((1, 2)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)))
    with pytest.raises(ValueError, match="moe implementation"):
        expert_ffn(jnp.zeros((1, 4)), routing, jnp.zeros((2, 4, 6)), jnp.zeros((2, 3, 4)), implementation="dense")


@pytest.mark.needs_torch
def test_load_balancing_loss_equals_hf():
    import torch
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 10, 6)).astype(np.float32)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(torch.from_numpy(x) for x in logits), 6, 2,
                                       None if m is None else torch.from_numpy(m))
        ours = load_balancing_loss(jnp.asarray(logits), 2, None if m is None else m.reshape(-1))
        np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


# ---------------------------------------------------------------------- config


def test_presets_are_the_released_moe_configs():
    """30B-A3B and 235B-A22B as their config.json give them (hidden, layers, heads, experts, widths)."""
    a3b, a22b = preset("30b-a3b").text, preset("235b-a22b").text
    assert (a3b.hidden_size, a3b.num_hidden_layers, a3b.num_attention_heads, a3b.num_key_value_heads,
            a3b.head_dim, a3b.num_experts, a3b.num_experts_per_tok, a3b.moe_intermediate_size,
            a3b.intermediate_size) == (2048, 48, 32, 4, 128, 128, 8, 768, 6144)
    assert (a22b.hidden_size, a22b.num_hidden_layers, a22b.num_attention_heads, a22b.num_key_value_heads,
            a22b.num_experts, a22b.num_experts_per_tok, a22b.moe_intermediate_size) == (4096, 94, 64, 4, 128, 8, 1536)
    for name in ("30b-a3b", "235b-a22b"):
        config = preset(name)
        assert config.text.sparse_layers == tuple(range(config.text.num_hidden_layers))
        assert config.vision.depth == 27 and config.vision.deepstack_visual_indexes == (8, 16, 24)
        # HF's own config class reads our dict and gives it back
        assert Qwen3VLConfig.from_hf_config(config.to_hf_config().to_dict()) == config


def test_released_style_config_json_is_read():
    raw = preset("30b-a3b").to_hf_dict()
    text = raw["text_config"]
    text["rope_theta"] = text["rope_parameters"].pop("rope_theta")  # the released (legacy) rope form
    text["rope_scaling"] = text.pop("rope_parameters")
    text.update(norm_topk_prob=True, output_router_logits=False, mlp_only_layers=[])
    config = Qwen3VLConfig.from_hf_config(raw)
    assert config == preset("30b-a3b")


@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen3_vl"), "belongs to a 'qwen3_vl_moe' config"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(num_experts_per_tok=200), "num_experts_per_tok"),
    (dict(mlp_only_layers=[60]), "mlp_only_layers"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
])
def test_bad_moe_configs_are_refused(change, message):
    raw = preset("30b-a3b").to_hf_dict()
    if "model_type" in change:
        raw["model_type"] = change.pop("model_type")
    raw["text_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        Qwen3VLConfig.from_hf_config(raw)


def test_stacking_mixed_layers_is_refused(moe_dirs):
    config = Qwen3VLConfig.from_hf_config(moe_dirs["mixed"])
    with pytest.raises(ValueError, match="scan_layers=True needs decoder layers of one kind"):
        Qwen3VL.abstract(config, scan_layers=True)
    assert not Qwen3VL.abstract(config.replace(text={"num_hidden_layers": 16, "mlp_only_layers": (1,)}),
                                scan_layers=None).language_model.scan_layers


# ---------------------------------------------------------------------- parity with HF


@pytest.mark.needs_torch
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_hf(name, moe_dirs, hf_moe, batch):
    import torch

    with torch.no_grad():
        out = hf_moe[name](**batch, output_router_logits=True)
    real = batch["attention_mask"].numpy().astype(bool)
    implementations = [("xla", "tiled"), ("xla", "ragged")] + ([("pallas", "auto")] if name == "mixed" else [])
    for attention, moe in implementations:
        model = Qwen3VL.from_pretrained(moe_dirs[name], attention_implementation=attention,
                                        moe_implementation=moe, **CONFIGS[name][2])
        logits, router = model(**_np(batch), return_router_logits=True)
        assert_close(np.asarray(logits)[real], out.logits.numpy()[real], "f32_logits", f"{name} {attention}/{moe}")
        sparse = model.config.text.sparse_layers
        assert router.shape[0] == len(sparse) == len(out.router_logits)
        rows = real.reshape(-1)
        for ours, ref in zip(np.asarray(router), out.router_logits):
            assert_close(ours[rows], ref.numpy()[rows], "f32_logits", f"{name} router logits")


@pytest.mark.needs_torch
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generate_equals_hf(name, moe_dirs, hf_moe, batch):
    import torch

    model = Qwen3VL.from_pretrained(moe_dirs[name], **CONFIGS[name][2])
    with torch.no_grad():
        ref = hf_moe[name].generate(**batch, do_sample=False, max_new_tokens=10, eos_token_id=None,
                                    pad_token_id=0).numpy()
    ours = np.asarray(model.generate(**_np(batch), max_new_tokens=10, eos_token_id=[]))
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.needs_torch
@pytest.mark.parametrize("name, attention", [pytest.param("mixed", "xla", marks=pytest.mark.slow), ("sparse", "xla"),
                                             pytest.param("mixed", "pallas", marks=pytest.mark.slow)])
def test_loss_and_gradients_with_aux_loss_equal_torch(name, attention, moe_dirs, hf_moe, batch):
    """HF's loss with `output_router_logits=True` (LM loss + coef x load balancing) and the gradient
    of every parameter, router included, against torch autograd."""
    hf = hf_moe[name]
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    labels[:, :5] = -100
    hf.zero_grad(set_to_none=True)
    out = hf(**batch, labels=labels, output_router_logits=True)
    out.loss.backward()
    ref_grads = {n: p.grad.numpy().copy() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)

    model = Qwen3VL.from_pretrained(moe_dirs[name], attention_implementation=attention, **CONFIGS[name][2])
    inputs = {**_np(batch), "labels": labels.numpy()}
    loss, grads = nnx.value_and_grad(lambda m: causal_lm_loss(m, inputs, router_aux_loss=True))(model)
    np.testing.assert_allclose(float(loss), float(out.loss.detach()), rtol=1e-5)
    assert abs(float(out.aux_loss.detach())) > 0
    ours = canonical_params(grads)
    assert len(ours) == len(ref_grads)
    for path, value in ours.items():
        hf_name, transform = ours_to_hf_name(path, "module")
        ref = ref_grads[hf_name]
        mine = transform.to_hf(np.asarray(value), model.config)
        scale = float(np.abs(ref).max())
        assert float(np.abs(mine - ref).max()) <= 2e-4 * scale + 1e-9, path
    router = ours["language_model.layers.0.mlp.gate.kernel"]
    assert float(np.abs(router).max()) > 0


# ---------------------------------------------------------------------- checkpoints


def _tensors(directory):
    return {name: (array.dtype, array.tobytes()) for _, name, array in iter_hf_tensors(directory)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_convert_writes_back_the_layout_it_read(name, moe_dirs, tmp_path):
    """HF -> HF and HF -> Orbax -> HF give back the same bytes, in the expert layout of the source."""
    source = moe_dirs[name]
    convert_checkpoint(source, tmp_path / "hf", expected_params, to="hf", dtype="float32")
    convert_checkpoint(source, tmp_path / "orbax", expected_params, to="orbax", dtype="float32")
    convert_checkpoint(tmp_path / "orbax", tmp_path / "back", expected_params, to="hf", dtype="float32")
    original = _tensors(source)
    assert _tensors(tmp_path / "hf") == original
    assert _tensors(tmp_path / "back") == original
    layout = CONFIGS[name][1]
    model = Qwen3VL.from_pretrained(tmp_path / "orbax")
    assert model.expert_layout == layout
    model.save_hf(tmp_path / "saved")
    assert _tensors(tmp_path / "saved") == original
    with open(os.path.join(tmp_path / "saved", "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]


@pytest.mark.parametrize("change", [{"moe_intermediate_size": 24}, {"num_experts": 6}])
def test_wrong_expert_shape_or_count_is_named(change, moe_dirs, tmp_path):
    config = Qwen3VLConfig.from_hf_config(moe_dirs["sparse"])
    wrong = config.replace(text=change)
    with pytest.raises(CheckpointError, match=r"shape mismatch for model\.language_model\.layers\.0\.mlp\.experts\."):
        convert_checkpoint(moe_dirs["sparse"], tmp_path / "out", lambda c: expected_params(wrong), to="hf")
    assert not os.path.exists(tmp_path / "out")


def test_missing_expert_tensor_is_named(moe_dirs, tmp_path):
    from safetensors.numpy import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in os.listdir(moe_dirs["sparse"]):
        if not item.endswith(".safetensors"):
            shutil.copy(os.path.join(moe_dirs["sparse"], item), broken / item)
    tensors = {name: array for _, name, array in iter_hf_tensors(moe_dirs["sparse"])
               if name != "model.language_model.layers.1.mlp.experts.down_proj"}
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.language_model\.layers\.1\.mlp\.experts\.down_proj"):
        Qwen3VL.from_pretrained(broken)


# ---------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
def test_expert_parallel_meshes_match_one_device(moe_dirs, tmp_path):
    """Meshes with an `expert` axis (with fsdp and tensor beside it) over 8 host CPU devices give
    one device's logits, greedy ids and loss gradients (LM + router aux loss), experts split E / n."""
    import subprocess
    import sys

    out = tmp_path / "mesh.npz"
    meshes = ["expert=8", "expert=2,fsdp=2,tensor=2", "data=2,expert=4"]
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "moe_mesh_worker.py"),
                           moe_dirs["sparse"], str(out), *meshes], env=worker_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = np.load(out)
    experts = CONFIGS["sparse"][0]["num_experts"]
    for mesh in meshes:
        n = dict(kv.split("=") for kv in mesh.split(","))["expert"]
        assert "expert" in str(results[f"{mesh}/spec"]), results[f"{mesh}/spec"]
        assert int(results[f"{mesh}/local_experts"]) == experts // int(n)
        assert_close(results[f"{mesh}/logits"], results["one/logits"], "f32_logits", mesh)
        np.testing.assert_array_equal(results[f"{mesh}/ids"], results["one/ids"])
        np.testing.assert_allclose(float(results[f"{mesh}/loss"]), float(results["one/loss"]), rtol=1e-5)
        assert float(results[f"{mesh}/grad_err"]) < 2e-4, (mesh, float(results[f"{mesh}/grad_err"]))
        assert float(results[f"{mesh}/step_err"]) < 1e-4, (mesh, float(results[f"{mesh}/step_err"]))


@pytest.mark.slow  # (the fast tier keeps the one-device quantized experts, tests/test_quant.py)
@pytest.mark.parametrize("method, meshes", [("int8", ["expert=2,fsdp=2,tensor=2"]),
                                            ("fp8", ["expert=8", "expert=2,fsdp=2,tensor=2"]),
                                            ("checkpoint", ["expert=8", "expert=2,fsdp=2,tensor=2"])])
def test_quantized_experts_under_an_expert_axis_match_one_device(moe_dirs, tmp_path, method, meshes):
    """Quantized experts (`moe.QuantExperts`, weights and scale grids) under `expert` meshes on 8 host
    CPU devices give the one-device quantized model's logits and greedy ids; each device holds E / n
    experts' stored weights. "checkpoint": an FP8 checkpoint (experts in 16 x 16 blocks, partial at
    the edges) read as it is stored, each device reading its experts from the file."""
    import subprocess
    import sys

    from qwen3vl_jax.testing import make_fp8_checkpoint

    directory = moe_dirs["sparse"]
    if method == "checkpoint":
        directory = make_fp8_checkpoint(directory, tmp_path / "fp8", block=(16, 16))
    out = tmp_path / "mesh.npz"
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "moe_mesh_worker.py"),
                           "--quantize", method, directory, str(out), *meshes], env=worker_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = np.load(out)
    experts = CONFIGS["sparse"][0]["num_experts"]
    for mesh in meshes:
        n = int(dict(kv.split("=") for kv in mesh.split(","))["expert"])
        assert str(results[f"{mesh}/dtype"]) == {"int8": "int8", "fp8": "float8_e4m3fn",
                                                 "checkpoint": "float8_e4m3fn"}[method]
        assert "expert" in str(results[f"{mesh}/spec"]), results[f"{mesh}/spec"]
        assert int(results[f"{mesh}/local_experts"]) == experts // n
        assert int(results[f"{mesh}/scale_experts"]) == experts  # the scale grids are replicated
        assert_close(results[f"{mesh}/logits"], results["one/logits"], "f32_logits", f"{method} {mesh}")
        np.testing.assert_array_equal(results[f"{mesh}/ids"], results["one/ids"])


def test_expert_axis_is_checked(moe_dirs):
    from qwen3vl_jax.sharding import ShardingError, check_mesh

    mesh = jax.sharding.AbstractMesh((1, 4, 1, 1), ("data", "expert", "fsdp", "tensor"))
    with pytest.raises(ShardingError, match="6 experts cannot be split over mesh axis 'expert' of size 4"):
        check_mesh(Qwen3VLConfig.from_hf_config(moe_dirs["mixed"]), mesh)
    with pytest.raises(ShardingError, match="no experts"):
        check_mesh(preset("8b"), mesh)


# ---------------------------------------------------------------------- generation and pruning in use


@pytest.fixture(scope="module")
def moe_model(moe_dirs):
    return Qwen3VL.from_pretrained(moe_dirs["mixed"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["evs", "vidcom2"])
def test_video_pruning_on_a_moe_model(method, moe_dirs, moe_model):
    """The pruned prompt equals the unpruned one with the pruned tokens masked out as keys (the
    dense models' check, tests/test_pruning_e2e.py), then bucketed generation with an
    ahead-of-time encoder gives the same ids as the plain run."""
    from test_pruning_e2e import _inputs, _model_kwargs, _video, check_pruned_equals_masked_unpruned

    from qwen3vl_jax.buckets import EncoderRunner
    from qwen3vl_jax.processing import Qwen3VLProcessor

    processor = Qwen3VLProcessor.from_pretrained(moe_dirs["mixed"])
    check_pruned_equals_masked_unpruned(moe_model, processor, method, 0.5)
    lumped = _inputs(processor, [["video", "what moves?"], ["short"]], videos=[_video(8, 64, 64, 3, static=True)],
                     pruning=(method, 0.5))
    out = moe_model.generate(**_model_kwargs(lumped), max_new_tokens=6, video_pruning=(method, 0.5))
    runner = EncoderRunner(moe_model, budgets=(16, 32)).warmup()
    again = moe_model.generate(**_model_kwargs(lumped), max_new_tokens=6, video_pruning=(method, 0.5),
                               vision_encoder=runner.encode)
    np.testing.assert_array_equal(out, again)


def test_router_part_is_frozen_alone_or_with_the_language_model(moe_model):
    from qwen3vl_jax.training.trainer import trainable_filter

    def trained(freeze):
        state = nnx.state(moe_model, trainable_filter(freeze))
        return {p for p in canonical_params(state)}

    routers = {p for p in canonical_params(moe_model) if ".mlp.gate." in p}
    assert routers and routers <= trained(())
    assert not routers & trained(("router",)) and trained(("router",)) == trained(()) - routers
    assert not routers & trained(("language",))


def test_lora_on_a_moe_model_targets_attention(moe_dirs):
    """LoRA wraps the attention projections of every layer; the default targets' MLP names match
    no linear layer of an all-sparse model, and the error says why."""
    from qwen3vl_jax.training.lora import LoRAConfig, add_lora

    model = Qwen3VL.from_pretrained(moe_dirs["sparse"], scan_layers=False)
    with pytest.raises(ValueError, match="fused expert tensors, not linear layers"):
        add_lora(model, LoRAConfig(rank=4))
    adapted = add_lora(model, LoRAConfig(rank=4, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    assert len(adapted) == 4 * model.config.text.num_hidden_layers
