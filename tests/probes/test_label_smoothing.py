import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _misc_helpers import PAD, V, kinds, setup_only
from tndebug.config import ModelConfig
from tndebug.harness import smoothed_loss, train_with_probes
from tndebug.inject import make_model
from tndebug.probes.label_smoothing import LabelSmoothingProbe
from tndebug.probes.schedule import every
from tndebug.subject import tndebug_subject

NAME = "label-smoothing"


class Sink:
    def __init__(self):
        self.tags = []

    def on_metric(self, step, tag, value):
        self.tags.append(tag)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_criterion_and_model_are_silent(norm):
    probe, sink = LabelSmoothingProbe(every(2)), Sink()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=3, batch=8,
                                       sinks=[sink])
    assert findings == [] and probe.status() == "pass"
    assert sink.tags.count("smoothing/pad_mass") == 2


def smoothing_onto_pad(logits, target, eps=0.1):
    """The fault label_smoothing_on_pad as the trainer writes it: eps/(V-1) on every other class."""
    true = torch.full_like(logits, eps / (logits.shape[-1] - 1))
    true.scatter_(1, target[:, None], 1.0 - eps)
    true[target == PAD] = 0
    return F.kl_div(logits.log_softmax(-1), true, reduction="sum") / (target != PAD).sum()


def _unit(criterion):
    probe = LabelSmoothingProbe()
    findings = setup_only(tndebug_subject(make_model(ModelConfig.tiny())), [probe],
                          criterion=criterion)
    return findings, probe


def test_smoothing_onto_pad_gives_exactly_the_warning():
    [f], _ = _unit(smoothing_onto_pad)
    assert (f.severity, f.where) == ("warning", "criterion")
    assert f.evidence["q_pad"] == pytest.approx(0.1 / (V - 1), rel=1e-4)
    assert f.evidence["g_pad"] == pytest.approx(f.evidence["g_other"], rel=1e-4)


@pytest.mark.parametrize("criterion", [
    lambda lg, t: smoothed_loss(lg, t),                                          # annotated
    lambda lg, t: F.cross_entropy(lg, t, ignore_index=PAD),                      # no smoothing
    lambda lg, t: F.cross_entropy(lg, t, ignore_index=PAD, reduction="sum"),
], ids=["annotated", "ce", "ce-sum"])
def test_criteria_that_keep_pad_clean_are_silent(criterion):
    findings, probe = _unit(criterion)
    assert findings == [] and probe.status() == "pass"


# -- the same bug written by hand ------------------------------------------------------------

def test_hand_torch_label_smoothing_spreads_onto_pad():
    """nn.CrossEntropyLoss(label_smoothing=...) spreads eps over all V classes, pad included."""
    [f], _ = _unit(nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1))
    assert (f.severity, f.where) == ("warning", "criterion")
    assert f.evidence["q_pad"] == pytest.approx(0.1 / V, rel=1e-4)


def test_hand_note_000_criterion_without_pad_rows_is_also_an_error():
    """Note 000: eps/(V-1) everywhere and pad-target rows kept (batchmean over all rows)."""
    def criterion(logits, target, eps=0.1):
        true = torch.full_like(logits, eps / (logits.shape[-1] - 1))
        true.scatter_(1, target[:, None], 1.0 - eps)
        return F.kl_div(logits.log_softmax(-1), true, reduction="batchmean")
    findings, _ = _unit(criterion)
    assert kinds(findings, NAME) == {("warning", "criterion"), ("error", "criterion")}
    assert [f.severity for f in findings] == ["error", "warning"]


def test_hand_ce_without_ignore_index_is_a_pad_row_error():
    findings, _ = _unit(nn.CrossEntropyLoss())
    assert kinds(findings, NAME) == {("error", "criterion")}


def test_no_criterion_or_raw_logits_skip_with_a_reason():
    _, probe = _unit(None)
    assert probe.status() == "skipped" and "criterion" in probe.reason()
    assert probe.coverage["criterion"]["status"] == "not applicable"
    raw = lambda lg, t: F.kl_div(lg, F.one_hot(t, V).float(), reduction="sum")   # no log_softmax
    findings, probe = _unit(raw)
    assert "log_softmax" in probe.skipped


def test_runtime_pad_mass_still_falling_is_no_verdict():
    """Above the threshold but falling fast (a model still converging): no warning."""
    from tndebug.probes.base import RunContext, StepInfo
    from tndebug.capture.trace import Trace
    run = RunContext(subject=tndebug_subject(make_model(ModelConfig.tiny())), criterion=None)
    probe = LabelSmoothingProbe(every(50))
    probe.setup(run)
    tgt_out = torch.randint(2, V, (4, 6))
    for step, p_pad in ((100, 0.004), (150, 0.0121), (200, 0.0071), (250, 0.0028)):
        probs = torch.full((4, 6, V), (1 - p_pad) / (V - 1))
        probs[..., PAD] = p_pad
        info = StepInfo(step, logits=probs.log(), tgt_out=tgt_out)
        probe.update(probe.observe(Trace(step=step), info), info)
    probe.finish(run)
    assert kinds(probe.findings, NAME) == set()
    assert "still falling" in probe.status_entry()["coverage"][""]["reason"]


def _fitted(p_pad, p_target, tgt_out):
    """A model that gives each target p_target, pad p_pad, every other class the rest alike."""
    probs = torch.full((*tgt_out.shape, V), (1 - p_pad - p_target) / (V - 2))
    probs[..., PAD] = p_pad
    probs.scatter_(-1, tgt_out[..., None], p_target)
    return probs


@pytest.mark.parametrize("p_pad, warned", [(0.01, True), (0.0005, False)])
def test_runtime_pad_mass_is_checked_when_the_unit_test_cannot_run(p_pad, warned):
    """A fitted model (0.9 on its targets) that gives pad the other wrong classes' share."""
    from tndebug.probes.base import RunContext, StepInfo
    from tndebug.capture.trace import Trace
    run = RunContext(subject=tndebug_subject(make_model(ModelConfig.tiny())), criterion=None)
    probe = LabelSmoothingProbe(every(10))
    probe.setup(run)
    tgt_out = torch.randint(2, V, (4, 6))
    probs = _fitted(p_pad, 0.9, tgt_out)
    for step in (90, 100, 110, 120):
        info = StepInfo(step, logits=probs.log(), tgt_out=tgt_out)
        probe.update(probe.observe(Trace(step=step), info), info)
    probe.finish(run)
    assert kinds(probe.findings, NAME) == ({("warning", "criterion")} if warned else set())
    if warned:
        assert probe.findings[0].step == 120
        assert probe.findings[0].evidence["pad_mass"] == pytest.approx(p_pad, rel=1e-4)


def test_runtime_pad_mass_of_a_model_still_learning_is_no_verdict():
    """Over PAD_MASS and holding, but far below the other wrong classes (a healthy nanoGPT-style
    loop at step 250: p(pad) 6e-3, the others 4.4e-2): not a warning."""
    from tndebug.probes.base import RunContext, StepInfo
    from tndebug.capture.trace import Trace
    run = RunContext(subject=tndebug_subject(make_model(ModelConfig.tiny())), criterion=None)
    probe = LabelSmoothingProbe(every(50))
    probe.setup(run)
    tgt_out = torch.randint(2, V, (4, 6))
    for step, p_pad in ((150, 0.0086), (200, 0.0059), (250, 0.0061)):
        info = StepInfo(step, logits=_fitted(p_pad, 0.6, tgt_out).log(), tgt_out=tgt_out)
        probe.update(probe.observe(Trace(step=step), info), info)
    probe.finish(run)
    assert kinds(probe.findings, NAME) == set()
    reason = probe.status_entry()["coverage"][""]["reason"]
    assert "other wrong classes" in reason and "criterion=" in reason
