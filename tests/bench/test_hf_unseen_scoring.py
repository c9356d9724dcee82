"""bench/hf_unseen.py's scoring of a bug as named (no model: records as `triage` writes them)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_hf_unseen", Path(__file__).resolve().parents[2] / "bench" / "hf_unseen.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
named = _module.named


def test_a_refusal_that_names_the_pad_id_counts_for_pad_wrong_only():
    line = ("tndebug: error: the weights in /x do not fit its config.json: 2 shape mismatch(es) "
            "(...); config.json disagrees with the saved tokenizer (pad_token_id = 5, the "
            "tokenizer's 0), and some classes size a table by such an id")
    refused = {"verdict": "refused", "exit": 2, "error": line}
    assert named(refused, "pad-wrong")
    assert not named({**refused, "error": "tndebug: error: 2 shape mismatch(es)"}, "pad-wrong")
    assert not named({**refused, "exit": 3}, "pad-wrong")                     # a crash is not
    assert not named(refused, "head-redrawn")


@pytest.mark.parametrize("where, ok", [("pad_token_id", True), ("eos_token_id", False)])
def test_pad_wrong_needs_the_finding_on_pad_token_id(where, ok):
    rec = {"verdict": "errors", "exit": 1, "findings": [
        {"code": "checkpoint/id-vs-tokenizer", "severity": "error", "where": where}]}
    assert named(rec, "pad-wrong") is ok
