"""Checkpoint files: Hugging Face safetensors and Orbax <-> our parameter tree (read, written, streamed).

The names, transforms and layouts come from the parameter tree's rule table (`params.RULES`):
every HF tensor name is matched by the first rule whose pattern fits; the rule names our
parameter path and a named transform (linear transpose, Conv3d-as-linear). Loading is strict:
every HF tensor is used exactly once (or listed as ignored with a reason), every parameter is
filled exactly once, every shape is checked, and all problems are reported together in one
`CheckpointError`. Only safetensors is read (never pickle), one shard at a time.

Our paths are dotted NNX state paths, e.g. `visual.blocks.3.attn.qkv.kernel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from .config import FP8Config, Qwen3VLConfig
from .params import (EXPERT_LAYOUTS, EXPERTS_RELEASED, LINEAR, CheckpointError, LazyTensor, Transform, as_lazy,
                     expert_layout_of, flatten_paths, hf_rule, keeps_dtype, nest_paths, ours_to_hf_name)
from .quant import TEXT_KINDS, VISION_KINDS, QuantSpec, module_kind, quantize_params

__all__ = [
    "safetensors_files",
    "iter_hf_tensors",
    "iter_hf_headers",
    "load_hf_params",
    "plan_hf_params",
    "checkpoint_quantization",
    "OrbaxMetadata",
    "orbax_metadata",
    "fp8_config",
    "export_hf_tensors",
    "export_hf_lazy",
    "open_orbax_params",
    "write_orbax",
    "save_orbax",
    "restore_orbax",
    "write_safetensors",
    "save_hf",
    "convert_checkpoint",
    "DEFAULT_MAX_SHARD_BYTES",
]


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
                # (safetensors' numpy side has no FP8 dtype: those are read by our own reader)
                fp8 = f.get_slice(name).get_dtype() == "F8_E4M3"
                yield file, name, _read_hf_tensor(file, name) if fp8 else f.get_tensor(name)


def iter_hf_headers(directory: str | os.PathLike) -> Iterator[tuple[str, str, tuple[int, ...], str]]:
    """Yield (shard file, HF name, shape, safetensors dtype name) from the headers alone (no data is read)."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(directory):
        try:
            with safe_open(file, framework="np") as f:
                entries = [(name, f.get_slice(name)) for name in f.keys()]
                entries = [(name, tuple(int(d) for d in s.get_shape()), s.get_dtype()) for name, s in entries]
        except SafetensorError as e:
            raise CheckpointError(
                f"{file}: cannot read the safetensors file (truncated or corrupt?): {e}") from e
        for name, shape, dtype in entries:
            yield file, name, shape, dtype


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name ("F32", "BF16", ...)."""
    import ml_dtypes

    names = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
             "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    if name not in names:
        raise CheckpointError(f"unsupported safetensors dtype {name}")
    return np.dtype(names[name])


def _safetensors_dtype(dtype: np.dtype) -> str:
    """The safetensors dtype name of a numpy dtype (the inverse of `_numpy_dtype`)."""
    for name in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3"):
        if np.dtype(dtype) == _numpy_dtype(name):
            return name
    raise ValueError(f"no safetensors dtype for {np.dtype(dtype)}")


def _read_hf_tensor(file: str, name: str) -> np.ndarray:
    """One tensor of a safetensors file, read (not memory-mapped) into one new array: the host holds
    the tensor once, and no mapped pages of the file count against the process."""
    problem = f"{file}: cannot read the safetensors file (truncated or corrupt?)"
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            info = json.loads(f.read(size))[name]
            dtype = _numpy_dtype(info["dtype"])
            begin, end = (int(x) for x in info["data_offsets"])
            count = (end - begin) // dtype.itemsize
            f.seek(8 + size + begin)
            array = np.fromfile(f, dtype=dtype, count=count)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{problem}: {name}: {e!r}") from e
    if array.size != count or count != int(np.prod(info["shape"], dtype=np.int64)):
        raise CheckpointError(f"{problem}: {name} has {array.size} of {count} elements")
    return array.reshape(info["shape"])


def _release_freed_memory() -> None:
    """Hand memory freed by the last tensor back to the OS (glibc keeps freed heap pages, e.g. of
    the writer threads' buffers, which would otherwise add up in the process's resident size)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _transformed_shape(fn: Callable, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `fn` (a transpose / reshape) gives an array of `shape`, computed without data."""
    import jax

    return tuple(int(d) for d in jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, np.float32)).shape)


def _fits(transform: Transform, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape `transform` makes of a stored `shape`, or None where it does not apply."""
    try:
        return _transformed_shape(transform.to_ours, shape)
    except (TypeError, ValueError):
        return None


def _load_to_ours(file: str, name: str, transform: Transform, dtype: np.dtype) -> np.ndarray:
    # transform (a view) and cast in one copy, straight into C order
    return np.asarray(transform.to_ours(_read_hf_tensor(file, name)), dtype=dtype, order="C")


def _read_hf_block(file: str, name: str, transform: Transform, index: tuple) -> np.ndarray:
    """The block `index` of our parameter from HF tensor `name`, through the memory-mapped file:
    only the pages of that block are touched (for a transposed weight, a strided slice)."""
    with _open_safetensors(file) as f:
        handle = f.get_slice(name)
        if handle.get_dtype() == "F8_E4M3":  # (no FP8 in safetensors' numpy side: a memory map of its bytes)
            handle = _mapped_tensor(file, name)
        return np.asarray(transform.read(lambda hf_index: handle[tuple(hf_index)], index))


def _mapped_tensor(file: str, name: str) -> np.ndarray:
    """Tensor `name` of a safetensors file as a read-only memory map (only the pages sliced are read)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(size))[name]
    begin = 8 + size + int(info["data_offsets"][0])
    return np.memmap(file, dtype=_numpy_dtype(info["dtype"]), mode="r", offset=begin, shape=tuple(info["shape"]))


def _load_to_hf(load: Callable[[], np.ndarray], transform: Transform, config: Qwen3VLConfig,
                dtype: np.dtype | None) -> np.ndarray:
    value = transform.to_hf(np.asarray(load()), config)
    return np.asarray(value, dtype=dtype or value.dtype, order="C")


def _with_callback(tensors: Mapping[str, LazyTensor], callback: Callable[[str], None] | None
                   ) -> dict[str, LazyTensor]:
    """The same tensors, calling `callback(source)` after each load (progress)."""
    if callback is None:
        return dict(tensors)

    def load(t: LazyTensor):
        value = t.load()
        callback(t.source)
        return value

    return {k: dataclasses.replace(t, load=functools.partial(load, t)) for k, t in tensors.items()}


# ---------------------------------------------------------------------- loading and exporting


def _layout(rule, stored_shape, shape) -> Transform:
    """The first of `rule`'s readers that turns `stored_shape` into our `shape` (else its transform)."""
    return next((t for t in rule.readers if _fits(t, stored_shape) == tuple(shape)), rule.transform)


def plan_hf_params(
    directory: str | os.PathLike,
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    config: Qwen3VLConfig,
    *,
    dtype=None,
) -> dict[str, LazyTensor]:
    """Check an HF checkpoint against `expected` from its headers alone, and plan the reads.

    `expected` maps each of our parameter paths to its (shape, dtype). Returns `{our path:
    LazyTensor}` whose `load()` reads the HF tensor, applies the rule's transform and casts to
    `dtype` (default: the expected dtype). Every problem (a tensor twice, unexpected, without a
    rule, filling a parameter twice, of the wrong shape, or missing) is found here, before any
    data is read, and all are raised together as one `CheckpointError`.
    """
    out: dict[str, LazyTensor] = {}
    problems: list[str] = []
    seen: dict[str, str] = {}  # HF name -> file
    claimed: dict[str, str] = {}  # our path -> HF name (also for tensors rejected on shape)
    headers = list(iter_hf_headers(directory))
    stored_shapes = {name: stored_shape for _, name, stored_shape, _ in headers}
    for file, name, stored_shape, _ in headers:
        if name in seen:
            problems.append(f"tensor {name} appears twice ({seen[name]} and {file})")
            continue
        seen[name] = file
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the logits reuse embed_tokens; a stored copy is redundant
        target = hf_rule(name)
        if target is None:
            problems.append(f"unexpected tensor {name} {list(stored_shape)} (no conversion rule)")
            continue
        path, rule = target
        if path not in expected:
            problems.append(f"unexpected tensor {name} {list(stored_shape)} (the model has no {path})")
            continue
        if path in claimed:
            problems.append(f"tensors {claimed[path]} and {name} both fill {path}")
            continue
        claimed[path] = name
        shape, want_dtype = expected[path]
        # A tensor stored in one of several layouts (the experts) is read through the first one
        # that gives the model's shape; every other tensor has one transform.
        transform = rule.transform
        if rule.layouts:
            weight = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else None
            found = hf_rule(weight) if weight in stored_shapes else None
            if found is not None and found[0] in expected:
                # a scale grid is read in its weight's layout (a square grid would fit either)
                transform = _layout(found[1], stored_shapes[weight], expected[found[0]][0])
            else:
                transform = _layout(rule, stored_shape, shape)
        try:
            ours_shape = _transformed_shape(transform.to_ours, stored_shape)
        except (TypeError, ValueError) as e:
            problems.append(f"shape mismatch for {name}: checkpoint {list(stored_shape)} does not fit "
                            f"{transform.name} ({e}), model expects {list(shape)}")
            continue
        if ours_shape != tuple(shape):
            problems.append(
                f"shape mismatch for {name}: checkpoint {list(stored_shape)} -> {list(ours_shape)} "
                f"after {transform.name}, model expects {list(shape)}"
            )
            continue
        want = np.dtype(want_dtype if keeps_dtype(path, want_dtype) else dtype or want_dtype)
        load = functools.partial(_load_to_ours, file, name, transform, want)
        out[path] = LazyTensor(ours_shape, want, load, name, functools.partial(_read_hf_block, file, name, transform),
                               transform.name)
    missing = sorted(set(expected) - set(claimed))
    for path in missing:
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
    return out


def checkpoint_quantization(directory: str | os.PathLike, config: Qwen3VLConfig) -> QuantSpec | None:
    """The FP8 layout of an HF checkpoint, from its headers: which modules hold FP8 weights (a weight
    with a sibling `weight_scale_inv`, or a layer's fused experts `gate_up_proj` / `down_proj` with
    `..._scale_inv`; every other tensor is not FP8, whatever `modules_to_not_convert` says) as a
    `quant.QuantSpec`, or None for a full-precision checkpoint.

    Every problem is reported in one `CheckpointError` naming the tensor: a scale without its
    weight, a scale grid that is not `[ceil(out/B), ceil(in/B)]` of its weight (`[E, ...]` of the
    experts, in the weight's layout), an FP8 weight without scales, scales of another dtype than
    float32 / bfloat16, FP8 weights outside the language model (the vision tower: not supported),
    or scales without a `quantization_config`.
    """
    headers = {name: (shape, dtype) for _, name, shape, dtype in iter_hf_headers(directory)}
    scales = sorted(n for n in headers if n.endswith("_scale_inv"))
    problems: list[str] = []
    if config.quantization is None:
        fp8 = sorted(n for n, (_, d) in headers.items() if d == "F8_E4M3")
        if scales or fp8:
            raise CheckpointError(f"{os.fspath(directory)}: {(scales + fp8)[0]} is a quantized tensor, but "
                                  "config.json has no quantization_config")
        return None
    block_out, block_in = config.quantization.weight_block_size
    modules, scale_dtypes = set(), set()
    for name in scales:
        weight = name[: -len("_scale_inv")]
        shape, dtype = headers[name]
        if weight not in headers:
            problems.append(f"{name}: a scale without its weight ({weight} is not in the checkpoint)")
            continue
        wshape, wdtype = headers[weight]
        target = hf_rule(weight)
        if target is None or target[1].transform is not (EXPERTS_RELEASED if ".mlp.experts." in name else LINEAR):
            problems.append(f"{name}: FP8 weights are read for linear layers and experts, not for {weight}")
            continue
        if wdtype != "F8_E4M3":
            problems.append(f"{name}: its weight {weight} is {wdtype}, not F8_E4M3")
        if dtype not in ("F32", "BF16"):
            problems.append(f"{name}: scales must be F32 or BF16, got {dtype}")
        grids = _scale_grids(wshape, (block_out, block_in), experts=".mlp.experts." in name)
        if list(shape) not in grids:
            expected = " or ".join(str(g) for g in grids) or "none: the weight is not a matrix"
            problems.append(f"{name}: scale grid {list(shape)} does not match its weight {weight} {list(wshape)} in "
                            f"blocks of {[block_out, block_in]} (weight_block_size): expected {expected}")
        scale_dtypes.add(dtype)
        modules.add(module_kind(target[0].rsplit(".", 1)[0]))
    for name, (_, dtype) in sorted(headers.items()):
        if dtype == "F8_E4M3" and f"{name}_scale_inv" not in headers:
            problems.append(f"{name} is F8_E4M3 but has no {name}_scale_inv")
    if len(scale_dtypes) > 1:
        problems.append(f"the scales mix dtypes {sorted(scale_dtypes)}; one dtype for all is supported")
    if problems:
        raise CheckpointError(f"{os.fspath(directory)}: {len(problems)} problem(s) with the FP8 weights:\n  - "
                              + "\n  - ".join(problems))
    if not modules:
        return None
    return QuantSpec("fp8", (block_in, block_out), frozenset(modules),
                     "bfloat16" if scale_dtypes == {"BF16"} else "float32")


def _scale_grids(shape, block: tuple[int, int], *, experts: bool) -> list[list[int]]:
    """The scale grids an FP8 weight of `shape` may carry in blocks of `block = [out, in]`
    (`weight_block_size`): `[ceil(out/B0), ceil(in/B1)]` of a linear's `[out, in]`; for a layer's
    experts `[E, ...]` the same per expert, the grid's last two axes in the weight's layout (the
    module layout `[E, out, in]`, or the released `[E, in, out]` with the grid swapped too)."""
    ceil = lambda n, b: -(-n // b)  # noqa: E731
    if not experts:
        return [[ceil(shape[0], block[0]), ceil(shape[1], block[1])]] if len(shape) == 2 else []
    if len(shape) != 3:
        return []
    e, a, b = shape
    grids = [[e, ceil(a, block[0]), ceil(b, block[1])], [e, ceil(a, block[1]), ceil(b, block[0])]]
    return grids[:1] if grids[0] == grids[1] else grids


def fp8_config(spec: QuantSpec):
    """The HF `quantization_config` (`config.FP8Config`) of an fp8 `QuantSpec` (what `save_hf` /
    `convert --quantize fp8 --to hf` write): `modules_to_not_convert` lists, as HF's module patterns
    (regular expressions from the start of the name), every linear kind the spec leaves in full
    precision, since HF's loader converts every other linear (and the router, never quantized here):
    `lm_head`, the vision tower whole where none of its linears is quantized, else its kinds one by one."""
    bi, bo = spec.block
    pattern = lambda kind: re.escape("model." + kind).replace(r"\*", r"\d+")  # noqa: E731
    keep = [] if "lm_head" in spec.modules else ["lm_head"]
    keep += [pattern(k) for k in TEXT_KINDS if k not in spec.modules]
    keep += [pattern("language_model.layers.*.mlp.gate")]
    vision = [pattern(k) for k in VISION_KINDS if k not in spec.modules]
    keep += vision if spec.modules & set(VISION_KINDS) else ["model.visual"]
    raw = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bo, bi],
           "modules_to_not_convert": keep}
    return FP8Config(weight_block_size=(bo, bi), raw=json.dumps(raw, sort_keys=True))


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
    (default: the expected dtype). Raises `CheckpointError` listing every problem at once (found
    from the headers by `plan_hf_params`, before any data is read). `on_tensor(hf_name)` is called
    after each tensor is read.
    """
    plan = _with_callback(plan_hf_params(directory, expected, config, dtype=dtype), on_tensor)
    return {path: tensor.load() for path, tensor in plan.items()}


def export_hf_tensors(params: Mapping[str, np.ndarray], config: Qwen3VLConfig, *,
                      expert_layout: str = "released") -> dict[str, np.ndarray]:
    """`{our path: array}` -> `{HF name: array}` (the inverse of `load_hf_params`); MoE experts in
    `expert_layout` ("released": `[E, H, 2I]`, "module": transformers-5's `[E, 2I, H]`)."""
    tensors = {}
    for path, value in params.items():
        name, transform = ours_to_hf_name(path, expert_layout)
        tensors[name] = np.ascontiguousarray(transform.to_hf(np.asarray(value), config))
    return tensors


def export_hf_lazy(params: Mapping[str, object], config: Qwen3VLConfig, *,
                   dtype=None, expert_layout: str = "released") -> dict[str, LazyTensor]:
    """`{our path: array or LazyTensor}` -> `{HF name: LazyTensor}`: `export_hf_tensors` one tensor at
    a time, cast to `dtype` (default: each tensor's own) when loaded."""
    out = {}
    for path, value in params.items():
        value = as_lazy(value, path)
        name, transform = ours_to_hf_name(path, expert_layout)
        shape = _transformed_shape(lambda a, t=transform: t.to_hf(a, config), value.shape)
        keep = dtype is None or keeps_dtype(path, value.dtype)  # (a quantized weight or its scales)
        want = np.dtype(value.dtype) if keep else np.dtype(dtype)
        load = functools.partial(_load_to_hf, value.load, transform, config, want)
        out[name] = LazyTensor(shape, want, load, name)
    return out


# ---------------------------------------------------------------------- Orbax and HF directories

ORBAX_SUBDIR = "orbax"
# Beside the config in an Orbax checkpoint: the HF layout its experts were read in, written back by
# a later export (`params.EXPERT_LAYOUTS`).
_EXPERT_LAYOUT_KEY = "qwen3vl_jax.expert_layout"
# An Orbax checkpoint of a quantized model records its `quant.QuantSpec` (method, block, modules,
# scale dtype) beside the config, so it is restored into the same quantized layout.
_QUANTIZATION_KEY = "qwen3vl_jax.quantization"


def _spec_to_json(spec: QuantSpec) -> dict:
    return {"method": spec.method, "block": list(spec.block), "modules": sorted(spec.modules),
            "scale_dtype": spec.scale_dtype}


def _spec_from_json(raw, root: str) -> QuantSpec | None:
    if raw is None:
        return None
    try:
        return QuantSpec(raw["method"], tuple(int(b) for b in raw["block"]), frozenset(raw["modules"]),
                         raw.get("scale_dtype", "float32"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{root}: {_QUANTIZATION_KEY} = {raw!r} is not a quantization spec: {e}") from e
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


# ---------------------------------------------------------------------- Orbax, streamed

# Orbax stores each array in chunks, and its data files, of at most this many bytes. Small pieces
# keep the writer's and the reader's buffers small (measured on a 1.2 GB tensor: ~0.4 GB of
# transient buffers at 64 MiB, ~0.9 GB at Orbax's default 2 GiB), and a sharded restore reads only
# the chunks its devices need.
ORBAX_CHUNK_BYTES = 64 * 2**20


@functools.cache
def _orbax_lazy_registry():
    """An Orbax type-handler registry that writes `LazyTensor` leaves one at a time.

    Orbax serializes all leaves of one type in one batch; for arrays it gets them already in
    memory. `LazyTensor`s are instead loaded, written (through Orbax's own numpy writer, so the
    stored format is Orbax's) and freed one after the other. Sharded `jax.Array`s that this host
    cannot gather keep Orbax's array handler (each host writes its own shards).
    """
    import asyncio

    import jax
    import orbax.checkpoint as ocp

    class LazyTensorHandler(ocp.type_handlers.NumpyHandler):
        async def serialize(self, values, infos, args=None):
            args = args or [ocp.type_handlers.SaveArgs()] * len(values)
            return [ocp.future.CommitFutureAwaitingContractedSignals(
                self._write_one_at_a_time(values, infos, args), name="lazy_tensor_handler")]

        async def _write_one_at_a_time(self, values, infos, args):
            for value, info, arg in zip(values, infos, args):
                if jax.process_index() != 0:  # numpy leaves are written by the primary process alone
                    continue
                array = value.checked(await asyncio.to_thread(value.load))  # off the event loop
                await self._background_serialize([array], [info], [arg])
                del array
                _release_freed_memory()

    return ocp.type_handlers.create_type_handler_registry(
        (LazyTensor, LazyTensorHandler()),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
    )


def write_orbax(params, config: Qwen3VLConfig, directory: str | os.PathLike, *,
                expert_layout: str = "released", quantization: QuantSpec | None = None) -> str:
    """Write `{directory}/orbax/0/{params, config}` one tensor at a time (no atomic rename: see `save_orbax`).

    `params`: the nested dict of the canonical layout (`{"language_model": {"layers": {0: ...}}}`).
    Leaves may be `LazyTensor`s (loaded as written), numpy arrays, or `jax.Array`s (copied to the
    host one at a time; a sharded array spanning hosts is written by Orbax shard by shard instead).
    """
    import jax
    import orbax.checkpoint as ocp

    def is_leaf(x):
        return isinstance(x, LazyTensor)

    def leaf(path, value):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return value
        return as_lazy(value, path)

    tree = nest_paths({path: leaf(path, value) for path, value in flatten_paths(params, is_leaf).items()})
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=ORBAX_CHUNK_BYTES), tree, is_leaf=is_leaf)
    root = os.path.join(os.fspath(directory), ORBAX_SUBDIR)
    handlers = {"params": ocp.PyTreeCheckpointHandler(type_handler_registry=_orbax_lazy_registry()),
                "config": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(root, item_handlers=handlers) as manager:
        params = ocp.args.PyTreeSave(tree, save_args=save_args, ocdbt_target_data_file_size=ORBAX_CHUNK_BYTES)
        stored = config.to_hf_dict()
        if config.text.is_moe:
            stored[_EXPERT_LAYOUT_KEY] = expert_layout
        if quantization is not None:
            stored[_QUANTIZATION_KEY] = _spec_to_json(quantization)
        manager.save(0, args=ocp.args.Composite(params=params, config=ocp.args.JsonSave(stored)))
        manager.wait_until_finished()
    return root


def save_orbax(params_tree, config: Qwen3VLConfig, directory: str | os.PathLike, *,
               overwrite: bool = False, expert_layout: str = "released", quantization: QuantSpec | None = None
               ) -> str:
    """Write `{directory}/orbax/0/{params, config}`: the parameter tree and the config as JSON.

    Streamed by `write_orbax` (one tensor on the host at a time), through `atomic_directory`: a
    non-empty `directory` is refused unless `overwrite`.
    """
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        write_orbax(params_tree, config, tmp, expert_layout=expert_layout, quantization=quantization)
    return os.path.join(os.path.abspath(os.fspath(directory)), ORBAX_SUBDIR)


def _orbax_handlers(params_handler: str) -> dict:
    import orbax.checkpoint as ocp

    if params_handler == "standard":
        return {"params": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
    return {"params": ocp.PyTreeCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}


def _check_orbax_params(manager, step: int, root: str, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Compare the stored tree (Orbax's metadata: names and shapes, no data) with `{our path: shape}`;
    every missing, unexpected or mis-shaped parameter is reported in one `CheckpointError`."""
    stored = {path: tuple(int(d) for d in m.shape)
              for path, m in flatten_paths(manager.item_metadata(step)["params"].tree).items()}
    expected = {path: tuple(int(d) for d in shape) for path, shape in expected.items()}
    problems = [f"missing parameter {p} {list(expected[p])}" for p in sorted(set(expected) - set(stored))]
    problems += [f"unexpected parameter {p} {list(stored[p])} (the model has no {p})"
                 for p in sorted(set(stored) - set(expected))]
    problems += [f"shape mismatch for {p}: checkpoint {list(stored[p])}, model expects {list(expected[p])}"
                 for p in sorted(set(stored) & set(expected)) if stored[p] != expected[p]]
    if problems:
        raise CheckpointError(f"{root}: the Orbax checkpoint does not match the model: {len(problems)} "
                              "problem(s):\n  - " + "\n  - ".join(problems))


@dataclasses.dataclass(frozen=True)
class OrbaxMetadata:
    """What `save_orbax` records beside the parameters: the config, the HF expert layout the experts
    were read in (`params.EXPERT_LAYOUTS`, for a later export) and the `quant.QuantSpec` of a
    quantized model (None otherwise)."""

    config: Qwen3VLConfig
    expert_layout: str
    quantization: QuantSpec | None


def _open_orbax(root: str, params_handler: str):
    """(manager, step, `OrbaxMetadata`) of `save_orbax`'s layout, reading the parameters with Orbax's
    "standard" or "pytree" handler; the caller closes the manager."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(root, item_handlers=_orbax_handlers(params_handler))
    try:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"{root}: no finished Orbax checkpoint")
        raw = dict(manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)
        layout = raw.pop(_EXPERT_LAYOUT_KEY, "released")
        if layout not in EXPERT_LAYOUTS:
            raise CheckpointError(f"{root}: {_EXPERT_LAYOUT_KEY} is {layout!r}, not one of {sorted(EXPERT_LAYOUTS)}")
        spec = _spec_from_json(raw.pop(_QUANTIZATION_KEY, None), root)
        return manager, step, OrbaxMetadata(Qwen3VLConfig.from_hf_config(raw), layout, spec)
    except BaseException:
        manager.close()
        raise


def orbax_metadata(directory: str | os.PathLike) -> OrbaxMetadata:
    """The config, expert layout and quantization recorded in a `save_orbax` checkpoint (no array is read)."""
    root = os.path.abspath(os.path.join(os.fspath(directory), ORBAX_SUBDIR))
    manager, _, metadata = _open_orbax(root, "standard")
    manager.close()
    return metadata


def restore_orbax(directory: str | os.PathLike, abstract_tree_for):
    """Restore (`OrbaxMetadata`, params) from `save_orbax`'s layout, opening it once.

    `abstract_tree_for(metadata)` gives the restore target (a tree of `ShapeDtypeStruct`), so the
    arrays come back with the shapes and dtypes the model expects, never guessed from the files. A
    leaf with a `sharding` is placed into it, each host reading only the chunks its devices need.
    The stored names and shapes are checked against the target first (`CheckpointError` listing
    every difference).
    """
    import orbax.checkpoint as ocp

    root = os.path.abspath(os.path.join(os.fspath(directory), ORBAX_SUBDIR))
    manager, step, metadata = _open_orbax(root, "standard")
    with manager:
        target = abstract_tree_for(metadata)
        shapes = {path: leaf.shape for path, leaf in flatten_paths(target).items()}
        _check_orbax_params(manager, step, root, shapes)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        except ValueError as e:  # Orbax reports tree / shape mismatches as ValueError
            raise CheckpointError(f"{root}: the Orbax checkpoint does not match the model: {e}") from e
    return metadata, restored.params


@contextlib.contextmanager
def open_orbax_params(directory: str | os.PathLike, expected_for, *, dtype=None
                      ) -> Iterator[tuple[OrbaxMetadata, dict[str, LazyTensor]]]:
    """Open `save_orbax`'s layout for reading one tensor at a time.

    `expected_for(metadata)` gives `{our path: (shape, dtype)}`. The stored tree (Orbax's metadata, no
    data) is checked against it first: every missing, unexpected or mis-shaped parameter is
    reported in one `CheckpointError`. Yields (`OrbaxMetadata`, `{our path: LazyTensor}`); each `load()`
    restores that one array (cast to `dtype`, default the expected one) while the context is open.
    """
    import jax
    import orbax.checkpoint as ocp

    root = os.path.abspath(os.path.join(os.fspath(directory), ORBAX_SUBDIR))
    manager, step, metadata = _open_orbax(root, "pytree")
    layout = metadata.expert_layout
    with manager:
        expected = expected_for(metadata)
        _check_orbax_params(manager, step, root, {p: shape for p, (shape, _) in expected.items()})

        def read(path: str, shape: tuple[int, ...], want: np.dtype) -> np.ndarray:
            item = nest_paths({path: jax.ShapeDtypeStruct(shape, want)})
            restore_args = nest_paths({path: ocp.RestoreArgs(restore_type=np.ndarray, dtype=want)})
            out = manager.restore(step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))).params
            (value,) = flatten_paths(out).values()
            return np.asarray(value, dtype=want, order="C")

        tensors = {}
        for path, (shape, want_dtype) in expected.items():
            want = np.dtype(want_dtype if keeps_dtype(path, want_dtype) else dtype or want_dtype)
            load = functools.partial(read, path, tuple(shape), want)
            # (the experts carry the layout they were first read in, for a later export)
            tensors[path] = LazyTensor(tuple(shape), want, load, path, transform=EXPERT_LAYOUTS[layout].name
                                       if ".mlp.experts." in path else "")
        yield metadata, tensors


# ---------------------------------------------------------------------- safetensors, streamed

# `convert --to hf` shards at this size by default (Qwen's released checkpoints use ~5 GB shards).
# The host never holds a whole shard (`write_safetensors` writes one tensor at a time), so this
# only sets the file sizes.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype for a safetensors storage dtype name ("float32", "bfloat16", "float16")."""
    import ml_dtypes

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if name not in dtypes:
        raise ValueError(f"storage dtype must be one of {sorted(dtypes)}, got {name!r}")
    return np.dtype(dtypes[name])


def _write_safetensors_file(path: str, tensors: Mapping[str, LazyTensor]) -> None:
    """One safetensors file, streamed: the header (known from shapes and dtypes) first, then each
    tensor's bytes, loaded one at a time. The layout is the one `safetensors.numpy.save_file`
    writes: wider dtypes first then by name (so every tensor is aligned to its item size), header
    JSON padded with spaces to 8 bytes."""
    order = sorted(tensors, key=lambda n: (-np.dtype(tensors[n].dtype).itemsize, n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _safetensors_dtype(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            array = tensors[name].checked(tensors[name].load())
            f.write(array.reshape(-1).view(np.uint8).data)
            del array
            _release_freed_memory()


def write_safetensors(tensors: Mapping[str, object], directory: str,
                      max_shard_bytes: int | None = None) -> None:
    """`model.safetensors`, or shards of at most `max_shard_bytes` plus `model.safetensors.index.json`.

    `tensors`: `{HF name: array or LazyTensor}`. Written one tensor at a time (`_write_safetensors_file`),
    so with `LazyTensor`s the host holds one tensor, not one shard. Shards take the names in sorted
    order, a new shard starting when the next tensor would overflow the current one.
    """
    tensors = {name: as_lazy(t, name) for name, t in tensors.items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if max_shard_bytes and shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    if len(shards) == 1:
        _write_safetensors_file(os.path.join(directory, "model.safetensors"), tensors)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors_file(os.path.join(directory, file), {n: tensors[n] for n in shard})
        weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def write_hf(params: Mapping[str, object], config: Qwen3VLConfig, directory: str | os.PathLike, *,
             dtype: str | None = None, max_shard_bytes: int | None = None, expert_layout: str = "released") -> None:
    """config.json + safetensors for `{our path: array or LazyTensor}` into `directory`, one tensor at
    a time (no atomic rename: see `save_hf`); MoE experts in `expert_layout`."""
    tensors = export_hf_lazy(params, config, dtype=None if dtype is None else storage_dtype(dtype),
                             expert_layout=expert_layout)
    hf_config = config.to_hf_dict()
    plain = [t.dtype for t in tensors.values() if not keeps_dtype(t.source, t.dtype) and not t.source.endswith("_scale_inv")]
    hf_config["dtype"] = dtype or str(np.dtype(plain[0] if plain else np.float32))
    write_safetensors(tensors, os.fspath(directory), max_shard_bytes)
    with open(os.path.join(os.fspath(directory), "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


def save_hf(params: Mapping[str, object], config: Qwen3VLConfig, directory: str | os.PathLike, *,
            dtype: str | None = None, max_shard_bytes: int | None = None, overwrite: bool = False,
            expert_layout: str = "released") -> str:
    """Write an HF checkpoint directory (config.json + safetensors, sharded when asked) HF loads.

    `params`: `{our path: array or LazyTensor}`, written one tensor at a time. Written through
    `atomic_directory`: a non-empty `directory` (e.g. an earlier sharded export, whose index would
    otherwise still be read) is refused unless `overwrite`, which replaces it whole.
    """
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        write_hf(params, config, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes, expert_layout=expert_layout)
    return os.fspath(directory)


# ---------------------------------------------------------------------- convert, streamed


def convert_checkpoint(source: str | os.PathLike, out: str | os.PathLike, expected_for, *, to: str = "orbax",
                       dtype: str = "bfloat16", max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
                       overwrite: bool = False, on_tensor: Callable[[str], None] | None = None,
                       quantize: QuantSpec | None = None) -> tuple[Qwen3VLConfig, int, list[str]]:
    """`qwen3vl-jax convert`: an HF or Orbax checkpoint directory to Orbax (`to="orbax"`) or HF
    safetensors (`to="hf"`, shards of at most `max_shard_bytes`), stored in `dtype`.

    Streamed: the source is checked whole from its headers / metadata first (every problem in one
    `CheckpointError`, before anything is written), then each tensor is read, transformed, cast
    and written before the next is read; the host holds a few tensors whatever the model's size.
    MoE experts are written in the layout they were read in (`params.EXPERT_LAYOUTS`; an Orbax
    checkpoint records the layout of the HF checkpoint it was made from), so HF -> Orbax -> HF gives
    back the same bytes.
    `expected_for(config)` gives `{our path: (shape, dtype)}` (the canonical per-block layout).
    Everything is written into a temporary directory renamed to `out` at the end
    (`atomic_directory`), side files (tokenizer, processor, generation config) included.
    Quantized weights: an FP8 checkpoint's weights and scales are written as they are (not cast to
    `dtype`), so HF FP8 -> HF gives back the same tensors; `quantize` (a `quant.QuantSpec`)
    quantizes a full-precision checkpoint as it is streamed (to HF only as "fp8": HF's fine-grained
    format; int8 / int4 to Orbax).
    Returns (config, number of parameters, side files copied).
    """
    if to not in ("orbax", "hf"):
        raise ValueError(f"to must be 'orbax' or 'hf', got {to!r}")
    if quantize is not None and to == "hf" and quantize.method != "fp8":
        raise ValueError(f"--quantize {quantize.method} has no HF checkpoint format here: write it --to orbax, "
                         "or quantize to fp8 (HF's fine-grained FP8)")
    np_dtype = storage_dtype(dtype)
    # Refuse a non-empty target before the (long) conversion, and again when renaming into place.
    with atomic_directory(out, overwrite=overwrite) as tmp, contextlib.ExitStack() as stack:
        if is_orbax_dir(source):
            if quantize is not None:
                raise ValueError("--quantize reads an HF checkpoint; convert the Orbax one to HF first")
            def expected_source(metadata):
                spec = metadata.quantization
                if spec is not None and to == "hf" and spec.method != "fp8":
                    raise ValueError(f"{source} holds {spec.method} weights, which have no HF checkpoint format here")
                return expected_for(metadata.config) if spec is None else expected_for(metadata.config, quantization=spec)

            metadata, params = stack.enter_context(open_orbax_params(source, expected_source, dtype=np_dtype))
            config, spec = metadata.config, metadata.quantization
        else:
            config = Qwen3VLConfig.from_hf_config(source)
            spec = checkpoint_quantization(source, config)
            if spec is not None and quantize is not None:
                raise ValueError(f"{source} is already an FP8 checkpoint; convert it without --quantize")
            expected = expected_for(config) if spec is None else expected_for(config, quantization=spec)
            params = plan_hf_params(source, expected, config, dtype=np_dtype)
            if quantize is not None:
                params = quantize_params(params, quantize)
                spec = quantize
                if quantize.method == "fp8":
                    config = config.replace(quantization=fp8_config(quantize))
        layout = expert_layout_of(params) or "released"
        params = _with_callback(params, on_tensor)
        if to == "orbax":
            write_orbax(nest_paths(params), config, tmp, expert_layout=layout, quantization=spec)
        else:
            write_hf(params, config, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes, expert_layout=layout)
        # An HF export writes its own config.json; an Orbax directory keeps the source's beside the
        # weights. Side files are written before the directory becomes visible under its name.
        copied = copy_side_files(source, tmp, skip=("config.json",) if to == "hf" else ())
    n = int(sum(int(np.prod(t.shape, dtype=np.int64)) for t in params.values()))
    return config, n, copied
