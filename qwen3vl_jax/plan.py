"""Per-device memory of a mesh before any device is touched: `qwen3vl-jax plan`.

    from qwen3vl_jax.plan import plan
    p = plan("8b", "tensor=8", batch=4, context=32768, device_memory="80GB")
    print(p.table())

Everything is computed from shapes: the model is built abstractly (`Qwen3VL.abstract`) and each
parameter is placed by its partition rule (`sharding.param_spec`, the converter's `spec` column),
so the figures follow the same rules a sharded `from_pretrained` uses. Per device:

- **parameters**: each parameter's bytes divided by the product of the mesh axes its spec splits
  it over (the vision tower is replicated unless `vision="tensor"`; a norm is replicated).
- **optimizer** (training): what the project's `Trainer` keeps. Its AdamW is optax's, whose two
  moments are `zeros_like(params)`: the parameter dtype, sharded as the parameter. The Trainer
  differentiates the parameters in their storage dtype, and `finetune` loads them as float32
  master weights (`param_dtype=float32`; `dtype` is the compute dtype). So a training plan stores
  parameters in float32 by default (`param_dtype`): 4 bytes of parameter + 8 of moments per
  trainable parameter. (The step counters are a few bytes.)
- **gradients** (training): the accumulator the Trainer carries between micro-steps, plus the
  gradient tree the micro-step computes before adding it in: 2 x the trainable parameters' bytes.
- **KV cache** (inference): `2 x N x B x S x G x D` in the compute dtype at `S = context` slots,
  batch over `data x fsdp` and kv heads over `tensor`, each only where the axis divides it
  (`sharding.constrain` leaves a dimension whole otherwise).
- **activations**: the peak temporaries of one step, a model whose terms `Plan.activation_terms`
  lists. Inference: the prefill of the whole `context`-token prompt at once (what `generate` does
  for a prompt bucket); decoding one token needs far less. Training: one micro-step (forward and
  backward of `batch` rows of `context` tokens), with or without `remat`. B rows are split over
  `data x fsdp` when they divide, else whole on every device; heads and MLP columns over `tensor`.
  The terms (b rows per device, L tokens, E hidden, i = I / tensor, h, g heads per device):
    block weights  one decoder block's weights in the compute dtype (the scan's slice; all-gathered
                   over `fsdp` when the batch is split over it, as FSDP does);
    hidden states  3 x b.L.E (the residual stream, a norm's output, a projection's output);
    MLP            2 x b.L.i; rotary cos/sin 2 x b.L.D float32;
    LM head        prefill: the last position's logits; training: the chunked loss's float32
                   `[chunk, V/tensor]` logits (x 3: values, softmax, cotangent); plus the head
                   gathered over `fsdp` when the batch is split over it;
    training       with remat: each block's input saved (N x b.L.E) and one block recomputed and
                   differentiated at a time; without: every block's residuals saved. A block's
                   residuals: 4 x b.L.E + 4 x b.L.i + 2 x b.L.h.D + 2 x b.L.g.D, plus attention's
                   backward (`pallas_kernels.attention.reference`, a flash backward; the Pallas
                   path's backward runs it too): the float32 log-sum-exp (b.h.L), float32
                   gradient accumulators (b.L.(h + 2g).D), the blocked layout's copies of q, dO,
                   k, v (b.L.(2h + 2g).D) and one block pair's float32 tiles (4 x h.Q.K).
                   The loss's LM-head phase and the blocks' backward (attention's, and with remat
                   the recomputed block's residuals) never overlap: the peak counts the larger.
  Not modelled: the vision tower's activations (the plan is a text prefill / a text-only step; the
  tower's parameters, moments and gradients are counted), and runtime reserves (CUDA context,
  XLA's workspace).

`check(plan)` compiles the real steps on abstract full-size shapes over a mesh of that many (host
CPU) devices in a subprocess and reads `compiled.memory_analysis()` per device: the prefill at the
context (inference), the train micro-step and the optimizer update (training). See its docstring
for what a CPU compilation does and does not tell about an accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.attention.reference import ATTENTION_BLOCK, balanced_block

from .config import Qwen3VLConfig, preset as preset_config
from .generate import prefill
from .model import MultimodalInputs, Qwen3VL, expected_params
from .params import keeps_dtype
from .quant import QuantSpec
from .sharding import AXES, BATCH, ShardingError, check_mesh, make_mesh, param_shardings, param_spec, parse_mesh
from .training.lora import LoRAKey
from .training.optim import OptimConfig, build_optimizer, param_path
from .training.trainer import apply_update, micro_step, trainable_filter

__all__ = ["Plan", "plan", "resolve_mesh", "parse_bytes", "smallest_mesh", "check", "check_table",
           "format_bytes", "attention_backward_bytes"]

GiB = 2**30
DTYPES = {"float32": 4, "bfloat16": 2}


def attention_backward_bytes(b: int, L: int, h: int, g: int, D: int, c: int) -> int:
    """What the attention spec's flash backward holds beyond the block's residuals (b rows of L
    tokens, h query and g kv heads of width D, compute dtype of c bytes): linear in L, plus one
    block pair's float32 tiles (scores, weights, their cotangents)."""
    blk = balanced_block(L, ATTENTION_BLOCK)
    return 4 * b * h * L + b * L * D * (4 * (h + 2 * g) + c * (2 * h + 2 * g)) + 4 * 4 * h * blk * blk
LOSS_CHUNK = 1024  # `Trainer(chunk_size=...)`'s default: tokens per LM-head call in the loss


def parse_bytes(value) -> int:
    """`"80GB"` (10^9), `"80GiB"` (2^30), `"512MiB"`, or a number of bytes -> bytes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)?", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"device memory {value!r} is not a size like 80GB, 141GB or 96GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def format_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def resolve_mesh(spec, devices: int | None = None) -> dict[str, int]:
    """`{axis: size}` over `sharding.AXES` for an abstract mesh of `devices` devices.

    `spec` as `sharding.make_mesh` takes it; one axis may be -1 (the rest) when `devices` is given.
    Raises `ShardingError` for unknown axes or a product that is not `devices`.
    """
    sizes = parse_mesh(spec if spec not in (None, "") else {"data": -1 if devices is not None else 1})
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if devices is None:
            raise ShardingError(f"mesh {spec!r}: an axis of size -1 needs the device count (--devices)")
        if devices % known:
            raise ShardingError(f"mesh {spec!r}: {devices} devices do not divide by {known}")
        sizes = {k: (devices // known if v == -1 else v) for k, v in sizes.items()}
    total = math.prod(sizes.values())
    if devices is not None and total != devices:
        shape = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise ShardingError(f"mesh {shape} needs {total} devices, but {devices} are given")
    return sizes


def _abstract_mesh(sizes: Mapping[str, int]):
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES)


def _config(config_or_preset) -> tuple[Qwen3VLConfig, str]:
    if isinstance(config_or_preset, Qwen3VLConfig):
        return config_or_preset, "config"
    name = str(config_or_preset)
    if os.path.exists(name):
        return Qwen3VLConfig.from_hf_config(name), os.path.basename(os.path.abspath(name))
    try:
        return preset_config(name), name
    except KeyError as e:
        raise ValueError(e.args[0]) from None


@functools.lru_cache(maxsize=16)
def _param_shapes(config: Qwen3VLConfig, quantize: str | None = None
                  ) -> tuple[tuple[str, tuple[int, ...], int | None], ...]:
    """Canonical `(path, shape, bytes per element)` of every parameter (abstract; no memory is
    allocated); the element size is that of a quantized weight or its scales (`quantize`), None
    for a parameter stored in `param_dtype`."""
    spec = None
    if quantize is not None:  # an FP8 checkpoint's own block size, else the default 128 x 128
        block = config.quantization.weight_block_size if config.quantization is not None else (128, 128)
        spec = QuantSpec.make(quantize, block=block)
    return tuple((path, shape, np.dtype(dtype).itemsize if keeps_dtype(path, dtype) else None)
                 for path, (shape, dtype) in expected_params(config, scan_layers=True, quantization=spec).items())


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One parameter: its canonical path, shape, spec, the devices it is split over, bytes per device."""

    path: str
    shape: tuple[int, ...]
    spec: tuple
    split: int
    bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one configuration on one mesh (see the module docstring)."""

    name: str
    config: Qwen3VLConfig = dataclasses.field(repr=False)
    mesh: dict[str, int]
    batch: int
    context: int
    train: bool
    remat: bool
    dtype: str
    param_dtype: str
    vision: str
    parameters: int  # count
    params_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    activation_terms: dict[str, int]
    input_bytes: int  # the step's batch inputs (tokens, positions, ...), per device
    device_memory: int | None = None
    param_rows: tuple[ParamRow, ...] = dataclasses.field(default=(), repr=False)
    quantize: str | None = None  # the language model's linears and experts stored quantized

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def rows_per_device(self) -> int:
        """Batch rows per device: split over data x fsdp when they divide it, else all of them."""
        dp = math.prod(self.mesh[a] for a in BATCH)
        return self.batch // dp if self.batch % dp == 0 else self.batch

    @property
    def mesh_spec(self) -> str:
        return ",".join(f"{a}={self.mesh[a]}" for a in AXES)

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.optimizer_bytes + self.gradient_bytes + self.kv_cache_bytes
                + self.activation_bytes + self.input_bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total_bytes <= self.device_memory

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.device_memory is None else self.device_memory - self.total_bytes

    def rows(self) -> list[tuple[str, int]]:
        out = [("parameters", self.params_bytes)]
        if self.train:
            out += [("optimizer (AdamW moments)", self.optimizer_bytes),
                    ("gradients (accumulator + step)", self.gradient_bytes)]
        else:
            out.append((f"KV cache ({self.context} slots)", self.kv_cache_bytes))
        out.append(("activations (peak)", self.activation_bytes))
        out.append(("inputs", self.input_bytes))
        return out

    def table(self, terms: bool = True) -> str:
        """The plan as text: the figures per device, then whether it fits."""
        what = (f"train micro-step of {self.batch} x {self.context} tokens"
                + (" with remat" if self.remat else " without remat")) if self.train else \
            f"inference: prefill of {self.batch} x {self.context} tokens into the KV cache"
        devices = f"{self.devices} device" + ("s" if self.devices > 1 else "")
        lines = [f"{self.name}: {self.parameters:,} parameters; mesh {self.mesh_spec} ({devices}); {what}",
                 f"compute {self.dtype}, parameters {self.param_dtype}"
                 + (f" (language-model linears and experts {self.quantize})" if self.quantize else "")
                 + "; vision tower "
                 + ("replicated" if self.vision == "data" else "tensor-parallel"), "",
                 f"{'per device':<34}{'GiB':>10}"]
        for label, value in self.rows():
            lines.append(f"  {label:<32}{value / GiB:>10.2f}")
            if terms and label.startswith("activations"):
                for term, v in self.activation_terms.items():
                    if v:
                        lines.append(f"      {term:<28}{v / GiB:>10.2f}")
        lines.append(f"  {'total':<32}{self.total_bytes / GiB:>10.2f}")
        if self.device_memory is not None:
            pct = 100 * self.headroom_bytes / self.device_memory
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"\n{verdict} in {self.device_memory / GiB:.2f} GiB per device: headroom "
                         f"{self.headroom_bytes / GiB:.2f} GiB ({pct:.0f}%)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        skip = ("config", "param_rows")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return fields | {
            "devices": self.devices, "total_bytes": self.total_bytes, "fits": self.fits,
            "headroom_bytes": self.headroom_bytes}


def _head_path(config: Qwen3VLConfig) -> str:
    return "language_model.embed_tokens.embedding" if config.tie_word_embeddings else "lm_head.kernel"


def _split(spec, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in spec if a is not None)


def plan(config_or_preset, mesh_spec="", batch: int = 1, context: int = 4096, train: bool = False, *,
         dtype: str = "bfloat16", param_dtype: str | None = None, remat: bool = False, vision: str = "data",
         devices: int | None = None, device_memory=None, chunk_size: int = LOSS_CHUNK,
         quantize: str | None = None) -> Plan:
    """The per-device memory of `config_or_preset` (a `Qwen3VLConfig`, a preset name, or an HF
    `config.json` / checkpoint directory) on the mesh `mesh_spec` (`"data=2,tensor=4"`).

    batch, context: rows and tokens per row (the KV cache's slots; a training micro-batch's length).
    train: a training micro-step (optimizer, gradients) instead of inference (KV cache).
    dtype: compute dtype; param_dtype: storage dtype (default: float32 when training, as
      `finetune` loads master weights, else `dtype`).
    remat: recompute each block in the backward pass (`Qwen3VL(remat=True)`, `finetune --remat`).
    vision: "data" (the tower replicated, the default) or "tensor" (`sharding`'s two modes).
    devices: if given, the mesh must use exactly this many devices (and may contain one -1).
    device_memory: bytes or a size like "80GB" to compare the total against.
    quantize: "fp8", "int8" or "int4": the language model's linears and experts stored quantized
      (`qwen3vl_jax.quant`; fp8 in 128 x 128 blocks with float32 scales, int4 in groups of 128;
      the embeddings, norms, vision tower and `lm_head` in `param_dtype`); inference only. An FP8
      checkpoint's config (`quantization_config`) plans as "fp8" unless `quantize` says otherwise.
    Raises `ShardingError` (a `ValueError`) naming the parameter and axis for a mesh that cannot
    split the model, and `ValueError` for other bad arguments.
    """
    config, name = _config(config_or_preset)
    for label, value in (("batch", batch), ("context", context), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if context > config.text.max_position_embeddings:
        raise ValueError(f"context {context} is past the model's context ({config.text.max_position_embeddings} "
                         "positions, max_position_embeddings)")
    if quantize is None and config.quantization is not None and not train:
        quantize = "fp8"  # an FP8 checkpoint keeps its weights in FP8 (`from_pretrained`)
    if quantize is not None and train:
        raise ValueError("quantize plans inference only (a full fine-tuning step; QLoRA's adapters are small)")
    param_dtype = param_dtype or ("float32" if train else dtype)
    for label, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{label} must be one of {sorted(DTYPES)}, got {value!r}")
    c, p = DTYPES[dtype], DTYPES[param_dtype]
    sizes = resolve_mesh(mesh_spec, devices)
    mesh = _abstract_mesh(sizes)
    check_mesh(config, mesh, vision=vision)

    rows = []
    for path, shape, itemsize in _param_shapes(config, quantize):
        spec = tuple(param_spec(path, shape, mesh, vision=vision))
        split = _split(spec, sizes)
        rows.append(ParamRow(path, shape, spec, split, math.prod(shape) // split * (itemsize or p)))
    count = sum(math.prod(shape) for _, shape, _ in _param_shapes(config))  # (the model's, unquantized)
    params_bytes = sum(r.bytes_per_device for r in rows)

    text = config.text
    data, fsdp, tp = sizes["data"], sizes["fsdp"], sizes["tensor"]
    dp = data * fsdp
    batch_split = batch % dp == 0
    b = batch // dp if batch_split else batch
    gathered = fsdp > 1 and batch_split  # FSDP: weights all-gathered for the local rows
    L, E, D = context, text.hidden_size, text.head_dim
    h = text.num_attention_heads // tp
    g = text.num_key_value_heads // tp if text.num_key_value_heads % tp == 0 else text.num_key_value_heads
    i = text.intermediate_size // tp
    v = text.vocab_size // tp if text.vocab_size % tp == 0 else text.vocab_size

    def as_read(row: ParamRow) -> int:  # elements per device as a step reads them
        split = row.split // (fsdp if gathered and "fsdp" in row.spec else 1)
        return math.prod(row.shape) // split

    block = sum(as_read(r) for r in rows if r.path.startswith("language_model.layers.0."))
    head = next(r for r in rows if r.path == _head_path(config))
    hidden = b * L * E * c
    mlp = b * L * i * c
    terms: dict[str, int] = {"block weights": block * c}
    if not train:
        terms["hidden states"] = 3 * hidden
        terms["MLP"] = 2 * mlp
        terms["rotary cos/sin"] = 2 * b * L * D * 4
        terms["LM head"] = b * v * c + (math.prod(head.shape) // tp * c if gathered else 0)
        kv_cache = 2 * text.num_hidden_layers * b * L * g * D * c
        inputs = b * L * (E * c + 3 * 4 + 1) + 20  # embeds, positions, mask; key + 3 sampling scalars
        optimizer = gradients = overlap = 0
    else:
        residuals = 4 * hidden + 4 * mlp + 2 * b * L * (h + g) * D * c
        attention = attention_backward_bytes(b, L, h, g, D, c)
        if remat:
            terms["saved block inputs"] = text.num_hidden_layers * hidden
            terms["one block's residuals"] = residuals
            terms["attention backward"] = attention
        else:
            terms["saved block residuals"] = text.num_hidden_layers * residuals
            terms["attention backward"] = text.num_hidden_layers * attention
        terms["rotary cos/sin"] = 2 * b * L * D * 4
        chunk = min(chunk_size, batch * L)
        terms["LM head / loss"] = 3 * chunk * v * 4 + (math.prod(head.shape) // tp * c if gathered else 0)
        # The loss's LM-head phase ends before the blocks' backward begins: the peak holds the
        # larger of the two, not both.
        backward = attention + (residuals if remat else 0)
        overlap = min(terms["LM head / loss"], backward)
        kv_cache = 0
        optimizer = 2 * params_bytes  # mu and nu: zeros_like(params)
        gradients = 2 * params_bytes  # the accumulator + the micro-step's gradient
        inputs = b * L * (4 * 3 + 3 * 4 + 1) + b * 4 + 16  # ids, visual_index, labels, positions, mask
    return Plan(
        name=name, config=config, mesh=dict(sizes), batch=int(batch), context=int(context), train=bool(train),
        remat=bool(remat), dtype=dtype, param_dtype=param_dtype, vision=vision, parameters=count,
        params_bytes=params_bytes, optimizer_bytes=optimizer, gradient_bytes=gradients,
        kv_cache_bytes=kv_cache, activation_bytes=sum(terms.values()) - overlap, activation_terms=terms,
        input_bytes=inputs, device_memory=None if device_memory is None else parse_bytes(device_memory),
        param_rows=tuple(rows), quantize=quantize)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smallest_mesh(config_or_preset, batch: int = 1, context: int = 4096, train: bool = False, *,
                  device_memory, max_devices: int = 512, **kwargs) -> Plan | None:
    """The plan on the fewest devices (powers of two) that fits `device_memory`, or None.

    For each device count, every `expert x fsdp x tensor` split the model allows (data = 1:
    replicas only add memory; `expert` > 1 only for MoE models) is planned and the one with the
    smallest total kept.
    """
    config, _ = _config(config_or_preset)
    n = 1
    while n <= max_devices:
        best = None
        for ep in _divisors(n) if config.text.is_moe else (1,):
            for tp in _divisors(n // ep):
                try:
                    candidate = plan(config_or_preset, f"expert={ep},fsdp={n // ep // tp},tensor={tp}", batch,
                                     context, train, device_memory=device_memory, **kwargs)
                except ShardingError:
                    continue
                if best is None or candidate.total_bytes < best.total_bytes:
                    best = candidate
        if best is not None and best.fits:
            return best
        n *= 2
    return None


# ---------------------------------------------------------------------- the compiled check


def check(p: Plan, *, context: int | None = None, dtype: str | None = None,
          timeout: float | None = None) -> dict:
    """Compile the plan's steps on abstract full-size shapes over `p.devices` host CPU devices (a
    subprocess with `--xla_force_host_platform_device_count`) and return each step's
    `memory_analysis()` per device, with the analytic figures beside them.

    Returns `{"context", "steps": {step: {"argument", "output", "alias", "temp", "peak"}}, "rows":
    [(label, analytic, compiled)], "plan", "seconds"}`. `context`, `dtype`: compile at this many
    tokens / this compute dtype instead of the plan's (the plan is recomputed to match, so the two
    sides stay comparable; "plan" is the one compared). Training keeps its parameter dtype.

    What a CPU compilation tells: arguments and outputs are exact per-device layouts (parameters,
    optimizer state, gradient accumulator, KV cache); temporaries are XLA's buffer assignment for
    the CPU backend, which differs from a GPU's: the CPU computes bfloat16 matmuls in float32 (float32
    copies of operands), the attention runs its XLA spec (the GPU runs the Pallas kernels under
    `shard_map`), and GSPMD makes the same partitioning decisions. Loop-invariant code motion is
    disabled so XLA does not hoist the float32 conversion of the whole stacked weights out of the
    layer loop (a CPU-only artefact: the GPU multiplies bfloat16 directly). A quantized plan is not
    compiled (ValueError).
    """
    if p.quantize is not None:
        raise ValueError("plan --check compiles full-precision steps only; drop --quantize")
    asked = (("context", context), ("dtype", dtype))
    changes = {k: v for k, v in asked if v is not None and v != getattr(p, k)}
    if "dtype" in changes and not p.train and p.param_dtype == p.dtype:
        changes["param_dtype"] = changes["dtype"]  # inference stores parameters in the compute dtype
    q = _replan(p, **changes) if changes else p
    request = {"config": q.config.to_hf_dict(), "mesh": q.mesh, "batch": q.batch, "context": q.context,
               "train": q.train, "remat": q.remat, "dtype": q.dtype, "param_dtype": q.param_dtype,
               "vision": q.vision}
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    env["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={q.devices} "
                        "--xla_disable_hlo_passes=while-loop-invariant-code-motion").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "qwen3vl_jax.plan", json.dumps(request)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the compiled check failed:\n{out.stderr[-4000:]}")
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    return {"context": q.context, "steps": steps, "rows": _compare(q, steps), "plan": q,
            "seconds": time.perf_counter() - start}


def _replan(p: Plan, **changes) -> Plan:
    kwargs = dict(batch=p.batch, context=p.context, train=p.train, dtype=p.dtype, param_dtype=p.param_dtype,
                  remat=p.remat, vision=p.vision, device_memory=p.device_memory)
    kwargs.update(changes)
    out = plan(p.config, p.mesh_spec, kwargs.pop("batch"), kwargs.pop("context"), kwargs.pop("train"),
               **kwargs)
    return dataclasses.replace(out, name=p.name)


def _compare(p: Plan, steps: dict) -> list[tuple[str, int | None, int | None]]:
    """`(label, analytic, compiled)` rows: what each compiled figure holds, by the plan."""
    if not p.train:
        s = steps["prefill"]
        vocab = p.config.text.vocab_size
        local_vocab = vocab // p.mesh["tensor"] if vocab % p.mesh["tensor"] == 0 else vocab
        # the last position's logits (compute dtype) and the first tokens
        logits = p.rows_per_device * (local_vocab * DTYPES[p.dtype] + 4)
        return [
            ("prefill arguments: parameters + inputs", p.params_bytes + p.input_bytes, s["argument"]),
            ("prefill outputs: KV cache (+ logits)", p.kv_cache_bytes + logits, s["output"]),
            ("prefill temporaries: activations", p.activation_bytes, s["temp"]),
            ("peak: arguments + outputs + temporaries", p.total_bytes, s["peak"]),
        ]
    m, u = steps["micro_step"], steps["update"]
    trained = p.params_bytes
    compiled_opt = u["argument"] - (m["argument"] - p.input_bytes)  # update args = params + moments + grads
    # The check's step is text-only: the vision tower does not run, so its gradient is never formed.
    tower = sum(r.bytes_per_device for r in p.param_rows if r.path.startswith("visual."))
    return [
        ("micro-step arguments: parameters + grad accumulator + inputs",
         p.params_bytes + trained + p.input_bytes, m["argument"]),
        ("micro-step outputs: grad accumulator (donated)", trained, m["output"]),
        ("micro-step temporaries: step's gradients + activations", trained + p.activation_bytes, m["temp"]),
        ("  the same without the vision tower's gradient (text-only step)",
         trained - tower + p.activation_bytes, m["temp"]),
        ("update arguments: parameters + AdamW moments + gradients",
         p.params_bytes + p.optimizer_bytes + trained, u["argument"]),
        ("update temporaries", None, u["temp"]),
        ("peak: micro-step + resident moments, or update", p.total_bytes,
         max(m["peak"] + compiled_opt, u["peak"])),
    ]


def check_table(result: dict) -> str:
    p = result["plan"]
    devices = f"{p.devices} host CPU device" + ("s" if p.devices > 1 else "")
    lines = [f"compiled check: {devices}, context {result['context']}, "
             f"{result['seconds']:.0f} s (lower + compile)",
             f"{'per device':<68}{'analytic':>12}{'compiled':>12}{'ratio':>8}"]
    for label, analytic, compiled in result["rows"]:
        ratio = f"{compiled / analytic:.2f}" if analytic and compiled is not None else ""
        lines.append(f"  {label:<66}{format_bytes(analytic):>12}{format_bytes(compiled):>12}{ratio:>8}")
    notes = ["arguments and outputs are exact layouts; temporaries are the CPU backend's buffer assignment "
             "(a GPU's differs)"]
    if p.dtype == "bfloat16":
        notes.append("the CPU computes bfloat16 matmuls in float32, so its temporaries also hold float32 "
                     "copies of their operands (weights and activations); --check-dtype float32 compares "
                     "the activation model itself")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _compile_steps(request: dict) -> dict:
    """(In the check's subprocess.) Lower and compile the steps; memory per device."""
    config = Qwen3VLConfig.from_hf_config(request["config"])
    sizes, b, length = request["mesh"], request["batch"], request["context"]
    mesh = make_mesh(sizes)
    dtype, param_dtype = jnp.dtype(request["dtype"]), jnp.dtype(request["param_dtype"])
    sds = jax.ShapeDtypeStruct
    dp = math.prod(sizes[a] for a in BATCH)
    replicated = NamedSharding(mesh, P())

    def batched(shape, dt, dim=0):
        spec = [None] * len(shape)
        if b % dp == 0:
            spec[dim] = BATCH
        return sds(shape, dt, sharding=NamedSharding(mesh, P(*spec)))

    def placed(state):
        pure = nnx.to_pure_dict(state)
        shardings = param_shardings(pure, mesh, vision=request["vision"])
        return jax.tree.map(lambda leaf, s: sds(leaf.shape, leaf.dtype, sharding=s), pure, shardings)

    def memory(compiled) -> dict:
        m = compiled.memory_analysis()
        out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
               "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes}
        out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
        return out

    model = Qwen3VL.abstract(config, dtype=dtype, param_dtype=param_dtype, scan_layers=True,
                             remat=request["remat"], attention_implementation="xla")
    key = jax.random.key(0)
    steps = {}
    with jax.set_mesh(mesh):
        if not request["train"]:
            graphdef, state = nnx.split(model)
            nnx.replace_by_pure_dict(state, placed(state))
            text = config.text
            fn = jax.jit(prefill.__wrapped__, static_argnames=("graphdef", "slots", "do_sample"),
                         keep_unused=True)  # resident parameters count even where the step skips them
            scalars = (sds((), jnp.float32, sharding=replicated), sds((), jnp.int32, sharding=replicated),
                       sds((), jnp.float32, sharding=replicated))
            lowered = fn.lower(graphdef, state, batched((b, length, text.hidden_size), dtype), None,
                               batched((3, b, length), jnp.int32, 1), batched((b, length), jnp.bool_), key,
                               *scalars, slots=length, do_sample=False)
            steps["prefill"] = memory(lowered.compile())
        else:
            graphdef, params, keys, rest = nnx.split(model, trainable_filter(()), LoRAKey, ...)
            params = placed(params)
            inputs = MultimodalInputs(batched((b, length), jnp.int32), batched((b, length), jnp.bool_),
                                      batched((3, b, length), jnp.int32, 1), batched((b, 1), jnp.int32),
                                      batched((b, length), jnp.int32))
            labels = batched((b, length), jnp.int32)
            acc = (params, sds((), jnp.float32, sharding=replicated), sds((), jnp.int32, sharding=replicated))
            micro = jax.jit(functools.partial(micro_step, graphdef, LOSS_CHUNK), donate_argnums=(0,),
                            keep_unused=True)
            lowered = micro.lower(acc, params, nnx.to_pure_dict(keys), rest, inputs, labels, key)
            steps["micro_step"] = memory(lowered.compile())
            tx = build_optimizer(OptimConfig(grad_accum_steps=1))
            flat = jax.tree_util.tree_flatten_with_path(params)[0]
            by_path = {param_path(kp): leaf.sharding for kp, leaf in flat}

            def moment(kp, leaf):  # AdamW's moments mirror the parameters: the same sharding
                parts = param_path(kp).split(".")
                for k in range(len(parts)):
                    if ".".join(parts[k:]) in by_path:
                        return sds(leaf.shape, leaf.dtype, sharding=by_path[".".join(parts[k:])])
                return sds(leaf.shape, leaf.dtype, sharding=replicated)

            opt_state = jax.tree_util.tree_map_with_path(moment, jax.eval_shape(tx.init, params))
            update = jax.jit(functools.partial(apply_update, tx), donate_argnums=(0, 1))
            steps["update"] = memory(update.lower(params, opt_state, params,
                                                  sds((), jnp.int32, sharding=replicated)).compile())
    return steps


if __name__ == "__main__":
    print(json.dumps(_compile_steps(json.loads(sys.argv[1]))))
