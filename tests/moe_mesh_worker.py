"""(A subprocess of tests/test_moe.py, 8 host CPU devices.) A tiny MoE checkpoint on one device and
on meshes with an `expert` axis: logits, greedy ids, the loss gradient (LM + router aux loss) and
the parameters after one `Trainer` step, written as .npz. With `--quantize METHOD` first, the
checkpoint is loaded with quantized weights (experts included), or with `--quantize checkpoint` in
the quantized layout it holds (an FP8 checkpoint): logits and greedy ids only."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from qwen3vl_jax import Qwen3VL  # noqa: E402
from qwen3vl_jax.model import canonical_params  # noqa: E402
from qwen3vl_jax.training import OptimConfig  # noqa: E402
from qwen3vl_jax.training.loss import causal_lm_loss  # noqa: E402
from qwen3vl_jax.training.trainer import Trainer  # noqa: E402


def run(model, batch):
    logits = np.asarray(model(batch["input_ids"], batch["attention_mask"]))
    ids = np.asarray(model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, eos_token_id=[]))
    grads = canonical_params(nnx.grad(lambda m: causal_lm_loss(m, batch, router_aux_loss=True))(model))
    trainer = Trainer(model, OptimConfig(learning_rate=1e-3, total_steps=10), router_aux_loss=True)
    loss = trainer.step([batch])["loss"]
    stepped = {k: np.asarray(v) for k, v in canonical_params(model).items()}
    return logits, ids, {k: np.asarray(v) for k, v in grads.items()}, loss, stepped


def relative(a, b):
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-30)) for k in b)


def run_frozen(model, batch):
    logits = np.asarray(model(batch["input_ids"], batch["attention_mask"]))
    ids = np.asarray(model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, eos_token_id=[]))
    return logits, ids


def main(directory, out, meshes, quantize=None):
    frozen = quantize is not None
    quantize = None if quantize == "checkpoint" else quantize
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 400, (4, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :7] = 0  # left padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask, ids, -100)}
    if frozen:
        logits, gen = run_frozen(Qwen3VL.from_pretrained(directory, scan_layers=False, quantize=quantize), batch)
        results = {"one/logits": logits, "one/ids": gen}
    else:
        logits, gen, grads, loss, stepped = run(Qwen3VL.from_pretrained(directory, scan_layers=False), batch)
        results = {"one/logits": logits, "one/ids": gen, "one/loss": np.array(loss)}
    for mesh in meshes:
        model = Qwen3VL.from_pretrained(directory, mesh=mesh, scan_layers=False, quantize=quantize)
        experts = model.language_model.layers[0].mlp.experts
        weight = experts.gate_up_proj[...]
        results[f"{mesh}/spec"] = np.array(str(weight.sharding.spec))
        results[f"{mesh}/local_experts"] = np.array(weight.addressable_shards[0].data.shape[0])
        if frozen:
            scale = experts.gate_up_proj_scale[...]
            results[f"{mesh}/dtype"] = np.array(str(weight.dtype))
            results[f"{mesh}/scale_experts"] = np.array(scale.addressable_shards[0].data.shape[0])
            results[f"{mesh}/logits"], results[f"{mesh}/ids"] = run_frozen(model, batch)
            continue
        m_logits, m_ids, m_grads, m_loss, m_stepped = run(model, batch)
        results[f"{mesh}/logits"], results[f"{mesh}/ids"] = m_logits, m_ids
        results[f"{mesh}/loss"] = np.array(m_loss)
        results[f"{mesh}/grad_err"] = np.array(relative(m_grads, grads))
        results[f"{mesh}/step_err"] = np.array(relative(m_stepped, stepped))
    np.savez(out, **results)


if __name__ == "__main__":
    args = sys.argv[1:]
    method = None
    if args[0] == "--quantize":
        method, args = args[1], args[2:]
    main(args[0], args[1], args[2:], quantize=method)
