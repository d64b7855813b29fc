"""Architecture configuration: frozen dataclasses mirroring HF's `Qwen3VLConfig`.

`Qwen3VLConfig.from_hf_config` accepts a transformers config object, a plain dict, or a path to a
`config.json` (or the directory holding one), in either rope form HF has used:

- legacy: `text_config.rope_theta` + `text_config.rope_scaling = {rope_type, mrope_section, ...}`
- v5:     `text_config.rope_parameters = {rope_type, rope_theta, mrope_section, ...}`

Attributes the port does not model raise unless they hold a value with no effect on the forward
pass (bookkeeping such as `architectures` or `transformers_version`), so a checkpoint that relies on
a feature we do not implement is refused instead of silently computed wrong.

Runtime knobs (dtype, attention implementation, buckets, pruning) are not architecture and live
elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["VisionConfig", "TextConfig", "Qwen3VLConfig", "FP8Config", "PRESETS", "preset", "MODEL_TYPES"]

# The dense models and the Mixture-of-Experts ones (30B-A3B, 235B-A22B).
MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
             "mlp_only_layers", "router_aux_loss_coef", "norm_topk_prob", "output_router_logits")

# Keys HF writes on every config that do not change the computation. Any value is accepted.
_BOOKKEEPING_KEYS = frozenset(
    {
        "architectures",
        "transformers_version",
        "model_type",
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "initializer_range",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "_attn_implementation_autoset",
        "use_sliding_window",
    }
)


class ConfigError(ValueError):
    """A config that this port cannot represent faithfully."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The ViT tower (`Qwen3VLVisionConfig`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...]
    num_position_embeddings: int = 2304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "num_position_embeddings", "in_channels", "patch_size", "temporal_patch_size",
                     "spatial_merge_size"):
            _check(getattr(self, name) > 0, f"vision_config.{name} must be positive, got {getattr(self, name)}")
        _check(self.hidden_size % self.num_heads == 0,
               f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        _check(self.head_dim % 4 == 0,
               f"vision head_dim {self.head_dim} must be divisible by 4 (axial 2D rotary: rows and columns "
               "each take head_dim/4 frequencies)")
        side = math.isqrt(self.num_position_embeddings)
        _check(side * side == self.num_position_embeddings,
               f"vision num_position_embeddings {self.num_position_embeddings} is not a perfect square")
        _check(len(set(self.deepstack_visual_indexes)) == len(self.deepstack_visual_indexes),
               f"deepstack_visual_indexes {self.deepstack_visual_indexes} has repeats")
        _check(all(0 <= i < self.depth for i in self.deepstack_visual_indexes),
               f"deepstack_visual_indexes {self.deepstack_visual_indexes} must lie in [0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of `pixel_values`: C * T * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The Qwen3 decoder (`Qwen3VLTextConfig`) with interleaved multimodal rotary."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    # Mixture of experts (`qwen3_vl_moe`; 0 experts: the dense model). A layer is sparse unless it
    # is in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0` (HF's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers or ()))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            _check(getattr(self, name) > 0, f"text_config.{name} must be positive, got {getattr(self, name)}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"num_attention_heads {self.num_attention_heads} is not a multiple of "
               f"num_key_value_heads {self.num_key_value_heads}")
        _check(self.head_dim % 2 == 0, f"text head_dim {self.head_dim} must be even")
        _check(len(self.mrope_section) == 3, f"mrope_section must have 3 entries (t, h, w), got {self.mrope_section}")
        _check(sum(self.mrope_section) == self.head_dim // 2,
               f"sum(mrope_section) = {sum(self.mrope_section)} must equal head_dim // 2 = {self.head_dim // 2}")
        # Interleaved layout: H takes channels 1, 4, 7, ... and W takes 2, 5, 8, ...; both must fit.
        half = self.head_dim // 2
        for axis, offset in ((1, 1), (2, 2)):
            taken = len(range(offset, min(3 * self.mrope_section[axis], half), 3))
            _check(taken == self.mrope_section[axis],
                   f"mrope_section {self.mrope_section} does not fit the interleaved layout of {half} "
                   f"frequency channels (axis {'thw'[axis]} gets {taken} channels)")
        _check(self.num_experts >= 0, f"text_config.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _check(0 < self.num_experts_per_tok <= self.num_experts,
                   f"text_config.num_experts_per_tok {self.num_experts_per_tok} must lie in "
                   f"[1, num_experts={self.num_experts}]")
            _check(self.moe_intermediate_size > 0,
                   f"text_config.moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            _check(self.decoder_sparse_step > 0,
                   f"text_config.decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
            _check(all(0 <= i < self.num_hidden_layers for i in self.mlp_only_layers),
                   f"text_config.mlp_only_layers {list(self.mlp_only_layers)} must lie in "
                   f"[0, num_hidden_layers={self.num_hidden_layers})")
            _check(self.router_aux_loss_coef >= 0,
                   f"text_config.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds routed experts (else the dense SwiGLU MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    @property
    def uniform_layers(self) -> bool:
        """All decoder layers have the same MLP kind (so their parameters can be stacked)."""
        return len(self.sparse_layers) in (0, self.num_hidden_layers)


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """HF's fine-grained FP8 `quantization_config` (the Qwen3-VL FP8 releases): `quant_method: "fp8"`,
    `fmt: "e4m3"`, `activation_scheme: "dynamic"`, `weight_block_size [out, in]`. Which tensors are
    FP8 is told by the checkpoint (a weight with a sibling `weight_scale_inv`), not by
    `modules_to_not_convert`. `raw` is the JSON as read, written back unchanged."""

    weight_block_size: tuple[int, int]
    raw: str

    KNOWN = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
                       "dequantize", "scale_fmt"})

    @classmethod
    def parse(cls, raw: Any, problems: list[str]) -> "FP8Config | None":
        where = "quantization_config"
        if not isinstance(raw, Mapping):
            problems.append(f"{where} must be a JSON object, got {raw!r}")
            return None
        raw = dict(raw)
        method = raw.get("quant_method")
        if method != "fp8":
            problems.append(f"{where}.quant_method = {method!r} is not supported (only 'fp8': HF's fine-grained "
                            "FP8; or load a full-precision checkpoint with quantize='int8' | 'int4' | 'fp8')")
            return None
        if raw.get("fmt", "e4m3") != "e4m3":
            problems.append(f"{where}.fmt = {raw['fmt']!r} is not supported (only 'e4m3')")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            problems.append(f"{where}.activation_scheme = {raw['activation_scheme']!r} is not supported (only "
                            "'dynamic': weight-only FP8, activations in the compute dtype)")
        if raw.get("scale_fmt") not in (None, "float"):
            problems.append(f"{where}.scale_fmt = {raw['scale_fmt']!r} is not supported (float scales only)")
        block = raw.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            problems.append(f"{where}.weight_block_size = {block!r} must be two positive ints [out, in] (per-tensor "
                            "FP8 is not supported)")
            block = None
        modules = raw.get("modules_to_not_convert")
        if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            problems.append(f"{where}.modules_to_not_convert = {modules!r} must be a list of module names")
        for key in sorted(set(raw) - cls.KNOWN):
            problems.append(f"{where}.{key} = {raw[key]!r} is not supported")
        if block is None:
            return None
        return cls(weight_block_size=(int(block[0]), int(block[1])), raw=json.dumps(raw, sort_keys=True))

    def to_hf_dict(self) -> dict[str, Any]:
        return json.loads(self.raw)


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig:
    """The whole model: vision tower, language model and the special token ids that join them.

    `quantization`: the checkpoint's FP8 `quantization_config` (`FP8Config`), or None."""

    vision: VisionConfig
    text: TextConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    quantization: FP8Config | None = None

    def __post_init__(self):
        _check(self.vision.out_hidden_size == self.text.hidden_size,
               f"vision out_hidden_size {self.vision.out_hidden_size} must equal text hidden_size "
               f"{self.text.hidden_size} (merged features are spliced into the text embeddings)")
        _check(len(self.vision.deepstack_visual_indexes) <= self.text.num_hidden_layers,
               f"{len(self.vision.deepstack_visual_indexes)} deepstack levels but only "
               f"{self.text.num_hidden_layers} decoder layers to inject them after")
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]
        _check(all(0 <= i < self.text.vocab_size for i in ids),
               f"special token ids {ids} must lie inside the vocabulary (size {self.text.vocab_size})")

    # ------------------------------------------------------------------ HF interop

    @classmethod
    def from_hf_config(cls, source: Any) -> "Qwen3VLConfig":
        """Build from a transformers `Qwen3VLConfig`, a dict, or a `config.json` file / directory."""
        raw = _as_dict(source)
        top = dict(raw)
        model_type = top.pop("model_type", "qwen3_vl")
        _check(model_type in MODEL_TYPES,
               f"model_type {model_type!r} is not one of {MODEL_TYPES} (the dense and the MoE Qwen3-VL)")
        vision_raw = dict(top.pop("vision_config", None) or {})
        text_raw = dict(top.pop("text_config", None) or {})
        problems: list[str] = []
        if model_type == "qwen3_vl":  # the dense config class has no expert fields
            for key in _MOE_KEYS:
                if key in text_raw:
                    problems.append(f"text_config.{key} = {text_raw.pop(key)!r} belongs to a 'qwen3_vl_moe' "
                                    "config, but model_type is 'qwen3_vl'")
        # Always true in the released MoE configs; HF renormalises the top-k weights unconditionally.
        _require("text_config", text_raw, "norm_topk_prob", (True,), problems)
        text_raw.pop("output_router_logits", None)  # a training switch (`Trainer(router_aux_loss=...)`)
        if "num_local_experts" in text_raw:  # HF's attribute name, which its `to_dict` writes
            alias = text_raw.pop("num_local_experts")
            if text_raw.setdefault("num_experts", alias) != alias:
                problems.append(f"text_config.num_local_experts = {alias!r} disagrees with num_experts = "
                                f"{text_raw['num_experts']!r}")

        vision = _take_vision(vision_raw, problems)
        # Older exports keep tie_word_embeddings inside text_config; either place is honoured.
        text_tie = text_raw.pop("tie_word_embeddings", None)
        if model_type == "qwen3_vl_moe":
            text_tie = None  # HF's MoE text config defaults it to true; its model reads the top level only
        text = _take_text(text_raw, problems)
        tie = top.pop("tie_word_embeddings", None)
        for key, value in (("tie_word_embeddings", tie), ("text_config.tie_word_embeddings", text_tie)):
            if value is not None and (problem := _type_problem(key, value, "bool")):
                problems.append(problem)
        if tie is None:
            tie = text_tie if text_tie is not None else False
        elif text_tie is not None and text_tie != tie:
            problems.append(f"tie_word_embeddings is {tie} at the top level but {text_tie} in text_config")
        tokens = _take(top, cls, problems, "")
        for key in ("vision", "text", "tie_word_embeddings", "quantization"):
            tokens.pop(key, None)
        top.pop("vision_token_id", None)  # an alias some exports carry; never read by the model
        quantization = None
        if "quantization_config" in top:
            quantization = FP8Config.parse(top.pop("quantization_config"), problems)
        _reject_unknown("config", top, problems)
        if problems:
            origin = f" ({_config_path(source)})" if isinstance(source, (str, os.PathLike)) else ""
            raise ConfigError(f"cannot represent this Qwen3-VL config{origin}:\n  - " + "\n  - ".join(problems))
        return cls(vision=vision, text=text, tie_word_embeddings=tie, quantization=quantization, **tokens)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content (v5 `rope_parameters` form)."""
        v, t = self.vision, self.text
        moe = "Moe" if t.is_moe else ""
        suffix = "_moe" if t.is_moe else ""
        experts = {} if not t.is_moe else {
            "num_experts": t.num_experts,
            "num_experts_per_tok": t.num_experts_per_tok,
            "moe_intermediate_size": t.moe_intermediate_size,
            "decoder_sparse_step": t.decoder_sparse_step,
            "mlp_only_layers": list(t.mlp_only_layers),
            "router_aux_loss_coef": t.router_aux_loss_coef,
        }
        return {
            "architectures": [f"Qwen3VL{moe}ForConditionalGeneration"],
            "model_type": f"qwen3_vl{suffix}",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "vision_config": {
                "model_type": f"qwen3_vl{suffix}_vision",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "hidden_act": "gelu_pytorch_tanh",
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_channels": v.in_channels,
                "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "temporal_patch_size": v.temporal_patch_size,
                "out_hidden_size": v.out_hidden_size,
                "num_position_embeddings": v.num_position_embeddings,
                "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
                "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
            },
            "text_config": {
                "model_type": f"qwen3_vl{suffix}_text",
                "vocab_size": t.vocab_size,
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "head_dim": t.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": t.max_position_embeddings,
                "rms_norm_eps": t.rms_norm_eps,
                "attention_bias": t.attention_bias,
                "attention_dropout": 0.0,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": t.rope_theta,
                    "mrope_section": list(t.mrope_section),
                    "mrope_interleaved": True,
                },
                **experts,
            },
            **({} if self.quantization is None else {"quantization_config": self.quantization.to_hf_dict()}),
        }

    def to_hf_config(self):
        """A transformers `Qwen3VLConfig` (needs no torch)."""
        import transformers

        name = "Qwen3VLMoeConfig" if self.text.is_moe else "Qwen3VLConfig"
        return getattr(transformers, name)(**self.to_hf_dict())

    def replace(self, **changes) -> "Qwen3VLConfig":
        """A copy with top-level fields, or `vision={...}` / `text={...}` field dicts, changed."""
        vision = changes.pop("vision", None)
        text = changes.pop("text", None)
        if isinstance(vision, Mapping):
            vision = dataclasses.replace(self.vision, **vision)
        if isinstance(text, Mapping):
            text = dataclasses.replace(self.text, **text)
        return dataclasses.replace(self, vision=vision or self.vision, text=text or self.text, **changes)


# ---------------------------------------------------------------------- parsing helpers


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's content; unreadable or malformed JSON is a `ConfigError` naming the file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def _config_path(source: str | os.PathLike) -> str:
    path = os.fspath(source)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _as_dict(source: Any) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source)))  # deep copy, tuples -> lists
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        path = _config_path(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        return read_json(path)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    raise TypeError(f"from_hf_config takes a transformers config, a dict or a path, not {type(source).__name__}")


def _reject_unknown(where: str, rest: dict[str, Any], problems: list[str]) -> None:
    for key, value in sorted(rest.items()):
        if key in _BOOKKEEPING_KEYS:
            continue
        problems.append(f"{where}.{key} = {value!r} is not supported by this port")


def _require(where: str, raw: dict[str, Any], key: str, allowed: tuple, problems: list[str]) -> None:
    if key in raw:
        value = raw.pop(key)
        if value not in allowed:
            problems.append(f"{where}.{key} = {value!r}; only {allowed} is supported")


_BAD = object()  # a field whose value was refused (the problem is already reported)


def _type_problem(where: str, value: Any, kind: str) -> str | None:
    """Why `value` is not of the JSON type a field of annotation `kind` needs, or None.

    As HF's strict config classes do: an int field takes only an int (not "64", 64.0 or true), a
    float field an int or float (not "1e-6"), a bool field only true / false (not "false", which
    Python would read as true), a tuple field a list of ints.
    """
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if kind == "int":
        ok = is_int(value)
    elif kind == "float":
        ok = is_int(value) or isinstance(value, float)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind.startswith("tuple[int"):
        ok = isinstance(value, (list, tuple)) and all(is_int(v) for v in value)
    else:
        return None
    if ok:
        return None
    return f"{where} = {value!r} ({type(value).__name__}) must be {'a list of int' if kind.startswith('tuple') else kind}"


def _take(raw: dict[str, Any], cls, problems: list[str], where: str,
          renames: Mapping[str, str] = {}) -> dict[str, Any]:
    """Pop the fields of `cls` from `raw`; a value of the wrong type is a problem, not a field."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    out = {}
    for key in list(raw):
        name = renames.get(key, key)
        if name in fields:
            value = raw.pop(key)
            problem = None if value is None else _type_problem(f"{where}.{key}" if where else key, value, fields[name])
            if problem:
                problems.append(problem)
            out[name] = _BAD if problem else value  # present (not "missing"), but never built
    return out


def _take_vision(raw: dict[str, Any], problems: list[str]) -> VisionConfig:
    where = "vision_config"
    _require(where, raw, "hidden_act", ("gelu_pytorch_tanh",), problems)
    rope = raw.pop("rope_parameters", None) or raw.pop("rope_scaling", None) or {}
    rope = dict(rope)
    _require(where + ".rope_parameters", rope, "rope_type", ("axial",), problems)
    theta = rope.pop("rope_theta", raw.pop("rope_theta", 10000.0))
    _reject_unknown(where + ".rope_parameters", rope, problems)
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(raw.get(key), (list, tuple)):
            values = set(raw[key])
            if len(values) != 1:
                problems.append(f"{where}.{key} = {raw[key]}: only square patches are supported")
            raw[key] = values.pop()
    kwargs = _take(raw, VisionConfig, problems, where, {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"})
    if problem := _type_problem(where + ".rope_theta", theta, "float"):
        problems.append(problem)
    else:
        kwargs["rope_theta"] = float(theta)
    _reject_unknown(where, raw, problems)
    missing = [f.name for f in dataclasses.fields(VisionConfig)
               if f.default is dataclasses.MISSING and f.name not in kwargs]
    if missing or problems:
        if missing:
            problems.append(f"{where} lacks {missing}")
        return None  # type: ignore[return-value]
    try:
        return VisionConfig(**kwargs)
    except ConfigError as e:
        problems.append(str(e))
        return None  # type: ignore[return-value]


def _take_text(raw: dict[str, Any], problems: list[str]) -> TextConfig:
    where = "text_config"
    _require(where, raw, "hidden_act", ("silu",), problems)
    _require(where, raw, "attention_dropout", (0, 0.0), problems)
    _require(where, raw, "sliding_window", (None,), problems)
    # Legacy form keeps theta beside rope_scaling; v5 folds both into rope_parameters.
    rope = dict(raw.pop("rope_parameters", None) or {})
    legacy = raw.pop("rope_scaling", None)
    if legacy:
        for key, value in legacy.items():
            if key in rope and rope[key] != value:
                problems.append(f"{where}: rope_scaling.{key}={value!r} disagrees with rope_parameters")
            rope[key] = value
    if "rope_theta" in raw:
        theta = raw.pop("rope_theta")
        if "rope_theta" in rope and rope["rope_theta"] != theta:
            problems.append(f"{where}: rope_theta={theta} disagrees with rope_parameters")
        rope.setdefault("rope_theta", theta)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type != "default":
        problems.append(f"{where}: rope_type {rope_type!r} is not supported (only 'default' mRoPE)")
    if not rope.pop("mrope_interleaved", True):
        problems.append(f"{where}: mrope_interleaved=False (Qwen2.5-VL layout) is not Qwen3-VL")
    kwargs = _take(raw, TextConfig, problems, where)
    kwargs.update(_take(rope, TextConfig, problems, where + ".rope_parameters"))
    if kwargs.get("rope_theta", _BAD) is not _BAD:
        kwargs["rope_theta"] = float(kwargs["rope_theta"])
    _reject_unknown(where + ".rope_parameters", rope, problems)
    if kwargs.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if kwargs.get("head_dim") is None and "hidden_size" in kwargs and "num_attention_heads" in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    _reject_unknown(where, raw, problems)
    missing = [f.name for f in dataclasses.fields(TextConfig)
               if f.default is dataclasses.MISSING and f.name not in kwargs]
    if missing or problems:
        if missing:
            problems.append(f"{where} lacks {missing}")
        return None  # type: ignore[return-value]
    try:
        return TextConfig(**kwargs)
    except ConfigError as e:
        problems.append(str(e))
        return None  # type: ignore[return-value]


# ---------------------------------------------------------------------- presets

_VISION_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                     deepstack_visual_indexes=(5, 11, 17))
_VISION_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                     deepstack_visual_indexes=(8, 16, 24))


def _preset(vision: dict, hidden: int, intermediate: int, layers: int, heads: int, tie: bool, kv_heads: int = 8,
            **experts) -> Qwen3VLConfig:
    return Qwen3VLConfig(
        vision=VisionConfig(out_hidden_size=hidden, **vision),
        text=TextConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=128, **experts),
        tie_word_embeddings=tie,
    )


def _moe(width: int) -> dict:
    """The released MoE members: 128 routed experts, 8 per token, every layer sparse."""
    return dict(kv_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=width)


# The released Qwen3-VL dense checkpoints (Instruct and Thinking share dimensions).
PRESETS: dict[str, Qwen3VLConfig] = {
    "2b": _preset(_VISION_SMALL, hidden=2048, intermediate=6144, layers=28, heads=16, tie=True),
    "4b": _preset(_VISION_SMALL, hidden=2560, intermediate=9728, layers=36, heads=32, tie=True),
    "8b": _preset(_VISION_LARGE, hidden=4096, intermediate=12288, layers=36, heads=32, tie=False),
    "32b": _preset(_VISION_LARGE, hidden=5120, intermediate=25600, layers=64, heads=64, tie=False),
    # The Mixture-of-Experts releases (`qwen3_vl_moe`; `intermediate_size` is the dense MLP width HF
    # would give a layer listed in `mlp_only_layers`, none in the released configs).
    "30b-a3b": _preset(_VISION_LARGE, hidden=2048, intermediate=6144, layers=48, heads=32, tie=False, **_moe(768)),
    "235b-a22b": _preset(_VISION_LARGE, hidden=4096, intermediate=12288, layers=94, heads=64, tie=False,
                         **_moe(1536)),
}


def preset(name: str) -> Qwen3VLConfig:
    """One of `PRESETS` by name ("2b", "4b", "8b", "32b", "30b-a3b", "235b-a22b")."""
    key = name.lower().removeprefix("qwen3-vl-").removesuffix("-instruct")
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[key]
