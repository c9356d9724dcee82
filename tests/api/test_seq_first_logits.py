"""A sequence-first model (`model(src.T, tgt.T)` -> logits [T, B, V]) under `watch` with the
`batch=` the docs give: the probes read its logits too, transposed to the batch-first ids that
`batch=` returns (issue 44: loss-health said "only the training loss was observed", so the run
could never be CLEAN). A square batch (B == T) keeps being read batch-first."""
from __future__ import annotations

from test_no_pad import seq_first_run


def test_the_logits_of_a_sequence_first_call_reach_the_probes():
    told = seq_first_run(pad_id=0, batch=lambda args, kwargs: (args[0].T, args[1].T))
    reason = told.report.probes["loss-health"].get("reason", "")
    assert "only the training loss was observed" not in reason, reason
    # the step-0 level was judged on the logits: no init finding on a healthy model
    assert not [f for f in told.report.findings if f.probe == "loss-health"]


def test_without_batch_the_call_is_read_as_before():
    dbg = seq_first_run(pad_id=0)
    assert [f.code for f in dbg.report.findings if f.code == "pad-id/mid-sequence"]
