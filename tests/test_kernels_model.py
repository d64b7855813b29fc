"""The tiny model with `attention_implementation="pallas"` (interpreted on CPU) equals the XLA path,
and the kernels are really in the traced / lowered model (no silent fallback).

- Vision tower: `encode_vision` calls `attention_api.attention` under a segments description
  and `pos_embed_api.interpolate_pos_embed`.
- Language model: the decoder calls `attention_api.attention` under a causal description (per query
  row, one run of keys); the Pallas path runs the flash kernel (prefill, L > 1) or the split-K decode
  kernel (L == 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gpu_lowering_target
from flax import nnx
from jax import export

from pallas_kernels import _dispatch
from qwen3vl_jax import Qwen3VL
from qwen3vl_jax.model import causal_padding_mask

# Lowering the Triton kernels on purpose: the Pallas Triton backend's deprecation warning (jax >= 0.11)
# is silenced here only (see tests/test_kernels_lowering.py for why we keep Triton).
TRITON_LOWERING = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

GRID = np.array([[1, 8, 12], [2, 4, 4], [1, 2, 6]])  # uneven images, a 2-slice video, a tiny image


@pytest.fixture(scope="module")
def pallas_model(tiny_dir):
    return Qwen3VL.from_pretrained(tiny_dir, attention_implementation="pallas")


@pytest.fixture(scope="module")
def xla_model(tiny_dir):
    return Qwen3VL.from_pretrained(tiny_dir, attention_implementation="xla")


def _pixels(model, grid, seed=0):
    patches = int(np.prod(grid, axis=1).sum())
    return np.random.default_rng(seed).standard_normal((patches, model.config.vision.patch_dim)).astype(np.float32)


def test_vision_tower_pallas_equals_xla(pallas_model, xla_model):
    pixels = _pixels(xla_model, GRID)
    ours = pallas_model.encode_vision(pixels, GRID, return_hidden_states=True)
    ref = xla_model.encode_vision(pixels, GRID, return_hidden_states=True)
    err = assert_close(ours.merged, ref.merged, "f32_tower", "merged")
    err = max(err, assert_close(ours.deepstack, ref.deepstack, "f32_tower", "deepstack"))
    print(f"\n[kernels] vision tower pallas vs xla: max|err| {err:.3g}")


def _prompt(model, grid, rows=2, text=11, pad=(0, 5)):
    """Left-padded batch: text, <vision_start> image pads <vision_end>, text (image in row 0 only)."""
    cfg = model.config
    merged = int(np.prod(grid, axis=1).sum()) // cfg.vision.merge_unit
    rng = np.random.default_rng(1)
    body = [int(x) for x in rng.integers(5, 100, text)]
    row0 = body[:4] + [cfg.vision_start_token_id] + [cfg.image_token_id] * merged + [cfg.vision_end_token_id] + body[4:]
    length = len(row0)
    ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), bool)
    ids[0], mask[0] = row0, True
    for r in range(1, rows):
        n = length - pad[r]
        ids[r, pad[r]:] = rng.integers(5, 100, n)
        mask[r, pad[r]:] = True
    return ids, mask


def test_language_model_prefill_pallas_equals_xla(pallas_model, xla_model):
    grid = GRID[:1]
    ids, mask = _prompt(xla_model, grid)
    pixels = _pixels(xla_model, grid, seed=2)
    ours = pallas_model(ids, mask, None, pixels, grid)
    ref = xla_model(ids, mask, None, pixels, grid)
    err = assert_close(ours, ref, "f32_logits", "logits")
    print(f"\n[kernels] LM prefill logits pallas vs xla: max|err| {err:.3g}")


def test_generate_pallas_equals_xla(pallas_model, xla_model):
    """Prefill (flash kernel) and decode steps (split-K kernel) through the model's generate."""
    rng = np.random.default_rng(3)
    ids = rng.integers(5, 100, (2, 9)).astype(np.int32)
    mask = np.arange(9)[None] >= np.array([0, 3])[:, None]  # left padding in row 1
    ours = pallas_model.generate(ids, mask, max_new_tokens=4)
    ref = xla_model.generate(ids, mask, max_new_tokens=4)
    np.testing.assert_array_equal(ours, ref)


def _vision_fn(model, grid):
    from qwen3vl_jax.vision import vision_metadata

    meta = vision_metadata(grid, model.config.vision)
    graphdef, state = nnx.split(model.visual)

    def run(pixels):  # a fresh function: no jit cache shared with the CPU runs above
        visual = nnx.merge(graphdef, state)
        return visual(pixels, meta, implementation="pallas").merged

    return run, jnp.asarray(_pixels(model, grid))


def test_traced_vision_tower_contains_the_kernels(pallas_model):
    run, pixels = _vision_fn(pallas_model, GRID)
    jaxpr = str(jax.make_jaxpr(run)(pixels))
    depth = pallas_model.config.vision.depth
    assert "pallas_call" in jaxpr and jaxpr.count("flash_attention") >= depth
    assert "interpolate_pos_embed" in jaxpr


@TRITON_LOWERING
def test_vision_tower_lowered_for_cuda_contains_the_triton_kernels(pallas_model):
    run, pixels = _vision_fn(pallas_model, GRID)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with _dispatch.lowering_for_gpu(), gpu_lowering_target():
        module = export.export(jax.jit(run), platforms=["cuda"], disabled_checks=checks)(pixels).mlir_module()
    calls = module.count("stablehlo.custom_call @__gpu$xla.gpu.triton")
    # one flash call per block (the blocks may share one outlined function) + the pos-embed kernel
    assert calls >= 2, f"{calls} Triton calls in the lowered tower"
    assert "flash_attention" in module and "interpolate_pos_embed" in module


@TRITON_LOWERING
def test_language_model_lowered_for_cuda_contains_the_triton_kernels(pallas_model):
    """The tiny LM's prefill (the model's causal description of left-padded rows),
    exported for CUDA, runs its attention in the Triton flash kernel. (The decode routing, L == 1
    -> split-K kernel, is lowered in test_kernels_lowering.py and run by the generate test above.)"""
    lm = pallas_model.language_model
    graphdef, state = nnx.split(lm)
    cfg = lm.config
    b, length = 2, 24

    def prefill(embeds, positions, attention_mask):
        model = nnx.merge(graphdef, state)
        return model(embeds, positions, causal_padding_mask(attention_mask), implementation="pallas").hidden

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    spec = jax.ShapeDtypeStruct
    with _dispatch.lowering_for_gpu(), gpu_lowering_target():
        module = export.export(jax.jit(prefill), platforms=["cuda"], disabled_checks=checks)(
            spec((b, length, cfg.hidden_size), jnp.float32), spec((3, b, length), jnp.int32),
            spec((b, length), jnp.bool_)).mlir_module()
    assert "flash_attention" in module and "stablehlo.custom_call @__gpu$xla.gpu.triton" in module
