"""The whole Qwen3-VL model: vision tower + Qwen3 decoder + LM head, and its entry points.

`Qwen3VL.from_pretrained(path, dtype=...)` reads an HF checkpoint directory (config.json +
safetensors) through the strict converter. `encode_vision(pixel_values, grid_thw)` runs the
tower under `jit` on host-computed metadata and returns HF's `pooler_output` and
`deepstack_features` as `(merged [N, O], deepstack [L, N, O])`.

A forward is two steps, so that the second can be jitted and differentiated:

- `prepare_inputs(**processor outputs)` (host, numpy): validation, mRoPE positions, which encoder
  row fills each visual position, the vision tower's grid metadata, and (with video pruning) the
  selection of the kept tokens. By default it also encodes the pixels; `encode=False` leaves the
  encoding to the forward.
- `forward(inputs)` (device; jit / grad friendly): encodes the pixels if needed, splices the visual
  features in, runs the decoder (`text.TextModel`, the same code as prefill and decoding) and the LM
  head. `model(**processor outputs)` is both.

Parameters are stored per block (`nnx.List`) or stacked (`scan_layers`); the converter and Orbax
always see the canonical per-block names (`canonical_params`, `load_canonical`).

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
from tqdm.auto import tqdm

from pallas_kernels.attention.mask import AttentionMask

from . import pruning as pruning_lib
from .config import Qwen3VLConfig
from .convert import (checkpoint_quantization, fp8_config, is_orbax_dir, plan_hf_params, restore_orbax, save_hf,
                      save_orbax)
from .generate import GenerationConfig
from .generate import generate as generate_tokens
from .layers import check_layers, use_scan
from .mrope import get_rope_index
from .params import canonical_params, count_params, expert_layout_of, fill_state, flat_paths, nest_paths, param_shapes
from .quant import QuantSpec, make_linear, quantize_params
from .sharding import check_mesh, constrain, make_mesh, param_shardings, shard, use_mesh
from .text import TextModel
from .vision import VisionMetadata, VisionModel, VisionOutput, validate_vision_inputs, vision_metadata

__all__ = ["Qwen3VL", "MultimodalInputs", "MODEL_INPUTS", "PROCESSOR_EXTRAS", "param_shapes", "count_params",
           "canonical_params", "expected_params", "causal_padding_mask", "register_adapter_loader"]

# How `Qwen3VL.from_pretrained(..., adapter=DIR)` attaches an adapter: a loader `(model, directory)`
# registered by the side that defines adapters (`training.lora` registers PEFT's LoRA format when
# it is imported, and the package imports it), so this module never imports the training side.
_ADAPTER_LOADERS: dict[str, object] = {}


def register_adapter_loader(name: str, loader) -> None:
    """Make `loader(model, directory)` the way `from_pretrained(adapter=...)` attaches adapters."""
    _ADAPTER_LOADERS[name] = loader

# The processor outputs the model reads (`__call__`, `prepare_inputs`, `generate`), in their order.
MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")
# Processor outputs the model accepts and does not need (the timestamps are already in the text).
PROCESSOR_EXTRAS = ("video_timestamps", "video_metadata")


@dataclasses.dataclass(frozen=True)
class MultimodalInputs:
    """A prompt batch ready for `Qwen3VL.forward` (all arrays; a pytree).

    input_ids: `[B, L]` int32. attention_mask: `[B, L]` bool (False = padding; each row's real
      tokens are one contiguous run).
    positions: `[3, B, L]` int32 mRoPE positions; rope_deltas: `[B, 1]` int32 (decode offset).
    visual_index: `[B, L]` int32 row of the encoder output spliced in at each position, -1 for text
      (images then videos, unpruned rows: a pruned token is simply never referenced).
    features: `[N, E]` merged visual features, or None (text only, or not encoded yet).
    deepstack: `[K, N, E]` deepstack features, or None.
    pixel_values: `[P, C*T*p*p]` float32 patches of all images then videos, or None once encoded.
    vision: the tower's `VisionMetadata` for `pixel_values`, or None.
    llm_pruning: an in-LLM pruning plan (`pruning.LLMPruning`) for this batch, or None.
    """

    input_ids: jnp.ndarray
    attention_mask: jnp.ndarray
    positions: jnp.ndarray
    rope_deltas: jnp.ndarray
    visual_index: jnp.ndarray
    features: jnp.ndarray | None = None
    deepstack: jnp.ndarray | None = None
    pixel_values: jnp.ndarray | None = None
    vision: VisionMetadata | None = None
    llm_pruning: pruning_lib.LLMPruning | None = None


jax.tree_util.register_dataclass(
    MultimodalInputs,
    data_fields=["input_ids", "attention_mask", "positions", "rope_deltas", "visual_index", "features", "deepstack",
                 "pixel_values", "vision", "llm_pruning"],
    meta_fields=[],
)


def causal_padding_mask(attention_mask) -> AttentionMask:
    """The decoder's `AttentionMask` for a padded batch `[B, L]` whose real tokens are one run per row."""
    mask = jnp.asarray(attention_mask).astype(bool)
    length = mask.shape[1]
    any_real = jnp.any(mask, axis=1)
    starts = jnp.where(any_real, jnp.argmax(mask, axis=1), 0)
    ends = jnp.where(any_real, length - jnp.argmax(mask[:, ::-1], axis=1), 0)
    return AttentionMask.causal(starts, ends, length)


class Qwen3VL(nnx.Module):
    """`Qwen3VLForConditionalGeneration` in Flax NNX.

    Args:
      config: the architecture.
      dtype: compute dtype; `param_dtype` (default: `dtype`) is the storage dtype. Norms, softmax,
        rotary and the position-embedding interpolation run in float32 regardless.
      attention_implementation: "xla" (the pure-jnp specs), "pallas" (the Triton kernels; interpret
        mode off-GPU) or "auto" (Pallas on a GPU, XLA elsewhere).
      scan_layers: stack each tower's block parameters and run the blocks under `lax.scan` (compile
        time flat in depth). None (default): per tower, when it has >= `layers.SCAN_MIN_DEPTH` blocks
        (every full-size preset; not the tiny test model).
      remat: recompute each block's activations in the backward pass (training memory).
      moe_implementation: the MoE models' expert matmul, "auto", "ragged" (`lax.ragged_dot`), "tiled"
        (a loop over expert tiles, the CPU path) or "tokamax" (its grouped-matmul kernels: the GPU
        path when installed); see `qwen3vl_jax.moe`.
      quantization: a `quant.QuantSpec`: which linears / experts hold quantized weights (FP8, int8,
        int4) and their block scales; None: all in `param_dtype`.
    The last five are runtime options, not architecture. A MoE config whose layers mix dense and
    sparse MLPs keeps its decoder layers per block (`scan_layers` True is refused for it).
    """

    def __init__(self, config: Qwen3VLConfig, *, dtype=jnp.float32, param_dtype=None,
                 attention_implementation: str = "auto", scan_layers: bool | None = None, remat: bool = False,
                 moe_implementation: str = "auto", quantization: QuantSpec | None = None, rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = config
        self.dtype = dtype
        self.attention_implementation = attention_implementation
        self.generation_config = GenerationConfig()  # EOS / pad ids; from_pretrained reads the checkpoint's
        self.expert_layout = "released"  # the HF layout of MoE experts that `save_hf` writes (as loaded)
        kw = dict(dtype=dtype, param_dtype=param_dtype, remat=bool(remat), rngs=rngs)
        self.visual = VisionModel(config.vision, scan_layers=use_scan(scan_layers, config.vision.depth),
                                  quant=quantization, **kw)
        text_scan = use_scan(scan_layers, config.text.num_hidden_layers)
        if scan_layers is None and not config.text.uniform_layers:
            text_scan = False  # dense and sparse layers mixed: they cannot share one stacked layout
        self.quantization = quantization
        self.language_model = TextModel(config.text, scan_layers=text_scan, moe_implementation=moe_implementation,
                                        quant=quantization, **kw)
        if not config.tie_word_embeddings:
            self.lm_head = make_linear(config.text.hidden_size, config.text.vocab_size, path="lm_head",
                                       quant=quantization, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                       rngs=rngs)

    # ------------------------------------------------------------------ construction

    @classmethod
    def abstract(cls, config: Qwen3VLConfig, **kwargs) -> "Qwen3VL":
        """The model with `ShapeDtypeStruct` leaves: no memory is allocated."""
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), **kwargs))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                        attention_implementation: str = "auto", scan_layers: bool | None = None,
                        remat: bool = False, moe_implementation: str = "auto", progress: bool = False,
                        adapter: str | os.PathLike | None = None, mesh=None, vision: str = "data",
                        quantize: str | QuantSpec | None = None) -> "Qwen3VL":
        """Load an HF checkpoint directory (config.json + safetensors) or one written by `save_orbax`.

        HF weights are checked from the safetensors headers (every problem reported at once), then
        read tensor by tensor from the memory-mapped files and cast to `param_dtype` (default
        `dtype`), so the host holds one tensor at a time; an Orbax checkpoint is restored against
        the abstract model, so shapes and dtypes are checked. Either
        loads into either parameter layout (`scan_layers`). `adapter`: a PEFT LoRA adapter directory
        (`adapter_config.json` + `adapter_model.safetensors`) added on top by the loader
        `training.lora` registers (`register_adapter_loader`).

        `mesh` (`sharding.make_mesh`, or its spec: "fsdp=2,tensor=4"): load sharded by the parameter
        tree's partition rules (`params.RULES`); every process
        reads only the slices its devices hold, straight into device shards (HF: memory-mapped
        safetensors slices; Orbax: a sharded restore). `vision`: "data" (the tower replicated, the
        default) or "tensor" (split by its rules). See `qwen3vl_jax.sharding`.

        Quantized weights (`qwen3vl_jax.quant`): an HF FP8 checkpoint (`quantization_config` with
        `quant_method: "fp8"`) keeps its FP8 weights and block scales on the device, whatever
        `quantize`; `quantize` ("int8", "int4", "fp8" or a `quant.QuantSpec`) quantizes a
        full-precision checkpoint as it is read (by default the language model's linears and
        experts; the vision tower, the mergers and `lm_head` stay in `param_dtype`).
        """
        kwargs = dict(dtype=dtype, param_dtype=param_dtype, attention_implementation=attention_implementation,
                      scan_layers=scan_layers, remat=remat, moe_implementation=moe_implementation)
        if is_orbax_dir(path) and quantize is not None:
            raise ValueError("quantize= reads an HF checkpoint; convert the Orbax one to HF first")
        if isinstance(mesh, (str, dict)):  # "data=4,tensor=2" or {"data": 4, "tensor": 2}
            mesh = make_mesh(mesh)
        # 1. resolve: the config, and each parameter's source (in its file until placed)
        config, params, kwargs["quantization"], expert_layout = cls._resolve(path, kwargs, mesh, vision, quantize)
        # 2. check: the mesh can split every parameter (the sources were checked in `_resolve`)
        if mesh is not None:
            check_mesh(config, mesh, vision=vision)
        # 3. plan: the abstract model, and each leaf's sharding
        graphdef, state = nnx.split(cls.abstract(config, **kwargs))
        shardings = None if mesh is None else param_shardings(state, mesh, vision=vision)
        # 4. place: read each parameter into its (sharded) leaf, one at a time
        bar = None
        if progress:
            bar = tqdm(desc=f"reading {os.path.basename(os.path.abspath(path))}", unit=" arrays",
                       total=len(jax.tree.leaves(state)))
        try:
            model = nnx.merge(graphdef, fill_state(state, params, shardings,
                                                   on_leaf=None if bar is None else bar.update))
        finally:
            if bar is not None:
                bar.close()
        model.generation_config = GenerationConfig.from_pretrained(path)
        model.expert_layout = expert_layout
        # 5. attach: an adapter on top
        if adapter is not None:
            if "peft" not in _ADAPTER_LOADERS:
                raise RuntimeError("no adapter loader is registered: import qwen3vl_jax.training.lora")
            _ADAPTER_LOADERS["peft"](model, adapter)
            if mesh is not None:
                shard(model, mesh, vision=vision)
        return model

    @classmethod
    def _resolve(cls, path, kwargs: dict, mesh, vision: str, quantize=None
                 ) -> tuple[Qwen3VLConfig, dict[str, object], QuantSpec | None, str]:
        """The checkpoint's config, `{canonical path: value}` (`LazyTensor`s checked from the
        safetensors headers, every problem at once; or Orbax arrays restored, sharded under `mesh`),
        its quantization (an FP8 checkpoint's layout, `quantize`'s spec, or what Orbax recorded) and
        its HF expert layout."""
        if not is_orbax_dir(path):
            config = Qwen3VLConfig.from_hf_config(path)
            spec = checkpoint_quantization(path, config)
            if spec is not None and quantize is not None:
                raise ValueError(f"{path} is already an FP8 checkpoint; load it without quantize=")
            # Checked from the headers first; then each array is read as it is placed (one tensor,
            # or one device's block of it, on the host at a time).
            params = plan_hf_params(path, expected_params(config, **kwargs, quantization=spec), config)
            if quantize is not None:
                spec = quantize if isinstance(quantize, QuantSpec) else QuantSpec.make(quantize)
                params = quantize_params(params, spec)
            return config, params, spec, expert_layout_of(params) or "released"

        def target(metadata):  # Orbax holds the canonical per-block layout
            options = {**kwargs, "scan_layers": False, "quantization": metadata.quantization}
            pure = nnx.to_pure_dict(nnx.state(cls.abstract(metadata.config, **options), nnx.Param))
            if mesh is None:
                return pure
            check_mesh(metadata.config, mesh, vision=vision)
            return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
                                pure, param_shardings(nnx.State(pure), mesh, vision=vision))

        metadata, pure = restore_orbax(path, target)
        return metadata.config, dict(flat_paths(pure)), metadata.quantization, metadata.expert_layout

    def save_orbax(self, directory: str | os.PathLike) -> str:
        """Write the parameters (canonical per-block layout) and the config as Orbax under `directory/orbax`
        (each parameter is copied to the host as it is written, one at a time)."""
        return save_orbax(nest_paths(canonical_params(self)), self.config, directory,
                          expert_layout=self.expert_layout, quantization=self.quantization)

    def save_hf(self, directory: str | os.PathLike, *, dtype: str | None = None,
                max_shard_bytes: int | None = None) -> str:
        """Export HF safetensors + config.json that `Qwen3VLForConditionalGeneration` loads (each
        parameter is copied to the host as it is written, one at a time). Quantized weights: FP8 in
        HF's fine-grained format (with its `quantization_config`); int8 / int4 have no HF format here."""
        config = self.config
        if self.quantization is not None and self.quantization.method != "fp8":
            raise ValueError(f"{self.quantization.method} weights have no HF checkpoint format here (save_orbax "
                             "keeps them; FP8 is written in HF's fine-grained format)")
        if self.quantization is not None and config.quantization is None:
            config = config.replace(quantization=fp8_config(self.quantization))
        return save_hf(canonical_params(self), config, directory, dtype=dtype,
                       max_shard_bytes=max_shard_bytes, expert_layout=self.expert_layout)

    # ------------------------------------------------------------------ vision

    def encode_vision(self, pixel_values, grid_thw, *, return_hidden_states: bool = False,
                      return_attentions=None):
        """Run the vision tower.

        Args:
          pixel_values: `[P, C*T*p*p]` (numpy or jax) patches, as the processor emits them.
          grid_thw: `[n, 3]` integer (t, h, w) in patches per image / video.
          return_hidden_states: also return each block's `[P, E]` output (`[depth, P, E]`).
          return_attentions: a block index or indices: also return those blocks' attention
            probabilities `{block: [H, P, P]}` (over the packed patches, in the processor's row order;
            zero between different frames or items). Only those blocks materialize them.
        Returns:
          `(merged [N, O], deepstack [L, N, O])`, or a `VisionOutput` when hidden states or
          attentions are asked for.
        """
        grid = validate_vision_inputs(pixel_values, grid_thw, self.config.vision)
        attend = check_layers(return_attentions, self.config.vision.depth, "return_attentions", noun="block")
        meta = vision_metadata(grid, self.config.vision)
        graphdef, state = nnx.split(self.visual)
        with use_mesh(self):
            out = _run_vision(graphdef, state, jnp.asarray(pixel_values, jnp.float32), meta,
                              implementation=self.attention_implementation,
                              return_hidden_states=return_hidden_states, return_attentions=attend)
        return out if return_hidden_states or attend else (out.merged, out.deepstack)

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
        encode: bool = True,
        llm_pruning=None,
        image_pruning: tuple[str, float] | None = None,
        video_timestamps=None,
        video_metadata=None,
    ) -> MultimodalInputs:
        """Host bookkeeping (+ vision encoding): everything `forward` needs, as arrays.

        Args:
          input_ids ... video_grid_thw: processor outputs. `mm_token_type_ids` defaults to 1 at image
            pads, 2 at video pads, 0 elsewhere (what the processor emits). Each row's real tokens
            (`attention_mask`) must be one contiguous run (left or right padding).
          video_pruning: `(method, rate)`, a registered method (`qwen3vl_jax.pruning`) and rate in [0, 1)
            (0 = off). The prompt must then be built by the processor with the same option (each
            video's K retained tokens lumped into frame 0); the encoder output decides which tokens
            are kept (computed here, from concrete values: the selection is not differentiated), and
            the sequence is rebuilt per frame with the kept tokens at their unpruned positions
            (shorter than the prompt when an adaptive method keeps fewer: docs/pruning.md §8.2).
          image_pruning: `(method, rate)`, a registered method that prunes images (its `media`; e.g.
            "divprune", "visionzip", the baselines): as `video_pruning`, with each image's placeholder
            sized by the processor for its K kept tokens, which keep their unpruned positions.
          vision_encoder: a callable `(pixel_values, grid_thw) -> (merged, deepstack)` used instead of
            `encode_vision`, e.g. `EncoderRunner(model).encode` for bucketed, precompiled encoding.
          encode: False leaves the pixels in the result for `forward` to encode (so gradients reach
            the vision tower when `forward` is differentiated).
          llm_pruning: `(method, options)`, an in-LLM method (`("fastv", {"layer": 2, "rate": 0.5})`,
            `("pyramiddrop", {"layers": (2, 4), "rate": 0.5})`; docs/pruning.md §11): planned here
            (how many vision tokens each row keeps at each stage, the stages' static lengths), run
            by `forward` at the decoder layers.
          video_timestamps, video_metadata: processor outputs the model does not need (accepted so
            `model(**processor(...))` works; the timestamps are already in the text).
        Raises ValueError naming the offending item for malformed inputs.
        """
        cfg = self.config
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, length] array, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= cfg.text.vocab_size)
        if bad.any():
            b, col = np.argwhere(bad)[0]
            raise ValueError(f"input_ids[{b}, {col}] = {int(ids[b, col])} is outside the vocabulary "
                             f"[0, {cfg.text.vocab_size})")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        _check_padding_runs(mask)
        if mm_token_type_ids is None:
            mm_token_type_ids = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.video_token_id, 2, 0))
        mm_token_type_ids = np.asarray(mm_token_type_ids)
        image_grid_thw, pixel_values = _none_if_empty(image_grid_thw, pixel_values, "image")
        video_grid_thw, pixel_values_videos = _none_if_empty(video_grid_thw, pixel_values_videos, "video")
        pruning = pruning_lib.validate_video_pruning(video_pruning)
        image_spec = pruning_lib.validate_image_pruning(image_pruning)
        in_llm = pruning_lib.validate_llm_pruning(llm_pruning)
        merge = cfg.vision.spatial_merge_size
        prune_videos = pruning is not None and video_grid_thw is not None
        prune_images = image_spec is not None and image_grid_thw is not None

        groups = []  # (pixels, grid) per modality, images first
        for name, token, pixels, grid in (
            ("image", cfg.image_token_id, pixel_values, image_grid_thw),
            ("video", cfg.video_token_id, pixel_values_videos, video_grid_thw),
        ):
            if (pixels is None) != (grid is None):
                raise ValueError(f"pass both the {name} pixels and the {name} grid_thw, or neither")
            found = int(((ids == token) & mask).sum())
            spec = {"image": image_spec, "video": pruning}[name] if grid is not None else None
            if grid is None:
                expected = 0
            elif spec is not None:
                expected = pruning_lib.placeholder_tokens(grid, merge, spec)
            else:
                expected = int(np.asarray(grid).prod(axis=-1).sum()) // cfg.vision.merge_unit
            if found != expected:
                raise ValueError(
                    f"{name} placeholders and {name} features do not match: the prompt has {found} {name} "
                    f"tokens but the {name} inputs give {expected} merged tokens"
                    + (f" after {spec[0]} pruning at rate {spec[1]}" if spec is not None else "")
                )
            if grid is not None:
                groups.append((pixels, validate_vision_inputs(pixels, grid, cfg.vision, what=name)))

        features = deepstack = pixels = meta = None
        kept_rows = None  # with pruning: the unpruned encoder rows of the kept visual tokens, images first
        if groups:
            pixels = np.concatenate([np.asarray(p, np.float32) for p, _ in groups])
            grid = np.concatenate([g for _, g in groups])
            if encode or prune_videos or prune_images:
                features, deepstack = (vision_encoder or self.encode_vision)(pixels, grid)
            if prune_videos or prune_images:
                if isinstance(features, jax.core.Tracer):
                    raise ValueError(
                        "video and image pruning select tokens from concrete encoder outputs: call "
                        "model.prepare_inputs(..., video_pruning=... / image_pruning=..., encode=False) outside "
                        "jit / grad and pass the result to model.forward inside")
                pruned = pruning_lib.prune_video_tokens(
                    ids, mask, mm_token_type_ids, image_grid_thw, video_grid_thw, features, deepstack,
                    pruning if prune_videos else None, config=cfg, embed_tokens=self.language_model.embed_tokens,
                    image_spec=image_spec if prune_images else None)
                ids, mask, positions, deltas = pruned.input_ids, pruned.attention_mask, pruned.positions, pruned.rope_deltas
                kept_rows = pruned.kept_rows
            else:
                positions, deltas = get_rope_index(ids, mm_token_type_ids, image_grid_thw, video_grid_thw, mask,
                                                   merge)
            if not encode:
                features = deepstack = None
                meta = vision_metadata(grid, cfg.vision)
            else:
                pixels = None
        else:
            # Text only: HF uses plain 0..L-1 on all three axes (padding included) and no delta.
            positions = np.broadcast_to(np.arange(ids.shape[1]), (3, *ids.shape))
            deltas = np.zeros((ids.shape[0], 1), np.int64)

        visual_index = np.full(ids.shape, -1, np.int32)
        is_image = (ids == cfg.image_token_id) & mask
        is_video = (ids == cfg.video_token_id) & mask
        n_image_tokens = int(is_image.sum())
        if kept_rows is None:
            kept_rows = np.arange(n_image_tokens + int(is_video.sum()))
        # Row-major over (batch, position), as HF scatters; pruned rows are simply never referenced.
        visual_index[is_image] = kept_rows[:n_image_tokens]
        visual_index[is_video] = kept_rows[n_image_tokens:]
        plan = None
        if in_llm is not None:
            plan = pruning_lib.plan_llm_pruning(mask, visual_index >= 0, *in_llm, cfg.text.num_hidden_layers)
        return MultimodalInputs(
            input_ids=jnp.asarray(ids, jnp.int32),
            attention_mask=jnp.asarray(mask),
            positions=jnp.asarray(positions, jnp.int32),
            rope_deltas=jnp.asarray(deltas, jnp.int32),
            visual_index=jnp.asarray(visual_index),
            features=features,
            deepstack=deepstack,
            pixel_values=None if pixels is None else jnp.asarray(pixels),
            vision=None if meta is None else jax.tree.map(jnp.asarray, meta),
            llm_pruning=plan,
        )

    def video_retention_masks(self, pixel_values_videos, video_grid_thw, video_pruning: tuple[str, float],
                              *, vision_encoder=None) -> list[np.ndarray]:
        """Per video, the bool `[T, R, C]` map of the merged tokens `video_pruning` keeps (for plots)."""
        pruning = pruning_lib.validate_video_pruning(video_pruning)
        grid = validate_vision_inputs(pixel_values_videos, video_grid_thw, self.config.vision, what="video")
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
        return_attentions=None,
        return_router_logits: bool = False,
        video_pruning: tuple[str, float] | None = None,
        llm_pruning=None,
        image_pruning: tuple[str, float] | None = None,
        vision_encoder=None,
        video_timestamps=None,
        video_metadata=None,
    ):
        """Logits `[B, L, V]` with the meaning of HF's `Qwen3VLForConditionalGeneration(...).logits`.

        `prepare_inputs` then `forward` (jitted); the keywords as there. Differentiable: under
        `nnx.grad` / `jax.grad` the vision tower, the deepstack and the decoder all get gradients.

        With `return_hidden_states`, also returns the hidden states `[N, B, L, E]`: each decoder
        layer's output before its deepstack addition, as HF's `output_hidden_states` records them.
        With `return_attentions` (a decoder layer index or indices), also returns `{layer: [B, H, L,
        L]}`, those layers' attention probabilities (HF's `output_attentions=True` under eager
        attention; rows of padding tokens are zero). Only the chosen layers materialize them; the
        forward without the option is unchanged.

        With `llm_pruning=(method, options)` (e.g. `("fastv", {"layer": 2, "rate": 0.5})`, see
        `prepare_inputs`), the logits are those of the tokens the last stage keeps, `[B, L', V]`, and
        the stages' kept rows follow: a tuple of `[B, L_s]` input positions (-1: padding), one per
        stage (the last is the layout of the logits). Attentions of layers after a stage cover its
        tokens only.

        With `return_router_logits` (MoE models), `router logits [sparse layers, B*L, experts]` come
        last in the tuple, as HF's `output_router_logits` records them (`moe.load_balancing_loss`).
        The extras follow the logits in this order: `(logits, hidden_states, attentions, kept,
        router_logits)`.
        """
        attend = check_layers(return_attentions, self.config.text.num_hidden_layers)
        inputs = self.prepare_inputs(input_ids, attention_mask, mm_token_type_ids, pixel_values,
                                     image_grid_thw, pixel_values_videos, video_grid_thw,
                                     video_pruning=video_pruning, vision_encoder=vision_encoder,
                                     llm_pruning=llm_pruning, image_pruning=image_pruning)
        graphdef, state = nnx.split(self)
        with use_mesh(self):
            return _run_forward(graphdef, state, inputs, return_hidden_states=return_hidden_states,
                                return_attentions=attend, return_router_logits=return_router_logits)

    def forward(self, inputs: MultimodalInputs, *, return_hidden_states: bool = False, return_attentions=None,
                return_router_logits: bool = False):
        """Logits `[B, L, V]` (then per-layer hidden states, attention probabilities, the in-LLM
        stages' kept rows, router logits, when asked; see `__call__`) for prepared inputs; jit / grad
        friendly."""
        out = self.forward_hidden(inputs, return_hidden_states=return_hidden_states,
                                  return_attentions=return_attentions, return_router_logits=return_router_logits)
        logits = self.logits(out.hidden)
        extras = ((out.hidden_states,) if return_hidden_states else ()) + (
            (out.attentions,) if out.attentions is not None else ()) + (
            (out.kept,) if out.kept is not None else ()) + ((out.router_logits,) if return_router_logits else ())
        return (logits, *extras) if extras else logits

    def forward_hidden(self, inputs: MultimodalInputs, *, return_hidden_states: bool = False,
                       return_attentions=None, return_router_logits: bool = False):
        """The forward up to the LM head: a `TextOutput` with the final-norm hidden states `[B, L, E]`
        (e.g. for a loss that projects them through `logits` a chunk at a time)."""
        embeds, deepstack = self.embed(inputs)
        return self.language_model(embeds, inputs.positions, causal_padding_mask(inputs.attention_mask), deepstack,
                                   implementation=self.attention_implementation,
                                   return_hidden_states=return_hidden_states,
                                   return_attentions=check_layers(return_attentions,
                                                                  self.config.text.num_hidden_layers),
                                   pruning=inputs.llm_pruning, return_router_logits=return_router_logits)

    def embed(self, inputs: MultimodalInputs):
        """Token embeddings with visual features spliced in, and the per-level deepstack additions.

        Encodes `inputs.pixel_values` first when the features are not there yet.
        """
        embeds = self.language_model.embed_tokens(inputs.input_ids)
        features, deepstack = inputs.features, inputs.deepstack
        if features is None and inputs.pixel_values is not None:
            out = self.visual(inputs.pixel_values, inputs.vision, implementation=self.attention_implementation)
            features, deepstack = out.merged, out.deepstack
        if features is None:
            return embeds, None
        is_visual = inputs.visual_index >= 0
        rows = jnp.maximum(inputs.visual_index, 0)
        embeds = jnp.where(is_visual[..., None], features[rows].astype(embeds.dtype), embeds)
        deepstack = jnp.where(is_visual[None, ..., None], deepstack[:, rows].astype(embeds.dtype), 0)
        return constrain(embeds, "batch", None, None), constrain(deepstack, None, "batch", None, None)

    def logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        """`[..., E] -> [..., V]` through `lm_head`, or the embedding matrix when tied."""
        if self.config.tie_word_embeddings:
            logits = self.language_model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return constrain(logits, *(("batch",) + (None,) * (logits.ndim - 2) + ("tensor",)))

    def generate(self, *args, **kwargs):
        """Token ids `[B, L + new]` like HF's `generate`; see `qwen3vl_jax.generate.generate`."""
        with use_mesh(self):
            return generate_tokens(self, *args, **kwargs)


def _check_padding_runs(mask: np.ndarray) -> None:
    """Each row's real tokens must be one contiguous run (what the attention description expresses)."""
    for b, row in enumerate(mask):
        real = np.flatnonzero(row)
        if real.size and real[-1] - real[0] + 1 != real.size:
            raise ValueError(f"attention_mask row {b} has padding between real tokens; only left or right "
                             "padding (one contiguous run of real tokens per row) is supported")


def _none_if_empty(grid, pixels, name: str):
    """`(grid, pixels)`, where a grid with no items and no pixels is the same as neither."""
    if grid is not None and np.asarray(grid).size == 0:
        if pixels is not None and np.asarray(pixels).size:
            raise ValueError(f"{name} grid_thw is empty but {name} pixels were given")
        return None, None
    return grid, pixels


@functools.partial(jax.jit, static_argnames=("graphdef", "implementation", "return_hidden_states",
                                             "return_attentions"))
def _run_vision(graphdef, state, pixel_values, meta, *, implementation, return_hidden_states,
                return_attentions=()) -> VisionOutput:
    visual = nnx.merge(graphdef, state)
    return visual(pixel_values, meta, implementation=implementation, return_hidden_states=return_hidden_states,
                  return_attentions=return_attentions)


@functools.partial(jax.jit, static_argnames=("graphdef", "return_hidden_states", "return_attentions",
                                             "return_router_logits"))
def _run_forward(graphdef, state, inputs: MultimodalInputs, *, return_hidden_states, return_attentions=(),
                 return_router_logits=False):
    return nnx.merge(graphdef, state).forward(inputs, return_hidden_states=return_hidden_states,
                                              return_attentions=return_attentions,
                                              return_router_logits=return_router_logits)


def expected_params(config: Qwen3VLConfig, **kwargs) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`param_shapes` of the model `config` describes (`kwargs`: `Qwen3VL`'s options, e.g. `dtype`),
    built abstractly: no memory is allocated. What a checkpoint must hold."""
    return param_shapes(nnx.state(Qwen3VL.abstract(config, **kwargs), nnx.Param))
