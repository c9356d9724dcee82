"""label-shift: from how a decoder-only model learns, labels not shifted or shifted twice are
named at the end of training; a healthy run passes; before the loss halves, or on an
encoder-decoder, the probe says why it has no verdict. In triage the trained weights' one pass
is judged (tests/triage/test_label_shift_triage.py: end to end, with the fresh re-judgement)."""
from __future__ import annotations

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.label_shift import LabelShiftProbe
from tndebug.subject import tndebug_subject
from tndebug.train.config import TrainConfig, model_config
from tndebug.train.loop import run_training


def train(*faults, steps=250):
    torch.manual_seed(0)
    mc = model_config("copy", "tiny", "pre", faults, arch="decoder", dropout=0.0)
    tc = TrainConfig(task="copy", steps=steps, warmup=100, lr_factor=1.5)
    return run_training(mc, tc, probes="label-shift", evaluate_at_end=False).report


def codes(report):
    return [f.code for f in report.findings]


@pytest.mark.parametrize("fault,code", [("lm_labels_unshifted", "label-shift/unshifted"),
                                        ("lm_labels_shifted_twice", "label-shift/shifted-twice")])
def test_a_misshifted_loss_is_named_from_what_the_model_learnt(fault, code):
    report = train(fault)
    assert codes(report) == [code]
    (f,) = report.findings
    assert f.severity == "error" and f.evidence["loss_last"] <= 0.5 * f.evidence["loss_first"]
    rate = f.evidence["self_rate" if fault.endswith("unshifted") else "after_next_rate"]
    # well past the probe's own cut (SELF_RATE 0.9, AFTER_NEXT_RATE 0.5): after-next measured
    # 0.898 at step 250 on a 2-core Intel Xeon, above 0.9 on AMD EPYC (float sums differ)
    assert rate >= (0.9 if fault.endswith("unshifted") else 0.8)
    assert rate >= 2 * f.evidence["next_rate"]


def test_a_healthy_decoder_passes_once_it_has_learnt():
    report = train()
    assert codes(report) == []
    assert report.probes["label-shift"]["status"] == "pass"


def _probe(kind="decoder", mode="train"):
    model = make_model(ModelConfig.tiny(arch=kind, dropout=0.0))
    probe = LabelShiftProbe()
    probe.mode = mode
    run = RunContext(subject=tndebug_subject(model), mode=mode)
    probe.setup(run)
    return probe, run


def _step(probe, step, loss, ids, pred):
    logits = torch.nn.functional.one_hot(pred, 11).float()
    probe.observed_steps += 1
    probe.update({k: v for k, v in probe.observe(None, StepInfo(
        step, loss=torch.tensor(loss), logits=logits, tgt_in=ids)).items()}, StepInfo(step))


def test_a_model_that_has_not_learnt_has_no_verdict_even_when_it_repeats_its_input():
    probe, run = _probe()
    ids = torch.randint(3, 11, (4, 9), generator=torch.Generator().manual_seed(0))
    _step(probe, 0, 2.5, ids, ids)          # a tied embedding at init: the input token on top
    _step(probe, 50, 2.0, ids, ids)
    probe.finish(run)
    assert probe.findings == [] and probe.status() == "no verdict"
    assert "has not halved" in probe.reason()


def test_the_rates_count_real_positions_only():
    probe, run = _probe()
    ids = torch.tensor([[1, 5, 6, 7, 0, 0]])
    pred = torch.tensor([[5, 6, 7, 3, 9, 9]])             # the next token at every real position
    _step(probe, 0, 2.0, ids, pred)
    _step(probe, 50, 0.5, ids, pred)
    probe.finish(run)
    assert probe.status() == "pass" and probe.findings == []
    assert probe._rows[-1]["next"] == 1.0 and probe._rows[-1]["self"] == 0.0


def test_not_applicable_on_an_encoder_decoder_says_why():
    probe, run = _probe("seq2seq", "train")
    probe.observed_steps = 5                                # the engine counts its scheduled steps
    probe.finish(run)
    assert probe.status() == "skipped" and "encoder-decoder" in probe.reason()


def _once(pred_of, ids):
    """Triage: one recorded pass whose top predictions are pred_of(ids)."""
    probe, run = _probe("decoder", "triage")
    _step(probe, 0, 1.0, ids, pred_of(ids))
    probe.finish(run)
    return probe


IDS = torch.randint(3, 11, (4, 9), generator=torch.Generator().manual_seed(0))
NEXT = lambda ids: torch.cat([ids[:, 1:], ids[:, :1]], 1)          # noqa: E731
AFTER = lambda ids: torch.cat([ids[:, 2:], ids[:, :2]], 1)         # noqa: E731


@pytest.mark.parametrize("pred_of,code", [(lambda ids: ids, "label-shift/unshifted"),
                                          (AFTER, "label-shift/shifted-twice"), (NEXT, None)])
def test_triage_judges_the_trained_weights_from_one_pass(pred_of, code):
    probe = _once(pred_of, IDS)
    assert [f.code for f in probe.findings] == ([code] if code else [])
    assert probe.status() == ("fail" if code else "pass")
    assert probe.coverage["unshifted"]["status"] == "checked"


def test_triage_has_no_twice_verdict_where_the_model_predicts_neither_offset():
    # a model shown data not its own: its top guess is neither the next token nor the one after
    probe = _once(lambda ids: torch.full_like(ids, 10) - (ids == 10).long(), IDS)
    assert probe.findings == [] and probe.status() == "pass"          # unshifted was checked
    cov = probe.coverage["shifted-twice"]
    assert cov["status"] == "no verdict" and "--data" in cov["reason"]


def test_triage_without_a_step_has_no_verdict():
    probe, run = _probe("decoder", "triage")
    probe.finish(run)
    assert probe.status() == "no verdict" and "no position with a label" in probe.reason()
