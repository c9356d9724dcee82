"""`watch` on a Hugging Face decoder-only loop (`model(input_ids=x, labels=x)`) reads the
output's `.logits` although their width (the output layer's) is past the content range the
subject keeps as its vocabulary (a GPT-2 config's eos id outside a small vocabulary: 93 of 94
columns; GPT-2 itself: 50256 of 50257). Before, every step's logits were dropped: loss-health
said "only the training loss was observed" and label-shift never judged, so a healthy run
was INCOMPLETE (issue 44, first contact)."""
from __future__ import annotations

import pytest
import torch

import tndebug

transformers = pytest.importorskip("transformers")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_logits_of_a_hugging_face_causal_lm_reach_the_probes():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=94, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, quiet=True, pad_id=None, total_steps=12) as dbg:
        for _ in range(12):
            x = torch.randint(0, 94, (8, 16), generator=g)
            out = model(input_ids=x, labels=x)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
    assert dbg.report.run["tgt_vocab"] < 94         # the content range, not the logits' width
    reason = dbg.report.probes["loss-health"].get("reason", "")
    assert "only the training loss was observed" not in reason, reason
    assert not [f for f in dbg.report.findings if f.severity != "info"], dbg.report.findings
