"""Sharding over a device mesh: axes `data`, `expert`, `fsdp` and `tensor`, one rule per parameter.

- **Mesh.** `make_mesh("data=2,tensor=4")` (axes not named have size 1; one may be `-1`, the
  rest of the devices). Every mesh has the four axes, so one partitioning serves every shape.
- **Experts.** The MoE models' expert tensors `[E, ...]` are split over `expert` (expert
  parallelism: each device holds E / n experts) and their hidden dimension over `fsdp`. Outside the
  experts, `expert` is one more data-parallel axis (the batch is split over `data` x `expert` x
  `fsdp`); `moe.py` runs the experts under `shard_map` (gather the tokens of the expert group,
  compute the rows routed to the local experts, reduce-scatter the sums back).
- **Parameters.** Each parameter's layout is its converter rule's `spec` (`convert.RULES`: heads
  and MLP columns over `tensor`, the other weight dimension over `fsdp`; norms, biases of
  row-split projections and the mergers replicated). The vision tower is replicated by default
  (`vision="data"`: small weights, many images, vLLM's `mm_encoder_tp_mode="data"`) and follows its
  rules with `vision="tensor"`. A stacked (scanned) parameter keeps its block axis whole.
- **Activations.** Batch over `data` x `fsdp` at the block boundaries (`constrain`); the vision
  tower's packed patch rows over the same axes; logits' vocabulary and the KV cache's kv heads over
  `tensor`. A dimension an axis does not divide is left whole there (GSPMD stays correct, only the
  split is lost), so any batch runs on any mesh.
- **Attention.** The Pallas kernels cannot be partitioned by GSPMD, and GSPMD does not split the
  jnp spec's loop over query blocks, so `pallas_kernels.attention.api` runs either under
  `shard_map` over batch rows and heads when a mesh is current (`use_mesh`).

A sharded model is an ordinary `Qwen3VL` whose arrays are sharded: `Qwen3VL.from_pretrained(path,
mesh=mesh)` reads each device's slices straight from the files, `shard(model, mesh)` moves a
loaded one. Its entry points (`__call__`, `encode_vision`, `generate`, the `Trainer` step) enter the
model's mesh themselves; code that jits `model.forward` itself may wrap it in `use_mesh(model)`
for the activation constraints (results are the same without).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import Qwen3VLConfig
from .params import EXPERT, FSDP, TENSOR, dotted, partition_spec, stacked_prefix, stacked_stacks

__all__ = ["AXES", "BATCH", "ShardingError", "make_mesh", "parse_mesh", "check_mesh", "param_spec",
           "param_shardings", "shard", "model_mesh", "use_mesh", "constrain", "initialize_distributed"]

DATA = "data"
AXES = (DATA, EXPERT, FSDP, TENSOR)
"""The mesh axes, in device order: `data` outermost, `tensor` innermost (the fastest links)."""
BATCH = (DATA, EXPERT, FSDP)
"""Activations' batch (and the vision tower's patch rows) are split over these together."""
VISION_MODES = ("data", "tensor")


class ShardingError(ValueError):
    """A mesh or a partitioning that cannot work; the message names the axis and the parameter."""


def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """`"data=2,tensor=4"` or `{"data": 2, "tensor": 4}` -> `{axis: size}` over `AXES` (unnamed: 1)."""
    if spec is None or spec == "":
        items: dict[str, object] = {}
    elif isinstance(spec, str):
        items = {}
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep:
                raise ShardingError(f"mesh {spec!r}: {part!r} is not AXIS=SIZE (axes: {', '.join(AXES)})")
            if name in items:  # (checked before the assignment, which would replace the first value)
                raise ShardingError(f"mesh {spec!r}: axis {name!r} is given twice")
            try:
                items[name] = int(value)
            except ValueError:
                raise ShardingError(f"mesh {spec!r}: the size of axis {name!r} is not an integer: {value!r}") from None
    elif isinstance(spec, Mapping):
        items = dict(spec)
    else:
        raise ShardingError(f"a mesh is a string like 'data=2,tensor=4' or a dict, got {type(spec).__name__}")
    unknown = sorted(set(items) - set(AXES))
    if unknown:
        raise ShardingError(f"unknown mesh axis name(s) {unknown}; the axes are {list(AXES)}")
    sizes = {}
    for name in AXES:
        size = items.get(name, 1)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise ShardingError(f"mesh axis {name!r} must have a positive integer size (or -1), got {size!r}")
        sizes[name] = int(size)
    if list(sizes.values()).count(-1) > 1:
        raise ShardingError("at most one mesh axis may be -1 (the remaining devices)")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, *, devices=None) -> Mesh:
    """A `Mesh` over `devices` (default: all of them, every process's) with the axes `AXES`.

    `spec`: `"data=2,tensor=4"`, a dict, or None (all devices on `data`). The sizes must multiply
    to the number of devices; one may be -1 (whatever the others leave).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec if spec not in (None, "") else {DATA: -1})
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    for name, size in sizes.items():
        if size == -1:
            if len(devices) % known:
                raise ShardingError(f"mesh {spec!r}: {len(devices)} devices do not divide by {known}")
            sizes[name] = len(devices) // known
    total = int(np.prod(list(sizes.values())))
    if total != len(devices):
        shape = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise ShardingError(f"mesh {shape} needs {total} devices, but {len(devices)} are given")
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def _axis_sizes(mesh) -> dict[str, int]:
    """`{axis: size}` of a `Mesh` or an `AbstractMesh`."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def check_mesh(config: Qwen3VLConfig, mesh, *, vision: str = "data") -> None:
    """Refuse a mesh whose `tensor` axis splits attention heads unevenly, or whose `expert` axis
    splits the experts unevenly or is given to a dense model (names the parameter)."""
    if vision not in VISION_MODES:
        raise ShardingError(f"vision must be one of {VISION_MODES}, got {vision!r}")
    missing = [a for a in AXES if a not in mesh.axis_names]
    if missing:
        raise ShardingError(f"the mesh has axes {list(mesh.axis_names)}; it needs {list(AXES)} "
                            "(build it with qwen3vl_jax.sharding.make_mesh)")
    tensor = _axis_sizes(mesh)[TENSOR]
    text = config.text
    heads = [("language_model.layers.*.self_attn.q_proj.kernel", "query heads", text.num_attention_heads),
             ("language_model.layers.*.self_attn.k_proj.kernel", "kv heads", text.num_key_value_heads)]
    if vision == "tensor":
        heads.append(("visual.blocks.*.attn.qkv.kernel", "vision heads", config.vision.num_heads))
    problems = [f"{name}: {count} {what} cannot be split over mesh axis 'tensor' of size {tensor}"
                for name, what, count in heads if count % tensor]
    experts = _axis_sizes(mesh)[EXPERT]
    if experts > 1 and not text.is_moe:
        problems.append(f"mesh axis 'expert' of size {experts}: this model has no experts (a dense config); "
                        "use data or fsdp")
    elif experts > 1 and text.num_experts % experts:
        problems.append(f"language_model.layers.*.mlp.experts: {text.num_experts} experts cannot be split over "
                        f"mesh axis 'expert' of size {experts}")
    if problems:
        counts = sorted({count for _, _, count in heads})
        raise ShardingError("; ".join(problems) + f" (choose a tensor size that divides {counts})")


def param_spec(path: str, shape: tuple[int, ...], mesh, *, vision: str = "data",
               stacked: bool = False) -> PartitionSpec:
    """The `PartitionSpec` of one parameter (canonical per-block `path`, e.g.
    `language_model.layers.3.mlp.up_proj.kernel`; `stacked`: `shape` has a leading block axis).

    Raises `ShardingError` naming the parameter, the dimension and the axis when the axis does not
    divide the dimension.
    """
    if path.startswith("visual.") and vision == "data":
        rule: tuple = ()
    else:
        try:
            rule = partition_spec(path)
        except KeyError:
            rule = ()  # no converter rule (e.g. LoRA factors): replicated
    body = tuple(shape[1:] if stacked else shape)
    rule = tuple(rule) + (None,) * (len(body) - len(rule))
    sizes = _axis_sizes(mesh)
    for dim, (extent, axis) in enumerate(zip(body, rule)):
        if axis is not None and extent % sizes[axis]:
            raise ShardingError(f"{path}: dimension {dim} ({extent}) cannot be split over mesh axis "
                                f"{axis!r} of size {sizes[axis]}")
    return PartitionSpec(*(((None,) if stacked else ()) + rule))


def _canonical(path: str, stacked: set[str]) -> tuple[str, bool]:
    prefix = stacked_prefix(path, stacked)
    if prefix is None:
        return path, False
    return f"{prefix}.0.{path[len(prefix) + 1:]}", True


def param_shardings(model_or_state, mesh, *, vision: str = "data"):
    """A pure dict like `nnx.to_pure_dict(nnx.state(model))` of `NamedSharding`s, by `param_spec`
    (from a model, its state, or such a pure dict of arrays / `ShapeDtypeStruct`s)."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    stacked = stacked_stacks(model_or_state)

    def one(key_path, leaf):
        path, is_stacked = _canonical(dotted(key_path), stacked)
        return NamedSharding(mesh, param_spec(path, tuple(leaf.shape), mesh, vision=vision, stacked=is_stacked))

    return jax.tree_util.tree_map_with_path(one, pure)


def shard(model, mesh, *, vision: str = "data"):
    """Move `model`'s arrays onto `mesh` (in place; returns the model)."""
    check_mesh(model.config, mesh, vision=vision)
    state = nnx.state(model)
    shardings = param_shardings(model, mesh, vision=vision)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, s), nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    return model


def model_mesh(model) -> Mesh | None:
    """The mesh `model`'s parameters live on (None on one device)."""
    leaf = model.language_model.embed_tokens.embedding[...]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding.mesh
    return None


def use_mesh(model_or_mesh):
    """A context in which `model_or_mesh`'s mesh is current (a no-op for a single-device model).

    Inside it the activation constraints (`constrain`) apply and the Pallas kernels run under
    `shard_map`. Entering the mesh that is already current is a no-op.
    """
    mesh = model_or_mesh if isinstance(model_or_mesh, Mesh) else model_mesh(model_or_mesh)
    current = jax.sharding.get_abstract_mesh()
    if mesh is None or (not current.empty and current == mesh.abstract_mesh):
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _fits(extent: int, axes, sizes) -> bool:
    axes = (axes,) if isinstance(axes, str) else axes
    return extent % int(np.prod([sizes[a] for a in axes])) == 0


def current_spec(shape: tuple[int, ...], dims: tuple) -> PartitionSpec | None:
    """`dims` (per dimension: None, an axis, a tuple of axes, or "batch") as a `PartitionSpec` for
    the current mesh, leaving whole each dimension its axes do not divide; None without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(a not in mesh.axis_names for a in AXES):
        return None
    sizes = _axis_sizes(mesh)
    spec = []
    for extent, axes in zip(shape, dims):
        axes = BATCH if axes == "batch" else axes
        spec.append(axes if axes is not None and _fits(extent, axes, sizes) else None)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, *dims) -> jax.Array:
    """`with_sharding_constraint` to `dims` under the current mesh (see `current_spec`); the
    identity without one."""
    spec = current_spec(tuple(x.shape), dims)
    if spec is None or all(d is None for d in spec):
        return x  # nothing to split: leave the layout to GSPMD
    return jax.lax.with_sharding_constraint(x, spec)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """`jax.distributed.initialize` from arguments or the environment (`QWEN3VL_COORDINATOR`,
    `QWEN3VL_NUM_PROCESSES`, `QWEN3VL_PROCESS_ID`; otherwise JAX's own cluster detection).

    Launch one process per host (each sees its local devices), e.g. on two hosts:
    `QWEN3VL_COORDINATOR=host0:1234 QWEN3VL_NUM_PROCESSES=2 QWEN3VL_PROCESS_ID=<0|1> python train.py`.
    On CPUs the collectives go through gloo.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("QWEN3VL_COORDINATOR")
    if num_processes is None and "QWEN3VL_NUM_PROCESSES" in env:
        num_processes = int(env["QWEN3VL_NUM_PROCESSES"])
    if process_id is None and "QWEN3VL_PROCESS_ID" in env:
        process_id = int(env["QWEN3VL_PROCESS_ID"])
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError("a coordinator address needs num_processes and process_id (or QWEN3VL_NUM_PROCESSES "
                         "and QWEN3VL_PROCESS_ID)")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
