"""CUDA lowering of the Pallas kernels on a CPU-only machine, at the production shapes.

`jax.export(..., platforms=["cuda"])` runs the whole Pallas -> Triton IR lowering (for sm_90,
Hopper: the fallback target on jax 0.10, an abstract H100 device on jax >= 0.11), so it catches what interpret mode accepts but Triton
rejects: non-power-of-two tiles, value slicing, unsupported primitives, a forgotten
`compiler_params` (which would route the kernel to Mosaic GPU). PTX compilation (register and
shared-memory fit) still needs a GPU: see scripts/bench_gpu.py.

Each export goes through the public api under `lowering_for_gpu()`, so the head_dim padding
(72 -> 128) and the "pallas"/"auto" routing are part of what is lowered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import gpu_lowering_target
from jax import export

from pallas_kernels import _dispatch
from pallas_kernels.attention import api as attention_api
from pallas_kernels.attention.mask import AttentionMask
from pallas_kernels.pos_embed import api as pos_api

TRITON = "__gpu$xla.gpu.triton"

# The Pallas Triton backend is deprecated from jax 0.11 (in favour of Mosaic GPU) and warns on every
# lowering. The kernels target Triton knowingly (scripts/bench_gpu.py re-checks them on a GPU after
# each jax upgrade), so exactly that warning is silenced here, where we lower on purpose; any other
# warning still shows.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


# name -> (vision hidden, heads, head_dim); LLM: head_dim 128, (query heads, kv heads)
VISION = {"2B": (1024, 16, 64), "8B": (1152, 16, 72)}
LLM = {"2B": (16, 8), "8B": (32, 8)}
IMAGE_TOKENS = {"448^2": 28 * 28, "896^2": 56 * 56, "1792^2": 112 * 112, "8-frame video 448^2": 4 * 28 * 28}


def _lower(fn, *specs) -> str:
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]  # not export-stable; we only lower
    with _dispatch.lowering_for_gpu(), gpu_lowering_target():
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*specs)
    return exported.mlir_module()


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _count_kernels(module: str, name: str) -> int:
    assert TRITON in module, "no Triton custom call: the kernel was not lowered for the GPU"
    return module.count(name)


@pytest.mark.parametrize("model", list(VISION))
@pytest.mark.parametrize("image", list(IMAGE_TOKENS))
def test_pos_embed_lowers(model, image):
    hidden = VISION[model][0]
    tokens = IMAGE_TOKENS[image]
    module = _lower(
        lambda t, i, w: pos_api.interpolate_pos_embed(t, i, w, implementation="pallas"),
        _spec((2304, hidden)), _spec((tokens, 4), jnp.int32), _spec((tokens, 4), jnp.float32),
    )
    assert _count_kernels(module, "interpolate_pos_embed") >= 1


@pytest.mark.parametrize("model", list(VISION))
@pytest.mark.parametrize("image", list(IMAGE_TOKENS) + ["packed 448^2+896^2+1792^2"])
@pytest.mark.parametrize("implementation", ["pallas", "auto"])
def test_varlen_vision_attention_lowers(model, image, implementation):
    _, heads, dim = VISION[model]
    tokens = IMAGE_TOKENS.get(image) or sum(IMAGE_TOKENS[k] for k in ("448^2", "896^2", "1792^2"))
    qkv = _spec((tokens, heads, dim))
    module = _lower(
        lambda q, k, v, s: attention_api.varlen_attention(q, k, v, s, implementation=implementation),
        qkv, qkv, qkv, _spec((tokens,), jnp.int32),
    )
    assert _count_kernels(module, "flash_attention") >= 1


@pytest.mark.parametrize("model", list(LLM))
@pytest.mark.parametrize("length", [512, 4096])
def test_causal_prefill_lowers(model, length):
    heads, kv_heads = LLM[model]
    module = _lower(
        lambda q, k, v, n: attention_api.causal_attention(q, k, v, n, implementation="pallas"),
        _spec((1, length, heads, 128)), _spec((1, length, kv_heads, 128)), _spec((1, length, kv_heads, 128)),
        _spec((1,), jnp.int32),
    )
    assert _count_kernels(module, "flash_attention") >= 1


@pytest.mark.parametrize("model", list(LLM))
@pytest.mark.parametrize("batch,cache", [(1, 8192), (8, 8192), (4, 32768)])
def test_decode_lowers(model, batch, cache):
    heads, kv_heads = LLM[model]
    module = _lower(
        lambda q, k, v, n: attention_api.decode_attention(q, k, v, n, implementation="pallas"),
        _spec((batch, heads, 128)), _spec((batch, cache, kv_heads, 128)), _spec((batch, cache, kv_heads, 128)),
        _spec((batch,), jnp.int32),
    )
    assert _count_kernels(module, "decode_attention") >= 1


@pytest.mark.parametrize("model", list(LLM))
def test_model_attention_lowers_for_prefill_and_decode(model):
    """The model's own op (`attention` with an `AttentionMask`) on the LM shapes: prefill -> flash,
    decode -> split-K."""
    heads, kv_heads = LLM[model]
    length, slots = 1024, 4096

    def prefill(q, k, v, starts):
        mask = AttentionMask.causal(starts, jnp.full_like(starts, length), length)
        return attention_api.attention(q, k, v, mask, implementation="pallas")

    def decode(q, k, v, starts, index):
        mask = AttentionMask.causal(starts, jnp.full_like(starts, index + 1), 1, offset=index)
        return attention_api.attention(q, k, v, mask, implementation="pallas")

    module = _lower(prefill, _spec((2, length, heads, 128)), _spec((2, length, kv_heads, 128)),
                    _spec((2, length, kv_heads, 128)), _spec((2,), jnp.int32))
    assert _count_kernels(module, "flash_attention") >= 1
    module = _lower(decode, _spec((2, 1, heads, 128)), _spec((2, slots, kv_heads, 128)),
                    _spec((2, slots, kv_heads, 128)), _spec((2,), jnp.int32), _spec((), jnp.int32))
    assert _count_kernels(module, "decode_attention") >= 1


@pytest.mark.parametrize("block_q,block_k", [(64, 64), (128, 64), (64, 128), (128, 128)])
@pytest.mark.parametrize("dim", [64, 72, 128])
def test_flash_block_configs_lower(block_q, block_k, dim):
    """The block sizes scripts/bench_gpu.py sweeps all lower."""
    qkv = _spec((4096, 16, dim))
    module = _lower(
        lambda q, k, v, s: attention_api.varlen_attention(q, k, v, s, implementation="pallas",
                                                          block_q=block_q, block_k=block_k),
        qkv, qkv, qkv, _spec((4096,), jnp.int32),
    )
    assert _count_kernels(module, "flash_attention") >= 1


def test_xla_choice_emits_no_kernel():
    qkv = _spec((784, 16, 64))
    module = _lower(
        lambda q, k, v, s: attention_api.varlen_attention(q, k, v, s, implementation="xla"),
        qkv, qkv, qkv, _spec((784,), jnp.int32),
    )
    assert TRITON not in module


def test_lowering_check_catches_unpadded_head_dim(monkeypatch):
    """Control: without the api's padding, head_dim 72 violates Triton's power-of-two rule; the
    lowering check must see it (interpret mode would not)."""
    from pallas_kernels.attention import kernel

    monkeypatch.setattr(kernel, "_check_dim", lambda dim: None)
    qkv = _spec((1, 256, 2, 72))
    bounds = _spec((1, 256), jnp.int32)
    with pytest.raises(Exception, match="power of 2"):
        _lower(lambda q, k, v, lo, hi: kernel.flash_attention(q, k, v, lo, hi, scale=0.1), qkv, qkv, qkv, bounds, bounds)


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_float32_inputs_lower_with_ieee_or_tf32_dots(precision):
    """float32 kernels follow jax_default_matmul_precision (IEEE for "highest", TF32 otherwise)."""
    qkv = _spec((1024, 16, 72), jnp.float32)
    with jax.default_matmul_precision(precision):
        module = _lower(
            lambda q, k, v, s: attention_api.varlen_attention(q, k, v, s, implementation="pallas"),
            qkv, qkv, qkv, _spec((1024,), jnp.int32),
        )
        decode = _lower(
            lambda q, k, v, n: attention_api.decode_attention(q, k, v, n, implementation="pallas"),
            _spec((2, 32, 128), jnp.float32), _spec((2, 4096, 8, 128), jnp.float32),
            _spec((2, 4096, 8, 128), jnp.float32), _spec((2,), jnp.int32),
        )
    assert _count_kernels(module, "flash_attention") >= 1 and _count_kernels(decode, "decode_attention") >= 1
