"""Shared fixtures: tiny HF-format checkpoints, the HF torch reference, and the tolerance table.

Parity runs in float32 at the highest matmul precision on both sides, so any difference is
rounding (different summation orders, transcendental implementations), never a numerics choice.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from filelock import FileLock
from jax import monitoring

jax.config.update("jax_default_matmul_precision", "highest")

# The tests' programs are tiny and run once or a few times, so XLA's CPU backend compiles them without
# LLVM's optimization passes (`--xla_backend_optimization_level=0`): the same HLO, the same fusions,
# machine code generated with less work. Measured on the 2-core CPU (tests/test_quant.py, no
# compilation cache): 170 s -> 124 s, compiling 116 s -> 77 s. Set here, before the first backend
# starts, so every subprocess a test starts inherits it (a worker that sets its own XLA_FLAGS appends
# to these); `QWEN3VL_JAX_TEST_XLA_OPT=default` leaves XLA's own level.
if os.environ.get("QWEN3VL_JAX_TEST_XLA_OPT", "") != "default":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# JAX's persistent compilation cache, one fresh directory per pytest run (so a run never reuses an
# earlier run's executables and CI's time stays a fresh machine's), deleted at the end. Tests that
# build the same program again (a new model object, a new jit wrapper, a subprocess: the sharding
# worker, the CLI, the notebooks, which inherit the directory through the environment) load it
# instead of compiling. `QWEN3VL_JAX_TEST_CACHE=off` runs without it;
# `QWEN3VL_JAX_TEST_CACHE=<directory>` keeps it there (created if missing, never deleted): .ci/run
# gives its fast and slow tiers one directory, so the slow tier loads what the fast tier compiled.
# The pytest-xdist workers (pyproject.toml's `-n`) inherit the directory through
# QWEN3VL_JAX_TEST_CACHE, so they share it and the process that made it deletes it.
_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": None, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "QWEN3VL_JAX_TEST_CACHE": None}
_CACHE_DIR = pytest.StashKey[tuple]()  # (directory, whether this run deletes it, the environment it replaced)
_cache_events: dict[str, int] = {}

# The torch-free lane (`QWEN3VL_JAX_LANE=torch-free`, run by .ci/run on the newest jax, where the
# HF torch reference is not installed). A test file that imports torch at module level, or uses
# torch / the HF reference anywhere without marking its torch tests `needs_torch`, is not
# collected; in a file that marks them, those tests (and any using the HF reference fixtures) are
# deselected. The summary lists all of them, so nothing is counted as a pass or a skip. In the
# default lane nothing is left out: a missing torch is an error there.
TORCH_FREE_LANE = os.environ.get("QWEN3VL_JAX_LANE") == "torch-free"
_MODULE_IMPORTS_TORCH = re.compile(r"^(import torch|from torch|import torchvision)", re.M)
_USES_TORCH = re.compile(r"^\s*(import torch|from torch)|\bhf_model\b|\bhf_processor\b|AutoProcessor|"
                         r"Qwen3VLForConditionalGeneration|Qwen2VLImageProcessorPil", re.M)
_TORCH_FIXTURES = {"hf_model", "hf_processor"}
_left_out: set[str] = set()  # pytest may ask about a file more than once


# Compilation time per test (the pytest processes: each xdist worker sends its figures to the main one;
# other subprocesses are not seen): JAX's tracing, lowering and XLA compile durations, charged to the
# test running when they happen. The summary prints the total, and with
# `QWEN3VL_JAX_TEST_COMPILE_REPORT=N` the N tests that spent the most (what to look at first when the
# suite outgrows its budget: about three quarters of the fast tier is compilation).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds: dict[str, float] = {}
_current_test = ["(collection)"]
_COMPILE_REPORT = pytest.StashKey[int]()  # how many tests the summary lists (0: none)


def _charge_compile_time(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[_current_test[0]] = _compile_seconds.get(_current_test[0], 0.0) + duration


monitoring.register_event_duration_secs_listener(_charge_compile_time)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test[0] = item.nodeid
    try:
        return (yield)
    finally:
        _current_test[0] = "(between tests)"


def _count_cache_event(event: str, **_) -> None:
    if event.startswith("/jax/compilation_cache/cache_"):
        _cache_events[event] = _cache_events.get(event, 0) + 1


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core, at most 4. The suite is three quarters tracing and
    compiling, which keeps one process near one core, so two workers on the 2-core CI machine use the
    second core; each worker holds ~1.5-3.5 GB, hence the cap. Cores: those this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


def pytest_configure(config):
    report = os.environ.get("QWEN3VL_JAX_TEST_COMPILE_REPORT", "")
    if report and not report.isdigit():
        raise pytest.UsageError(f"QWEN3VL_JAX_TEST_COMPILE_REPORT must be a number of tests, got {report!r}")
    config.stash[_COMPILE_REPORT] = int(report or 0)
    setting = os.environ.get("QWEN3VL_JAX_TEST_CACHE", "")
    if setting == "off":
        return
    if setting:
        directory, owned = os.path.abspath(setting), False
        os.makedirs(directory, exist_ok=True)
    else:
        directory, owned = tempfile.mkdtemp(prefix="qwen3vl-jax-xla-cache-"), True
    config.stash[_CACHE_DIR] = (directory, owned, {k: os.environ.get(k) for k in _CACHE_ENV})
    os.environ.update({k: v or directory for k, v in _CACHE_ENV.items()})
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    monitoring.register_event_listener(_count_cache_event)


def pytest_unconfigure(config):
    directory, owned, saved = config.stash.get(_CACHE_DIR, (None, False, {}))
    if directory is None:
        return
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if owned:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    if TORCH_FREE_LANE and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        text = collection_path.read_text()
        if _MODULE_IMPORTS_TORCH.search(text) or (_USES_TORCH.search(text) and "needs_torch" not in text):
            _left_out.add(f"{collection_path.name} (needs torch)")
            return True
    return None


def _needs_torch(item) -> bool:
    return item.get_closest_marker("needs_torch") is not None or bool(_TORCH_FIXTURES & set(item.fixturenames))


def pytest_collection_modifyitems(config, items):
    if not TORCH_FREE_LANE:
        return
    dropped = [item for item in items if _needs_torch(item)]
    _left_out.update(f"{item.nodeid} (needs torch)" for item in dropped)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _needs_torch(item)]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its figures go to the summary of the main process
        workeroutput["qwen3vl_jax_compile_seconds"] = dict(_compile_seconds)
        workeroutput["qwen3vl_jax_cache_events"] = dict(_cache_events)
        workeroutput["qwen3vl_jax_left_out"] = sorted(_left_out)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker is done: add its compilation figures to this process's (the summary's)."""
    output = getattr(node, "workeroutput", {})
    for mine, theirs in ((_compile_seconds, output.get("qwen3vl_jax_compile_seconds", {})),
                         (_cache_events, output.get("qwen3vl_jax_cache_events", {}))):
        for key, value in theirs.items():
            mine[key] = mine.get(key, 0) + value
    _left_out.update(output.get("qwen3vl_jax_left_out", ()))  # each worker collects the whole suite


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.config.stash.get(_CACHE_DIR, None) is not None:
        hits = _cache_events.get("/jax/compilation_cache/cache_hits", 0)
        misses = _cache_events.get("/jax/compilation_cache/cache_misses", 0)
        terminalreporter.write_line(f"persistent compilation cache (all workers): {hits} hits, {misses} compiles")
    if _compile_seconds:
        terminalreporter.write_line(f"tracing, lowering and compiling (all workers): "
                                    f"{sum(_compile_seconds.values()):.0f} s")
    report = terminalreporter.config.stash.get(_COMPILE_REPORT, 0)
    if report:
        terminalreporter.write_sep("=", f"the {report} tests that spent the most time compiling")
        for nodeid, seconds in sorted(_compile_seconds.items(), key=lambda kv: -kv[1])[:report]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
    if TORCH_FREE_LANE:
        terminalreporter.write_sep("=", f"torch-free lane: {len(_left_out)} left out (not run, not passed)")
        for line in sorted(_left_out):
            terminalreporter.write_line(line)


def load_script(name: str):
    """The module of `scripts/<name>.py` (the scripts are not a package), loaded afresh."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_env(*xla_flags: str) -> dict[str, str]:
    """The environment of a test's JAX subprocess that sets its own number of host devices (the mesh
    workers): this process's, CPU only, the repository on PYTHONPATH, and its XLA flags (this file's
    optimization level among them) without a host device count, with `xla_flags` added."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, *xla_flags])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """`once_per_run(name, write)`: the path of a file that `write(path)` made once in this pytest run.
    The xdist workers share it: the first to ask writes it (to a temporary name, renamed when done),
    the others wait on a lock and read it. For an expensive subprocess whose results several tests
    check (the sharding meshes), which otherwise runs once in every worker that has one of them."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own

    def get(name: str, write) -> str:
        path = root / name
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                partial = path.with_name(f"partial-{name}")
                write(str(partial))
                os.replace(partial, path)
        return str(path)

    return get


# One tolerance table for every parity check: name -> (atol, rtol) applied as
# |ours - ref| <= atol + rtol * |ref|.
TOLERANCES = {
    "f32_module": (2e-5, 2e-5),   # a single module (patch embed, block, merger, interpolation)
    "f32_tower": (5e-5, 5e-5),    # the whole vision tower, many modules deep
    "f32_logits": (1e-4, 1e-4),   # the whole model, vision + LLM
    "bf16_tower": (0.15, 0.05),   # bf16 weights and compute against the f32 reference
}


def assert_close(ours, ref, kind: str, what: str = "") -> float:
    """Assert elementwise closeness under TOLERANCES[kind]; returns the max abs difference."""
    atol, rtol = TOLERANCES[kind]
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(ours)), f"{what}: non-finite values"
    diff = np.abs(ours - ref)
    excess = diff - (atol + rtol * np.abs(ref))
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert excess.size == 0 or excess.max() <= 0, (
        f"{what}: max |diff| {diff.max():.3g} at {worst} exceeds atol {atol} + rtol {rtol} * |ref| "
        f"(ours {ours[worst]:.6g}, ref {ref[worst]:.6g})"
    )
    return float(diff.max()) if diff.size else 0.0


@contextlib.contextmanager
def gpu_lowering_target():
    """Around `jax.export(..., platforms=["cuda"])` of Pallas Triton kernels on a machine without a
    GPU: on jax >= 0.11 lowering needs an abstract GPU device to lower for (an H100, sm_90: the
    target jax 0.10 falls back to by itself); on jax 0.10 nothing is needed."""
    if jax.__version_info__ < (0, 11, 0):
        yield
        return
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def random_image(h: int, w: int, seed: int):
    """A PIL RGB image of uniform noise."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


def random_video(frames: int, h: int, w: int, seed: int) -> np.ndarray:
    """`(T, H, W, 3)` uint8 frames of uniform noise."""
    return (np.random.default_rng(seed).random((frames, h, w, 3)) * 255).astype(np.uint8)


def user_prompt(*parts: str) -> list[dict]:
    """One user message; "image" / "video" parts become media slots, anything else text."""
    content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def hf_processor_batch(processor, spec: dict):
    """HF processor inputs (torch tensors, left-padded) for a case spec.

    `spec`: {"prompts": [messages, ...], "images": [(h, w), ...], "videos": [(frames, h, w, fps), ...]};
    media are seeded noise, video frames are taken as given (no resampling).
    """
    texts = [processor.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in spec["prompts"]]
    kwargs = {}
    if "images" in spec:
        kwargs["images"] = [random_image(h, w, i) for i, (h, w) in enumerate(spec["images"])]
    if "videos" in spec:
        kwargs["videos"] = [random_video(f, h, w, 10 + i) for i, (f, h, w, _) in enumerate(spec["videos"])]
        kwargs["video_metadata"] = [
            {"fps": fps, "total_num_frames": f, "frames_indices": list(range(f))} for f, _, _, fps in spec["videos"]
        ]
        kwargs["do_sample_frames"] = False
    return processor(text=texts, return_tensors="pt", padding=True, padding_side="left", **kwargs)


@pytest.fixture(scope="session")
def hf_processor(tiny_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from qwen3vl_jax.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    import torch  # the test extra installs it; a missing reference is a failure, not a skip
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def jax_model(tiny_dir):
    from qwen3vl_jax import Qwen3VL

    return Qwen3VL.from_pretrained(tiny_dir)
