"""train-mode: optimizer steps taken with the model in eval mode (model.train() forgotten)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tndebug
from tndebug.config import ModelConfig
from tndebug.harness import copy_batch, train_with_probes
from tndebug.inject import make_model
from tndebug.probes import probe_class
from tndebug.probes.train_mode import TrainModeProbe

V = 11


def user_loop(model, steps=6, *, evaluate_at=2, train_after=True):
    """A user's loop under tndebug.watch with one evaluation at step `evaluate_at`."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, quiet=True, probes="train-mode", total_steps=steps) as dbg:
        model.train()
        for step in range(steps):
            if step == evaluate_at:
                model.eval()
                with torch.no_grad():
                    src, tgt_in, _ = copy_batch(g, 8, 8, V)
                    model(src, tgt_in)
                if train_after:
                    model.train()
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1),
                                   ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return dbg.report


def mine(report):
    return [f for f in report.findings if f.probe == "train-mode"]


def test_registered():
    assert probe_class("train-mode") is TrainModeProbe


def test_train_after_the_evaluation_is_clean():
    torch.manual_seed(0)
    report = user_loop(make_model(ModelConfig.tiny()))
    assert mine(report) == [] and report.probes["train-mode"]["status"] == "pass"


def test_forgotten_train_after_the_evaluation_warns_from_that_step():
    torch.manual_seed(0)
    report = user_loop(make_model(ModelConfig.tiny()), train_after=False)
    (f,) = mine(report)
    assert f.severity == "warning" and f.step == 2, f.message
    assert f.evidence["eval_steps"] == 4 and f.evidence["steps_seen"] == 6
    assert "model.train()" in f.fix and f.where in f.evidence["modules_off"]


class NoDropout(nn.Module):
    """A model with nothing that behaves differently in eval mode."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, 16), nn.Linear(16, V)

    def forward(self, src, tgt):
        return self.out(self.emb(tgt) + self.emb(src).mean(1, keepdim=True))


def test_eval_mode_without_dropout_or_batch_norm_is_info():
    torch.manual_seed(0)
    model = NoDropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = TrainModeProbe()
    from tndebug.probes.base import RunContext
    from tndebug.probes.engine import ProbeEngine
    from tndebug.subject import Subject
    subject = Subject(model, lambda m, s, t, pad: m(s, t), pad_id=0, bos_id=1, src_vocab=V,
                      tgt_vocab=V)
    g = torch.Generator().manual_seed(0)
    with ProbeEngine([probe], RunContext(subject=subject, optimizer=opt)) as engine:
        engine.setup()
        model.eval()
        for _ in range(3):
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        findings = engine.finish()
    (f,) = findings
    assert f.severity == "info" and "nothing we can see changes" in f.message


def test_the_trainer_loop_is_clean():
    probe = TrainModeProbe()
    _, findings, _ = train_with_probes(ModelConfig.tiny(), [probe], steps=3)
    assert findings == [] and probe.status() == "pass" and probe.steps == 3


def test_steps_in_eval_mode_are_steps_for_every_probe():
    """Issue 44: with model.train() forgotten, train-mode names it, and the probes that need
    training steps count the steps taken in eval mode (all but the first one in eval mode);
    before, each said "never observed a training step"."""
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    probes = "train-mode,gradient-flow,loss-health,lr-schedule"
    with tndebug.watch(model, opt, quiet=True, probes=probes, total_steps=12,
                       lr_schedule=lambda step: 1e-3) as dbg:
        model.eval()
        for _ in range(12):
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1),
                                   ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = dbg.report
    assert [(f.code, f.step) for f in report.findings if f.severity != "info"] == \
        [("train-mode/eval-mode-steps", 0)], report.findings
    for name in ("gradient-flow", "loss-health", "lr-schedule"):
        assert report.probes[name]["steps_observed"] > 0, (name, report.probes[name])
        assert report.probes[name]["status"] == "pass", (name, report.probes[name])
    assert report.probes["lr-schedule"]["steps_observed"] == 11


def test_an_evaluation_with_gradients_on_is_not_a_step():
    """A forward in eval mode with gradients on (no torch.no_grad()) in a loop that trains in
    train mode: still not the step's batch."""
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, quiet=True, probes="train-mode,lr-schedule", total_steps=6) as dbg:
        for _ in range(6):
            model.eval()
            model(*copy_batch(g, 8, 8, V)[:2])          # an evaluation, gradients on
            model.train()
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1),
                                   ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert dbg._trains_in_eval is False
    assert dbg.report.probes["lr-schedule"]["steps_observed"] == 6
    assert mine(dbg.report) == []
