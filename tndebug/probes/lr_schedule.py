"""lr-schedule: is the lr in the optimizer the lr the schedule declares, also after a resume?

Observed lr = StepInfo.lr (the lr actually in the optimizer at that step), else the first
param group's. Declared lr = run.lr_schedule(step).
"""
from __future__ import annotations

from tndebug.notes import FAULT_NOTES
from tndebug.probes.base import Probe, ResumeInfo, RunContext, StepInfo
from tndebug.probes.schedule import every
from tndebug.capture.trace import Trace

# MISMATCH exact in kind (round-off), RESUME_JUMP from FAILURE_MODES 7d: no run; clean on realbugs' healthy loops.
MISMATCH = 1e-6       # relative; a float32 lr tensor or round-off stays far below it
RESUME_JUMP = 0.1     # FAILURE_MODES 7d: |lr_after / lr_before - 1| > 0.1 -> error
_FIX = FAULT_NOTES["warmup_restart_on_resume"][2] + " [note 000]"


class LrScheduleProbe(Probe):
    """Failure: the checkpoint omits the step counter (and the optimizer state), so on resume the
    warmup starts again from step 0 and Adam from empty moments; or the scheduler is stepped at
    the wrong rate (twice per step, per epoch instead of per step).
    Symptom: the lr collapses (or jumps) at the resume step and the loss rises (note 000: +0.3);
    the lr curve does not match the Noam formula.
    Fix: save and restore {'model', 'optimizer', 'step_num'} so the schedule continues (note 000);
    step the scheduler once per optimizer step.
    """

    name = "lr-schedule"
    summary = "observed lr follows the declared schedule; warmup and optimizer state survive resume"
    codes = {
        "lr-mismatch": "the optimizer's lr differs from the declared schedule",
        "no-optimizer-state": "optimizer state missing on resume",
        "warmup-restart": "the warmup restarted on resume",
    }
    reads = ()
    fix = _FIX
    default_schedule = staticmethod(lambda: every(1))   # host numbers only: no device sync
    needs_steps = True           # the lr applied at training steps is what it judges
    host_only = True             # the step and the lr: nothing from the batch or the device

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._run: RunContext | None = None
        self._last_lr: float | None = None       # the last lr observed before a resume
        self._resume: ResumeInfo | None = None   # pending: judged at the first step after it
        self._resumed_badly = False

    def setup(self, run: RunContext) -> None:
        self._run = run
        if run.lr_schedule is None:
            self.cover("optimizer", "not applicable", "no declared lr schedule; only resume jumps are checked")

    def observe(self, trace: Trace, info: StepInfo) -> dict:
        return {}

    def update(self, stats, info: StepInfo) -> None:
        run, step = self._run, info.step
        lr = info.lr
        if lr is None and run is not None and run.optimizer is not None:
            lr = run.optimizer.param_groups[0]["lr"]
        if lr is None:
            return
        lr = float(lr)
        self.metric(step, "lr/observed", lr)
        if self._resume is not None and step >= self._resume.step:
            self._judge_resume(lr, step)
        declared = run.lr_schedule(step) if run is not None and run.lr_schedule else None
        if declared is not None:
            self.metric(step, "lr/declared", declared)
            rel = abs(lr - declared) / max(abs(declared), 1e-30)
            self.cover("optimizer", "checked")
            if rel > MISMATCH and not self._resumed_badly and not self.already("optimizer"):
                self.report("warning", f"lr in the optimizer {lr:.4g} differs from the declared "
                            f"schedule {declared:.4g} at step {step}", where="optimizer", step=step,
                            evidence={"lr_observed": lr, "lr_declared": declared,
                                      "rel_diff": rel, "threshold": MISMATCH},
                            fix="Step the scheduler once per optimizer step, from the global step "
                                "(Noam: step_num counted from 1) [note 000]", code="lr-mismatch")
        self._last_lr = lr

    # -- resume ----------------------------------------------------------------------------------
    def on_resume(self, run: RunContext, info: ResumeInfo) -> None:
        self._run = run
        self._resume = info
        if info.step > 0 and not info.had_optimizer_state:
            self._missing_state(info.step, "the checkpoint carried no optimizer state")

    def _missing_state(self, step: int, why: str) -> None:
        if self.already("optimizer.state"):
            return
        self.report("error", f"optimizer state missing on resume at step {step}: {why}; Adam "
                    f"restarts from zero moments", where="optimizer.state", step=step,
                    evidence={"resume_step": step, "reason": why,
                              "threshold": "optimizer state present after step 0"}, code="no-optimizer-state")

    def _judge_resume(self, lr_after: float, step: int) -> None:
        info, self._resume = self._resume, None
        run = self._run
        self.cover("", "checked")             # the resume: optimizer state and lr continuity
        opt = run.optimizer if run is not None else None
        if info.step > 0 and opt is not None and not any(opt.state.values()):
            self._missing_state(info.step, "the optimizer holds no state at the first step after it")
        lr_before = info.lr_before if info.lr_before is not None else self._last_lr
        if lr_before is None or lr_before <= 0:
            return
        # the ratio the declared schedule itself expects between the two steps (1 if unknown)
        expected = 1.0
        if run is not None and run.lr_schedule is not None and info.step > 0:
            prev = run.lr_schedule(info.step - 1)
            expected = run.lr_schedule(step) / prev if prev > 0 else 1.0
        ratio = lr_after / lr_before
        if abs(ratio / expected - 1.0) > RESUME_JUMP:
            self._resumed_badly = True
            self.report("error", f"warmup restarted on resume: lr went from {lr_before:.4g} to "
                        f"{lr_after:.4g} (x{ratio:.3g}) at step {step}", where="lr_schedule",
                        step=step, evidence={"lr_before": lr_before, "lr_after": lr_after,
                                             "ratio": ratio, "expected_ratio": expected,
                                             "threshold": RESUME_JUMP, "resume_step": info.step}, code="warmup-restart")
