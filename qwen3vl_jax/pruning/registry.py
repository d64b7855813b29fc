"""The pruning-method registry: names -> method objects, and the checks every method passes through.

A method is any object (a module, a class instance) with two callables (docs/pruning.md §8):

    retained_count(tokens_per_frame, num_frames, rate) -> int
        K (1 <= K <= N), the number of video tokens the processor sizes the prompt placeholder for,
        known before the encoder runs (so it may depend on the grid and the rate only).
    retention_mask(rows, grid_thw, spatial_merge_size, rate) -> bool [N]
        which of the video's N merged tokens survive; `rows` `[N, D_tot]` are its encoder rows
        `[merged | deepstack_0 | ...]` in flat frame-major order `t*R*C + r*C + c`. Exactly K trues.

and optional attributes that extend the protocol:

    media = ("image", "video")  what the method prunes: images (`image_pruning`, one frame: grid
                        `(1, H, W)`, T = 1), videos (`video_pruning`) or both; default ("video",).

    adaptive = True     content-adaptive: K is an upper bound (the placeholder budget) and the mask
                        may keep any number of tokens in [0, K], decided from the features. The model
                        then drops the unused placeholder slots and re-pads the batch.
    uses_text = True    text-guided: `retention_mask` is also called with `text=PromptText(ids,
                        embeds)`, the row's prompt text outside vision blocks and its input
                        embeddings (the language model's embedding table).

`register_method(name, method)` makes `video_pruning=(name, rate)` (and `image_pruning=(name, rate)`
for a method whose `media` holds "image") work in the processor, the model, `generate`, the
bucketed encoder path and the ablation; EVS and VidCom2 are registered the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._common import merged_grid

__all__ = [
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
    "media",
    "method_kind",
    "retained_count",
    "retention_mask",
]

DEFAULT_METHOD = "evs"  # vLLM's default `--video-pruning-method`


@runtime_checkable
class PruningMethod(Protocol):
    """The registry protocol (optional attributes: `adaptive`, `uses_text`; see the module doc)."""

    def retained_count(self, tokens_per_frame: int, num_frames: int, rate: float) -> int: ...

    def retention_mask(self, rows, grid_thw, spatial_merge_size: int, rate: float): ...


@dataclasses.dataclass(frozen=True)
class PromptText:
    """What a text-guided method sees of the prompt row that holds the video.

    ids: `[S]` int token ids of the row's text outside vision blocks (the chat template, the question;
      not timestamps, vision markers or padding), in prompt order.
    embeds: `[S, E]` their input embeddings (the language model's table; E = the merged feature width).
    """

    ids: np.ndarray
    embeds: Any


# The live registry (name -> method object); a Mapping view for readers, `register_method` to write.
_REGISTRY: dict[str, Any] = {}
PRUNING_METHODS: Mapping[str, Any] = _REGISTRY


def register_method(name: str, method, *, replace: bool = False):
    """Register `method` under `name` (see the module doc for the protocol); returns `method`.

    Re-registering a name raises unless `replace=True` (re-running a notebook cell wants that).
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a pruning method name must be a non-empty string without surrounding spaces, "
                         f"got {name!r}")
    if getattr(method, "kind", None) == "llm":
        missing = [attr for attr in ("stages", "score") if not callable(getattr(method, attr, None))]
        if missing:
            raise ValueError(f"in-LLM pruning method {name!r} ({type(method).__name__}) lacks callable {missing}; "
                             "the protocol is stages(options) -> (Stage, ...) and score(weights [B, H, S]) -> [B, S]")
    else:
        missing = [attr for attr in ("retained_count", "retention_mask")
                   if not callable(getattr(method, attr, None))]
        if missing:
            raise ValueError(f"pruning method {name!r} ({type(method).__name__}) lacks callable {missing}; the "
                             "protocol is retained_count(tokens_per_frame, num_frames, rate) and "
                             "retention_mask(rows, grid_thw, spatial_merge_size, rate)")
        kinds = getattr(method, "media", ("video",))
        if (isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset)) or not kinds
                or not set(kinds) <= {"image", "video"}):
            raise ValueError(f"pruning method {name!r}: media must be a non-empty collection of 'image' and "
                             f"'video', got {kinds!r}")
    if name in _REGISTRY and _REGISTRY[name] is not method and not replace:
        raise ValueError(f"pruning method {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove a registered method (ValueError naming the registered ones if unknown)."""
    get_method(name)
    del _REGISTRY[name]


def registered_methods() -> list[str]:
    """The registered method names, sorted."""
    return sorted(_REGISTRY)


def get_method(method: str):
    """The method object registered under `method`; ValueError listing the registered names otherwise."""
    if not isinstance(method, str) or method not in _REGISTRY:
        raise ValueError(f"unknown pruning method {method!r}; registered methods: {registered_methods()}")
    return _REGISTRY[method]


def media(method: str) -> frozenset[str]:
    """What an encoder-side method prunes: a subset of {"image", "video"} (its `media`, default video)."""
    return frozenset(getattr(get_method(method), "media", ("video",)))


def method_kind(method: str) -> str:
    """"llm" for a method that runs at decoder layers (`pruning.llm`), "encoder" for one that selects
    from the encoder output."""
    return "llm" if getattr(get_method(method), "kind", None) == "llm" else "encoder"


def _llm_methods() -> list[str]:
    return [m for m in registered_methods() if method_kind(m) == "llm"]


def validate_llm_pruning(spec):
    """`(method, stages)` for an in-LLM pruning option `(name, options)` (e.g. `("fastv", {"layer": 2,
    "rate": 0.5})`), None for None. Every stage is kept, rate 0 included (it runs the machinery and
    keeps every token). ValueError naming the method and the problem otherwise; whether the model
    has the layers is checked where the model is known."""
    if spec is None:
        return None
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise ValueError(f"llm_pruning must be None or a (method, options) pair such as ('fastv', {{'layer': 2, "
                         f"'rate': 0.5}}), got {spec!r}")
    name, options = spec
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown in-LLM pruning method {name!r}; in-LLM methods: {_llm_methods()}")
    if method_kind(name) != "llm":
        raise ValueError(f"pruning method {name!r} selects tokens from the encoder output, not inside the language "
                         f"model: pass it as video_pruning / image_pruning=({name!r}, rate); in-LLM methods: "
                         f"{_llm_methods()}")
    stages = tuple(get_method(name).stages(options))
    if not stages or any(b.layer <= a.layer for a, b in zip(stages, stages[1:])):
        raise ValueError(f"in-LLM pruning method {name!r} returned stages {stages}; they must be non-empty with "
                         "strictly increasing layers")
    return name, stages


def is_adaptive(method: str) -> bool:
    """True when `method` decides its token count from the features (K is then an upper bound)."""
    return bool(getattr(get_method(method), "adaptive", False))


def uses_text(method: str) -> bool:
    """True when `method` scores with the prompt's text (its mask takes `text=PromptText`)."""
    return bool(getattr(get_method(method), "uses_text", False))


def _check_rate(rate, kind: str = "video") -> float:
    if isinstance(rate, (bool, str, bytes)) or not hasattr(rate, "__float__"):
        raise ValueError(f"{kind} pruning rate must be a number in [0, 1), got {rate!r}")
    rate = float(rate)
    if math.isnan(rate) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{kind} pruning rate must be in [0, 1) (0 = off), got {rate}")
    return rate


def _check_media(method: str, kind: str) -> None:
    if method_kind(method) == "llm":
        raise ValueError(f"pruning method {method!r} runs inside the language model, not on the encoder output: "
                         f"pass it as llm_pruning=({method!r}, {{...}}) (docs/pruning.md §11)")
    handles = media(method)
    if kind not in handles:
        able = [m for m in registered_methods() if method_kind(m) == "encoder" and kind in media(m)]
        raise ValueError(f"pruning method {method!r} prunes {' and '.join(sorted(handles))}s only, not {kind}s; "
                         f"{kind} methods: {able}")


def validate_image_pruning(spec):
    """`(method, float(rate))` when image pruning is on, None when off (None, or rate None or 0).

    `spec` is None or a `(method, rate)` pair naming a registered method whose `media` holds
    "image". ValueError naming the method and the problem otherwise (checked even when off)."""
    if spec is None:
        return None
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise ValueError(f"image_pruning must be None or a (method, rate) pair such as ('divprune', 0.5), "
                         f"got {spec!r}")
    method, rate = spec
    _check_media(method, "image")
    if rate is None:
        return None
    rate = _check_rate(rate, "image")
    return None if rate == 0.0 else (method, rate)


def validate_video_pruning(*spec):
    """`(method, float(rate))` when pruning is on, `None` when off (rate None or 0, like vLLM's spec).

    Called either with the whole option, `validate_video_pruning(video_pruning)` (None, or a
    `(method, rate)` pair), or unpacked, `validate_video_pruning(method, rate)` (method None = "evs").
    Raises ValueError for anything else (a bare name, a dict, a 1-tuple), an unknown method (even
    when off, so typos surface early) or a rate outside [0, 1) (NaN, bools and strings included).
    """
    if len(spec) == 1:
        if spec[0] is None:
            return None
        pair = spec[0]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"video_pruning must be None or a (method, rate) pair such as ('evs', 0.5), "
                             f"got {pair!r}")
        spec = tuple(pair)
    if len(spec) != 2:
        raise ValueError(f"video_pruning must be a (method, rate) pair such as ('evs', 0.5), got {len(spec)} "
                         f"items {spec!r}")
    method, rate = spec
    if method is None:
        method = DEFAULT_METHOD
    _check_media(method, "video")
    if rate is None:
        return None
    rate = _check_rate(rate)
    if rate == 0.0:
        return None
    return method, rate


def retained_count(method: str, tokens_per_frame: int, num_frames: int, rate: float) -> int:
    """K of `method` for a video of `num_frames` frames of `tokens_per_frame` merged tokens (the
    placeholder size; an upper bound for adaptive methods)."""
    k = get_method(method).retained_count(int(tokens_per_frame), int(num_frames), float(rate))
    total = int(tokens_per_frame) * int(num_frames)
    low = min(1, total)  # the prompt finds a video by its placeholder tokens, so a video keeps at least one
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not low <= int(k) <= total:
        raise ValueError(f"pruning method {method!r}: retained_count({tokens_per_frame}, {num_frames}, {rate}) "
                         f"returned {k!r}; it must be an int in [{low}, {total}]")
    return int(k)


def retention_mask(method: str, rows, grid_thw, spatial_merge_size: int, rate: float, *,
                   text: PromptText | None = None) -> np.ndarray:
    """Bool `[N]` keep mask of one video under `method`, checked against the protocol.

    `text` is passed on to text-guided methods (ValueError if such a method gets none). The mask
    must be N booleans with exactly `retained_count` trues (at most that many for adaptive methods).
    """
    impl = get_method(method)
    t, r, c = merged_grid(grid_thw, spatial_merge_size)
    n = t * r * c
    k = retained_count(method, r * c, t, rate)
    kwargs = {}
    if uses_text(method):
        if text is None:
            raise ValueError(f"pruning method {method!r} is text-guided (uses_text) and needs the prompt's "
                             "text; call it with the prompt (model(...) / prepare_inputs)")
        kwargs["text"] = text
    mask = np.asarray(impl.retention_mask(rows, grid_thw, spatial_merge_size, rate, **kwargs))
    grid = [int(x) for x in np.asarray(grid_thw).reshape(-1)]
    if mask.shape != (n,) or mask.dtype != bool:
        raise ValueError(f"pruning method {method!r} returned a {mask.dtype} mask of shape {mask.shape} for "
                         f"grid_thw {grid}; it must be bool [{n}]")
    kept = int(mask.sum())
    if is_adaptive(method) and kept > k or not is_adaptive(method) and kept != k:
        rule = "an adaptive method keeps at most" if is_adaptive(method) else "a method keeps exactly"
        raise ValueError(f"pruning method {method!r} kept {kept} tokens of a video with grid_thw {grid} at rate "
                         f"{rate}, but its retained_count said {k} ({rule} that many)")
    return mask
