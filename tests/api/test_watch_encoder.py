"""`check` and `watch` on an encoder-only Hugging Face model (a masked LM, issue 21): the
probes run with the encoder's tests, a causal mask is named, and a masked-LM loss taken at
every position (label-shift/mlm-unmasked) is named from the loop's own batches."""
from __future__ import annotations

import pytest
import torch

import tndebug
from tndebug.probes import _mlm_labels as mlm

transformers = pytest.importorskip("transformers")

V, MASK, PAD = 60, 3, 0


def bert(**kw):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64, pad_token_id=PAD, **kw)
    return transformers.BertForMaskedLM(cfg)


def errors(report):
    return [f for f in report.findings if f.severity == "error"]


def test_check_on_a_masked_lm_runs_the_encoder_tests_and_is_clean():
    report = tndebug.check(bert().eval())
    assert report.verdict == "clean", errors(report)
    assert report.run["adapter"] == "huggingface"
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert report.probes["lm-decoding"]["status"] == "skipped"          # decoder-only probe


def test_check_names_a_causal_mask_in_a_masked_lm():
    report = tndebug.check(bert(is_decoder=True).eval())     # BERT with the decoder's mask
    assert [f.code for f in errors(report)] == ["mask-broadcast/encoder-causal"]


def mlm_loop(model, steps: int, every_position: bool, out):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with tndebug.watch(model, opt, out=out) as w:
        for _ in range(steps):
            ids = torch.randint(5, V, (16, 12), generator=g)
            ids[:4, 9:] = PAD
            pick = (torch.rand(ids.shape, generator=g) < 0.15) & (ids != PAD)
            labels = torch.where(pick, ids, torch.full_like(ids, -100))
            if every_position:                                  # the bug: labels = input_ids
                labels = ids.masked_fill(ids == PAD, -100)
            loss = model(input_ids=ids.masked_fill(pick, MASK), attention_mask=(ids != PAD).long(),
                         labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w.report


@pytest.mark.slow
def test_watch_on_a_masked_lm_checks_the_labels_and_names_a_loss_at_every_position(tmp_path):
    healthy = mlm_loop(bert(), 60, False, tmp_path / "healthy")
    assert healthy.probes["label-shift"]["status"] == "pass"
    assert not errors(healthy), errors(healthy)
    faulty = mlm_loop(bert(), 60, True, tmp_path / "faulty")
    (f,) = errors(faulty)
    assert f.code == "label-shift/mlm-unmasked"
    assert f.evidence["labelled_share"] == 1.0 and f.evidence["unchanged_share"] > 0.8


def test_the_label_counts_tell_the_recipe_from_a_loss_at_every_position():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (32, 20), generator=g)
    pick = torch.rand(ids.shape, generator=g) < 0.15
    keep = torch.rand(ids.shape, generator=g) < 0.1               # BERT's 10% left unchanged
    src = torch.where(pick & ~keep, torch.full_like(ids, MASK), ids)
    recipe = mlm.counts(src, torch.where(pick, ids, torch.full_like(ids, PAD)), PAD)
    every = mlm.counts(src, ids, PAD)
    assert not mlm.verdict(*(int(recipe[k]) for k in ("real", "labelled", "unchanged")))[0]
    bad, ev = mlm.verdict(*(int(every[k]) for k in ("real", "labelled", "unchanged")))
    assert bad and ev["labelled_share"] == 1.0 and ev["unchanged_share"] > 0.8
