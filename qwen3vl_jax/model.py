"""The whole Qwen3-VL model: vision tower + Qwen3 decoder + LM head, and its entry points.

`Qwen3VL.from_pretrained(path, dtype=...)` reads an HF checkpoint directory (config.json +
safetensors) through the strict converter. `encode_vision(pixel_values, grid_thw)` runs the
tower under `jit` on host-computed metadata and returns HF's `pooler_output` and
`deepstack_features` as `(merged [N, O], deepstack [L, N, O])`.

Attribute names mirror HF (`visual.blocks[i].attn.qkv`, `language_model.layers[i].self_attn.q_proj`,
`lm_head`) so the converter in `convert.py` is a table of renames plus named transforms.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import Qwen3VLConfig
from .convert import load_hf_params
from .layers import Linear
from .text import TextModel
from .vision import VisionModel, VisionOutput, validate_vision_inputs, vision_metadata

__all__ = ["Qwen3VL", "param_shapes", "count_params"]


class Qwen3VL(nnx.Module):
    """`Qwen3VLForConditionalGeneration` in Flax NNX.

    Args:
      config: the architecture.
      dtype: compute dtype; `param_dtype` (default: `dtype`) is the storage dtype. Norms, softmax,
        rotary and the position-embedding interpolation run in float32 regardless.
      attention_implementation: "auto" | "xla" (runtime option, not architecture).
    """

    def __init__(self, config: Qwen3VLConfig, *, dtype=jnp.float32, param_dtype=None,
                 attention_implementation: str = "auto", rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = config
        self.dtype = dtype
        self.attention_implementation = attention_implementation
        self.visual = VisionModel(config.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.language_model = TextModel(config.text, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.text.hidden_size, config.text.vocab_size, use_bias=False, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)

    # ------------------------------------------------------------------ construction

    @classmethod
    def abstract(cls, config: Qwen3VLConfig, **kwargs) -> "Qwen3VL":
        """The model with `ShapeDtypeStruct` leaves: no memory is allocated."""
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), **kwargs))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                        attention_implementation: str = "auto") -> "Qwen3VL":
        """Load an HF-format checkpoint directory (config.json + safetensors)."""
        config = Qwen3VLConfig.from_hf_config(path)
        model = cls.abstract(config, dtype=dtype, param_dtype=param_dtype,
                             attention_implementation=attention_implementation)
        graphdef, state = nnx.split(model)
        params = load_hf_params(path, param_shapes(state), config)
        return nnx.merge(graphdef, _fill_state(state, params))

    # ------------------------------------------------------------------ vision

    def encode_vision(self, pixel_values, grid_thw, *, return_hidden_states: bool = False):
        """Run the vision tower.

        Args:
          pixel_values: `[P, C*T*p*p]` (numpy or jax) patches, as the processor emits them.
          grid_thw: `[n, 3]` integer (t, h, w) in patches per image / video.
          return_hidden_states: also return each block's `[P, E]` output.
        Returns:
          `(merged [N, O], deepstack [L, N, O])`, or a `VisionOutput` when hidden states are asked for.
        """
        grid = validate_vision_inputs(pixel_values, grid_thw, self.config.vision)
        meta = vision_metadata(grid, self.config.vision)
        graphdef, state = nnx.split(self.visual)
        out = _run_vision(graphdef, state, jnp.asarray(pixel_values), meta,
                          implementation=self.attention_implementation,
                          return_hidden_states=return_hidden_states)
        return out if return_hidden_states else (out.merged, out.deepstack)


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "return_hidden_states"))
def _run_vision(graphdef, state, pixel_values, meta, *, implementation, return_hidden_states) -> VisionOutput:
    visual = nnx.merge(graphdef, state)
    return visual(pixel_values, meta, implementation=implementation, return_hidden_states=return_hidden_states)


# ---------------------------------------------------------------------- state helpers


def _flat_paths(state) -> list[tuple[str, object]]:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf) for path, leaf in leaves]


def param_shapes(state) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`{dotted path: (shape, dtype)}` for every parameter of an NNX state (abstract or concrete)."""
    return {path: (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in _flat_paths(state)}


def count_params(model_or_state) -> int:
    """Number of parameters (works on abstract models from `Qwen3VL.abstract`)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return int(sum(int(np.prod(shape)) for shape, _ in param_shapes(state).values()))


def _fill_state(state, params: dict[str, np.ndarray]):
    pure = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    values = []
    for path, leaf in leaves:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        values.append(jnp.asarray(params[name], dtype=leaf.dtype))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return state
