"""Every notebook runs top to bottom on the tiny default, and every plotting cell draws a figure."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_pruning", "03_parity", "04_finetune", "05_where_it_looks"]


def _param(path):  # a notebook that compares with the HF torch reference needs torch
    needs = "import torch" in path.read_text() or "transformers" in path.read_text()
    marks = [pytest.mark.needs_torch] if needs else []
    if path.stem != "01_quickstart":  # the fast tier runs the first; .ci/run every one (`slow`)
        marks.append(pytest.mark.slow)
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_runs_and_plots(path, tmp_path, monkeypatch):
    book = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), "outputs must be stripped in git"
    assert any(line.strip() == "TINY = True" for line in book.cells[1].source.splitlines())
    monkeypatch.setenv("QWEN3VL_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend emits the PNGs
    NotebookClient(book, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on any cell error
    streams = "".join(o.get("text", "") for c in book.cells if c.cell_type == "code" for o in c.outputs)
    assert "IProgress not found" not in streams, "progress bars must render as widgets (the notebook extra)"
    plots = [c for c in book.cells if "plot" in c.metadata.get("tags", [])]
    assert plots
    for cell in plots:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"plotting cell produced no image:\n{cell.source[:200]}"
