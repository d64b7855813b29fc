"""Vision token pruning for Qwen3-VL: a registry of methods (EVS and VidCom2 with vLLM 0.33.0's counts,
masks and tie rules; content-blind baselines; VisionZip- and DivPrune-style image selection; FastV and
PyramidDrop inside the language model; your own), and the orchestration the model calls.

Spec and protocol: docs/pruning.md (§8 the registry). A method is any object with

  retained_count(tokens_per_frame, num_frames, rate) -> int     K, the placeholder size
  retention_mask(rows [N, D_tot], grid_thw, spatial_merge_size, rate) -> bool [N]   (one video, K trues)

plus the optional flags `adaptive` (K is an upper bound; the mask decides) and `uses_text` (the mask
also gets `text=PromptText(ids, embeds)`). Register it with `register_method(name, method)`; then
`video_pruning=(name, rate)` works in the processor, the model, `generate`, the bucketed encoder path
and the ablation. `rows` are the full encoder rows `[merged | deepstack_0 | ...]` (`concat_levels`) in
flat frame-major order `t*R*C + r*C + c`. Rate 0 (or None) means pruning is off.

The built-in modules also expose their jitted cores: `evs.keep_mask` / `vidcom2.keep_mask` and
`evs.keep_indices` / `vidcom2.keep_indices` (ascending kept indices of static shape K).
"""

from __future__ import annotations

from . import baselines, divprune, evs, llm, prompt, vidcom2, visionzip
from ._common import concat_levels, frame_counts, merged_grid
from .apply import PrunedInputs, placeholder_tokens, plan_videos, prune_video_tokens, retention_maps
from .registry import (
    DEFAULT_METHOD,
    PRUNING_METHODS,
    PromptText,
    PruningMethod,
    get_method,
    is_adaptive,
    media,
    method_kind,
    register_method,
    registered_methods,
    retained_count,
    retention_mask,
    unregister_method,
    uses_text,
    validate_image_pruning,
    validate_llm_pruning,
    validate_video_pruning,
)
from .llm import LLMPruning, Stage, plan_llm_pruning

__all__ = [
    # the registry
    "PruningMethod",
    "PromptText",
    "PRUNING_METHODS",
    "DEFAULT_METHOD",
    "register_method",
    "unregister_method",
    "registered_methods",
    "get_method",
    "is_adaptive",
    "uses_text",
    "validate_video_pruning",
    "validate_image_pruning",
    "validate_llm_pruning",
    "method_kind",
    "media",
    "retained_count",
    "retention_mask",
    # orchestration (what the model calls)
    "PrunedInputs",
    "plan_videos",
    "placeholder_tokens",
    "prune_video_tokens",
    "retention_maps",
    # in the language model
    "Stage",
    "LLMPruning",
    "plan_llm_pruning",
    "llm",
    # helpers and the built-in methods
    "concat_levels",
    "frame_counts",
    "merged_grid",
    "evs",
    "vidcom2",
    "baselines",
    "prompt",
]

register_method("evs", evs)
register_method("vidcom2", vidcom2)
register_method("random", baselines.RandomSelection(seed=0))
register_method("spatial_grid", baselines.SpatialGrid())
register_method("temporal", baselines.TemporalSubsample())
register_method("visionzip", visionzip.VisionZip())
register_method("divprune", divprune.DivPrune())
register_method("fastv", llm.FastV())
register_method("pyramiddrop", llm.PyramidDrop())
