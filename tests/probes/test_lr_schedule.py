import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from _misc_helpers import ResumeInfo, kinds, probed_loop
from tndebug.config import ModelConfig
from tndebug.harness import noam, train_with_probes
from tndebug.inject import make_model
from tndebug.probes.lr_schedule import RESUME_JUMP, LrScheduleProbe
from tndebug.subject import tndebug_subject

NAME = "lr-schedule"
SCHEDULE = noam(64, 20)
RESUME = 8


def _subject():
    return tndebug_subject(make_model(ModelConfig.tiny()))


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_run_is_silent(norm):
    probe = LrScheduleProbe()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=5, batch=8)
    assert findings == [] and probe.status() == "pass"


def _restart(state):
    """The fault warmup_restart_on_resume: step counter and Adam state start from zero."""
    params = state["model"].parameters()
    return (torch.optim.Adam(params, lr=SCHEDULE(0)), lambda s: SCHEDULE(s - RESUME),
            ResumeInfo(RESUME, lr_before=SCHEDULE(RESUME - 1), had_optimizer_state=False))


def _continue(state):
    """A correct resume: optimizer rebuilt from its state dict, schedule at the global step."""
    opt = torch.optim.Adam(state["model"].parameters(), lr=1.0)
    opt.load_state_dict(state["optimizer"].state_dict())
    return opt, SCHEDULE, ResumeInfo(RESUME, lr_before=SCHEDULE(RESUME - 1), had_optimizer_state=True)


def test_warmup_restart_on_resume_gives_its_two_errors():
    _, findings = probed_loop(_subject(), [LrScheduleProbe()], steps=RESUME + 2, lr_fn=SCHEDULE,
                              resume_at=RESUME, resume_fn=_restart)
    assert kinds(findings, NAME) == {("error", "lr_schedule"), ("error", "optimizer.state")}
    jump = next(f for f in findings if f.where == "lr_schedule")
    assert jump.step == RESUME and jump.evidence["ratio"] < 1 - RESUME_JUMP


def test_correct_resume_is_silent():
    _, findings = probed_loop(_subject(), [LrScheduleProbe()], steps=RESUME + 2, lr_fn=SCHEDULE,
                              resume_at=RESUME, resume_fn=_continue)
    assert findings == []


def test_resume_without_lr_before_uses_the_last_observed_lr():
    def restart(state):
        opt, fn, _ = _restart(state)
        return opt, fn, ResumeInfo(RESUME)          # the trainer knows nothing; the probe does
    _, findings = probed_loop(_subject(), [LrScheduleProbe()], steps=RESUME + 1, lr_fn=SCHEDULE,
                              resume_at=RESUME, resume_fn=restart)
    assert kinds(findings, NAME) == {("error", "lr_schedule"), ("error", "optimizer.state")}


# -- written by hand with torch's LambdaLR ---------------------------------------------------

def _lambda_lr(holder):
    def make(params):
        opt = torch.optim.Adam(params, lr=1.0)
        holder["sched"] = LambdaLR(opt, SCHEDULE)        # lr = 1.0 * SCHEDULE(0) now
        return opt
    return make


def test_hand_scheduler_stepped_twice_warns_once_at_step_1():
    holder = {}

    def set_lr(opt, step, fn):   # stepped in the batch loop and again in an outer loop
        if step > 0:
            holder["sched"].step()
            holder["sched"].step()
    _, findings = probed_loop(_subject(), [LrScheduleProbe()], steps=4, lr_fn=SCHEDULE,
                              optimizer_fn=_lambda_lr(holder), set_lr=set_lr)
    [f] = findings
    assert (f.severity, f.where, f.step) == ("warning", "optimizer", 1)


def test_hand_checkpoint_without_scheduler_state_restarts_warmup():
    """Note 000: model and optimizer saved, step_num not; a new LambdaLR starts at 0."""
    holder = {}

    def resume(state):
        opt = torch.optim.Adam(state["model"].parameters(), lr=1.0)
        opt.load_state_dict(state["optimizer"].state_dict())
        for group in opt.param_groups:
            group["lr"] = 1.0                            # LambdaLR multiplies the base lr
        holder["sched"] = LambdaLR(opt, SCHEDULE)        # last_epoch=-1: warmup again
        return opt, SCHEDULE, ResumeInfo(RESUME, lr_before=SCHEDULE(RESUME - 1))

    def set_lr(opt, step, fn):
        if step not in (0, RESUME):
            holder["sched"].step()
    _, findings = probed_loop(_subject(), [LrScheduleProbe()], steps=RESUME + 2, lr_fn=SCHEDULE,
                              optimizer_fn=_lambda_lr(holder), set_lr=set_lr,
                              resume_at=RESUME, resume_fn=resume)
    [f] = findings
    assert (f.severity, f.where, f.step) == ("error", "lr_schedule", RESUME)
