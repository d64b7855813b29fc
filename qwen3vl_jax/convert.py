"""Hugging Face safetensors <-> our parameter tree, by one declarative table of name rules.

Every HF tensor name is matched by the first rule whose pattern fits; the rule names our
parameter path and a named transform (linear transpose, Conv3d-as-linear). Loading is strict:
every HF tensor is used exactly once (or listed as ignored with a reason), every parameter is
filled exactly once, every shape is checked, and all problems are reported together in one
`CheckpointError`. Only safetensors is read (never pickle), one shard at a time.

Our paths are dotted NNX state paths, e.g. `visual.blocks.3.attn.qkv.kernel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from .config import Qwen3VLConfig

__all__ = [
    "CheckpointError",
    "RULES",
    "hf_to_ours_name",
    "ours_to_hf_name",
    "partition_spec",
    "safetensors_files",
    "iter_hf_tensors",
    "load_hf_params",
    "plan_hf_params",
    "SliceReader",
    "export_hf_tensors",
]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists every problem found."""


@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible map between an HF tensor and our parameter.

    `ours_shape` maps an HF shape to ours (for checking a checkpoint from its headers alone);
    `read` builds a block of our parameter, `our_index` (a tuple of slices), from a reader of HF
    blocks (`get(hf_index) -> ndarray`), so a device reads only the slice it holds.
    """

    name: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray, Qwen3VLConfig], np.ndarray]
    ours_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    read: Callable[[Callable[[tuple], np.ndarray], tuple], np.ndarray]


IDENTITY = Transform("identity", lambda a: a, lambda a, c: a, lambda s: tuple(s), lambda get, index: get(index))
# torch Linear stores [out, in]; nnx.Linear's kernel is [in, out].
LINEAR = Transform("linear_transpose", lambda a: a.T, lambda a, c: a.T, lambda s: tuple(s)[::-1],
                   lambda get, index: get(tuple(index)[::-1]).T)
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
    lambda s: (int(np.prod(s[1:])), s[0]),
    lambda get, index: _conv3d_to_ours(get(tuple(index[1:2])))[index[0]],
)

# Mesh axis names (`sharding.py` builds the mesh). A rule's `spec` names the axis each dimension of
# our parameter is split over (None: not split): attention heads and MLP columns over `tensor`, the
# other weight dimension over `fsdp`.
FSDP, TENSOR = "fsdp", "tensor"
COLUMNS = (FSDP, TENSOR)  # [in, out] kernels whose outputs are heads / MLP columns
ROWS = (TENSOR, FSDP)  # [in, out] kernels whose inputs are heads / MLP columns
REPLICATED = ()


@dataclasses.dataclass(frozen=True)
class Rule:
    """`hf` and `ours` are name templates; `{x}` stands for the same text (matching `x`) in both.

    `spec`: the parameter's partitioning over the mesh (see above). The vision tower's rules give
    its tensor-parallel layout; by default the tower is replicated (`sharding.py`).
    """

    hf: str
    ours: str
    transform: Transform
    x: str = r".+"
    spec: tuple[str | None, ...] = REPLICATED

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
    Rule("lm_head.weight", "lm_head.kernel", LINEAR, spec=COLUMNS),
)


def hf_to_ours_name(name: str) -> tuple[str, Transform] | None:
    """Our path and transform for an HF tensor name, or None if no rule matches."""
    for rule in RULES:
        path = rule.match_hf(name)
        if path is not None:
            return path, rule.transform
    return None


def _rule_for(path: str) -> tuple[str, Rule]:
    for rule in RULES:
        name = rule.match_ours(path)
        # Only a name that converts forward to the same path is a true inverse (first match wins).
        if name is not None and hf_to_ours_name(name) == (path, rule.transform):
            return name, rule
    raise KeyError(f"no conversion rule produces the parameter {path!r}")


def ours_to_hf_name(path: str) -> tuple[str, Transform]:
    """The HF name and transform for one of our parameter paths (the inverse of the table)."""
    name, rule = _rule_for(path)
    return name, rule.transform


def partition_spec(path: str) -> tuple[str | None, ...]:
    """The mesh axis of each dimension of one of our (canonical, per-block) parameters: its rule's `spec`."""
    return _rule_for(path)[1].spec


# ---------------------------------------------------------------------- reading safetensors


def safetensors_files(directory: str | os.PathLike) -> list[str]:
    """The checkpoint's safetensors files: the shards of `model.safetensors.index.json`, or the single file."""
    directory = os.fspath(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (no JSON weight_map): {e!r}") from e
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
        if missing:
            raise CheckpointError(f"{directory}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(directory, s) for s in shards]
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(
        f"{directory}: no model.safetensors or model.safetensors.index.json (only safetensors is read)"
    )


@contextlib.contextmanager
def _open_safetensors(file: str):
    """`safe_open` (memory-mapped, numpy) whose read errors name the file."""
    from safetensors import SafetensorError, safe_open

    try:  # a truncated or corrupt shard fails inside safetensors, without naming the file
        with safe_open(file, framework="np") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{file}: cannot read the safetensors file (truncated or corrupt?): {e}") from e


def iter_hf_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, str, np.ndarray]]:
    """Yield (shard file, HF name, numpy array), one shard open at a time."""
    for file in safetensors_files(directory):
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield file, name, f.get_tensor(name)


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one of our parameters lives in an HF checkpoint: file, HF name and transform."""

    file: str
    name: str
    transform: Transform


def plan_hf_params(
    directory: str | os.PathLike,
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    config: Qwen3VLConfig,
) -> dict[str, TensorSource]:
    """Match an HF checkpoint to `expected` (`{our path: (shape, dtype)}`) from the safetensors
    headers alone: `{our path: TensorSource}`. Strict: raises `CheckpointError` listing every
    problem at once (unexpected, duplicate, missing tensors and shape mismatches)."""
    sources: dict[str, TensorSource] = {}
    problems: list[str] = []
    seen: dict[str, str] = {}  # HF name -> file
    claimed: dict[str, str] = {}  # our path -> HF name (also for tensors rejected on shape)
    for file in safetensors_files(directory):
        with _open_safetensors(file) as f:
            headers = [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
        for name, hf_shape in headers:
            if name in seen:
                problems.append(f"tensor {name} appears twice ({seen[name]} and {file})")
                continue
            seen[name] = file
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the logits reuse embed_tokens; a stored copy is redundant
            target = hf_to_ours_name(name)
            if target is None:
                problems.append(f"unexpected tensor {name} {list(hf_shape)} (no conversion rule)")
                continue
            path, transform = target
            if path not in expected:
                problems.append(f"unexpected tensor {name} {list(hf_shape)} (the model has no {path})")
                continue
            if path in claimed:
                problems.append(f"tensors {claimed[path]} and {name} both fill {path}")
                continue
            claimed[path] = name
            shape = tuple(expected[path][0])
            ours = tuple(transform.ours_shape(hf_shape)) if hf_shape else ()
            if ours != shape:
                problems.append(f"shape mismatch for {name}: checkpoint {list(hf_shape)} -> {list(ours)} "
                                f"after {transform.name}, model expects {list(shape)}")
                continue
            sources[path] = TensorSource(file, name, transform)
    for path in sorted(set(expected) - set(claimed)):
        try:
            hf_name = ours_to_hf_name(path)[0]
        except KeyError:
            hf_name = "?"
        problems.append(f"missing tensor {hf_name} for parameter {path}")
    if problems:
        raise CheckpointError(
            f"{os.fspath(directory)}: {len(problems)} problem(s) loading the checkpoint:\n  - "
            + "\n  - ".join(problems)
        )
    return sources


def load_hf_params(
    directory: str | os.PathLike,
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    config: Qwen3VLConfig,
    *,
    dtype=None,
    on_tensor: Callable[[str], None] | None = None,
) -> dict[str, np.ndarray]:
    """Read an HF checkpoint into `{our path: array}` for exactly the parameters in `expected`.

    `expected` maps each of our parameter paths to its (shape, dtype). Arrays are cast to `dtype`
    (default: the expected dtype). The checkpoint is checked first (`plan_hf_params`), then read
    one shard at a time. Raises `CheckpointError` listing every problem at once.
    """
    sources = plan_hf_params(directory, expected, config)
    by_file: dict[str, list[str]] = {}
    for path, source in sources.items():
        by_file.setdefault(source.file, []).append(path)
    out: dict[str, np.ndarray] = {}
    for file, paths in by_file.items():
        with _open_safetensors(file) as f:
            for path in paths:
                source = sources[path]
                if on_tensor is not None:
                    on_tensor(source.name)
                value = source.transform.to_ours(f.get_tensor(source.name))
                out[path] = np.ascontiguousarray(value.astype(dtype or expected[path][1], copy=False))
    return out


class SliceReader:
    """Reads blocks of our parameters from an HF checkpoint (`plan_hf_params`' sources), keeping
    each safetensors file open (memory-mapped) until `close`: `read(path, index, dtype)` returns
    `param[index]` having read only that block's bytes (plus, for the patch embedding, its rows)."""

    def __init__(self, sources: Mapping[str, TensorSource]):
        self.sources = dict(sources)
        self._stack = contextlib.ExitStack()
        self._files: dict[str, object] = {}

    def _file(self, file: str):
        if file not in self._files:
            self._files[file] = self._stack.enter_context(_open_safetensors(file))
        return self._files[file]

    def read(self, path: str, index: tuple, dtype) -> np.ndarray:
        source = self.sources[path]
        handle = self._file(source.file).get_slice(source.name)
        block = source.transform.read(lambda hf_index: handle[tuple(hf_index)], tuple(index))
        return np.ascontiguousarray(np.asarray(block).astype(dtype, copy=False))

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def export_hf_tensors(params: Mapping[str, np.ndarray], config: Qwen3VLConfig) -> dict[str, np.ndarray]:
    """`{our path: array}` -> `{HF name: array}` (the inverse of `load_hf_params`)."""
    tensors = {}
    for path, value in params.items():
        name, transform = ours_to_hf_name(path)
        tensors[name] = np.ascontiguousarray(transform.to_hf(np.asarray(value), config))
    return tensors


# ---------------------------------------------------------------------- Orbax and HF directories

ORBAX_SUBDIR = "orbax"
# Files of an HF checkpoint directory that are not weights: carried along so a converted directory
# is self-contained (the processor reads them).
_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory beside `directory`; on success rename it to `directory`.

    Everything written inside (weights, config, side files) becomes visible together, so a crash or
    kill at any point leaves either no directory at `directory` or a complete one, never weights
    of one checkpoint beside files of another. A non-empty `directory` is refused unless
    `overwrite`; then it is moved aside, the new one renamed in, and the old one deleted (a kill
    between the two renames leaves no directory at `directory` and the old one at `.NAME.old-*`).
    On an exception the temporary directory is removed.
    """
    import shutil
    import tempfile

    target = os.path.abspath(os.fspath(directory))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"{target} exists and is not a directory")
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        raise ValueError(f"{target} is not empty; choose a new directory or pass overwrite=True "
                         "(`--overwrite` on the command line) to replace it")
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        yield tmp
        if overwrite and os.path.isdir(target):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.replace(target, old)  # rename(2) may replace an empty directory
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            try:  # onto nothing or an empty directory; one that filled up meanwhile is refused
                os.replace(tmp, target)
            except OSError as e:
                raise ValueError(f"{target} is not empty (written to while converting?); nothing was "
                                 "replaced") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_orbax_dir(directory: str | os.PathLike) -> bool:
    return os.path.isdir(os.path.join(os.fspath(directory), ORBAX_SUBDIR))


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the config / tokenizer / processor / generation files of a checkpoint (not the weights)."""
    import shutil

    copied = []
    for name in _SIDE_FILES:
        if name in skip:
            continue
        path = os.path.join(os.fspath(src), name)
        if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(os.path.join(os.fspath(dst), name)):
            shutil.copyfile(path, os.path.join(os.fspath(dst), name))
            copied.append(name)
    return copied


def save_orbax(params_tree, config: Qwen3VLConfig, directory: str | os.PathLike, *,
               overwrite: bool = False) -> str:
    """Write `{directory}/orbax/0/{params, config}`: the parameter tree and the config as JSON.

    Written through `atomic_directory`: a non-empty `directory` is refused unless `overwrite`.
    """
    import orbax.checkpoint as ocp

    with atomic_directory(directory, overwrite=overwrite) as tmp:
        with ocp.CheckpointManager(os.path.join(tmp, ORBAX_SUBDIR)) as manager:
            manager.save(0, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params_tree), config=ocp.args.JsonSave(config.to_hf_dict())))
            manager.wait_until_finished()
    return os.path.join(os.path.abspath(os.fspath(directory)), ORBAX_SUBDIR)


def restore_orbax(directory: str | os.PathLike, abstract_tree_for):
    """Restore (config, params) from `save_orbax`'s layout.

    `abstract_tree_for(config)` gives the restore target (a tree of `ShapeDtypeStruct`), so the
    arrays come back with the shapes and dtypes the model expects, never guessed from the files.
    """
    import orbax.checkpoint as ocp

    root = os.path.abspath(os.path.join(os.fspath(directory), ORBAX_SUBDIR))
    with ocp.CheckpointManager(root) as manager:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"{root}: no finished Orbax checkpoint")
        raw = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        config = Qwen3VLConfig.from_hf_config(raw.config)
        target = abstract_tree_for(config)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        except ValueError as e:  # Orbax reports tree / shape mismatches as ValueError
            raise CheckpointError(f"{root}: the Orbax checkpoint does not match the model: {e}") from e
    return config, restored.params


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype for a safetensors storage dtype name ("float32", "bfloat16", "float16")."""
    import ml_dtypes

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if name not in dtypes:
        raise ValueError(f"storage dtype must be one of {sorted(dtypes)}, got {name!r}")
    return np.dtype(dtypes[name])


def write_safetensors(tensors: Mapping[str, np.ndarray], directory: str, max_shard_bytes: int | None = None) -> None:
    """`model.safetensors`, or shards of at most `max_shard_bytes` plus `model.safetensors.index.json`."""
    from safetensors.numpy import save_file

    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if max_shard_bytes and shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    if len(shards) == 1:
        save_file(dict(tensors), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def save_hf(params: Mapping[str, np.ndarray], config: Qwen3VLConfig, directory: str | os.PathLike, *,
            dtype: str | None = None, max_shard_bytes: int | None = None, overwrite: bool = False) -> str:
    """Write an HF checkpoint directory (config.json + safetensors, sharded when asked) HF loads.

    Written through `atomic_directory`: a non-empty `directory` (e.g. an earlier sharded export, whose index would otherwise still be
    read) is refused unless `overwrite`, which replaces it whole.
    """
    tensors = export_hf_tensors(params, config)
    if dtype is not None:
        np_dtype = storage_dtype(dtype)
        tensors = {k: v.astype(np_dtype) for k, v in tensors.items()}
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = dtype or str(np.dtype(next(iter(tensors.values())).dtype))
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
    return os.fspath(directory)
