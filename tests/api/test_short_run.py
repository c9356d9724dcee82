"""A run shorter than a probe's schedule needs says so (issue 44): a 20-step loop cannot give
label-shift its 2 probed steps at every 50 steps, so its no-verdict reason says "needs 51 steps;
this run had 20", and loss-health's plateau check says how many it needs against the 20."""
from __future__ import annotations

import pytest
import torch

import tndebug

import chargpt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_20_step_run_says_how_many_steps_each_schedule_needs():
    torch.manual_seed(0)
    model = chargpt.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with tndebug.watch(model, opt, forward=chargpt.forward, quiet=True, pad_id=None,
                       probes="label-shift,loss-health") as dbg:
        chargpt.train(model, opt, 20)
    ls = dbg.report.probes["label-shift"]
    assert ls["status"] == "no verdict"
    assert "needs 51 steps; this run had 20" in ls["reason"], ls
    assert "this run had 20" in str(dbg.report.probes["loss-health"]), dbg.report.probes["loss-health"]
    assert dbg.report.verdict != "clean"
