"""ln-placement's warmup hazard: post-LN trained without warmup at a high learning rate (the
probe's class is in ln_placement.py; these are its methods, with their thresholds and messages).

* lr: StepInfo.lr on steps 0, 1, 2, 4, 8, 16 (else the declared schedule).
* post-LN without warmup at a high lr: the hazard is decided from the lr by step 16; it is a
  warning only with its symptom, looked for at every step the probe observes after that (every
  SYMPTOM_EVERY steps while the hazard is open; the streams are no longer captured then, only
  the loss and the parameter-gradient norm): the loss non-finite (divergence), the loss above
  RISE x its step-0 value at any probed step, a gradient norm spike (> SPIKE x the median of
  the earlier probed norms), or a stalled run: the loss fell less than STALL_FALL over the last
  doubling of steps *and* the gradient norm has shrunk below STALL_GRAD x its step-0 value
  (stuck in a flat region, not learning slowly: a slow run keeps its gradient). A run that
  never shows one is info: the hazard, and the loss trend that shows it did not bite.
  Calibrated on (`bench/ln_warmup_symptom.py`, bench/results/ln_warmup_symptom.json) the fault
  `no_warmup_high_lr` on tiny Post-LN, seeds 1 and 2 (loss 1.8-1.9x its start within 16 steps,
  then flat at 1.69 with the gradient at 0.014-0.018x its start); healthy: tiny Post-LN with
  warmup (trainer, seed 1; gradient >= 0.26x), user loops at a constant Adam lr, seed 1, 300
  steps: HF BART at 1e-3 and 3e-4 (its loss falls only 0.9% over a doubling early, while the
  gradient stays >= 0.65x), tndebug's tiny Post-LN and nn.Transformer Post-LN at 1e-3 (gradient
  >= 0.24x); spikes at most 4x the median, the loss at most 1.008x its start. Evaluated apart
  (the same script, and the tests): the fault at seed 0 (`tndebug run --preset tiny --norm post
  --fault no_warmup_high_lr --steps 300`): a warning at step 64 (stall: 1.3% fall, gradient
  0.043x); the user loops at seed 0 for 150 steps: info.
"""
from __future__ import annotations

from tndebug.faults import FAULT_NOTES

HIGH_LR = 1e-4        # Xiong et al.: post-LN without warmup diverges at lr ≥ 1e-4 (FAILURE_MODES 6)
# RAMP, DECIDE_AT: no run (e19bac1): a linear or Noam warmup doubles its lr from step 1 to 2.
RAMP = 1.5            # a warmup raises the lr by more than this factor over its first steps
DECIDE_AT = 16        # steps of lr history before the warmup verdict
SYMPTOM_EVERY = 8     # while the hazard is open, the loss and gradient norm are read this often
# The symptoms (module docstring: set on seeds 1-2 of the fault and on healthy seed-1 runs):
RISE = 1.5            # loss above 1.5x its step-0 value at a later probed step (healthy: at most
                      # 1.008x at any step; the fault, seeds 1-2: 1.8-1.9x within 16 steps)
SPIKE = 10.0          # gradient norm > 10x the median of the earlier probed norms (healthy: <= 4x)
STALL_FROM = 64       # the stall needs a doubling of steps after the early transient
STALL_FALL = 0.05     # the loss fell < 5% from [3t/8, t/2] to [3t/4, t] (medians of probed losses)
STALL_GRAD = 0.1      # ... and the gradient norm is < 0.1x its step-0 value (fault <= 0.066x at
                      # step 64; healthy >= 0.24x: a slow run keeps its gradient, a stuck one not)


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


class WarmupTests:
    """ln-placement's warmup hazard, mixed into LnPlacement: it reads the probe's `placement`,
    `lrs`, `loss_steps`, `grad_steps` and `run_context`, keeps the open `hazard`, and reports as
    the probe."""

    # -- warmup ----------------------------------------------------------------------------
    def _lr_history(self) -> list[tuple[int, float]]:
        if self.lrs:
            return self.lrs
        run = self.run_context
        if run is not None and run.lr_schedule is not None:
            horizon = min(run.total_steps or 1000, 1000)
            return [(s, float(run.lr_schedule(s))) for s in range(0, horizon + 1, max(1, horizon // 64))]
        return []

    def warmup_verdict(self) -> None:
        history = self._lr_history()
        if not history or history[0][0] != 0:
            return                      # no lr seen, or a resumed run: warmup is not at stake
        self.lr_decided = True
        if self.placement != "post":
            return
        lr0 = history[0][1]
        peak_step, peak = max(history, key=lambda h: h[1])
        ramp = peak > RAMP * lr0
        if lr0 < HIGH_LR or ramp or len(history) < 2:
            return
        last = history[-1]
        self.hazard = {
            "step": last[0],
            "message": f"post-LN trained without warmup at a high learning rate: lr {lr0:.2g} "
                       f"from step 0, never above {peak / lr0:.2f}x that by step {last[0]}",
            "evidence": {"placement": "post", "lr_step0": lr0, "lr_peak": peak,
                         "lr_peak_step": peak_step, "lr_last": last[1],
                         "steps_seen": [h[0] for h in history][:12],
                         "threshold_lr": HIGH_LR, "threshold_ramp": RAMP}}

    def symptom(self, step: int | None) -> dict | None:
        """The symptom of the missing warmup shown by the probed steps so far, or None.

        `step`: the step just observed (the stall and the spike are judged there); None at the
        end of the run (only what the history shows)."""
        if not self.loss_steps or self.loss_steps[0][0] != 0:
            return None                 # no step-0 loss (a resumed run, or no loss seen)
        (_, first), (last_step, last) = self.loss_steps[0], self.loss_steps[-1]
        if last != last or last in (float("inf"), float("-inf")):
            return {"kind": "divergence", "text": f"the loss is {last} at step {last_step}",
                    "step": last_step}
        risen = [(s, v) for s, v in self.loss_steps if s > 0 and v > RISE * first > 0]
        if risen:
            s, v = risen[0]
            peak_step, peak = max(risen, key=lambda r: r[1])
            return {"kind": "loss rise", "step": s, "threshold_rise": RISE,
                    "text": f"the loss rose above {RISE:g}x its start ({first:.3g}) at step {s}, "
                            f"to {peak:.3g} ({peak / first:.2f}x) at step {peak_step}"}
        if step is None or not self.grad_steps or self.grad_steps[-1][0] != step:
            return None
        norm = self.grad_steps[-1][1]
        earlier = [g for s, g in self.grad_steps if s < step]
        if len(earlier) >= 3 and norm > SPIKE * _median(earlier):
            return {"kind": "gradient spike", "step": step, "threshold_spike": SPIKE,
                    "text": f"the gradient norm spiked to {norm:.3g} at step {step}, "
                            f"{norm / _median(earlier):.1f}x the median of the earlier probed steps"}
        g0 = self.grad_steps[0][1] if self.grad_steps[0][0] == 0 else None
        if step < STALL_FROM or not g0:
            return None
        late = [v for s, v in self.loss_steps if 0.75 * step <= s <= step]
        early = [v for s, v in self.loss_steps if 0.375 * step <= s <= 0.5 * step]
        grads = [g for s, g in self.grad_steps if 0.75 * step <= s <= step]
        if not late or not early or not grads or _median(early) <= 0:
            return None
        fall = 1 - _median(late) / _median(early)
        shrink = _median(grads) / g0
        if fall < STALL_FALL and shrink < STALL_GRAD:
            return {"kind": "stall", "step": step, "loss_fall": round(fall, 4),
                    "grad_ratio": round(shrink, 4), "threshold_fall": STALL_FALL,
                    "threshold_grad": STALL_GRAD,
                    "text": f"the loss stopped falling: {_median(late):.3g} by step {step}, "
                            f"{fall:.1%} below its level at step {step // 2}, while the gradient "
                            f"norm shrank to {shrink:.3f}x its start (a stuck run, not a slow one)"}
        return None

    def report_hazard(self, symptom: dict | None) -> None:
        """The missing warmup: a warning with its symptom, else info (it did not bite)."""
        hazard, self.hazard = self.hazard, None
        ev = {**hazard["evidence"],
              "losses": [round(v, 4) for s, v in self.loss_steps if s <= DECIDE_AT][:8],
              "loss_trend": [(s, round(v, 4)) for s, v in self.loss_steps[-4:]],
              "grad_norms": [(s, round(g, 4)) for s, g in self.grad_steps[-4:]],
              "threshold_stall_fall": STALL_FALL, "threshold_stall_grad": STALL_GRAD,
              "threshold_spike": SPIKE, "threshold_rise": RISE}
        fix = FAULT_NOTES["no_warmup_high_lr"][2]
        if symptom is not None:
            ev["symptom"] = {k: v for k, v in symptom.items() if k != "text"}
            self.report("warning", f"{hazard['message']}, and it shows: {symptom['text']}",
                        step=symptom["step"], evidence=ev, fix=fix, code="no-warmup-shows")
            return
        trend = ""
        if len(self.loss_steps) >= 2 and self.loss_steps[0][0] == 0:
            (s0, l0), (s1, l1) = self.loss_steps[0], self.loss_steps[-1]
            trend = f"loss {l0:.3g} at step {s0}, {l1:.3g} at step {s1}"
        seen = (f"no symptom in this run ({trend}: no divergence, spike or stall)" if trend else
                "no symptom could be looked for (the loss was not observed)")
        self.report("info", f"{hazard['message']}; {seen}: a hazard if you raise the lr or the "
                    f"depth (by design here)", step=hazard["step"], evidence=ev, fix=fix, code="no-warmup-hazard")
