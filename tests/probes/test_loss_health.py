import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _misc_helpers import PAD, V, hand_subject, kinds, probed_loop
from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.inject import make_model
from tndebug.probes import loss_health
from tndebug.probes.loss_health import PLATEAU_SHARE, LossHealthProbe
from tndebug.probes.schedule import every
from tndebug.subject import tndebug_subject

NAME = "loss-health"


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_model_is_silent(norm):
    probe = LossHealthProbe(every(5), plateau_steps=60)
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=61, batch=16,
                                       length=8, warmup=20)
    assert kinds(findings, NAME) == set()
    assert probe._plateau_judged and probe.status() == "pass"


def test_tied_embeddings_high_initial_loss_is_only_info():
    probe = LossHealthProbe(every(5))
    _, findings, _ = train_with_probes(ModelConfig.tiny(tie_embeddings=True), [probe], steps=2,
                                       batch=8)
    [f] = findings
    assert f.severity == "info" and f.evidence["loss0"] > f.evidence["threshold_high"]
    assert f.evidence["predicts_input_token"] > 0.5 and probe.status() == "pass"


def test_lr_zero_is_a_plateau_error():
    """A schedule that returns 0 (F24): nothing learns, the loss stays at ln V."""
    subject = tndebug_subject(make_model(ModelConfig.tiny()))
    _, findings = probed_loop(subject, [LossHealthProbe(every(5), plateau_steps=20)], steps=21,
                              lr_fn=lambda step: 0.0)
    [f] = findings
    assert (f.severity, f.step) == ("error", 20)
    assert f.evidence["ce"] > f.evidence["threshold"] == pytest.approx(PLATEAU_SHARE * math.log(V))


def test_too_short_run_skips_the_plateau_check_with_a_reason():
    probe = LossHealthProbe(every(5))
    _, findings, _ = train_with_probes(ModelConfig.tiny(), [probe], steps=6, batch=8)
    assert findings == [] and "200 steps" in probe.skipped and probe.status() == "pass"


def test_run_shorter_than_plateau_steps_is_judged_at_its_end(monkeypatch):
    monkeypatch.setattr(loss_health, "PLATEAU_MIN_STEPS", 10)     # 200 in real runs
    subject = tndebug_subject(make_model(ModelConfig.tiny()))
    probe = LossHealthProbe(every(5))                             # plateau_steps 500
    _, findings = probed_loop(subject, [probe], steps=11, lr_fn=lambda step: 0.0)
    [f] = findings
    assert (f.severity, f.step) == ("error", 10)


def _loop_without_logits(give_loss: bool):
    """A user's loop that hands the engine the loss (or nothing), never the logits/targets."""
    from tndebug.harness import copy_batch
    from tndebug.probes.base import RunContext, StepInfo
    from tndebug.probes.engine import ProbeEngine
    model = make_model(ModelConfig.tiny())
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    probe = LossHealthProbe(every(5))
    g = torch.Generator().manual_seed(0)
    with ProbeEngine([probe], RunContext(subject=tndebug_subject(model), optimizer=opt)) as eng:
        eng.setup()
        for step in range(6):
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            eng.begin_step(step, src, tgt_in)
            loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1))
            opt.zero_grad()
            loss.backward()
            eng.end_step(StepInfo(step, lr=1e-3, loss=loss.detach() if give_loss else None))
            opt.step()
        eng.finish()
    return probe


@pytest.mark.parametrize("give_loss", [True, False])
def test_no_logits_or_targets_is_no_verdict_never_a_pass(give_loss):
    """The loss levels need the logits and the targets; a loss alone (or nothing) decides
    no level: no verdict, with what was seen, never a pass."""
    probe = _loop_without_logits(give_loss)
    entry = probe.status_entry()
    assert probe.findings == [] and entry["status"] == "no verdict", entry
    if give_loss:
        assert entry["reason"].startswith("only the training loss was observed (2 probed steps")
    else:
        assert entry["reason"] == "no training loss and no logits/targets were observed"


# -- written by hand -------------------------------------------------------------------------

class HandLogits(nn.Module):
    """A user's model with an output layer of N(0, 1) weights over an unnormalised stream."""

    def __init__(self, d=32, out_std=None, tied=False):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, V)
        if out_std is not None:
            nn.init.normal_(self.out.weight, std=out_std)
        self.tied = tied

    def forward(self, src, tgt):
        x = self.embed(tgt) + self.mix(self.embed(src).mean(1, keepdim=True))
        if self.tied:                    # logits = x E^T: the input token scores itself highest
            return x @ self.embed.weight.T
        return self.out(x)


def test_hand_large_init_logits_warn_at_step_0():
    subject = hand_subject(HandLogits(out_std=1.0), encode=False)
    _, findings = probed_loop(subject, [LossHealthProbe(every(5))], steps=2)
    [f] = findings
    assert (f.severity, f.step) == ("warning", 0)
    assert f.evidence["loss0"] > f.evidence["threshold_high"]
    assert f.evidence["predicts_input_token"] < 0.5


def test_hand_unshifted_targets_with_tied_embeddings_warn_at_step_0():
    subject = hand_subject(HandLogits(tied=True), encode=False)
    _, findings = probed_loop(subject, [LossHealthProbe(every(5))], steps=2, unshifted=True)
    [f] = findings
    assert (f.severity, f.step) == ("warning", 0) and "targets visible" in f.message


def test_hand_nonfinite_loss_is_an_error_at_its_step():
    calls = {"n": 0}

    def criterion(logits, target):      # mean over real tokens, but counted on a batch that has none
        calls["n"] += 1
        n = (target != PAD).sum() if calls["n"] < 4 else (target < 0).sum()
        return F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum") / n
    subject = hand_subject(HandLogits(), encode=False)
    _, findings = probed_loop(subject, [LossHealthProbe(every(1))], steps=6, criterion=criterion)
    [f] = findings
    assert (f.severity, f.step) == ("error", 3) and f.evidence["loss"] == math.inf


@pytest.mark.parametrize("criterion", [
    # note 001's example: KLDivLoss given the generator's raw logits
    lambda lg, t: F.kl_div(lg, F.one_hot(t, lg.shape[-1]).float() * 0.9 + 0.01, reduction="batchmean"),
    # the same mistake with NLLLoss
    lambda lg, t: F.nll_loss(lg, t, ignore_index=PAD),
], ids=["kl_div", "nll_loss"])
def test_a_criterion_fed_raw_logits_gives_a_negative_loss_error(criterion):
    subject = tndebug_subject(make_model(ModelConfig.tiny()))
    _, findings = probed_loop(subject, [LossHealthProbe(every(1))], steps=30, criterion=criterion)
    bad = [f for f in findings if f.where == "criterion"]
    assert len(bad) == 1 and bad[0].severity == "error"
    assert bad[0].evidence["loss"] < loss_health.NEGATIVE_LOSS and "log_softmax" in bad[0].fix


def test_a_healthy_kl_with_log_softmax_never_goes_negative():
    crit = lambda lg, t: F.kl_div(lg.log_softmax(-1), F.one_hot(t, lg.shape[-1]).float() * 0.9 + 0.01,  # noqa: E731
                                  reduction="batchmean")
    subject = tndebug_subject(make_model(ModelConfig.tiny()))
    _, findings = probed_loop(subject, [LossHealthProbe(every(1))], steps=30, criterion=crit)
    assert not [f for f in findings if f.where == "criterion"]


# -- issue 12: an exploding loss ---------------------------------------------------------------
def test_an_exploding_post_ln_run_is_an_error_naming_its_onset_and_the_lr():
    """`tndebug run --preset tiny --norm post --lr-factor 2000 --warmup 1`: 2.6 -> 1e6."""
    probe = LossHealthProbe(every(5))
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm="post"), [probe], steps=11, batch=16,
                                       warmup=1, lr_factor=2000)
    (f,) = [f for f in findings if f.severity == "error"]
    assert f.step == 5 and "the loss exploded at step 5 (it began after step 0" in f.message
    assert f.evidence["ce"] > f.evidence["threshold"] == pytest.approx(
        loss_health.EXPLODE_X * max(f.evidence["ce_start"], f.evidence["ln_V"]))
    assert f.evidence["steps_above"] == [5, 10]
    assert "likely cause: the lr is" in f.message and "no warmup: the lr starts at 250" in f.message
    assert f.evidence["lr_peak_step"] == 0 and "warm up" in f.fix
    assert probe.status() == "fail"


def test_an_explosion_at_the_last_probed_step_is_judged_at_the_end():
    probe = LossHealthProbe(every(5))
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm="post"), [probe], steps=6, batch=16,
                                       warmup=1, lr_factor=2000)
    (f,) = [f for f in findings if f.severity == "error"]
    assert f.step == 5 and f.evidence["steps_above"] == [5]


def test_a_spike_that_recovers_is_a_warning():
    probe = LossHealthProbe(every(1))
    probe.setup(type("Run", (), {"lr_schedule": None, "total_steps": 10})())
    probe._ln_v = math.log(V)
    for step, ce in enumerate([2.4, 2.0, 40.0, 1.9]):
        probe._ce.append((step, ce))
        probe._explosion(step, ce, math.log(V))
    (f,) = probe.findings
    assert f.severity == "warning" and f.step == 2 and "loss spiked" in f.message


# -- issue 44: the loop's targets are not the ones the CE scores -----------------------------------
def feed(ces, losses, every_n=10):
    """The probe's update at steps 0, 10, ...: the CE it scores and the loop's own loss."""
    probe = LossHealthProbe(every(every_n))
    probe.setup(type("Run", (), {"lr_schedule": None, "total_steps": None})())
    for i, (ce, loss) in enumerate(zip(ces, losses)):
        probe.update({"ce": torch.tensor(ce), "loss": torch.tensor(loss), "vocab": V},
                     type("Info", (), {"step": i * every_n, "lr": None})())
    probe.finish(None)
    return probe


def test_a_loop_that_learns_other_targets_is_not_stuck_at_uniform():
    """targets = inputs in a user's loop: its loss 2.4 -> 0.007 while the CE against the next
    token climbs to 6.9 (> 0.95 ln V, and 2.9x its start): label-shift's to name, no
    collateral plateau or explosion."""
    n = 22
    ces = [2.4 + 4.5 * i / (n - 1) for i in range(n)]
    losses = [2.4 * 0.7 ** i + 0.007 for i in range(n)]
    probe = feed(ces, losses)
    assert probe.findings == [] and probe._plateau_judged and probe.status() == "pass"


def test_a_stuck_loop_whose_loss_is_scaled_is_still_stuck():
    """Gradient accumulation's loss / 4: a constant factor, the loss does not fall: error."""
    n = 22
    probe = feed([2.4] * n, [2.4 / 4] * n)
    (f,) = probe.findings
    assert f.code == "loss-health/stuck-uniform" and f.step == 210


def test_a_run_of_exactly_the_plateau_steps_is_judged_at_its_last_read():
    """A 200-step run read every 10 steps last reads step 190: the run had the 200 steps the
    check needs, so it is judged there (it said "plateau check needs 200 steps; this run had
    200" and was partly checked)."""
    probe = LossHealthProbe(every(10))
    probe.setup(type("Run", (), {"lr_schedule": None, "total_steps": None})())
    for i in range(20):                                           # steps 0, 10, ..., 190
        probe.update({"ce": torch.tensor(2.4), "loss": torch.tensor(2.4), "vocab": V},
                     type("Info", (), {"step": i * 10, "lr": None})())
    probe.steps_run = 200
    probe.finish(None)
    (f,) = probe.findings
    assert f.code == "loss-health/stuck-uniform" and f.step == 190
