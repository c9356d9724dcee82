import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _misc_helpers import PAD, V, ReluCapture, hand_subject, kinds, probed_loop, setup_only
from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.inject import make_model
from tndebug.probes.base import StepInfo
from tndebug.probes.gradient_flow import (DEAD_SHARE, DEAD_SHARE_TRAINING, MIN_TOKENS, SPIKE,
                                          GradientFlowProbe)
from tndebug.probes.schedule import every
from tndebug.subject import tndebug_subject
from tndebug.capture.trace import Trace

NAME = "gradient-flow"
FFN_SITES = {f"{s}.layers.{i}.ffn" for s in ("encoder", "decoder") for i in range(2)}


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_model_is_silent(norm):
    probe = GradientFlowProbe(every(1))
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=12, batch=16)
    assert kinds(findings, NAME) == set()
    assert probe.status() == "pass"
    assert probe._grad_steps == 12


def test_dead_relu_init_gives_one_warning_per_ffn():
    subject = tndebug_subject(make_model(ModelConfig.tiny(norm="post").with_faults("dead_relu_init")))
    findings = setup_only(subject, [GradientFlowProbe()])
    assert kinds(findings, NAME) == {("warning", s) for s in FFN_SITES}
    assert all(f.evidence["dead_fraction"] > DEAD_SHARE and f.evidence["tokens"] >= MIN_TOKENS
               for f in findings)


# -- the same bugs written by hand ------------------------------------------------------------

class HandMLP(nn.Module):
    """A user's position-wise model: residual ReLU blocks over target + mean source embedding."""

    def __init__(self, d=32, d_ff=64, n=2, ffn_bias=None):
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, d), nn.Embedding(64, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d_ff), nn.ReLU(),
                                                  nn.Linear(d_ff, d)) for _ in range(n))
        self.out = nn.Linear(d, V)
        if ffn_bias is not None:            # the user's init: "start the FFN biases at -3"
            for block in self.layers:
                nn.init.xavier_uniform_(block[1].weight)
                nn.init.constant_(block[1].bias, ffn_bias)

    def forward(self, src, tgt):
        x = self.embed(tgt) + self.pos(torch.arange(tgt.shape[1]))
        x = x + self.embed(src).mean(1, keepdim=True)
        for block in self.layers:
            x = x + block(x)
        return self.out(x)                                                  # [B, T, V]


def _hand(model, **kw):
    return hand_subject(model, ReluCapture(model), encode=False, **kw)


def test_hand_negative_bias_is_the_same_warning():
    findings = setup_only(_hand(HandMLP(ffn_bias=-3.0)), [GradientFlowProbe()])
    assert kinds(findings, NAME) == {("warning", "layers.0"), ("warning", "layers.1")}


def test_hand_healthy_mlp_trains_silently():
    _, findings = probed_loop(_hand(HandMLP()), [GradientFlowProbe(every(1))], steps=10)
    assert kinds(findings, NAME) == set()


def test_hand_division_by_zero_tokens_is_a_nonfinite_error():
    def criterion(logits, target):      # normalised by a count that is 0: inf loss
        return F.cross_entropy(logits, target, reduction="sum") / (target < 0).sum()
    probe = GradientFlowProbe(every(1))
    _, findings = probed_loop(_hand(HandMLP()), [probe], steps=3, criterion=criterion)
    [f] = [f for f in findings if f.probe == NAME]
    assert (f.severity, f.step) == ("error", 0)


def test_hand_loss_scale_left_on_once_is_one_spike():
    calls = {"n": 0}

    def criterion(logits, target):      # an AMP-style loss scale not undone at step 8
        calls["n"] += 1
        scale = 1000.0 if calls["n"] == 9 else 1.0
        return scale * F.cross_entropy(logits, target, ignore_index=PAD)
    _, findings = probed_loop(_hand(HandMLP()), [GradientFlowProbe(every(1))], steps=10,
                              criterion=criterion, lr_fn=lambda s: 0.0)
    [f] = [f for f in findings if f.probe == NAME]
    assert (f.severity, f.step) == ("warning", 8)
    assert f.evidence["ratio"] > SPIKE and len(f.evidence["layer_ratios"]) == 2
    assert f.where in ("layers.0", "layers.1")


def test_detached_layer_gets_no_gradient():
    class Frozen(HandMLP):
        def forward(self, src, tgt):     # layer 1's output is detached by mistake
            x = self.embed(tgt) + self.pos(torch.arange(tgt.shape[1]))
            x = x + self.layers[0](x)
            x = x + self.layers[1](x).detach()
            return self.out(x)
    _, findings = probed_loop(_hand(Frozen()), [GradientFlowProbe(every(1))], steps=4)
    assert kinds(findings, NAME) == {("warning", "layers.1")}


def test_units_that_die_during_training_are_caught_by_the_window():
    probe = GradientFlowProbe(every(1))
    tokens = 0
    step = 0
    while tokens < MIN_TOKENS:          # 1024 tokens per step; 2 units of 48 still fire
        h = torch.zeros(32, 32, 48)
        h[..., :2] = 1.0
        trace = Trace(step=step, ffn_hidden={"enc.layers.0.ffn": torch.relu(h - 0.5)})
        probe.update(probe.observe(trace, StepInfo(step, grads_ready=False)), StepInfo(step))
        tokens += 1024
        step += 1
    [f] = probe.findings
    assert f.where == "enc.layers.0.ffn" and f.step == 3
    assert f.evidence["dead_fraction"] == pytest.approx(46 / 48)
    assert f.evidence["threshold"] == DEAD_SHARE_TRAINING


def test_late_hard_batch_below_the_early_peak_is_not_a_spike():
    probe = GradientFlowProbe(every(1))
    probe._groups, probe._indexed = {"layers.0": []}, {"layers.0"}
    norms = [10, 5, 2, 1, 0.5, 0.3, 0.2, 0.2, 0.2, 0.2, 3.0, 0.2, 0.2, 60.0]
    for step, norm in enumerate(norms):
        probe.update({"grad_norm": torch.tensor([norm]), "grad_present": [True]}, StepInfo(step))
    [f] = probe.findings                 # 3.0 is 15x the median but below the peak of 10
    assert (f.step, f.where) == (13, "layers.0") and f.evidence["earlier_peak"] == 10


def test_one_layer_rising_while_the_total_is_calm_is_not_a_spike():
    probe = GradientFlowProbe(every(1))
    probe._groups, probe._indexed = {"layers.0": [], "layers.1": []}, {"layers.0", "layers.1"}
    for step in range(12):              # layer 0 rises 20x late; layer 1 dominates the total
        norm0 = 0.01 if step < 11 else 0.2
        probe.update({"grad_norm": torch.tensor([norm0, 5.0]), "grad_present": [True, True]},
                     StepInfo(step))
    assert probe.findings == []


def test_gradients_that_grow_by_orders_of_magnitude_are_an_explosion():
    from tndebug.probes.gradient_flow import EXPLODE
    probe = GradientFlowProbe(every(10))
    probe._groups, probe._indexed = {"layers.0": [], "layers.1": []}, {"layers.0", "layers.1"}
    totals = [5.9, 3083.0, 4436.0, 1557.0, 1344.0]         # `--lr-factor 2000 --warmup 1`, post-LN
    for i, t in enumerate(totals):
        probe.update({"grad_norm": torch.tensor([t * 0.6, t * 0.8]), "grad_present": [True, True]},
                     StepInfo(10 * i, lr=75.4 if i == 1 else 50.0))
    [f] = probe.findings
    assert (f.severity, f.step) == ("error", 10)
    assert f.evidence["ratio"] > EXPLODE and f.evidence["steps"] == [10, 20]
    assert "from step 10" in f.message and "lr is 75.4 at step 10" in f.message


def test_an_exploding_run_is_an_error_not_a_pass():
    probe = GradientFlowProbe()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm="post"), [probe], steps=30, batch=32,
                                       warmup=1, lr_factor=2000)
    errors = [f for f in findings if f.probe == NAME and f.severity == "error"]
    assert errors and errors[0].step <= 20, findings
    assert probe.status() == "fail"


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_200_step_runs_never_look_exploded(norm):
    probe = GradientFlowProbe()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=200, batch=32,
                                       warmup=20)
    assert kinds(findings, NAME) == set(), findings
    first = probe._first[1]
    assert max(probe._peak.get("total", 0), first) <= 2 * first     # far below EXPLODE
