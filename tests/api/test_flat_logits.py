"""A model whose forward returns flattened logits [B*T, V] (the paper tutorials'
`seq_logit.view(-1, V)`, tests/foreign/two_input_seq2seq.py) under `watch`, its loss summed
over tokens as those tutorials sum it: loss-health reads the logits, reshaped to the batch
(it said "only the training loss was observed" and the run was INCOMPLETE), and so judges
the loss level against ln V by itself."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import tndebug

sys.path.insert(0, str(Path(__file__).parents[1] / "foreign"))
from two_input_seq2seq import make  # noqa: E402

PAD, BOS = 0, 1


def test_flattened_logits_reach_loss_health():
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, forward=lambda m, s, t, p: m(s, t), pad_id=PAD,
                       probes="loss-health", quiet=True) as dbg:
        for _ in range(12):
            src = torch.randint(2, 40, (8, 7), generator=g)
            src[4:, 5:] = PAD
            tgt = torch.cat([torch.full((8, 1), BOS), src], 1)
            pred = model(src, tgt[:, :-1])                       # [B*T, V]
            loss = F.cross_entropy(pred, tgt[:, 1:].reshape(-1), ignore_index=PAD,
                                   reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
    reason = dbg.report.probes["loss-health"].get("reason", "")
    assert "only the training loss was observed" not in reason, reason
    assert dbg.report.probes["loss-health"]["status"] == "pass"
