"""bench/first_contact.py (issue 44): its scoring, and a short end-to-end run (a 20-step loop,
its 16-bit copies, one loop bug) writing both results files into a scratch folder."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("first_contact", BENCH / "first_contact.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_summary_counts_flagged_named_collateral_and_refused():
    fc = _load()
    recs = [{"kind": "loop", "fault": "healthy", "flagged": True, "verdict": "errors"},
            {"kind": "loop", "fault": "healthy", "flagged": False, "verdict": "incomplete"},
            {"kind": "loop", "fault": "shifted_twice", "named": True, "collateral": ["x/y"]},
            {"kind": "loop", "fault": "no_zero_grad", "named": True, "collateral": []},
            {"kind": "front-end", "fault": "healthy", "refused": True, "flagged": False}]
    s = fc.summarise(recs)
    assert s["loop"] == {"healthy": 2, "flagged": 1, "bugs": 2, "named": 2, "named_clean": 1,
                         "refused": 0, "not_clean": 2}
    recs[1]["verdict"] = "clean"
    assert fc.summarise(recs)["loop"]["not_clean"] == 1
    assert s["front-end"]["refused"] == 1


def test_a_short_run_writes_both_files(tmp_path):
    fc = _load()
    out = tmp_path / "fc"
    assert fc.main(["--seeds", "1", "--steps", "20", "--bugs", "no_zero_grad",
                    "--no-front-ends", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["summary"]["loop"]["named"] == 1 and data["summary"]["16-bit"]["healthy"] == 3
    assert "| loop |" in out.with_suffix(".md").read_text()
