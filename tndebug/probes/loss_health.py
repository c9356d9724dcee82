"""loss-health: does the loss start at ln V, stay finite, and leave the uniform level?

The probe computes the token cross-entropy from the logits and the targets itself (ignoring pad
targets), because the training criterion may be a KL to smoothed targets, whose floor is 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tndebug.faults import FAULT_NOTES
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.schedule import every
from tndebug.capture.trace import Trace

# Initial CE over ln V.  Healthy models (V = 11, Xavier generator over a normalised stream)
# start at 1.10-1.72 ln V (bench/results/notes_claims.json: 60 models, every preset, copy and
# reverse, both norms): the logit variance at init is ~2, which adds sigma^2/2 ~ 1 nat, a large
# share of a small ln V.  So the upper bound allows that excess in nats (1.72 ln V is
# ln V + 1.7 nats at V = 11, inside the 2-nat bound).
INIT_LOW = 0.8             # L0 < 0.8 ln V: the model "knows" the targets before training (leak)
INIT_HIGH_SHARE = 0.2      # L0 > ln V + max(0.2 ln V, 2 nats): logits far too large at init
INIT_HIGH_NATS = 2.0
# Tied embeddings are a benign control (FAILURE_MODES 3): with Pre-LN they start at 3.2 (tiny),
# 4.7 (small) and 8.9 (base) nats above ln V, because the stream still holds the input token's
# embedding and the tied generator scores it highest.  When the argmax at step 0 is the decoder
# input token at more than SELF_PRED of real positions, the excess is reported as info.
SELF_PRED = 0.5
# PLATEAU_*: FAILURE_MODES 7e and harness tiny/small runs (d75d3be, 6110320); held out by seed only (det-eval).
PLATEAU_SHARE = 0.95       # FAILURE_MODES 7e: CE > 0.95 ln V ...
PLATEAU_STEPS = 500        # ... at 500 steps -> error; a shorter run is judged at its end if it
PLATEAU_MIN_STEPS = 200    # ran 200 steps (healthy tiny/small runs are at <= 0.67 ln V by then)
PLATEAU_LAST = 3           # judged on the mean of the last 3 probed CEs
# A cross-entropy, an NLL of log-probabilities and a KL divergence are >= 0 exactly; float
# rounding gives at worst ~-1e-7. Below this the criterion is fed something that is not
# log-probabilities (raw logits into KLDivLoss or NLLLoss: note 001's example).
NEGATIVE_LOSS = -1e-3
# An exploding run (issue 12): the cross-entropy above EXPLODE_X * max(CE at step 0, ln V) at
# EXPLODE_K probed steps in a row (or at the last probed step: the run ended so). A model that
# has learnt nothing scores ln V; 5x that gives the true token V^-5 of the mass on average, i.e.
# confidently wrong. Healthy runs stay below their step-0 CE after step 0 (tiny post-LN at Noam
# factor 1, a spiky setting, peaks at 0.87x); factor 10 without warmup reaches 13x, factor 2000
# 1e6x. One probed step above, then back below, is a spike: a warning.
EXPLODE_X = 5.0
EXPLODE_K = 2
# The loop's own loss beside the CE this probe scores (the logits against the targets it takes
# to be the loop's: a user loop's are inferred). Scoring the same targets, a CE still above
# PLATEAU_SHARE ln V is at least ~0.5x its start (a start is at most ln V + max(0.2 ln V, 2
# nats); label smoothing only adds to the loss), and a CE above EXPLODE_X x its start is not
# under its start. A loop loss under LOOP_APART x its own start at such a step: the loop trains
# on other targets and learns (targets = inputs: 0.007 against a CE of 6.9; label-shift names
# that), so neither a plateau nor an explosion. A constant factor on the loss (gradient
# accumulation's loss / k) cancels in the ratio.
LOOP_APART = 0.25
# An lr above this is named as a likely cause: an order of magnitude above the paper's peak
# (7e-4: d_model 512, warmup 4000) and above every preset's default Noam peak (tiny: 5.6e-3).
HIGH_LR = 1e-2
# A schedule whose step-0 lr is at least this share of its peak has no warmup to speak of.
NO_WARMUP_SHARE = 0.5
_RAW_LOGITS_FIX = FAULT_NOTES["kl_raw_logits"][2] + " [notes 001, 003]"


class LossHealthProbe(Probe):
    """Failure: an initialisation that makes the logits large (the model is confidently wrong before
    it has seen data), a training loop that does not learn (lr 0, optimizer not stepped, targets
    not aligned), a loss that goes to NaN/inf, or a criterion fed raw logits where it expects
    log-probabilities (KLDivLoss without log_softmax, note 001's example).
    Symptom: the first loss is far above ln V; the loss sits near ln V for hundreds of steps
    (note 000's "stuck at about 3.5"); NaN/inf; a negative training loss.
    Fix: small output logits at init; check the optimizer, the lr and the target shift; for NaN,
    lower the lr and use warmup (note 002), LayerNorm eps 1e-5 (note 000).
    """

    name = "loss-health"
    cause = (
        "A plateau near ln V points to missing PE or attention to pads, and early inf/NaN "
        "points to lr/warmup [notes 000, 002]; a KLDivLoss given raw logits instead of "
        "log_softmax makes the loss unbounded below [notes 001, 003]."
    )
    summary = "initial loss vs ln V, plateau at the uniform level, exploding or non-finite loss"
    codes = {
        "nonfinite-loss": "the loss (or cross-entropy) is NaN/Inf",
        "negative-loss": "a negative training loss (a loss fed the wrong inputs)",
        "init-high-explained": "an initial loss far above ln V, explained (advisory)",
        "init-high": "an initial loss far above ln V",
        "init-low": "an initial loss far below ln V",
        "loss-spike": "a loss spike",
        "loss-exploded": "the loss exploded and stayed high",
        "stuck-uniform": "the loss stays at the uniform level",
    }
    reads = ()
    fix = ("Check the loss at init (~ln V), the optimizer and lr, and the target shift; a plateau "
           "near ln V points to missing PE or pads in attention, NaN to lr/warmup [notes 000, 002]")
    default_schedule = staticmethod(lambda: every(10))
    needs_steps = True           # the loss of training steps is what it judges

    def __init__(self, schedule=None, *, plateau_steps: int = PLATEAU_STEPS) -> None:
        super().__init__(schedule)
        self.plateau_steps = plateau_steps
        self._ce: list[tuple[int, float]] = []
        self._bad_step: int | None = None
        self._plateau_judged = False
        self._ln_v: float | None = None
        self._negative_reported = False
        self._schedule = None                     # the declared lr schedule (RunContext)
        self._total_steps: int | None = None
        self._lrs: dict[int, float] = {}          # probed step -> lr applied
        self._above: list[tuple[int, float]] = [] # the current run of probed steps above the limit
        self._exploded = False
        self._spiked = False
        self._losses_seen = 0                     # probed steps with a training loss
        self._loop: dict[int, float] = {}         # probed step -> the loop's own loss (finite)

    def setup(self, run: RunContext) -> None:
        self._schedule, self._total_steps = run.lr_schedule, run.total_steps

    def observe(self, trace: Trace, info: StepInfo) -> dict[str, torch.Tensor]:
        stats = {}
        if info.loss is not None:
            stats["loss"] = info.loss.detach().float().reshape(())
        logits = info.logits if info.logits is not None else trace.logits
        if logits is not None and info.tgt_out is not None:
            V = logits.shape[-1]
            stats["ce"] = F.cross_entropy(logits.detach().float().reshape(-1, V),
                                          info.tgt_out.reshape(-1), ignore_index=trace.pad_id)
            stats["vocab"] = V
            if info.step == 0 and info.tgt_in is not None and info.tgt_in.shape == info.tgt_out.shape:
                real = info.tgt_out != trace.pad_id                           # [B, T]
                top = logits.detach().argmax(-1)                              # [B, T]
                stats["self_pred"] = (top == info.tgt_in)[real].float().mean()
        return stats

    def update(self, stats, info: StepInfo) -> None:
        step = info.step
        loss = float(stats["loss"]) if "loss" in stats else None
        ce = float(stats["ce"]) if "ce" in stats else None
        if loss is not None:
            self.metric(step, "loss/train", loss)
        if ce is not None:
            self.cover("", "checked")          # the CE levels (a loss alone: finite, >= 0 only)
        if loss is not None:
            self._losses_seen += 1
            if math.isfinite(loss):
                self._loop[step] = loss
        for value, what in ((loss, "training loss"), (ce, "cross-entropy")):
            if value is not None and not math.isfinite(value) and self._bad_step is None:
                self._bad_step = step
                self.report("error", f"{what} is {value} at step {step}", step=step,
                            evidence={"loss": loss, "ce": ce, "step": step, "threshold": "finite"}, code="nonfinite-loss")
        if loss is not None and math.isfinite(loss) and loss < NEGATIVE_LOSS \
                and not self._negative_reported:
            self._negative_reported = True
            self.report("error", f"training loss is negative ({loss:.4g} at step {step}): a "
                        f"cross-entropy or KL divergence cannot be; the criterion is given raw "
                        f"logits where it expects log-probabilities", where="criterion", step=step,
                        evidence={"loss": loss, "ce_from_logits": ce, "step": step,
                                  "threshold": NEGATIVE_LOSS},
                        fix=_RAW_LOGITS_FIX, code="negative-loss")
        if ce is None or self._bad_step is not None:
            return
        self._ln_v = ln_v = math.log(stats["vocab"])
        self.metric(step, "loss/ce", ce)
        self.metric(step, "loss/ce_over_uniform", ce / ln_v)
        if not self._ce and step == 0:
            self._initial(ce, ln_v, float(stats["self_pred"]) if "self_pred" in stats else None)
        self._ce.append((step, ce))
        if info.lr is not None:
            self._lrs[step] = float(info.lr)
        self._explosion(step, ce, ln_v)
        if step >= self.plateau_steps and not self._plateau_judged and not self._exploded:
            self._plateau(step)

    def _initial(self, ce: float, ln_v: float, self_pred: float | None) -> None:
        high = ln_v + max(INIT_HIGH_SHARE * ln_v, INIT_HIGH_NATS)
        evidence = {"loss0": ce, "ln_V": ln_v, "ratio": ce / ln_v,
                    "threshold_low": INIT_LOW * ln_v, "threshold_high": high,
                    "predicts_input_token": self_pred, "threshold_self_prediction": SELF_PRED}
        if ce > high and self_pred is not None and self_pred > SELF_PRED:
            self.report("info", f"initial loss {ce:.2f} is far above ln V = {ln_v:.2f}, because the "
                        f"model predicts its own input token at {self_pred:.0%} of positions "
                        f"(tied embeddings with a Pre-LN stream do this at init)", step=0,
                        evidence=evidence, fix="", code="init-high-explained")
        elif ce > high:
            self.report("warning", f"initial loss {ce:.2f} is far above ln V = {ln_v:.2f}: the "
                        f"logits are too large at init", step=0, evidence=evidence,
                        fix="Initialise the output projection small (Xavier over a normalised "
                            "stream); the loss at step 0 should be close to ln V", code="init-high")
        elif ce < INIT_LOW * ln_v:
            self.report("warning", f"initial loss {ce:.2f} is below {INIT_LOW} ln V = "
                        f"{INIT_LOW * ln_v:.2f} before any training: are the targets visible "
                        f"to the model (unshifted targets, no causal mask)?", step=0,
                        evidence=evidence,
                        fix="Feed tgt[:, :-1] and score tgt[:, 1:], with the causal mask on "
                            "(notes 001, 003)", code="init-low")

    # -- an exploding loss -----------------------------------------------------------------
    def _explosion_limit(self, ln_v: float) -> float:
        first = self._ce[0][1] if self._ce and self._ce[0][0] == 0 else ln_v
        return EXPLODE_X * max(first, ln_v)

    def _explosion(self, step: int, ce: float, ln_v: float) -> None:
        if self._exploded:
            return
        limit = self._explosion_limit(ln_v)
        if ce > limit and self._loop_left([step]) is None:
            self._above.append((step, ce))
            if len(self._above) >= EXPLODE_K:
                self._report_explosion()
            return
        if self._above and not self._spiked:            # one probed step above, then back
            self._spiked = True
            (s0, c0), = self._above
            self.report("warning", f"loss spiked: cross-entropy {c0:.4g} at step {s0} "
                        f"({c0 / limit * EXPLODE_X:.3g}x its start), back to {ce:.3g} by step {step}",
                        step=s0, evidence={"ce": c0, "ce_after": ce, "step_after": step,
                                           "threshold": limit, **self._lr_evidence(s0)},
                        fix=self._explosion_fix(s0), code="loss-spike")
        self._above = []

    def _lr_evidence(self, step: int) -> dict:
        ev: dict = {"lr": self._lrs.get(step)}
        if self._schedule is not None:
            horizon = max(1, min(self._total_steps or 1000, 100_000))
            stride = max(1, horizon // 2000)
            pts = [(s, float(self._schedule(s))) for s in range(0, horizon, stride)]
            peak_step, peak = max(pts, key=lambda p: p[1])
            ev.update(lr_step0=pts[0][1], lr_peak=peak, lr_peak_step=peak_step)
        return ev

    def _causes(self, step: int, ev: dict) -> list[str]:
        causes = []
        lr, lr0, peak = ev.get("lr"), ev.get("lr_step0"), ev.get("lr_peak")
        if lr is not None and lr > HIGH_LR:
            causes.append(f"the lr is {lr:.3g} at step {step}, {lr / HIGH_LR:.3g}x {HIGH_LR:g} "
                          f"(a high Adam lr for a Transformer)")
        if lr0 is not None and peak and lr0 >= NO_WARMUP_SHARE * peak:
            causes.append(f"no warmup: the lr starts at {lr0:.3g}, {lr0 / peak:.0%} of its peak "
                          f"{peak:.3g} (step {ev['lr_peak_step']})")
        elif peak and lr is not None:
            causes.append(f"the lr at step {step} is {lr:.3g}, {lr / peak:.0%} of the schedule's "
                          f"peak {peak:.3g} (step {ev['lr_peak_step']})")
        return causes

    def _explosion_fix(self, step: int) -> str:
        return ("Lower the lr (the Noam factor) and warm up over more steps; Post-LN needs warmup "
                "most (ln-placement names this model's placement) [note 002]; clip gradients "
                "(clip_grad_norm_ 1.0) to contain a spike")

    def _report_explosion(self) -> None:
        self._exploded = True
        (s0, c0), (s1, c1) = self._above[0], self._above[-1]
        limit = self._explosion_limit(self._ln_v)
        start = self._ce[0][1] if self._ce and self._ce[0][0] == 0 else None
        before = [(s, c) for s, c in self._ce if s < s0]
        ev = self._lr_evidence(s0)
        causes = self._causes(s0, ev)
        began = f" (it began after step {before[-1][0]}, CE {before[-1][1]:.3g})" if before else ""
        self.report(
            "error", f"the loss exploded at step {s0}{began}: cross-entropy {c0:.4g}, "
                     f"{c0 / max(start or self._ln_v, self._ln_v):.3g}x its start, still "
                     f"{c1:.4g} at step {s1}"
                     + (f"; likely cause: {'; '.join(causes)}" if causes else ""),
            step=s0,
            evidence={"ce": c0, "ce_start": start, "ln_V": self._ln_v, "threshold": limit,
                      "threshold_rule": f"CE > {EXPLODE_X:g} x max(CE at step 0, ln V) at "
                                        f"{EXPLODE_K} probed steps in a row, or at the last",
                      "steps_above": [s for s, _ in self._above], "ce_last": c1, **ev},
            fix=self._explosion_fix(s0), code="loss-exploded")

    def _plateau(self, step: int) -> None:
        self._plateau_judged = True
        last = [c for _, c in self._ce[-PLATEAU_LAST:]]
        mean = sum(last) / len(last)
        limit = PLATEAU_SHARE * self._ln_v
        self.metric(step, "loss/plateau_ce", mean)
        loop = self._loop_left([s for s, _ in self._ce[-PLATEAU_LAST:]])
        if loop is not None:
            self.metric(step, "loss/plateau_loop_loss", loop)
        if mean > limit and loop is None:
            self.report("error", f"loss still at the uniform level after {step} steps: "
                        f"cross-entropy {mean:.3f} > {PLATEAU_SHARE} ln V = {limit:.3f}",
                        step=step, evidence={"ce": mean, "ln_V": self._ln_v, "threshold": limit,
                                             "steps": step,
                                             "last_steps": [s for s, _ in self._ce[-PLATEAU_LAST:]]}, code="stuck-uniform")

    def _loop_left(self, steps: list[int]) -> float | None:
        """The loop's mean loss at `steps` when it is under LOOP_APART x its first (the loop
        learns what this probe's CE does not score), else None."""
        if not self._loop:
            return None
        first = self._loop[min(self._loop)]
        seen = [self._loop[s] for s in steps if s in self._loop]
        if not seen or first <= 0:
            return None
        mean = sum(seen) / len(seen)
        return mean if mean < LOOP_APART * first else None

    def finish(self, run: RunContext) -> None:
        if not self._ce and self._bad_step is None:
            # nothing to judge the levels on: no verdict (never a pass), and why
            self.skip(f"only the training loss was observed ({self._losses_seen} probed "
                      f"steps; its sign and finiteness checked): the loss levels against ln V "
                      f"need the logits and the targets" if self._losses_seen else
                      "no training loss and no logits/targets were observed")
            return
        if self._above and not self._exploded:      # the run ended above the limit
            self._report_explosion()
        if self._plateau_judged or self._bad_step is not None or self._exploded:
            return
        needed = min(self.plateau_steps, PLATEAU_MIN_STEPS)
        last = self._ce[-1][0]
        ran = self.steps_run if self.steps_run is not None else last + 1   # steps count from 0
        if ran >= needed:                        # judged at its last read, as the run's end
            self._plateau(last)
        else:
            self.skip(f"plateau check needs {needed} steps; this run had {ran}")
