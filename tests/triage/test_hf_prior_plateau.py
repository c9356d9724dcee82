"""bench/hf_unseen.py HELD-OUT false error (issue 19): a Megatron-BERT trained 150 masked-LM steps
on random ids, whose masked token no input predicts, learns its targets' prior (loss ln 124) and
gives one answer at every position; its stream's rank ratio falls to 0.08 at layer 0 under one
learned vector (retention 0.99). Triage called it a rank collapse; its fresh initialisation is
clean, so it is info now."""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]
V, D = 128, 32


def test_megatron_bert_on_its_prior_is_not_a_rank_collapse(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MegatronBertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=2 * D,
                                          max_position_embeddings=64, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = transformers.AutoModelForMaskedLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):                                   # bench/hf_unseen.py's train()
        x = torch.randint(4, V - 4, (16, 12), generator=g)
        pick = torch.rand(x.shape, generator=g) < 0.15
        pick[:, 0] = True
        loss = model(input_ids=x.masked_fill(pick, V - 1),
                     labels=torch.where(pick, x, torch.full_like(x, -100))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(loss.item() - math.log(V - 8)) < 0.1        # the prior: nothing else is learnable
    model.save_pretrained(tmp_path / "mb")
    report = triage_hf(TriageOptions(str(tmp_path / "mb")))
    drift = [f for f in report.findings if f.code == "variance-drift/rank-collapse"]
    assert drift and {f.severity for f in drift} == {"info"}, [(f.severity, f.message) for f in drift]
    (f,) = drift
    assert f.evidence["r"] < 0.2 and f.evidence["retention"] >= 0.3
    assert f.evidence["logits_r"] < 0.02                    # one answer at every position
    assert f.evidence["judged_on"] == "fresh init" and f.evidence["init_r"] is None
