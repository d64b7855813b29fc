"""scripts/bench_gpu.py: refuses to run without a GPU; its code paths run on tiny shapes (--cpu-smoke)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU refusal")
def test_refuses_to_run_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load().main([])
    assert exit_info.value.code == 2
    assert "no GPU backend" in capsys.readouterr().err


def test_cpu_smoke_runs_every_section(tmp_path):
    import json

    out = tmp_path / "bench.json"
    assert _load().main(["--cpu-smoke", "--quick", "--no-sweep", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"varlen", "prefill", "decode", "pos_embed"}
    assert all(r["ms"] is not None for r in rows if r["impl"] in ("pallas", "xla"))
