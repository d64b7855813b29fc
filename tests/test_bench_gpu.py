"""scripts/bench_gpu.py: refuses to run without a GPU; its code paths run on tiny shapes (--cpu-smoke)."""

from __future__ import annotations

import importlib.util

import jax
import pytest
from conftest import load_script


def _load():
    return load_script("bench_gpu")


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


@pytest.mark.slow  # a script's code paths (the suite's budget)
def test_cpu_smoke_moe_checks_every_implementation_against_ragged_and_hf(tmp_path):
    import json

    out = tmp_path / "moe.json"
    assert _load().main(["--cpu-smoke", "--moe", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == []
    timed = {(r["case"], r["impl"]) for r in report["rows"] if r["ms"] is not None}
    for case in ("30B-A3B 8 tok", "30B-A3B 4096 tok"):
        assert {(case, "ragged"), (case, "tiled")} <= timed
        if importlib.util.find_spec("torch") is not None:  # HF's module on the same weights, checked and timed
            assert (case, "hf-eager") in timed
