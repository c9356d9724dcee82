import math

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.inject import make_model
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.nan_scores import NanScores
from tndebug.subject import tndebug_subject

try:
    from attn_handmade import HandAttention, HandModel, HandNorm, PAD, hand_subject, run_probe
except ImportError:  # tests/probes imported as a package
    from tests.probes.attn_handmade import HandAttention, HandModel, HandNorm, PAD, hand_subject, run_probe


def found(cfg, steps=2):
    _, findings, _ = train_with_probes(cfg, [NanScores()], steps=steps, batch=8)
    return [(f.severity, f.where) for f in findings], findings


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_model_gives_no_finding(norm):
    assert found(ModelConfig.tiny(norm=norm), steps=3)[0] == []


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_neg_inf_fill_with_fully_masked_rows_is_named_at_its_softmax(norm):
    pairs, findings = found(ModelConfig.tiny(norm=norm).with_faults("neg_inf_fill_all_masked"))
    assert pairs == [("error", "encoder.layers.0.self_attn")]
    f = findings[0]
    assert f.message.startswith("encoder.layers.0.self_attn.hook_probs: softmax produced NaN in")
    assert "every key masked" in f.message and f.step == 0
    assert f.evidence["fully_masked_nonfinite_rows"] == f.evidence["rows"] > 0
    assert f.evidence["fill"] == -math.inf


def test_fill_1e9_is_info_on_fp32_and_fails_under_fp16():
    # docs/severity.md: an fp16 portability advisory on a model that does not compute in fp16
    pairs, findings = found(ModelConfig.tiny().with_faults("fill_1e9_fp16"))
    assert pairs == [("info", "encoder.layers.0.self_attn")]
    assert "-1e+09 would overflow float16" in findings[0].message
    assert "fp32 model: only matters if you switch on fp16 autocast" in findings[0].message
    assert findings[0].evidence["fill"] == -1e9
    probe = NanScores()
    probe.setup(RunContext(tndebug_subject(make_model(ModelConfig.tiny().with_faults("fill_1e9_fp16"))),
                           compute_dtype=torch.float16))
    assert [(f.severity, f.where) for f in probe.findings] == [("error", "encoder.layers.0.self_attn")]


def test_finfo_min_fill_is_safe_under_fp16():
    probe = NanScores()
    probe.setup(RunContext(tndebug_subject(make_model(ModelConfig.tiny())), compute_dtype=torch.float16))
    assert probe.findings == []


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_tiny_ln_eps_is_info_on_fp32_and_names_the_first_norm(norm):
    pairs, findings = found(ModelConfig.tiny(norm=norm).with_faults("tiny_ln_eps"))
    assert pairs == [("info", "encoder.layers.0.sublayer.0.norm")]
    assert "eps=1e-12 rounds to 0 in float16" in findings[0].message
    assert "fp32 model: only matters if you switch on fp16 autocast" in findings[0].message


@pytest.mark.parametrize("dtype, severity", [(torch.float16, "warning"), (torch.bfloat16, "info")])
def test_tiny_ln_eps_in_a_16_bit_model(dtype, severity):
    # nn.LayerNorm stays finite in float16, so in an fp16 model the rounded eps is a warning
    # (it bites under this dtype), not an error (no NaN shown); bf16 has the fp32 range
    probe = NanScores()
    probe.setup(RunContext(tndebug_subject(make_model(ModelConfig.tiny().with_faults("tiny_ln_eps"))),
                           compute_dtype=dtype))
    assert [f.severity for f in probe.findings] == [severity]
    assert probe.findings[0].evidence["fp16_constant_row_nonfinite"] == []


# -- the same bugs written by hand, in a model tndebug did not build -------------------------
class NegInfAttention(HandAttention):
    def mask(self, s, keep):
        return s.masked_fill(~keep, float("-inf"))      # the bug: -inf fill


class SquarePadMask(HandModel):
    def src_mask(self, src):
        keep = src != PAD
        return (keep[:, None, :, None] & keep[:, None, None, :])   # the bug: pad queries masked too


def test_handmade_healthy_model_gives_no_finding():
    assert run_probe(hand_subject(HandModel()), NanScores()) == []


def test_handmade_neg_inf_square_mask_gives_the_same_finding():
    findings = run_probe(hand_subject(SquarePadMask(attn_cls=NegInfAttention)), NanScores())
    assert [(f.severity, f.where) for f in findings] == [("error", "enc.0.self_attn")]
    assert findings[0].message.startswith("enc.0.self_attn.probs: softmax produced NaN in")
    assert "every key masked" in findings[0].message


def test_handmade_norm_with_tiny_eps_fails_in_float16_behaviourally():
    findings = run_probe(hand_subject(HandModel(norm_cls=HandNorm, eps=1e-12)), NanScores())
    assert [(f.severity, f.where) for f in findings] == [("info", "enc.0.norms.0")]
    assert "enc.0.norms.0" in findings[0].evidence["fp16_constant_row_nonfinite"]
    probe = NanScores()
    probe.setup(RunContext(hand_subject(HandModel(norm_cls=HandNorm, eps=1e-12)),
                           compute_dtype=torch.float16))
    assert [(f.severity, f.where) for f in probe.findings] == [("error", "enc.0.norms.0")]


def test_nan_during_training_is_replayed_and_named():
    model = HandModel()

    def poison(step):
        if step == 1:
            with torch.no_grad():
                model.dec[0].src_attn.wq.weight[0, 0] = float("inf")

    findings = run_probe(hand_subject(model), NanScores(), steps=3, before_step=poison)
    assert [(f.severity, f.where, f.step) for f in findings] == [("error", "dec.0.src_attn", 1)]
    assert findings[0].message.startswith("dec.0.src_attn.q: query projection produced")


def test_nonfinite_gradient_with_finite_forward_is_named():
    model = make_model(ModelConfig.tiny())
    # a hand-written op whose forward is exact and whose backward is 0 * inf: sqrt at 0
    model.generator.register_forward_pre_hook(lambda m, args: (args[0] + 0 * torch.sqrt(args[0] - args[0]),))
    findings = run_probe(tndebug_subject(model), NanScores(), steps=1)
    assert [(f.severity, f.where, f.step) for f in findings] == [("error", "decoder.hook_out", 0)]
    assert "gradient is NaN/Inf in backward while the forward is finite" in findings[0].message


def test_a_nan_between_probed_steps_is_named_on_divergence():
    """nan-scores probes sparsely; the divergence hook replays the batch and names the op."""
    from tndebug.config import ModelConfig
    from tndebug.harness import train_with_probes

    def poison(step, model):
        if step == 5:                        # not a probed step (log-spaced: 0, 1, 2, 4, 8, ...)
            with torch.no_grad():
                model.encoder.layers[1].ffn.w_1.weight.fill_(float("nan"))

    probe = NanScores()
    assert not probe.schedule(5)
    _, findings, _ = train_with_probes(ModelConfig.tiny(), [probe], steps=12, batch=8,
                                       before_step=poison)
    errors = [f for f in findings if f.severity == "error"]
    assert errors and errors[0].step == 5
    assert "encoder.layers.1.ffn" in errors[0].where or "encoder.layers.1.ffn" in errors[0].message


# -- a NaN made by the loss code while the logits are finite (issue 19) ---------------------
def nan_loss_run(criterion_nan: bool):
    """A step whose loss is NaN: the declared criterion gives NaN itself (a log of a negative),
    or is healthy while the user's loss code (not the declared criterion) made the NaN."""
    model = make_model(ModelConfig.tiny())
    subject = tndebug_subject(model)
    crit = (lambda lg, t: torch.nn.functional.cross_entropy(lg, t) + torch.log(-lg.new_ones(())))
    run = RunContext(subject, criterion=crit if criterion_nan else
                     (lambda lg, t: torch.nn.functional.cross_entropy(lg, t)))
    probe = NanScores()
    probe.setup(run)
    src, tgt = subject.random_batch(4, 8, 8, pad_share=0.0)
    with torch.no_grad():
        logits = subject.logits(src, tgt)
    return probe, run, StepInfo(3, loss=torch.tensor(float("nan")), logits=logits, src=src,
                                tgt_in=tgt, tgt_out=tgt)


@pytest.mark.parametrize("criterion_nan", [True, False])
@pytest.mark.parametrize("moment", ["on_divergence", "update"])
def test_nan_loss_with_finite_logits_names_the_loss_code(criterion_nan, moment):
    probe, run, info = nan_loss_run(criterion_nan)
    assert probe.findings == []                           # a healthy model at setup
    if moment == "on_divergence":
        probe.on_divergence(run, info)
    else:                                                 # a probed step: loss flagged, activations finite
        probe.update({"names": [], "gnames": [], "loss_bad": torch.tensor(1.0)}, info)
    (f,) = probe.findings
    assert f.severity == "error" and f.where == "loss" and f.step == 3
    assert "update diverged" not in f.message and "learning rate" not in f.message
    assert "this step's logits are finite" in f.message and "loss computation" in f.message
    assert f.evidence["step_logits"] == "finite"
    assert f.evidence["criterion_on_finite_logits"] == ("non-finite" if criterion_nan else "finite")
    assert "log_softmax" in f.fix and "max(n, 1)" in f.fix


# -- eps = 0 divides by zero on a constant row in fp32 too (issue 19) ------------------------
def zero_eps_tiny():
    model = make_model(ModelConfig.tiny())
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 0.0
    return model


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_hand_written_norm_with_eps_0_is_a_warning_in_fp32(eps):
    findings = run_probe(hand_subject(HandModel(norm_cls=HandNorm, eps=eps)), NanScores())
    if eps:
        assert findings == []
        return
    (f,) = findings
    assert (f.severity, f.where) == ("warning", "enc.0.norms.0")
    assert "a constant row gives NaN/Inf in float32" in f.message and "bites in this dtype" in f.message
    assert "only matters if you switch on fp16" not in f.message
    assert f.fix.startswith("use eps=1e-5 (1e-6 for RMSNorm)")


def test_nn_layernorm_with_eps_0_is_a_warning_in_fp32():
    probe = NanScores()
    probe.setup(RunContext(tndebug_subject(zero_eps_tiny())))
    (f,) = [f for f in probe.findings if f.probe == "nan-scores"]
    assert f.severity == "warning" and f.evidence["eps"][f.where] == 0.0
    assert f.evidence["compute_dtype"] == "torch.float32" and "more norm modules" in f.message
