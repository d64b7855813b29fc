"""(A subprocess of tests/test_moe.py, 8 host CPU devices.) A tiny MoE checkpoint on one device and
on meshes with an `expert` axis: logits, greedy ids and the loss gradient, written as .npz."""

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
from qwen3vl_jax.training.loss import causal_lm_loss  # noqa: E402


def run(model, batch):
    logits = np.asarray(model(batch["input_ids"], batch["attention_mask"]))
    ids = np.asarray(model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, eos_token_id=[]))
    grads = canonical_params(nnx.grad(lambda m: causal_lm_loss(m, batch, router_aux_loss=True))(model))
    return logits, ids, {k: np.asarray(v) for k, v in grads.items()}


def main(directory, out, meshes):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 400, (4, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :7] = 0  # left padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask, ids, -100)}
    logits, gen, grads = run(Qwen3VL.from_pretrained(directory), batch)
    results = {"one/logits": logits, "one/ids": gen}
    for mesh in meshes:
        model = Qwen3VL.from_pretrained(directory, mesh=mesh)
        shard = model.language_model.layers[0].mlp.experts.gate_up_proj[...].sharding.spec
        m_logits, m_ids, m_grads = run(model, batch)
        results[f"{mesh}/logits"], results[f"{mesh}/ids"] = m_logits, m_ids
        results[f"{mesh}/spec"] = np.array(str(shard))
        results[f"{mesh}/grad_err"] = np.array(max(
            float(np.abs(m_grads[k] - grads[k]).max() / max(np.abs(grads[k]).max(), 1e-30)) for k in grads))
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
