"""Smoke test of bench/bad_input.py (issue 47): a handful of cases of each surface in fresh
folders of the user's files; every one meets the promise, no user file changes, and the full
bench holds >= 150 distinct kinds, at least half of them new."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_bad_input", BENCH / "bad_input.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_holds_150_distinct_kinds_half_of_them_new():
    bench = _bench()
    cli, lib = bench.cases(bench.docs_module(), None)
    kinds = [(c[0], c[1]) for c in cli] + [(c[0], c[1]) for c in lib]
    assert len(kinds) >= 150
    assert len({tuple(c[2]) for c in cli}) == len(cli), "two CLI cases with the same argv"
    assert len({c[2] for c in lib}) == len(lib), "two library cases with the same call"
    assert sum(src == "new" for src, _ in kinds) >= len(kinds) / 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_handful_of_cases_meet_the_promise(tmp_path):
    bench = _bench()
    out = tmp_path / "bad.json"
    assert bench.main(["--limit", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["kinds_tried"] == 8 and s["kinds_met"] == 8, [r for r in result["cases"] if not r["met"]]
    assert s["user_files_changed"] == 0
    assert s["cli_flag_or_path"]["max_s"] <= bench.TARGET_S
    assert {r["source"] for r in result["cases"]} == {"docs", "new"}
    assert "Kinds tried: **8**" in out.with_suffix(".md").read_text()
