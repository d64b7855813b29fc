"""The whole Qwen3-VL model: vision tower + Qwen3 decoder + LM head, and its entry points.

`Qwen3VL.from_pretrained(path, dtype=...)` reads an HF checkpoint directory (config.json +
safetensors) through the strict converter. `encode_vision(pixel_values, grid_thw)` runs the
tower under `jit` on host-computed metadata and returns HF's `pooler_output` and
`deepstack_features` as `(merged [N, O], deepstack [L, N, O])`.

Attribute names mirror HF (`visual.blocks[i].attn.qkv`, `language_model.layers[i].self_attn.q_proj`,
`lm_head`) so the converter in `convert.py` is a table of renames plus named transforms.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import pruning as pruning_lib
from .config import Qwen3VLConfig
from .convert import is_orbax_dir, load_hf_params, restore_orbax, save_hf, save_orbax
from .generate import GenerationConfig
from .generate import generate as generate_tokens
from .layers import Linear
from .mrope import get_rope_index
from .text import TextModel
from .vision import VisionModel, VisionOutput, validate_vision_inputs, vision_metadata

__all__ = ["Qwen3VL", "MultimodalInputs", "MODEL_INPUTS", "param_shapes", "count_params"]

# The processor outputs the model reads (`__call__`, `prepare_inputs`, `generate`), in their order.
MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")


@dataclasses.dataclass(frozen=True)
class MultimodalInputs:
    """A prompt batch ready for the language model (all arrays; a pytree).

    input_ids: `[B, L]` int32. attention_mask: `[B, L]` bool (False = padding).
    positions: `[3, B, L]` int32 mRoPE positions; rope_deltas: `[B, 1]` int32 (decode offset).
    visual_index: `[B, L]` int32 row of `features` spliced in at each position, -1 for text.
    features: `[N, E]` merged visual features (images then videos), or None for text-only.
    deepstack: `[K, N, E]` deepstack features, or None.
    """

    input_ids: jnp.ndarray
    attention_mask: jnp.ndarray
    positions: jnp.ndarray
    rope_deltas: jnp.ndarray
    visual_index: jnp.ndarray
    features: jnp.ndarray | None
    deepstack: jnp.ndarray | None


jax.tree_util.register_dataclass(
    MultimodalInputs,
    data_fields=["input_ids", "attention_mask", "positions", "rope_deltas", "visual_index", "features", "deepstack"],
    meta_fields=[],
)


class Qwen3VL(nnx.Module):
    """`Qwen3VLForConditionalGeneration` in Flax NNX.

    Args:
      config: the architecture.
      dtype: compute dtype; `param_dtype` (default: `dtype`) is the storage dtype. Norms, softmax,
        rotary and the position-embedding interpolation run in float32 regardless.
      attention_implementation: "xla" (the pure-jnp specs), "pallas" (the Triton kernels; interpret
        mode off-GPU) or "auto" (Pallas on a GPU, XLA elsewhere). A runtime option, not architecture.
    """

    def __init__(self, config: Qwen3VLConfig, *, dtype=jnp.float32, param_dtype=None,
                 attention_implementation: str = "auto", rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = config
        self.dtype = dtype
        self.attention_implementation = attention_implementation
        self.generation_config = GenerationConfig()  # EOS / pad ids; from_pretrained reads the checkpoint's
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
                        attention_implementation: str = "auto", progress: bool = False) -> "Qwen3VL":
        """Load an HF checkpoint directory (config.json + safetensors) or one written by `save_orbax`.

        HF weights are read one shard at a time and cast to `param_dtype` (default `dtype`); an Orbax
        checkpoint is restored against the abstract model, so shapes and dtypes are checked.
        """
        kwargs = dict(dtype=dtype, param_dtype=param_dtype, attention_implementation=attention_implementation)
        if is_orbax_dir(path):
            def target(config):
                abstract_state = nnx.state(cls.abstract(config, **kwargs), nnx.Param)
                return nnx.to_pure_dict(abstract_state)

            config, pure = restore_orbax(path, target)
            graphdef, state = nnx.split(cls.abstract(config, **kwargs))
            nnx.replace_by_pure_dict(state, pure)
            model = nnx.merge(graphdef, state)
            model.generation_config = GenerationConfig.from_pretrained(path)
            return model
        config = Qwen3VLConfig.from_hf_config(path)
        graphdef, state = nnx.split(cls.abstract(config, **kwargs))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc=f"reading {os.path.basename(os.path.abspath(path))}", unit=" tensors")
        try:
            params = load_hf_params(path, param_shapes(state), config,
                                    on_tensor=None if bar is None else (lambda name: bar.update()))
        finally:
            if bar is not None:
                bar.close()
        model = nnx.merge(graphdef, _fill_state(state, params))
        model.generation_config = GenerationConfig.from_pretrained(path)
        return model

    def save_orbax(self, directory: str | os.PathLike) -> str:
        """Write the parameters and the config as an Orbax checkpoint under `directory/orbax`."""
        return save_orbax(nnx.to_pure_dict(nnx.state(self, nnx.Param)), self.config, directory)

    def save_hf(self, directory: str | os.PathLike, *, dtype: str | None = None,
                max_shard_bytes: int | None = None) -> str:
        """Export HF safetensors + config.json that `Qwen3VLForConditionalGeneration` loads."""
        params = {path: np.asarray(leaf) for path, leaf in _flat_paths(nnx.state(self, nnx.Param))}
        return save_hf(params, self.config, directory, dtype=dtype, max_shard_bytes=max_shard_bytes)

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

    # ------------------------------------------------------------------ full model

    def prepare_inputs(
        self,
        input_ids,
        attention_mask=None,
        mm_token_type_ids=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        *,
        video_pruning: tuple[str, float] | None = None,
        vision_encoder=None,
    ) -> MultimodalInputs:
        """Host bookkeeping + vision encoding: everything the language model needs, as arrays.

        Args:
          input_ids ... video_grid_thw: processor outputs. `mm_token_type_ids` defaults to 1 at image
            pads, 2 at video pads, 0 elsewhere (what the processor emits).
          video_pruning: `(method, rate)`, a registered method (`qwen3vl_jax.pruning`) and rate in [0, 1) (0 = off).
            The prompt must then be built by the processor with the same option (each video's K
            retained tokens lumped into frame 0); the encoder output decides which tokens are kept,
            and the sequence is rebuilt per frame with the kept tokens at their unpruned positions
            (shorter than the prompt when an adaptive method keeps fewer: docs/pruning.md §8.2).
          vision_encoder: a callable `(pixel_values, grid_thw) -> (merged, deepstack)` used instead of
            `encode_vision`, e.g. `EncoderRunner(model).encode` for bucketed, precompiled encoding.
        Raises ValueError when placeholders and visual inputs disagree.
        """
        cfg = self.config
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {ids.shape}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        if mm_token_type_ids is None:
            mm_token_type_ids = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.video_token_id, 2, 0))
        mm_token_type_ids = np.asarray(mm_token_type_ids)
        pruning = pruning_lib.validate_video_pruning(video_pruning)
        merge = cfg.vision.spatial_merge_size
        prune_videos = pruning is not None and video_grid_thw is not None

        groups = []  # (pixels, grid) per modality, images first
        for name, token, pixels, grid in (
            ("image", cfg.image_token_id, pixel_values, image_grid_thw),
            ("video", cfg.video_token_id, pixel_values_videos, video_grid_thw),
        ):
            if (pixels is None) != (grid is None):
                raise ValueError(f"pass both the {name} pixels and the {name} grid_thw, or neither")
            found = int(((ids == token) & mask).sum())
            if grid is None:
                expected = 0
            elif name == "video" and prune_videos:
                expected = pruning_lib.placeholder_tokens(grid, merge, pruning)
            else:
                expected = int(np.asarray(grid).prod(axis=-1).sum()) // cfg.vision.merge_unit
            if found != expected:
                raise ValueError(
                    f"{name} placeholders and {name} features do not match: the prompt has {found} {name} "
                    f"tokens but the {name} inputs give {expected} merged tokens"
                    + (f" after {pruning[0]} pruning at rate {pruning[1]}" if name == "video" and prune_videos else "")
                )
            if grid is not None:
                groups.append((pixels, validate_vision_inputs(pixels, grid, cfg.vision)))

        features = deepstack = None
        if groups:
            pixels = np.concatenate([np.asarray(p, np.float32) for p, _ in groups])
            grid = np.concatenate([g for _, g in groups])
            features, deepstack = (vision_encoder or self.encode_vision)(pixels, grid)
            if prune_videos:
                pruned = pruning_lib.prune_video_tokens(
                    ids, mask, mm_token_type_ids, image_grid_thw, video_grid_thw, features, deepstack, pruning,
                    config=cfg, embed_tokens=self.language_model.embed_tokens)
                ids, mask, positions = pruned.input_ids, pruned.attention_mask, pruned.positions
                deltas, features, deepstack = pruned.rope_deltas, pruned.merged, pruned.deepstack
            else:
                positions, deltas = get_rope_index(ids, mm_token_type_ids, image_grid_thw, video_grid_thw, mask,
                                                   merge)
        else:
            # Text only: HF uses plain 0..L-1 on all three axes (padding included) and no delta.
            positions = np.broadcast_to(np.arange(ids.shape[1]), (3, *ids.shape))
            deltas = np.zeros((ids.shape[0], 1), np.int64)

        visual_index = np.full(ids.shape, -1, np.int32)
        is_image = (ids == cfg.image_token_id) & mask
        is_video = (ids == cfg.video_token_id) & mask
        n_image = int(is_image.sum())
        visual_index[is_image] = np.arange(n_image)  # row-major over (batch, position), as HF scatters
        visual_index[is_video] = n_image + np.arange(int(is_video.sum()))
        return MultimodalInputs(
            input_ids=jnp.asarray(ids, jnp.int32),
            attention_mask=jnp.asarray(mask),
            positions=jnp.asarray(positions, jnp.int32),
            rope_deltas=jnp.asarray(deltas, jnp.int32),
            visual_index=jnp.asarray(visual_index),
            features=features,
            deepstack=deepstack,
        )

    def video_retention_masks(self, pixel_values_videos, video_grid_thw, video_pruning: tuple[str, float],
                              *, vision_encoder=None) -> list[np.ndarray]:
        """Per video, the bool `[T, R, C]` map of the merged tokens `video_pruning` keeps (for plots)."""
        pruning = pruning_lib.validate_video_pruning(video_pruning)
        grid = validate_vision_inputs(pixel_values_videos, video_grid_thw, self.config.vision)
        merged = deepstack = None
        if pruning is not None:
            merged, deepstack = (vision_encoder or self.encode_vision)(pixel_values_videos, grid)
        return pruning_lib.retention_maps(merged, deepstack, grid, self.config.vision.spatial_merge_size, pruning)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        mm_token_type_ids=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        *,
        return_hidden_states: bool = False,
        video_pruning: tuple[str, float] | None = None,
        vision_encoder=None,
    ):
        """Logits `[B, L, V]` with the meaning of HF's `Qwen3VLForConditionalGeneration(...).logits`.

        `video_pruning` and `vision_encoder` as in `prepare_inputs`.

        With `return_hidden_states`, returns `(logits, per-layer hidden states)`: each decoder layer's
        output before its deepstack addition, as HF's `output_hidden_states` records them.
        """
        inputs = self.prepare_inputs(input_ids, attention_mask, mm_token_type_ids, pixel_values,
                                     image_grid_thw, pixel_values_videos, video_grid_thw,
                                     video_pruning=video_pruning, vision_encoder=vision_encoder)
        graphdef, state = nnx.split(self)
        return _run_language_model(graphdef, state, inputs, implementation=self.attention_implementation,
                                   return_hidden_states=return_hidden_states)

    def embed(self, inputs: MultimodalInputs):
        """Token embeddings with visual features spliced in, and the per-level deepstack additions."""
        embeds = self.language_model.embed_tokens(inputs.input_ids)
        if inputs.features is None:
            return embeds, None
        is_visual = inputs.visual_index >= 0
        rows = jnp.maximum(inputs.visual_index, 0)
        embeds = jnp.where(is_visual[..., None], inputs.features[rows].astype(embeds.dtype), embeds)
        deepstack = jnp.where(is_visual[None, ..., None], inputs.deepstack[:, rows], 0)
        return embeds, deepstack

    def logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        """`[..., E] -> [..., V]` through `lm_head`, or the embedding matrix when tied."""
        if self.config.tie_word_embeddings:
            return self.language_model.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def generate(self, *args, **kwargs):
        """Token ids `[B, L + new]` like HF's `generate`; see `qwen3vl_jax.generate.generate`."""
        return generate_tokens(self, *args, **kwargs)


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "return_hidden_states"))
def _run_vision(graphdef, state, pixel_values, meta, *, implementation, return_hidden_states) -> VisionOutput:
    visual = nnx.merge(graphdef, state)
    return visual(pixel_values, meta, implementation=implementation, return_hidden_states=return_hidden_states)


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "return_hidden_states"))
def _run_language_model(graphdef, state, inputs: MultimodalInputs, *, implementation, return_hidden_states):
    model = nnx.merge(graphdef, state)
    embeds, deepstack = model.embed(inputs)
    length = inputs.input_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = causal[None] & inputs.attention_mask[:, None, :]
    out = model.language_model(embeds, inputs.positions, mask, deepstack, implementation=implementation,
                               return_hidden_states=return_hidden_states)
    if return_hidden_states:
        hidden, layers = out
        return model.logits(hidden), layers
    return model.logits(out)


# ---------------------------------------------------------------------- state helpers


def _dotted(path) -> str:
    """A pytree key path as our dotted parameter name, e.g. `visual.blocks.3.attn.qkv.kernel`."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _flat_paths(state) -> list[tuple[str, object]]:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return [(_dotted(path), leaf) for path, leaf in leaves]


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
    # Pop as we go, so each host copy is freed once its device array exists.
    values = [jnp.asarray(params.pop(_dotted(path)), dtype=leaf.dtype) for path, leaf in leaves]
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return state
