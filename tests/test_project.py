"""The README's two commands are the ones CI and users run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    setup = [c for c in commands if ".venv" in c and "python3 -m venv" in c]
    assert len(setup) == 2, setup
    demo, tests = setup
    assert demo.endswith("qwen3vl-jax demo") and "pytest" in tests
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert tests in ci.splitlines()


def test_demo_runs_on_the_shipped_default(tmp_path):
    env = dict(os.environ, QWEN3VL_JAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "qwen3vl_jax.cli", "demo"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in ("built-in default", "task seed", "[image: ", "[video: ", "question:", "answer:", "truth:",
                   "decode tok/s", "image warm", "video warm"):
        assert needle in out.stdout
    assert not os.listdir(tmp_path)  # the shipped default needs no cache


def test_generate_command_streams_an_answer(tmp_path):
    env = dict(os.environ, QWEN3VL_JAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "qwen3vl_jax.cli", "generate", "--prompt", "Hello", "--max-new-tokens",
                          "8", "--temperature", "0.7", "--seed", "3"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the shipped default ends its (one-word) answers with EOS: at most 8 tokens, at least one
    made = re.search(r"\[(\d+) prompt tokens, (\d+) generated\]", out.stdout)
    assert made and 1 <= int(made.group(2)) <= 8, out.stdout
