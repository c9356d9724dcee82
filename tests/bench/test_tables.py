"""bench/_tables.py: DataFrame.to_markdown in the results files' compact layout; detection.md
rendered through it from detection.json is byte for byte the committed file."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytest.importorskip("tabulate")


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_md_table_writes_the_cells_as_given_unpadded():
    md_table = _load("_tables").md_table
    frame = pd.DataFrame({"healthy": {"nan-scores": "0/3", "any": "1/3 (33%)"},
                          "n": {"nan-scores": "007", "any": ""}}).rename_axis("probe")
    assert md_table(frame) == ["| probe | healthy | n |", "|---|---|---|",
                               "| nan-scores | 0/3 | 007 |", "| any | 1/3 (33%) |  |"]
    assert md_table(frame, index=False)[:2] == ["| healthy | n |", "|---|---|"]


def test_detection_md_is_unchanged_by_the_dataframe_tables():
    results = BENCH / "results"
    d = json.loads((results / "detection.json").read_text())
    assert _load("detection_report").markdown(d) == (results / "detection.md").read_text()
