"""Issue 45: heads written as separate modules that scale by the embedding width C (C**-0.5,
copied from a well-known lecture) are named as the division by sqrt(d_model) that they are,
with the numbers of this model, not as a "wrong constant" of "d_k = 8 / 1 heads"."""
from __future__ import annotations

import torch

import tndebug
from head_modules_gpt import BigramLM, forward


def test_heads_as_modules_scaled_by_the_embedding_width_are_named_by_d_model():
    torch.manual_seed(0)
    report = tndebug.check(BigramLM(by_width=True), forward, arch="decoder", pad_id=None)
    found = [f for f in report.findings if f.probe == "missing-scale" and f.severity == "error"]
    assert [f.code for f in found] == ["missing-scale/by-d-model"], report.findings
    f = found[0]
    assert "= 1/sqrt(32): each of its 4 per-head modules divides by sqrt of the embedding width, " \
           "C = n_embd = 32" in f.message, f.message
    assert f.evidence["d_model"] == 32 and f.evidence["heads"] == 4 and f.evidence["d_k"] == 8
    assert "d_k = 32 / 4 heads = 8" in f.fix


def test_heads_as_modules_scaled_by_their_own_width_pass():
    torch.manual_seed(0)
    report = tndebug.check(BigramLM(), forward, arch="decoder", pad_id=None)
    assert report.probes["missing-scale"]["status"] == "pass", report.findings
