"""lr-schedule: is the lr in the optimizer the lr the schedule declares, also after a resume?

Observed lr = StepInfo.lr (the lr actually in the optimizer at that step), else the first
param group's. Declared lr = run.lr_schedule(step).
Sharded parameters (FSDP2): the update ratio's norms and the gradient norm from the ranks'
local shards, summed over the ranks in the optimizer's hooks (`tndebug.sharded.norms`): no gather.
"""
from __future__ import annotations

import math
import statistics
import weakref

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.findings import Finding
from tndebug.probes.base import Probe, ResumeInfo, RunContext, StepInfo
from tndebug.probes.schedule import every
from tndebug.sharded import norms
from tndebug.capture.trace import Trace

# MISMATCH exact in kind (round-off), RESUME_JUMP from FAILURE_MODES 7d: no run; clean on realbugs' healthy loops.
MISMATCH = 1e-6       # relative; a float32 lr tensor or round-off stays far below it
RESUME_JUMP = 0.1     # FAILURE_MODES 7d: |lr_after / lr_before - 1| > 0.1 -> error
# The update-to-weight ratio |w_after - w_before| / |w_before| of one optimizer step, the median
# over the TRACKED smallest weight matrices (dim >= 2, non-zero), at the first UPDATE_FIRST
# optimizer steps and every UPDATE_EVERY after. Adam's first step is lr * sign(g) per entry, so
# there the ratio is ~lr / rms(w): a 32-wide CharGPT (rms(w) ~0.1) at AdamW lr 3e-3 gives 0.029,
# at 3e-2 0.29 (it still trains: 2.38 nats at step 300 against 2.46), at 1e-1 0.98 and at 3e-1
# 2.9 (3.07 and 3.23 nats: it does not recover); gradient clipping at 1.0 changes none of these
# (Adam's step does not scale with the gradient). Later steps cannot show it: the weights grow
# until the ratio is back at ~1e-2. A step that moves a matrix by half its norm or more rewrites
# it: UPDATE_RATIO, 17x the healthy run's and 1.7x the 10x lr that still trains (seed 0 of
# tests/api/test_loop_bugs.py's loop; the test runs seed 2).
UPDATE_RATIO = 0.5
UPDATE_FIRST = 3
UPDATE_EVERY = 25
TRACKED = 8
# A total gradient norm equal at this relative precision on two sampled steps is a clip's bound.
CLIP_SAME = 1e-4
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
    cause = (
        "Use Noam with warmup_steps=4000 and step_num counted from 1; resuming without "
        "step_num resets warmup and the loss jumps [note 000]. No warmup with a high lr "
        "gives NaN, and note 002 keeps the peak at about 1e-4 [note 002]."
    )
    summary = "observed lr follows the declared schedule; warmup and optimizer state survive resume"
    codes = {
        "lr-mismatch": "the optimizer's lr differs from the declared schedule",
        "no-optimizer-state": "optimizer state missing on resume",
        "warmup-restart": "the warmup restarted on resume",
        "lr-too-high": "one optimizer step moves the weights by a large share of their norm",
        # triage reads the file (no_resume_state, below)
        "no-resume-state": "no optimizer state or step in the file (advisory)",
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
        self._handles: list = []
        self._mats: list[tuple[str, torch.nn.Parameter]] = []
        self._before: list[torch.Tensor] | None = None
        self._opt_steps = 0
        self._ratios: list[tuple[int, float, float | None]] = []   # (step, median ratio, lr)
        self._gnorms: list[float] = []           # total gradient norm at the sampled steps
        self._start = 0

    def setup(self, run: RunContext) -> None:
        self._run = run
        if run.mode == "train" and run.optimizer is not None:
            mats = [(n, p) for n, p in run.subject.model.named_parameters()
                    if p.requires_grad and p.dim() >= 2 and p.is_floating_point()]
            self._mats = sorted(mats, key=lambda np_: np_[1].numel())[:TRACKED]
            if self._mats:
                me = weakref.ref(self)
                self._handles = [
                    run.optimizer.register_step_pre_hook(lambda o, a, k: _call(me, "_pre")),
                    run.optimizer.register_step_post_hook(lambda o, a, k: _call(me, "_post"))]
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

    # -- the update-to-weight ratio -------------------------------------------------------------
    def _sampled(self) -> bool:
        n = self._opt_steps
        return n < UPDATE_FIRST or n % UPDATE_EVERY == 0

    def _pre(self) -> None:
        self._before = None
        if not self._sampled():
            return
        with torch.no_grad():                        # on the device: no host sync here
            self._before = [p.detach().clone() for _, p in self._mats]
            grads = norms([p.grad for p in self._run.subject.model.parameters()
                           if p.grad is not None])    # FSDP2: over every rank's shard
            if grads:
                self._gnorms.append(torch.linalg.vector_norm(torch.stack(
                    [g.to(grads[0].device) for g in grads])))

    def _post(self) -> None:
        step, before = self._start + self._opt_steps, self._before
        self._opt_steps += 1
        self._before = None
        if before is None:
            return
        with torch.no_grad():
            n = len(before)          # a DTensor's difference stays sharded: no gather
            both = norms([p.detach() - w0 for (_, p), w0 in zip(self._mats, before)] + before)
            ratios = [a / b for a, b in zip(both[:n], both[n:])]
        lr = self._run.optimizer.param_groups[0].get("lr") if self._run.optimizer else None
        lr = float(lr) if isinstance(lr, (int, float)) else None
        self._ratios.append((step, [r.to(ratios[0].device) for r in ratios], lr))

    def _judge_updates(self) -> None:
        rows = []
        for step, ratios, lr in self._ratios:             # host numbers once, at the end
            vals = [v for v in torch.stack(ratios).tolist() if math.isfinite(v)]   # 0/0: zero-init
            if vals:
                rows.append((step, statistics.median(vals), lr))
                self.metric(step, "lr/update_ratio", rows[-1][1])
        if not rows:
            return
        self.cover("update", "checked")
        step, ratio, lr = max(rows, key=lambda r: r[1])
        if ratio < UPDATE_RATIO:
            return
        first = min(s for s, r, _ in rows if r >= UPDATE_RATIO)   # from when the lr was too high
        g = [float(t) for t in self._gnorms]
        at_bound = [a for i, a in enumerate(g) if any(j != i and abs(a - b) <= CLIP_SAME * max(a, b)
                                                      for j, b in enumerate(g))]
        lr_s = f" (lr {lr:.3g})" if lr is not None else ""
        clip = (f" Gradients were clipped (total norm {statistics.median(at_bound):.3g} at "
                f"{len(at_bound)} of {len(g)} sampled steps): clipping bounds the gradient, not "
                f"an Adam-style step, which is lr-sized whatever the gradient's norm; it keeps "
                f"the loss from exploding, which hides this lr from the loss, not from the weights."
                if len(at_bound) >= 2 else "")
        self.report("warning", f"one optimizer step moves the weights by {ratio:.3g}x their norm "
                    f"at step {step}{lr_s} (median of {len(self._mats)} weight matrices; a "
                    f"healthy Adam run moves them by ~1e-3 to 1e-2 of it, and this test's bar is "
                    f"{UPDATE_RATIO:g}): the lr is far above what the model tolerates.{clip}",
                    where="update", step=step,
                    evidence={"update_ratio": round(ratio, 3), "lr": lr, "step": step,
                              "first_step": first,
                              "threshold": UPDATE_RATIO, "matrices": len(self._mats),
                              "sampled_steps": len(self._ratios), "clipped_steps": len(at_bound),
                              "rule": "median over the smallest weight matrices of |w_after - "
                                      "w_before| / |w_before| at one optimizer step"},
                    fix="lower the lr (by the factor the ratio is above ~1e-2 at the first "
                        "steps), or warm it up; clipping gradients does not bound an Adam step",
                    code="lr-too-high")

    def finish(self, run: RunContext) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._judge_updates()

    # -- resume ----------------------------------------------------------------------------------
    def on_resume(self, run: RunContext, info: ResumeInfo) -> None:
        self._run = run
        self._start = info.step
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


def _call(ref, name: str) -> None:
    probe = ref()
    if probe is not None:
        getattr(probe, name)()


FIX_RESUME = ("save {'model': model.state_dict(), 'optimizer': opt.state_dict(), 'step': step} "
              "and restore all three, so the warmup and Adam's moments continue [note 000]")


def no_resume_state(missing: list[str], container, top_level_keys: list, step_key) -> Finding:
    """A checkpoint file without optimizer state or step counter (`missing` names which; triage
    reads the file: triage/hygiene.resume_state). An advisory (docs/severity.md): a weights-only
    file is healthy for evaluation and export; the defect shows only in a resume, which this
    probe checks when one happens."""
    return Finding("lr-schedule", "info",
                   f"checkpoint has no {' and no '.join(missing)}: resuming from it restarts the "
                   f"warmup (the lr jumps) and Adam from empty moments (only matters if you resume "
                   f"training from this file)", where="", step=0,
                   evidence={"container": container, "top_level_keys": top_level_keys,
                             "step_key": step_key}, fix=FIX_RESUME, code="lr-schedule/no-resume-state")
