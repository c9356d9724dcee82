"""judge/nan.py after_nan_forward: a non-finite gradient at or after the step whose forward went
non-finite is that NaN carried back (info); one that comes first stays an error."""
from __future__ import annotations

from tndebug.judge.nan import after_nan_forward
from tndebug.findings import Finding


def _nan(step):
    return Finding("nan-scores", "error", "first NaN at softmax", where="dec.0.attn", step=step,
                   fix="fill with finfo.min", code="nan-scores/nonfinite-forward")


def _grad(step):
    return Finding("gradient-flow", "error", f"non-finite gradient in enc.0 at step {step}",
                   where="enc.0", step=step, fix="init", code="gradient-flow/nonfinite-grad")


def test_a_gradient_after_the_nan_forward_is_carried_back():
    statuses = {"gradient-flow": {"status": "fail"}, "nan-scores": {"status": "fail"}}
    out, st = after_nan_forward([_nan(3), _grad(3)], statuses)
    assert [f.severity for f in out] == ["error", "info"]
    assert out[1].fix == "fill with finfo.min" and "step 3 (dec.0.attn" in out[1].message
    assert st["gradient-flow"]["status"] == "pass" and st["nan-scores"]["status"] == "fail"


def test_a_nan_loss_after_the_nan_forward_is_carried_on_too():
    loss = Finding("loss-health", "error", "training loss is nan at step 3", step=3,
                   fix="NaN to lr/warmup", code="loss-health/nonfinite-loss")
    out, st = after_nan_forward([_nan(3), loss], {"loss-health": {"status": "fail"}})
    assert out[1].severity == "info" and out[1].fix == "fill with finfo.min"
    assert st["loss-health"]["status"] == "pass"


def test_a_gradient_that_goes_first_stays_an_error():
    statuses = {"gradient-flow": {"status": "fail"}}
    out, st = after_nan_forward([_grad(2), _nan(3)], statuses)
    assert [f.severity for f in out] == ["error", "error"] and st["gradient-flow"]["status"] == "fail"


def test_no_nan_forward_changes_nothing():
    findings = [_grad(0)]
    assert after_nan_forward(findings, {})[0] == findings
