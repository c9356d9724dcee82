"""judge/collateral.py explained_by_update_fault (issue 44): the dynamic symptoms of a found update
fault (gradients carried across steps, an lr whose step rewrites the weights) are that fault's
consequences, info that cites it, and the fault keeps the worst severity; a structural symptom,
one present at initialisation, or one seen before the fault was in effect keeps its own.

The rules on findings built by hand, then issue 44's two loops end to end (a nanoGPT-style char
loop under `watch`, seed 2; bench/first_contact.py runs seed 3): zero_grad forgotten gave a
loss-health/stuck-uniform error beside zero-grad's, an lr 100x too high under clipping a
variance-drift/rank-collapse error beside lr-schedule's warning.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tndebug
from tndebug.judge import conclude
from tndebug.findings import Finding
from tndebug.judge.collateral import explained_by_update_fault

import chargpt


def _zero_grad(carried=599, checked=599, step=1):
    return Finding("zero-grad", "error", "gradients accumulate across optimizer steps", step=step,
                   fix="call zero_grad", code="zero-grad/grads-accumulate",
                   evidence={"carried_steps": carried, "checked_steps": checked})


def _lr(first=0, sev="warning"):
    return Finding("lr-schedule", sev, "one optimizer step moves the weights by 2.91x their norm",
                   where="update", step=first, fix="lower the lr", code="lr-schedule/lr-too-high",
                   evidence={"update_ratio": 2.91, "first_step": first, "step": first})


def _stuck(step=500):
    return Finding("loss-health", "error", "loss still at the uniform level", step=step,
                   code="loss-health/stuck-uniform", evidence={"ce": 4.6, "steps": step})


def _rank(cause="dynamic", step=8, sev="error"):
    return Finding("variance-drift", sev, "rank collapse in the decoder", where="blocks.0",
                   step=step, code="variance-drift/rank-collapse", fix="residual",
                   evidence={"r": 0.017, "cause": cause})


def _growth(first_check, step=2):
    return Finding("variance-drift", "warning", "residual stream RMS grows 72x", where="decoder",
                   step=step, code="variance-drift/stream-growth",
                   evidence={"growth": 71.6, "threshold": 54.0, "growth_first_check": first_check})


def _statuses(findings):
    out = {}
    for f in findings:
        st = "fail" if f.severity == "error" else "warn"
        if out.get(f.probe, {}).get("status") != "fail":
            out[f.probe] = {"status": st}
    return out


def _judge(findings):
    report = conclude({}, findings, _statuses(findings))
    return report, {f.code: f for f in report.findings}


def test_a_plateau_under_carried_gradients_is_zero_grads_story():
    report, by = _judge([_stuck(), _zero_grad()])
    stuck, cause = by["loss-health/stuck-uniform"], by["zero-grad/grads-accumulate"]
    assert stuck.severity == "info" and stuck.evidence["follows"] == "zero-grad/grads-accumulate"
    assert "likely a consequence of gradients carried" in stuck.message
    assert stuck.fix == "call zero_grad" and stuck.evidence["severity_before"] == "error"
    assert cause.severity == "error" and cause.evidence["explains"] == ["loss-health/stuck-uniform"]
    assert report.probes["loss-health"]["status"] == "pass"
    assert report.probes["zero-grad"]["status"] == "fail" and report.verdict == "errors"


def test_a_collapse_during_training_under_a_huge_lr_raises_the_lr_finding_to_its_severity():
    report, by = _judge([_growth(3.0), _rank(), _lr()])
    assert by["variance-drift/rank-collapse"].severity == "info"
    assert by["variance-drift/stream-growth"].severity == "info"
    lr = by["lr-schedule/lr-too-high"]
    assert lr.severity == "error" and lr.evidence["severity_before"] == "warning"
    assert sorted(lr.evidence["explains"]) == ["variance-drift/rank-collapse",
                                               "variance-drift/stream-growth"]
    assert "What it brought about" in lr.message
    assert report.verdict == "errors"        # the verdict stays what the symptom made it
    assert report.probes["variance-drift"]["status"] == "pass"
    assert report.probes["lr-schedule"]["status"] == "fail"


@pytest.mark.parametrize("symptom", [
    _rank(cause="missing", step=0),      # a collapse at initialisation: a missing residual
    _growth(60.0),                       # already past its bar at the first check
    _rank(step=2),                       # seen before the lr was too high (from step 5)
])
def test_what_no_update_explains_keeps_its_severity(symptom):
    _, by = _judge([symptom, _lr(first=5)])
    kept = by[symptom.code]
    assert kept.severity == symptom.severity and "follows" not in kept.evidence
    assert by["lr-schedule/lr-too-high"].severity == "warning"


def test_a_carry_on_few_steps_explains_nothing():
    _, by = _judge([_stuck(), _zero_grad(carried=3, checked=599)])
    assert by["loss-health/stuck-uniform"].severity == "error"


def test_info_and_no_cause_leave_the_findings_as_they_are():
    fs = [_stuck(), _rank()]
    out, touched = explained_by_update_fault(fs)
    assert out == fs and touched == set()


# -- the loops ----------------------------------------------------------------------------------
SEED, STEPS, BLOCK, BATCH = 2, 600, 32, 16


def _corpus():
    from pydoc_data.topics import topics
    s = "".join(topics[k] for k in sorted(topics))
    s = "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in s)
    chars = sorted(set(s))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in s], dtype=torch.long), len(chars)


def _loop(zero_grad=True, lr=3e-3):
    data, vocab = _corpus()
    torch.manual_seed(SEED)
    model = chargpt.build(vocab_size=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(SEED)
    with tndebug.watch(model, opt, forward=chargpt.forward, quiet=True, total_steps=STEPS,
                       pad_id=None) as dbg:
        model.train()
        for _ in range(STEPS):
            ix = torch.randint(len(data) - BLOCK - 2, (BATCH,), generator=g).tolist()
            x = torch.stack([data[i:i + BLOCK] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
            loss = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
            if zero_grad:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            if zero_grad:                    # clipped as nanoGPT does; the bug's loop is not
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return dbg.report


def _loud(report):
    return {f.code: f for f in report.findings if f.severity in ("warning", "error")}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_zero_grad_forgotten_is_one_story():
    report = _loop(zero_grad=False)
    loud = _loud(report)
    assert list(loud) == ["zero-grad/grads-accumulate"], list(loud)
    (stuck,) = [f for f in report.findings if f.code == "loss-health/stuck-uniform"]
    assert stuck.severity == "info" and stuck.evidence["ce"] > stuck.evidence["threshold"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_lr_100x_too_high_is_one_story():
    report = _loop(lr=3e-1)
    assert list(_loud(report)) == ["lr-schedule/lr-too-high"], list(_loud(report))
    follows = [f for f in report.findings if f.evidence.get("follows") == "lr-schedule/lr-too-high"]
    assert follows and all(f.probe == "variance-drift" for f in follows)
