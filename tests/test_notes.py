"""The probable causes the reports quote never offer a claim of the notes that we measured false
(README, "What the measurements showed"; NOTE_CLAIMS' flags)."""
from __future__ import annotations

from tndebug.notes import NOTE_CLAIMS
from tndebug.probes import PROBE_NAMES, probe_cause

# claim measured false -> words that would offer it as a cause
REFUTED = {
    "dropout=0.0 every head in layer 4 collapsed": ("dropout",),          # heads do not collapse
    "Loss stuck at ~3.5": ("3.5",),                                        # vocabulary-dependent
    "-inf in masked_fill makes softmax NaN, so use -1e9": ("so use -1e9",),
    "LayerNorm eps=1e-6 can make var+eps zero": ("eps 1e-5, clamp", "eps that is too small"),
    "Pre-LN (LN before residual) is a mistake": ("5.0", "pre-norm a bug"),
}


def test_refuted_claims_are_flagged_in_note_claims():
    claims = {c["claim"]: c["flag"] for c in NOTE_CLAIMS}
    for start in REFUTED:
        (flag,) = [f for c, f in claims.items() if start in c]
        assert flag, start


def test_no_probable_cause_offers_a_refuted_claim():
    causes = {name: probe_cause(name) for name in PROBE_NAMES}
    assert all(causes.values()), [n for n, c in causes.items() if not c]   # each probe states one
    for probe, cause in causes.items():
        for words in REFUTED.values():
            for w in words:
                assert w not in cause, (probe, w)


def test_head_collapse_cause_is_the_shared_projection_not_dropout():
    cause = probe_cause("head-collapse")
    assert "W_q=W_k=W_v" in cause and "dropout" not in cause.lower()
