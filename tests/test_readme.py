"""The README's ONNX example runs as written (on the CPU, in a fresh folder)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _tested_block() -> str:
    text = README.read_text()
    match = re.search(r"<!-- tests/test_readme.py runs this block as written -->\n```python\n(.*?)```", text, re.S)
    assert match, "the README lost its tested ONNX example"
    return match.group(1)


@pytest.mark.slow
def test_readme_onnx_example_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")  # torch's default exporter needs it (the `onnx` extra installs it)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_tested_block(), str(README), "exec"), scope)  # noqa: S102
    torch, model, x = scope["torch"], scope["model"], scope["x"]
    assert (tmp_path / "model.onnx").is_file()
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(scope["y"], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(scope["y3"], expected[:3], rtol=1e-4, atol=1e-5)
    out = capsys.readouterr().out
    assert "memory plan (batch=8)" in out and "<- linear" in out
