"""Issue 18: a verdict is earned. Every exact test runs on inputs the user's model takes (a short
position table, masks derived from lengths), a model that raises on those inputs is a finding
that names the input, and a probe that applied and decided nothing makes the report INCOMPLETE,
never CLEAN."""
from __future__ import annotations

import torch
from torch import nn

import models as M
import tndebug
from tndebug.library.check import CheckResult

EXACT = ("nan-scores", "missing-scale", "mask-broadcast")


def _probes_checked(report, names=EXACT):
    return {n: report.probes[n]["status"] for n in names}


# -- a position table that just fits -----------------------------------------------------------------
class NoCausalBlock(M.DecBlock):
    """The decoder block with its causal mask dropped (the bug a short table used to hide)."""

    def __init__(self, d, h, d_ff):
        super().__init__(d, h, d_ff)
        self.attn.causal = False


def short_table(causal: bool = True, rows: int = 12):
    torch.manual_seed(0)
    model = M.FusedSDPA(max_len=rows)
    if not causal:
        for i, block in enumerate(model.dec):
            model.dec[i] = NoCausalBlock(32, 4, 64)
    return model


def test_every_exact_test_runs_on_a_position_table_that_just_fits():
    report = tndebug.check(short_table(rows=12), M.fused_forward)
    assert report.verdict == "clean", report.probes
    assert set(_probes_checked(report).values()) == {"pass"}
    assert report.probes["mask-broadcast"]["coverage"][""]["status"] == "checked"


def test_a_missing_causal_mask_is_found_behind_a_short_position_table():
    """Before: mask-broadcast's batch (12 positions + 3 pads) overran the table, the probe was
    switched off, and check() said clean."""
    report = tndebug.check(short_table(causal=False, rows=12), M.fused_forward)
    errors = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "error"]
    assert errors and errors[0].code == "mask-broadcast/causal-leak", report.findings
    result = CheckResult(report)
    try:
        result.assert_clean()
    except AssertionError as e:
        assert "mask-broadcast" in str(e)
    else:
        raise AssertionError("assert_clean passed on a model without a causal mask")


def test_a_table_shorter_than_the_probes_batches_still_gets_every_exact_test():
    report = tndebug.check(short_table(rows=8), M.fused_forward)
    assert set(_probes_checked(report).values()) == {"pass"}, report.probes


# -- masks derived from the rows' lengths ---------------------------------------------------------
def sequence_mask(lengths: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, max(lengths)] keep-mask, as NMT toolkits build it: as wide as the longest row."""
    return torch.arange(int(lengths.max()), device=lengths.device)[None, :] < lengths[:, None]


class LengthMasked(M.FusedSDPA):
    """Masks from the source and target lengths, never from the pad id."""

    def forward(self, src, tgt, pad_id=M.PAD):
        src_len, tgt_len = (src != pad_id).sum(1), (tgt != pad_id).sum(1)
        keep, tgt_keep = sequence_mask(src_len), sequence_mask(tgt_len)
        x = self.embed(src)
        for block in self.enc:
            x = block(x, keep)
        memory, y = self.ln_e(x), self.embed(tgt)
        for block in self.dec:
            y = block(y, memory, tgt_keep, keep)
        return self.lm_head(self.ln_f(y))


def test_every_exact_test_runs_on_a_model_that_derives_masks_from_lengths():
    """Before: "setup raised RuntimeError: The size of tensor a (10) must match the size of
    tensor b (13)" — the probe appended pads past the longest row — and the verdict was CLEAN."""
    torch.manual_seed(0)
    report = tndebug.check(LengthMasked(), M.fused_forward)
    assert report.probes["mask-broadcast"]["status"] == "pass", report.probes["mask-broadcast"]
    assert report.probes["mask-broadcast"]["coverage"][""]["status"] == "checked"
    assert not [f for f in report.findings if f.severity != "info"], report.findings


# -- the model raising is evidence ------------------------------------------------------------------
class InvertedKeyPadding(nn.Module):
    """nn.Transformer with src_key_padding_mask inverted (True = keep): in eval mode the encoder's
    nested-tensor fast path raises on a row without padding, whose every key is then masked."""

    def __init__(self, d=32):
        super().__init__()
        self.src_tok, self.tgt_tok = nn.Embedding(M.V, d), nn.Embedding(M.V, d)
        self.pos = nn.Embedding(64, d)
        self.transformer = nn.Transformer(d, 4, 2, 2, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, M.V)

    def embed(self, tok, ids):
        return tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src, tgt, pad_id=M.PAD):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        h = self.transformer(self.embed(self.src_tok, src), self.embed(self.tgt_tok, tgt),
                             tgt_mask=causal, src_key_padding_mask=src != pad_id,      # the bug
                             memory_key_padding_mask=src == pad_id,
                             tgt_key_padding_mask=tgt == pad_id)
        return self.out(h)


def test_a_model_that_raises_on_a_probe_input_gets_an_error_naming_the_input():
    torch.manual_seed(0)
    model = InvertedKeyPadding()
    report = tndebug.check(model, M.torch_forward)
    raised = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "error"]
    assert raised, report.findings
    f = raised[0]
    from tndebug.probes._mask_tests import INPUTS
    assert f.code == "mask-broadcast/model-raised" and f.evidence["input"] in INPUTS.values()
    assert "without padding" in f.evidence["input"]          # the rows whose every key it masks
    assert "inverted key padding mask" in f.message and "True at the pads" in f.fix
    assert report.verdict == "errors"


def test_a_tndebug_bug_is_not_blamed_on_the_model(monkeypatch):
    """An exception raised by tndebug's own code inside a probe stays a probe failure (no
    verdict: the report is INCOMPLETE), not a finding about the model."""
    from tndebug.probes import mask_broadcast

    def broken(*a, **k):
        raise ZeroDivisionError("tndebug's own arithmetic")
    monkeypatch.setattr(mask_broadcast, "compare", broken)
    report = tndebug.check(short_table(), M.fused_forward)
    st = report.probes["mask-broadcast"]
    assert st["status"] == "no verdict" and "ZeroDivisionError" in st["reason"]
    assert not [f for f in report.findings if f.probe == "mask-broadcast"]
    assert report.verdict == "incomplete" and report.exit_code() == 4
    assert "mask-broadcast" in report.incomplete()
