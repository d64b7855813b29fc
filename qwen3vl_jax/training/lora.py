"""LoRA adapters on the model's linear layers, read and written in PEFT's format.

    model = Qwen3VL.from_pretrained(path)
    add_lora(model, LoRAConfig(rank=16, alpha=32))          # the language model's 7 projections
    trainer = Trainer(model, OptimConfig(...), trainable=LoRAWeight)
    save_adapter(model, "out/adapter")                      # PeftModel.from_pretrained loads it
    export_merged(model, "out/merged")                      # a plain HF checkpoint

Each targeted `nnx.Linear` becomes a `LoRALinear`: the same `kernel` / `bias` variables (so the
parameter names, the converter and Orbax are unchanged) plus `lora_a [in, r]` and `lora_b [r, out]`
as `LoRAWeight` variables (not `nnx.Param`, so `canonical_params` and `save_hf` never see them),
computing PEFT's `base(x) + lora_B(lora_A(dropout(x))) * alpha / r` (`alpha / sqrt(r)` with rsLoRA).
In a stacked layer stack the adapters carry the same leading layer axis as the kernel. PEFT stores
`lora_A.weight [r, in]` and `lora_B.weight [out, r]` (torch's layout), our transposes, under
`base_model.model.<HF module name>.lora_{A,B}.weight` with the HF module name from
`convert.ours_to_hf_name`.

Why not `qwix` (`qwix.LoraProvider` / `apply_lora_to_model`): qwix creates the adapters lazily by
intercepting `dot_general` during a sample forward. Our forward has a host half (`prepare_inputs`)
that such a traced call cannot run, and with `scan_layers` the blocks are re-merged from split
state inside `lax.scan` (`layers.run_stack`), where parameters created on the fly do not survive.
Naming the adapters after the PEFT / HF module paths is needed either way; a module of our own that
keeps the base variables in place is smaller than adapting qwix's interception to both.

Target modules follow PEFT's rule for a list of names: a module matches a target when its HF name
equals it or ends with `.` + target. Matching is over the HF names of our `nnx.Linear` layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checks import fraction, positive_int, positive_number
from ..convert import save_hf, save_orbax
from ..model import register_adapter_loader
from ..quant import QuantLinear
from ..params import (STACKS, CheckpointError, canonical_params, fill_state, hf_to_ours_name, nest_paths,
                      ours_to_hf_name)

__all__ = ["LoRAConfig", "LoRALinear", "QuantLoRALinear", "LoRAWeight", "LoRAKey", "LANGUAGE_TARGETS",
           "VISION_TARGETS",
           "add_lora", "lora_modules", "save_adapter", "load_adapter", "merged_params", "export_merged",
           "set_lora_training"]

LANGUAGE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's usual targets: every projection of the language model's attention and MLP."""

VISION_TARGETS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""The vision blocks' linear layers (the mergers' layers are `merger.linear_fc1`, not matched)."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAWeight(nnx.Variable):
    """A LoRA factor: trained, saved as an adapter; not an `nnx.Param` of the base model."""


class LoRAKey(nnx.Variable):
    """Raw uint32 key data for LoRA dropout; the trainer writes fresh keys every micro-step."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank, alpha (scale alpha / rank, or alpha / sqrt(rank) with `use_rslora`), dropout on the
    adapter's input while training, and PEFT-style target module names (HF module names)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LANGUAGE_TARGETS
    use_rslora: bool = False

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        positive_int("LoRA rank", self.rank)
        positive_number("LoRA alpha", self.alpha)
        fraction("LoRA dropout", self.dropout)
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class _LoRA:
    """The low-rank update shared by `LoRALinear` and `QuantLoRALinear` (a mixin: no variables of
    its own until `_add_factors`)."""

    def _share(self, base) -> None:
        for key, value in vars(base).items():  # share the base layer's variables and settings
            if not key.startswith("_"):
                setattr(self, key, value)

    def _add_factors(self, stack: tuple, fan_in: int, fan_out: int, dtype, rank: int, scale: float,
                     dropout: float, rngs: nnx.Rngs) -> None:
        # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
        bound = 1.0 / math.sqrt(fan_in)
        self.lora_a = LoRAWeight(
            jax.random.uniform(rngs.params(), (*stack, fan_in, rank), dtype, -bound, bound))
        self.lora_b = LoRAWeight(jnp.zeros((*stack, rank, fan_out), dtype))
        self.lora_scale = float(scale)
        self.lora_dropout = float(dropout)
        self.lora_training = False
        if dropout > 0:
            self.lora_key = LoRAKey(jnp.zeros((*stack, 2), jnp.uint32))

    def _with_update(self, inputs, y):
        x = inputs
        if self.lora_training and self.lora_dropout > 0:
            key = jax.random.wrap_key_data(self.lora_key[...])
            keep = jax.random.bernoulli(key, 1.0 - self.lora_dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
        a, b = self.lora_a[...], self.lora_b[...]
        dtype = self.dtype or y.dtype
        delta = (x.astype(dtype) @ a.astype(dtype)) @ b.astype(dtype)
        return y + (delta * self.lora_scale).astype(y.dtype)


class LoRALinear(_LoRA, nnx.Linear):
    """An `nnx.Linear` (same variables, same names) plus a low-rank update."""

    def __init__(self, base: nnx.Linear, rank: int, scale: float, dropout: float, *, rngs: nnx.Rngs):
        self._share(base)
        stack = base.kernel.shape[:-2]  # the layer axis of a stacked (scanned) tower
        fan_in, fan_out = base.kernel.shape[-2:]
        self._add_factors(stack, fan_in, fan_out, base.kernel.dtype, rank, scale, dropout, rngs)

    def __call__(self, inputs, out_sharding=None):
        return self._with_update(inputs, super().__call__(inputs, out_sharding))


class QuantLoRALinear(_LoRA, QuantLinear):
    """QLoRA: a `quant.QuantLinear` (its quantized kernel and scales frozen, same names) plus a
    low-rank update in float32 (the adapters train; the base is never differentiated)."""

    def __init__(self, base: QuantLinear, rank: int, scale: float, dropout: float, *, rngs: nnx.Rngs):
        self._share(base)
        stack = base.stored[0].shape[:-2]
        self._add_factors(stack, base.in_features, base.out_features, jnp.float32, rank, scale, dropout, rngs)

    def __call__(self, inputs):
        return self._with_update(inputs, super().__call__(inputs))


def _linear_modules(model) -> dict[str, tuple[object, str, nnx.Linear]]:
    """`{our module path: (parent, attribute, module)}` for every `nnx.Linear` (or quantized
    `quant.QuantLinear`) in the model."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.Linear, QuantLinear)) and path:
            parent = model
            for key in path[:-1]:
                parent = parent[key] if isinstance(key, int) else getattr(parent, key)
            out[".".join(str(k) for k in path)] = (parent, path[-1], node)
    return out


def _hf_module(path: str) -> str:
    """The HF module name of one of our linear layers (`language_model.layers.3.self_attn.q_proj` ->
    `model.language_model.layers.3.self_attn.q_proj`), through the converter's name table."""
    name, _ = ours_to_hf_name(path + ".kernel")
    return name.removesuffix(".weight")


def _matches(hf_name: str, target: str) -> bool:
    return hf_name == target or hf_name.endswith("." + target)


def lora_modules(model) -> dict[str, LoRALinear]:
    """`{our module path: LoRALinear or QuantLoRALinear}` of the adapters in `model`."""
    return {p: m for p, (_, _, m) in _linear_modules(model).items() if isinstance(m, _LoRA)}


def add_lora(model, config: LoRAConfig, *, seed: int = 0, modules: list[str] | None = None) -> list[str]:
    """Put LoRA adapters on the linear layers `config.target_modules` names (or exactly `modules`,
    our module paths). Returns our paths of the adapted modules. Raises ValueError when a target
    matches no module, or a module already has an adapter."""
    linears = _linear_modules(model)
    names = {path: _hf_module(_canonical_module(path, model)) for path in linears}
    if modules is None:
        chosen, unmatched = [], []
        for target in config.target_modules:
            hits = [p for p, hf in names.items() if _matches(hf, target)]
            if not hits:
                unmatched.append(target)
            chosen += hits
        if unmatched:
            examples = sorted({hf.rsplit(".", 1)[-1] for hf in names.values()})
            experts = ("; in this MoE model the sparse layers' experts are fused expert tensors, not linear "
                       "layers: target the attention projections (q_proj, k_proj, v_proj, o_proj)"
                       if model.config.text.is_moe else "")
            raise ValueError(f"LoRA target modules {unmatched} match no linear layer of the model; the "
                             f"layers' names end in {examples} (HF module names, e.g. "
                             f"{next(iter(names.values()))}){experts}")
        modules = sorted(set(chosen), key=list(linears).index)
    rngs = nnx.Rngs(params=seed)
    for path in modules:
        if path not in linears:
            raise ValueError(f"no linear layer {path!r} in the model")
        parent, attr, linear = linears[path]
        if isinstance(linear, _LoRA):
            raise ValueError(f"{path} already has a LoRA adapter")
        kind = QuantLoRALinear if isinstance(linear, QuantLinear) else LoRALinear
        wrapped = kind(linear, config.rank, config.scale, config.dropout, rngs=rngs)
        if isinstance(attr, int):
            parent[attr] = wrapped
        else:
            setattr(parent, attr, wrapped)
    model.lora_config = config
    return list(modules)


def _canonical_module(path: str, model) -> str:
    """A module path with a block index (`...layers.0....`) for a stacked stack, so the converter's
    name table applies (the HF name then has index 0; matching ignores it)."""
    for stack in STACKS:
        if path.startswith(stack + ".") and not path[len(stack) + 1].isdigit():
            return f"{stack}.0.{path[len(stack) + 1:]}"
    return path


def set_lora_training(model, training: bool) -> None:
    """Turn LoRA dropout on (inside `Trainer`) or off (evaluation, the default)."""
    for module in lora_modules(model).values():
        module.lora_training = training


# ---------------------------------------------------------------------- PEFT format


def _adapter_tensors(model) -> dict[str, np.ndarray]:
    """PEFT's `{base_model.model.<HF module>.lora_{A,B}.weight: torch-layout array}`, per block."""
    tensors = {}
    for path, leaf in canonical_params(nnx.state(model, LoRAWeight)).items():
        module, factor = path.rsplit(".", 1)
        key = f"base_model.model.{_hf_module(module)}.lora_{'A' if factor == 'lora_a' else 'B'}.weight"
        tensors[key] = np.ascontiguousarray(np.asarray(leaf, np.float32).T)
    return tensors


def save_adapter(model, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> str:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's format) to `directory`,
    through a temporary directory renamed into place."""
    from safetensors.numpy import save_file

    config: LoRAConfig | None = getattr(model, "lora_config", None)
    modules = lora_modules(model)
    if config is None or not modules:
        raise ValueError("the model has no LoRA adapters (add_lora / load_adapter first)")
    tensors = _adapter_tensors(model)
    hf_modules = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in tensors})
    peft_config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        # The exact module names: PEFT matches a list entry by equality, so nothing else is adapted.
        "target_modules": hf_modules,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    directory = os.fspath(directory)
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config, f, indent=2)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_adapter(model, directory: str | os.PathLike) -> list[str]:
    """Add the PEFT LoRA adapter in `directory` (ours or one trained with HF PEFT) to `model`.

    Raises ValueError for what this module does not express (DoRA, per-module ranks, bias
    training, modules_to_save) and for tensors that name no linear layer of the model.
    """
    from safetensors.numpy import load_file

    directory = os.fspath(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(directory, name)):
            raise CheckpointError(f"{directory}: not a PEFT adapter directory ({name} is missing)")
    try:
        with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
            peft = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{directory}/{ADAPTER_CONFIG}: not readable JSON: {e}") from None
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory}: not a LoRA adapter (peft_type {peft.get('peft_type')!r})")
    for key, off in (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"),
                     ("modules_to_save", None), ("fan_in_fan_out", False)):
        if peft.get(key, off) not in (off, None, [], {}):
            raise ValueError(f"{directory}: adapter_config {key}={peft[key]!r} is not supported")
    tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    per_block: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if not key.startswith("base_model.model.") or not key.endswith(("lora_A.weight", "lora_B.weight")):
            raise ValueError(f"{directory}: unexpected adapter tensor {key}")
        module, factor = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        found = hf_to_ours_name(module + ".weight")
        if found is None or not found[0].endswith(".kernel"):
            raise ValueError(f"{directory}: adapter tensor {key} names no linear layer of the model")
        ours = found[0].removesuffix(".kernel")
        per_block[f"{ours}.{'lora_a' if factor == 'lora_A' else 'lora_b'}"] = value.T
    linears = _linear_modules(model)
    blocks = sorted({k.rsplit(".", 1)[0] for k in per_block})
    # per-block names -> our module paths (one per stack when stacked)
    paths = {block: block if block in linears else _stacked_name(block) for block in blocks}
    features = {block: (linears[path][2].in_features, linears[path][2].out_features)
                for block, path in paths.items() if path in linears}
    rank = _check_adapter(directory, peft, per_block, features)
    config = LoRAConfig(rank=rank, alpha=float(peft.get("lora_alpha", rank)),
                        dropout=float(peft.get("lora_dropout", 0.0)),
                        target_modules=tuple(sorted({k.rsplit(".", 1)[0] for k in per_block})),
                        use_rslora=bool(peft.get("use_rslora", False)))
    modules = []
    for block in blocks:
        path = paths[block]
        if path not in linears:
            raise ValueError(f"{directory}: no linear layer {block} in the model")
        if path not in modules:
            modules.append(path)
    add_lora(model, config, modules=modules)
    state = nnx.state(model, LoRAWeight)
    nnx.update(model, fill_state(state, per_block))
    return modules


def _check_adapter(directory: str, peft: dict, per_block: dict[str, np.ndarray],
                   features: dict[str, tuple[int, int]]) -> int:
    """The adapter checked whole before any weight is touched: its rank against the config, each
    A against its B, their shapes against the base model's layers (`features`: each layer's (in,
    out), whatever its stored layout, quantized or not), every listed target present. Every problem
    is listed in one `CheckpointError`; returns the rank."""
    problems = []
    rank = peft.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{directory}/{ADAPTER_CONFIG}: r must be a positive integer, got {rank!r}")
    for block in sorted({k.rsplit(".", 1)[0] for k in per_block}):
        a, b = per_block.get(f"{block}.lora_a"), per_block.get(f"{block}.lora_b")
        if a is None or b is None:
            problems.append(f"{block}: lora_{'A' if a is None else 'B'} is missing")
            continue
        if a.ndim != 2 or b.ndim != 2:
            problems.append(f"{block}: factors must be matrices, got lora_A {a.T.shape} and lora_B {b.T.shape}")
            continue
        if a.shape[1] != rank or b.shape[0] != rank:
            problems.append(f"{block}: lora_A has rank {a.shape[1]} and lora_B rank {b.shape[0]}, "
                            f"adapter_config r is {rank}")
        layer = features.get(block)
        if layer is not None and (a.shape[0], b.shape[1]) != layer:
            problems.append(f"{block}: the adapter maps {a.shape[0]} -> {b.shape[1]} features, the base "
                            f"layer {layer[0]} -> {layer[1]} (an adapter for another model?)")
    targets = peft.get("target_modules")
    if isinstance(targets, (list, tuple)):
        modules = [m for m in {k.rsplit(".", 1)[0] for k in per_block} if m in features]
        missing = [t for t in targets if not any(_matches(_hf_module(m), t) for m in modules)]
        problems += [f"target_modules lists {t!r}, but no adapter tensor is for it" for t in missing]
    if problems:
        raise CheckpointError(f"{directory}: the adapter does not fit this model: {len(problems)} problem(s):\n  "
                              + "\n  ".join(problems))
    return rank


def _strip_index(block: str) -> tuple[str, str]:
    """`language_model.layers.3.self_attn.q_proj` -> (`language_model.layers`, `self_attn.q_proj`)."""
    for stack in STACKS:
        if block.startswith(stack + "."):
            rest = block[len(stack) + 1:]
            index, _, tail = rest.partition(".")
            if index.isdigit():
                return stack, tail
    return "", block


# ---------------------------------------------------------------------- merging


def merged_params(model) -> dict[str, np.ndarray]:
    """`canonical_params(model)` with every adapter folded into its kernel (`W + scale * A B`).
    Refused over a quantized base (QLoRA): its adapters load on the full-precision base instead."""
    if any(isinstance(m, QuantLinear) for m in lora_modules(model).values()):
        raise ValueError("the adapters sit on quantized weights (QLoRA): merging would requantize them; "
                         "load the adapter on the full-precision base (from_pretrained(base, adapter=...))")
    params = {k: np.asarray(v) for k, v in canonical_params(model).items()}
    lora = canonical_params(nnx.state(model, LoRAWeight))
    scales = {p: m.lora_scale for p, m in lora_modules(model).items()}
    for path in [p for p in lora if p.endswith(".lora_a")]:
        module = path.removesuffix(".lora_a")
        scale = scales.get(module, scales.get(_stacked_name(module)))
        a = np.asarray(lora[path], np.float32)
        b = np.asarray(lora[module + ".lora_b"], np.float32)
        kernel = params[module + ".kernel"]
        params[module + ".kernel"] = (kernel.astype(np.float32) + scale * (a @ b)).astype(kernel.dtype)
    return params


def _stacked_name(module: str) -> str:
    stack, tail = _strip_index(module)
    return f"{stack}.{tail}" if stack else module


def export_merged(model, directory: str | os.PathLike, *, dtype: str | None = None, to: str = "hf") -> str:
    """The model with its adapters merged, as a plain HF checkpoint (config.json + safetensors,
    `to="hf"`) or as Orbax (`to="orbax"`, what `Qwen3VL.from_pretrained` and `save_orbax` use)."""

    if to == "hf":
        return save_hf(merged_params(model), model.config, directory, dtype=dtype)
    if to == "orbax":
        return save_orbax(nest_paths(merged_params(model)), model.config, directory)
    raise ValueError(f"to must be 'hf' or 'orbax', got {to!r}")


register_adapter_loader("peft", load_adapter)  # `Qwen3VL.from_pretrained(path, adapter=DIR)`
