"""The parameter tree: what each parameter is called, how it is laid out, and where it goes.

One module owns the tree, and every other module reads it from here:

- **The rule table** (`RULES`): each row pairs an HF tensor name with our parameter path, the
  named transform between them (`Transform`: linear transpose, Conv3d-as-linear) and the
  parameter's partition spec over the mesh (`spec`). The converter (`convert.py`) reads the names
  and transforms, the sharding (`sharding.py`) and the planner (`plan.py`) the specs, LoRA
  (`training/lora.py`) the names. A new kind of tensor (a stack of experts, a quantized weight
  with its scales) is a new row or a new `Transform`, not a special case in those modules.
- **Layouts**: a tower's repeated blocks (`STACKS`) are stored per block (a list of modules) or
  stacked along a leading axis (`scan_layers`). `canonical_params` / `param_shapes` give the
  per-block names whatever the layout; those are the names checkpoints use.
- **Placement**: `fill_state` puts `{canonical path: value}` into a model's (abstract) state,
  stacking per-block values where the state is stacked, on each leaf's sharding if given; a
  value may be a `LazyTensor` still in its file, read as it is placed (block by block when
  sharded, so each device reads only what it holds).

Our paths are dotted NNX state paths, e.g. `visual.blocks.3.attn.qkv.kernel`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import Qwen3VLConfig

__all__ = [
    "CheckpointError", "Transform", "IDENTITY", "LINEAR", "CONV3D_AS_LINEAR", "EXPERTS_RELEASED", "EXPERTS_MODULE",
    "EXPERT_LAYOUTS", "FSDP", "TENSOR", "EXPERT", "COLUMNS", "ROWS", "REPLICATED", "Rule", "RULES", "hf_to_ours_name",
    "hf_rule", "ours_to_hf_name", "expert_layout_of", "rule_for", "partition_spec", "QUANTIZED_DTYPES", "keeps_dtype",
    "LazyTensor", "as_lazy", "STACKS", "dotted", "flat_paths", "nest_paths", "flatten_paths", "stacked_prefix",
    "stacked_stacks", "canonical_params", "param_shapes", "count_params", "place", "fill_state",
]

class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists every problem found."""



# ---------------------------------------------------------------------- the rule table


@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible map between an HF tensor and our parameter.

    `read(get, index)` builds the block `index` (a tuple of slices) of our parameter from a reader
    of HF blocks (`get(hf_index) -> ndarray`), so a device reads only the slice it holds.
    """

    name: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray, Qwen3VLConfig], np.ndarray]
    read: Callable[[Callable[[tuple], np.ndarray], tuple], np.ndarray]


IDENTITY = Transform("identity", lambda a: a, lambda a, c: a, lambda get, index: get(index))
# torch Linear stores [out, in]; nnx.Linear's kernel is [in, out].
LINEAR = Transform("linear_transpose", lambda a: a.T, lambda a, c: a.T, lambda get, index: get(tuple(index)[::-1]).T)
# A Conv3d with kernel == stride over a [C, T, p, p] patch is a linear map of the flattened patch:
# weight [E, C, T, p, p] -> kernel [C*T*p*p, E] (the flattening order of `pixel_values` rows).
def _conv3d_to_ours(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1).T


CONV3D_AS_LINEAR = Transform(
    "conv3d_as_linear",
    _conv3d_to_ours,
    lambda a, c: a.T.reshape(
        c.vision.hidden_size, c.vision.in_channels, c.vision.temporal_patch_size, c.vision.patch_size,
        c.vision.patch_size,
    ),
    lambda get, index: _conv3d_to_ours(get(tuple(index[1:2])))[index[0]],
)

# A layer's fused expert weights, `[E, ...]` (one row of the table for all experts; `moe.py`). Ours
# is the released checkpoints' layout: `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`. The
# transformers-5 modules hold (and save) the last two axes swapped: `[E, 2I, H]`, `[E, H, I]`.
EXPERTS_RELEASED = Transform("experts_released", lambda a: a, lambda a, c: a, lambda get, index: get(index))
EXPERTS_MODULE = Transform("experts_module", lambda a: np.swapaxes(a, 1, 2), lambda a, c: np.swapaxes(a, 1, 2),
                           lambda get, index: np.swapaxes(get((index[0], index[2], index[1])), 1, 2))
EXPERT_LAYOUTS = {"released": EXPERTS_RELEASED, "module": EXPERTS_MODULE}
"""The two layouts of expert tensors in HF checkpoints, by name (what `convert` reads and writes back)."""

# Mesh axis names (`sharding.py` builds the mesh). A rule's `spec` names the axis each dimension of
# our parameter is split over (None: not split): attention heads and MLP columns over `tensor`, the
# other weight dimension over `fsdp`.
FSDP, TENSOR, EXPERT = "fsdp", "tensor", "expert"
COLUMNS = (FSDP, TENSOR)  # [in, out] kernels whose outputs are heads / MLP columns
ROWS = (TENSOR, FSDP)  # [in, out] kernels whose inputs are heads / MLP columns
REPLICATED = ()


@dataclasses.dataclass(frozen=True)
class Rule:
    """`hf` and `ours` are name templates; `{x}` stands for the same text (matching `x`) in both.

    `spec`: the parameter's partitioning over the mesh (see above). The vision tower's rules give
    its tensor-parallel layout; by default the tower is replicated (`sharding.py`).
    `layouts`: other transforms the HF tensor may be stored in, tried first when reading (the
    one whose result has the model's shape is taken); `transform` is the one written by default.
    `read`: False for a parameter no HF checkpoint holds under `hf` (an int8 linear's `[out, in]`
    weight, quantized here from the full-precision row): never matched when reading an HF name;
    `hf` still names it (its module) for messages and adapters.
    """

    hf: str
    ours: str
    transform: Transform
    x: str = r".+"
    spec: tuple[str | None, ...] = REPLICATED
    layouts: tuple[Transform, ...] = ()
    read: bool = True

    @property
    def readers(self) -> tuple[Transform, ...]:
        """The transforms to try, in order, on a stored tensor of unknown layout."""
        return self.layouts + (self.transform,)

    def _regex(self, template: str) -> re.Pattern:
        return re.compile(re.escape(template).replace(r"\{x\}", f"({self.x})"))

    def match_hf(self, name: str) -> str | None:
        m = self._regex(self.hf).fullmatch(name)
        return None if m is None else self.ours.replace("{x}", m.group(1) if m.groups() else "")

    def match_ours(self, path: str) -> str | None:
        m = self._regex(self.ours).fullmatch(path)
        return None if m is None else self.hf.replace("{x}", m.group(1) if m.groups() else "")


_VIT = r"blocks\.\d+\."
_LAYER = r"layers\.\d+\."
# The vision tower's linears (each ViT block's four, the mergers' two): quantized only where a spec
# names them (an FP8 checkpoint whose vision weights carry scales; a tower left in full precision
# by default). Replicated, as the tower is by default.
_VISION_LINEARS = r"(?:" + _VIT + r"(?:attn\.(?:qkv|proj)|mlp\.linear_fc[12])|(?:merger|deepstack_merger_list\.\d+)\.linear_fc[12])"
# Order matters: the first matching rule wins.
RULES: tuple[Rule, ...] = (
    Rule("model.visual.patch_embed.proj.weight", "visual.patch_embed.proj.kernel", CONV3D_AS_LINEAR),
    Rule("model.visual.pos_embed.weight", "visual.pos_embed.embedding", IDENTITY),
    Rule("model.visual.{x}.weight", "visual.{x}.scale", IDENTITY, x=r"(?:.*\.)?norm\d?"),  # LayerNorm
    Rule("model.visual.{x}.weight", "visual.{x}.kernel", LINEAR, x=_VIT + r"(?:attn\.qkv|mlp\.linear_fc1)",
         spec=(None, TENSOR)),
    Rule("model.visual.{x}.bias", "visual.{x}.bias", IDENTITY, x=_VIT + r"(?:attn\.qkv|mlp\.linear_fc1)",
         spec=(TENSOR,)),
    Rule("model.visual.{x}.weight", "visual.{x}.kernel", LINEAR, x=_VIT + r"(?:attn\.proj|mlp\.linear_fc2)",
         spec=(TENSOR, None)),
    Rule("model.visual.{x}.weight", "visual.{x}.kernel", LINEAR),  # the mergers
    Rule("model.visual.{x}.bias", "visual.{x}.bias", IDENTITY),
    Rule("model.language_model.embed_tokens.weight", "language_model.embed_tokens.embedding", IDENTITY,
         spec=(TENSOR, FSDP)),
    Rule("model.language_model.{x}.weight", "language_model.{x}.weight", IDENTITY, x=r".*norm"),  # RMSNorm
    Rule("model.language_model.{x}.weight", "language_model.{x}.kernel", LINEAR,
         x=_LAYER + r"(?:self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)", spec=COLUMNS),
    Rule("model.language_model.{x}.weight", "language_model.{x}.kernel", LINEAR,
         x=_LAYER + r"(?:self_attn\.o_proj|mlp\.down_proj)", spec=ROWS),
    Rule("model.language_model.{x}.bias", "language_model.{x}.bias", IDENTITY, x=_LAYER + r"self_attn\.[qkv]_proj",
         spec=(TENSOR,)),
    Rule("model.language_model.{x}.bias", "language_model.{x}.bias", IDENTITY, x=_LAYER + r"self_attn\.o_proj"),
    # MoE layers: the router `[E, H]` and the fused experts. Where both layouts fit (H == 2I for
    # gate_up, H == I for down) the tensor is read as the module layout, as transformers reads it.
    Rule("model.language_model.{x}.weight", "language_model.{x}.kernel", LINEAR, x=_LAYER + r"mlp\.gate",
         spec=(FSDP, None)),
    Rule("model.language_model.{x}", "language_model.{x}", EXPERTS_RELEASED, x=_LAYER + r"mlp\.experts\.gate_up_proj",
         spec=(EXPERT, FSDP, None), layouts=(EXPERTS_MODULE,)),
    Rule("model.language_model.{x}", "language_model.{x}", EXPERTS_RELEASED, x=_LAYER + r"mlp\.experts\.down_proj",
         spec=(EXPERT, None, FSDP), layouts=(EXPERTS_MODULE,)),
    Rule("lm_head.weight", "lm_head.kernel", LINEAR, spec=COLUMNS),
    # Quantized weights (`quant.py`): the weight is the row above in a narrow dtype (FP8, int8, packed
    # int4), its block scales this row: HF's `weight_scale_inv [ceil(out/B), ceil(in/B)]`
    # transposed like the weight; experts' `{gate_up,down}_proj_scale_inv` in the experts' layouts.
    Rule("model.language_model.{x}.weight_scale_inv", "language_model.{x}.kernel_scale", LINEAR,
         x=_LAYER + r"(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"),
    Rule("model.language_model.{x}_scale_inv", "language_model.{x}_scale", EXPERTS_RELEASED,
         x=_LAYER + r"mlp\.experts\.(?:gate_up|down)_proj", layouts=(EXPERTS_MODULE,)),
    Rule("lm_head.weight_scale_inv", "lm_head.kernel_scale", LINEAR),
    Rule("model.visual.{x}.weight_scale_inv", "visual.{x}.kernel_scale", LINEAR, x=_VISION_LINEARS),
    # An int8 linear (`quant.OUT_MAJOR`) holds its weight `[out, in]`, HF's orientation, and one
    # scale per output `[out, 1]`; quantized here from the rows above, so not read from HF names.
    Rule("model.language_model.{x}.weight", "language_model.{x}.weight", IDENTITY,
         x=_LAYER + r"(?:self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)", spec=COLUMNS[::-1], read=False),
    Rule("model.language_model.{x}.weight", "language_model.{x}.weight", IDENTITY,
         x=_LAYER + r"(?:self_attn\.o_proj|mlp\.down_proj)", spec=ROWS[::-1], read=False),
    Rule("model.language_model.{x}.weight_scale", "language_model.{x}.weight_scale", IDENTITY,
         x=_LAYER + r"(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)", read=False),
    Rule("lm_head.weight", "lm_head.weight", IDENTITY, spec=COLUMNS[::-1], read=False),
    Rule("lm_head.weight_scale", "lm_head.weight_scale", IDENTITY, read=False),
    Rule("model.visual.{x}.weight", "visual.{x}.weight", IDENTITY, x=_VISION_LINEARS, read=False),
    Rule("model.visual.{x}.weight_scale", "visual.{x}.weight_scale", IDENTITY, x=_VISION_LINEARS, read=False),
)

# The storage dtypes of quantized weights (`quant.py`): FP8 e4m3, int8 (and int4 packed in int8).
QUANTIZED_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(np.int8))


def keeps_dtype(path: str, dtype) -> bool:
    """Whether parameter `path` of `dtype` keeps its dtype when a checkpoint is cast to a storage dtype:
    a quantized weight and its scales (the rows that hold them) are stored as they are."""
    if np.dtype(dtype) in QUANTIZED_DTYPES:
        return True
    try:
        return rule_for(path)[1].hf.endswith(("_scale_inv", "_scale"))
    except KeyError:
        return False


def hf_to_ours_name(name: str) -> tuple[str, Transform] | None:
    """Our path and transform for an HF tensor name, or None if no rule matches."""
    found = hf_rule(name)
    return None if found is None else (found[0], found[1].transform)


def hf_rule(name: str) -> tuple[str, Rule] | None:
    """Our path and the rule for an HF tensor name (first match), or None."""
    for rule in RULES:
        path = rule.match_hf(name) if rule.read else None
        if path is not None:
            return path, rule
    return None


def rule_for(path: str) -> tuple[str, Rule]:
    for rule in RULES:
        name = rule.match_ours(path)
        # Only a name that converts forward to the same path is a true inverse (first match wins).
        if name is not None and (not rule.read or hf_to_ours_name(name) == (path, rule.transform)):
            return name, rule
    raise KeyError(f"no conversion rule produces the parameter {path!r}")


def ours_to_hf_name(path: str, expert_layout: str = "released") -> tuple[str, Transform]:
    """The HF name and transform for one of our parameter paths (the inverse of the table);
    expert tensors in `expert_layout` (`EXPERT_LAYOUTS`)."""
    name, rule = rule_for(path)
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {sorted(EXPERT_LAYOUTS)}, got {expert_layout!r}")
    layout = EXPERT_LAYOUTS[expert_layout]
    return name, layout if layout in rule.readers else rule.transform


def partition_spec(path: str) -> tuple[str | None, ...]:
    """The mesh axis of each dimension of one of our (canonical, per-block) parameters: its rule's `spec`."""
    return rule_for(path)[1].spec





@dataclasses.dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by its shape and dtype, read only when `load()` is called.

    The streaming writers take these and load each one just before writing it, so a conversion
    holds one tensor (plus its source copy) on the host at a time. `source` names it in messages
    (the HF name or our path).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]
    source: str = ""
    read_block: Callable[[tuple], np.ndarray] | None = None
    transform: str = ""  # the name of the `Transform` an HF tensor is read through ("" otherwise)

    def block(self, index: tuple) -> np.ndarray:
        """`tensor[index]` (a tuple of slices, as `jax.make_array_from_callback` asks for a device's
        shard), reading only that block's bytes where the source allows (`read_block`)."""
        if self.read_block is None:
            return self.checked(self.load())[tuple(index)]
        return np.asarray(self.read_block(tuple(index)), dtype=self.dtype, order="C")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def checked(self, array) -> np.ndarray:
        """`array` as C-contiguous numpy of exactly this shape and dtype (or an error naming it)."""
        array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if tuple(array.shape) != tuple(self.shape) or array.dtype != np.dtype(self.dtype):
            raise CheckpointError(f"{self.source or 'a tensor'} loaded as {array.dtype}{list(array.shape)}, "
                                  f"expected {np.dtype(self.dtype)}{list(self.shape)}")
        return array


def expert_layout_of(params: Mapping[str, object]) -> str | None:
    """The `EXPERT_LAYOUTS` name the expert tensors of `{path: LazyTensor}` were read in (the first
    found), or None when no expert tensor was read from an HF file."""
    names = {t.name: layout for layout, t in EXPERT_LAYOUTS.items()}
    for value in params.values():
        if isinstance(value, LazyTensor) and value.transform in names:
            return names[value.transform]
    return None


def as_lazy(value, source: str = "") -> LazyTensor:
    """`value` (a numpy or jax array, or a `LazyTensor`) as a `LazyTensor`; an array is copied to the
    host (`np.asarray`) only when loaded."""
    if isinstance(value, LazyTensor):
        return value
    shape = tuple(int(d) for d in value.shape)
    return LazyTensor(shape, np.dtype(value.dtype), lambda: np.asarray(value), source)



# ---------------------------------------------------------------------- paths


def nest_paths(flat: Mapping[str, object]) -> dict:
    """`{dotted path: leaf}` -> the nested dict Orbax stores (integer keys for block indices)."""
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf
    return tree


def flatten_paths(tree, is_leaf=None) -> dict[str, object]:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]

    def dotted(path) -> str:
        return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    return {dotted(path): leaf for path, leaf in leaves}



# ---------------------------------------------------------------------- parameters: the canonical layout

# The repeated blocks of each tower: stored per block, or stacked along a leading axis (`scan_layers`).
STACKS = ("visual.blocks", "language_model.layers")


def dotted(path) -> str:
    """A pytree key path as our dotted parameter name, e.g. `visual.blocks.3.attn.qkv.kernel`."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_paths(tree) -> list[tuple[str, object]]:
    tree = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(dotted(path), leaf) for path, leaf in leaves]


def stacked_prefix(path: str, stacked: set[str]) -> str | None:
    for prefix in stacked:
        if path.startswith(prefix + "."):
            return prefix
    return None


def stacked_stacks(model_or_state) -> set[str]:
    """Which of `STACKS` hold stacked parameters in this model / state."""
    if isinstance(model_or_state, nnx.Module):
        towers = {"visual.blocks": model_or_state.visual, "language_model.layers": model_or_state.language_model}
        return {name for name, tower in towers.items() if tower.scan_layers}
    paths = {p for p, _ in flat_paths(model_or_state)}
    return {s for s in STACKS if any(p.startswith(s + ".") and not p[len(s) + 1].isdigit() for p in paths)}


def _per_block(model_or_state):
    """`(canonical path, leaf, block index or None)` for every parameter: a stacked leaf once per block."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    stacked = stacked_stacks(model_or_state)
    for path, leaf in flat_paths(state):
        prefix = stacked_prefix(path, stacked)
        if prefix is None:
            yield path, leaf, None
            continue
        rest = path[len(prefix) + 1:]
        for i in range(leaf.shape[0]):
            yield f"{prefix}.{i}.{rest}", leaf, i


def canonical_params(model_or_state) -> dict[str, object]:
    """`{per-block dotted path: array}` whatever the layout: stacked parameters are sliced per block
    (`language_model.layers.3.self_attn.q_proj.kernel`). The names the converter and Orbax use."""
    return {path: leaf if i is None or not hasattr(leaf, "__getitem__") else leaf[i]
            for path, leaf, i in _per_block(model_or_state)}


def param_shapes(model_or_state) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`{canonical path: (shape, dtype)}` for every parameter (abstract or concrete; either layout)."""
    return {path: (tuple(leaf.shape if i is None else leaf.shape[1:]), np.dtype(leaf.dtype))
            for path, leaf, i in _per_block(model_or_state)}


def count_params(model_or_state) -> int:
    """Number of parameters (works on abstract models from `Qwen3VL.abstract`)."""
    return int(sum(int(np.prod(shape)) for shape, _ in param_shapes(model_or_state).values()))


def place(values: list, leaf, sharding, stacked: bool):
    """One state leaf from its per-block values (one value unless `stacked`), on `sharding` if given.

    A value is an array or a `LazyTensor` (still in its file): read whole without a sharding, else
    block by block, each device reading only the block it holds."""
    if sharding is None:
        arrays = [jnp.asarray(v.load() if isinstance(v, LazyTensor) else v, dtype=leaf.dtype) for v in values]
        return jnp.stack(arrays) if stacked else arrays[0]
    if isinstance(values[0], LazyTensor):
        dtype = np.dtype(leaf.dtype)

        def block(index):
            if not stacked:
                return values[0].block(index).astype(dtype, copy=False)
            picked = values[index[0]] if isinstance(index[0], slice) else [values[index[0]]]
            return np.stack([v.block(index[1:]).astype(dtype, copy=False) for v in picked])

        return jax.make_array_from_callback(tuple(leaf.shape), sharding, block)
    if not stacked:
        return jax.device_put(jnp.asarray(values[0], dtype=leaf.dtype), sharding)
    return jax.jit(lambda *xs: jnp.stack(xs).astype(leaf.dtype), out_shardings=sharding)(*values)


def fill_state(state, params: dict[str, object], shardings=None, on_leaf=None):
    """Fill an (abstract) state from `{canonical path: array}`, stacking per-block arrays where the
    state is stacked. Pops as it goes, so each host copy is freed once its device array exists.

    `shardings` (a pure dict like the state's, of `NamedSharding`): place each leaf on its devices;
    values may be `LazyTensor`s (read as they are placed; with shardings, block by block)."""
    pure = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    targets = [None] * len(leaves) if shardings is None else jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    stacked = stacked_stacks(state)
    values = []
    for (path, leaf), sharding in zip(leaves, targets):
        name = dotted(path)
        prefix = stacked_prefix(name, stacked)
        if prefix is None:
            values.append(place([params.pop(name)], leaf, sharding, stacked=False))
        else:
            rest = name[len(prefix) + 1:]
            blocks = [params.pop(f"{prefix}.{i}.{rest}") for i in range(leaf.shape[0])]
            values.append(place(blocks, leaf, sharding, stacked=True))
        if on_leaf is not None:
            on_leaf()
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return state

