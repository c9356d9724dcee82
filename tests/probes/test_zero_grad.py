"""zero-grad: gradients carried across optimizer steps (optimizer.zero_grad() forgotten), exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tndebug
from tndebug.config import ModelConfig
from tndebug.harness import copy_batch, train_with_probes
from tndebug.inject import make_model
from tndebug.probes import probe_class
from tndebug.probes.zero_grad import ZeroGradProbe

V = 11


def user_loop(steps=6, *, zero=True, set_to_none=True, micro=1, clip=False, start_step=0):
    """A user's loop under tndebug.watch: Adam, `micro` backward calls per step."""
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, quiet=True, probes="zero-grad", total_steps=steps,
                       start_step=start_step) as dbg:
        for _ in range(steps):
            if zero:
                opt.zero_grad(set_to_none=set_to_none)
            for _ in range(micro):
                src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
                loss = F.cross_entropy(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1),
                                       ignore_index=0)
                (loss / micro).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
    return dbg.report


def test_registered():
    assert probe_class("zero-grad") is ZeroGradProbe


@pytest.mark.parametrize("kw", [{}, {"set_to_none": False}, {"micro": 3}, {"clip": True}],
                         ids=["set_to_none", "zeroed_in_place", "accumulation", "clipped"])
def test_a_loop_that_clears_its_gradients_is_clean(kw):
    report = user_loop(**kw)
    assert [f for f in report.findings if f.probe == "zero-grad"] == []
    assert report.probes["zero-grad"]["status"] == "pass"


@pytest.mark.parametrize("clip", [False, True])
def test_forgotten_zero_grad_is_an_exact_error_at_the_second_step(clip):
    report = user_loop(zero=False, clip=clip)
    (f,) = [f for f in report.findings if f.probe == "zero-grad"]
    assert f.severity == "error" and f.step == 1, f.message
    assert "zero_grad" in f.fix and f.evidence["version_unchanged"]
    assert f.evidence["carried_steps"] == f.evidence["checked_steps"] == 5


def test_a_resumed_loop_names_the_global_step():
    """Issue 44: after a resume at step 100 the finding is at step 101, not 1."""
    report = user_loop(zero=False, start_step=100)
    (f,) = [f for f in report.findings if f.probe == "zero-grad"]
    assert f.step == 101 and "at step 101" in f.message and "step 100's gradient" in f.message


def test_the_trainer_loop_is_clean():
    probe = ZeroGradProbe()
    _, findings, _ = train_with_probes(ModelConfig.tiny(), [probe], steps=4)
    assert findings == [] and probe.status() == "pass" and probe.checked_steps == 3


def test_one_step_has_nothing_to_compare():
    report = user_loop(steps=1, zero=False)
    assert report.probes["zero-grad"]["status"] == "no verdict"
    assert "no backward followed an optimizer step" in report.probes["zero-grad"]["reason"]
