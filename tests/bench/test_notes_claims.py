"""bench/notes_claims.py measures what its faults change, at init, on a tiny model: each
quantity separates the healthy model from the fault the note is about."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load():
    if "bench_notes_claims" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_notes_claims", BENCH / "notes_claims.py")
        sys.modules["bench_notes_claims"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["bench_notes_claims"]


def test_each_quantity_separates_healthy_from_its_fault():
    m = _load().measure
    healthy = m("copy", "tiny", "pre", 0, None, 16)
    assert 0.5 < healthy["entropy"] <= 1.0 and 1.0 < healthy["rho"] < 2.0
    assert healthy["symmetry"] > 0.5 and healthy["self_argmax"] < 0.5
    assert 1.0 < healthy["loss_over_ln_v"] < 2.0                  # near ln V at init, not 0
    assert m("copy", "tiny", "pre", 0, "no_scale", 16)["entropy"] < healthy["entropy"] - 0.2
    assert m("copy", "tiny", "pre", 0, "no_emb_scale", 16)["rho"] < 0.5 * healthy["rho"]
    shared = m("copy", "tiny", "pre", 0, "shared_qkv", 16)
    assert shared["symmetry"] < 1e-5 and shared["self_argmax"] > healthy["self_argmax"] + 0.3
