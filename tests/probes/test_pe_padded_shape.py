"""A positional encoding whose added rows depend on the padded shape is named once, by
positional-encoding (issue 19): mask-broadcast's behaviour tests then fail with every mask
holding, and the difference is already in the embedding output before any attention, so it
says so as info (`mask-broadcast/at-embedding`) instead of a second error. Models: the real-bug
corpus' plain user-style encoder-decoder (tests/realbugs), its PE swapped from outside."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "realbugs"))

import tndebug  # noqa: E402
import mechanisms as X  # noqa: E402
from bugs import BUGS, build  # noqa: E402
from model import PositionalEncoding, forward  # noqa: E402

PROBES = "mask-broadcast,positional-encoding"


class PELastRows(PositionalEncoding):
    """x + pe[:, -T:]: the last T rows of the table. Each position gets its own row (token
    order is encoded), but which row depends on the padded length T."""

    def forward(self, x):
        return x + self.pe[:, -x.size(1):]


def _check(model):
    report = tndebug.check(model, forward, pad_id=0, bos_id=1, probes=PROBES)
    return {(f.code, f.severity) for f in report.findings}, report


def test_healthy_model_gets_neither():
    got, report = _check(build(None, 0))
    assert not {c for c, _ in got if c.startswith(("mask-broadcast/", "positional-encoding/"))}, report.findings


@pytest.mark.parametrize("name", ["pe_single_row", "pe_indexed_by_batch"])
def test_reported_pe_bug_is_one_positional_encoding_error(name):
    got, report = _check(build(BUGS[name], 0))
    errors = {c for c, s in got if s in ("warning", "error")}
    assert errors == {"positional-encoding/order-ignored"}, report.findings
    assert ("mask-broadcast/at-embedding", "info") in got, report.findings
    info = next(f for f in report.findings if f.code == "mask-broadcast/at-embedding")
    assert info.evidence["deferred_to"] == "positional-encoding"
    assert all(m["delta"] > m["tol"] for m in info.evidence["embedding"].values())


def test_pe_rows_picked_by_the_padded_length():
    """Order is encoded (the permutation test passes), so only the padded-shape test names it."""
    model = build(None, 0)
    X.swap(model, PositionalEncoding, PELastRows)
    got, report = _check(model)
    errors = {(c, s) for c, s in got if s in ("warning", "error")}
    assert errors == {("positional-encoding/padded-shape", "error")}, report.findings
    f = next(f for f in report.findings if f.code == "positional-encoding/padded-shape")
    assert f.evidence["moved"] and f.where.endswith("_embed.0"), f
    assert ("mask-broadcast/at-embedding", "info") in got, report.findings


def test_a_mask_bug_beside_keeps_its_error():
    """No causal mask as well: the causality test is not the embedding's, so it stays an error."""
    model = build(BUGS["no_tgt_mask"], 0)
    X.swap(model, PositionalEncoding, PELastRows)
    got, report = _check(model)
    assert ("mask-broadcast/causal-leak", "error") in got, report.findings
    assert ("positional-encoding/padded-shape", "error") in got, report.findings
