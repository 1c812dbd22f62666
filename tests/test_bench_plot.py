"""bench/plot.py: ratios per case against each peer (and the floor), a PNG next to each suite's table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import plot  # noqa: E402

ROWS = [
    {"suite": "lowbit", "case": "M=1,int4", "tessera_us": 10.0, "peers_us": {"cublas": 30.0, "tinygemm": 20.0},
     "floor_us": 6.0, "rel_err": 1e-3, "gpu": "NVIDIA H200", "date": "2026-11-22", "commit": "abc"},
    {"suite": "lowbit", "case": "M=16,int4", "tessera_us": 40.0, "peers_us": {"cublas": 20.0},
     "floor_us": 8.0, "rel_err": 1e-3, "gpu": "NVIDIA H200", "date": "2026-11-22", "commit": "abc"},
]  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_ratios_per_case_peer_and_floor():
    cases, series = plot.ratios(ROWS)
    assert cases == ["M=1,int4", "M=16,int4"]
    assert series["cublas"] == [3.0, 0.5]
    assert series["tinygemm"][0] == 2.0 and math.isnan(series["tinygemm"][1])  # that case has no tinygemm time
    assert series[plot.FLOOR] == [0.6, 0.2]
    _, without_floor = plot.ratios([{**r, "floor_us": None} for r in ROWS])
    assert plot.FLOOR not in without_floor


@pytest.mark.slow
def test_plot_file_writes_a_png_next_to_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    png = plot.plot_file(_write(tmp_path / "2026-11-22-h200-lowbit.jsonl", ROWS))
    assert png == tmp_path / "2026-11-22-h200-lowbit.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plot.main([str(tmp_path / "2026-11-22-h200-lowbit.jsonl"), str(tmp_path / "missing.jsonl")]) == 1


def test_no_plot_without_comparable_times(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{**ROWS[0], "peers_us": {}, "floor_us": None}]
    assert plot.plot_file(_write(tmp_path / "x.jsonl", rows)) is None
    assert "no case has both" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_suites_write_the_plot_with_their_table(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")
    import harness

    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "NVIDIA H200", "date": "2026-11-22", "commit": "abc",
                                                         "torch": "2.11", "cuda": "13.0"})  # fmt: skip
    rows = [{k: v for k, v in r.items() if k not in ("suite", "gpu", "date", "commit")} for r in ROWS]
    harness.write_results("lowbit", rows, [tmp_path], ["floor_us"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-22-h200-lowbit.jsonl", "2026-11-22-h200-lowbit.md",
                                                           "2026-11-22-h200-lowbit.png"]  # fmt: skip
