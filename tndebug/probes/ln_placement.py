"""ln-placement: which LayerNorm placement the model uses, and the combinations that break it.

Failure: (1) pre-LN blocks `x + f(norm(x))` with no final LayerNorm after the stack, so the
    memory and the generator read an unnormalised, growing stream; (2) post-LN blocks
    `norm(x + f(x))` trained without warmup at a high learning rate (Xiong et al. 2020).
Symptom: (1) every block output fails the LayerNorm identity (pre-LN) and so does the stack
    output; (2) post-LN, and the applied lr is ≥ 1e-4 from the first step with no rising ramp,
    and the loss does not fall: the hazard is a risk, not a verdict, until the run shows it.
Fix: (1) add the final LayerNorm (annotated `Encoder.norm`); (2) use a warmup schedule
    (Noam) or pre-LN.

How it decides (tensors and behaviour only; FAILURE_MODES 2.6, 6):
* placement: a LayerNorm output x = γ ⊙ z + β satisfies Σ_i x_i/γ_i = const for every token,
  so the token-centred block outputs have a null vector (σ_min/σ_rms ~1e-7), whatever γ and β
  training gave; pre-LN block outputs do not (≥ 1e-2). All block outputs normalised -> post;
  none -> pre. Reported as info, with the gradient profile at init as evidence (post-LN
  gradients grow toward the output, pre-LN ones do not).
* stack outputs: the last "stack" stream point of each stack (else the encoder memory).
* lr: StepInfo.lr on steps 0, 1, 2, 4, ..., 64 (else the declared schedule).
* post-LN without warmup at a high lr: decided from the lr by step 16, judged from the loss.
  Once the loss at a probed step (every 250) is below PROGRESS x the step-0 loss, the run
  trains despite it: info. A run that never gets there (or diverges) by its end: warning.
  Measured: the `no_warmup_high_lr` fault on `tiny` (Post-LN, 5x the Noam peak) ends at 0.66x
  its first loss (`tndebug run --preset tiny --norm post --fault no_warmup_high_lr --steps 200
  --seed 10`; 0% exact match in bench/results/detection_eval_rerun.jsonl); Hugging Face BART
  (3+3 layers, Adam 3e-4 constant, copy task) is at 0.021x at step 250 and 0.0016x at step 750
  (`python bench/watch_breakdown.py --model bart`).
Setup traces a random batch itself (forward and backward, eval mode); the training traces of
the early steps are used only when setup could not run the model.
"""
from __future__ import annotations

from typing import Any

from tndebug.notes import FAULT_NOTES
from tndebug.probes import _depth_stats as ds
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.schedule import Schedule
from tndebug.trace import StreamPoint, Trace

HIGH_LR = 1e-4        # Xiong et al.: post-LN without warmup diverges at lr ≥ 1e-4 (FAILURE_MODES 6)
RAMP = 1.5            # a warmup raises the lr by more than this factor over its first steps
DECIDE_AT = 16        # steps of lr history before the warmup verdict
EARLY_STEPS = (0, 1, 2, 4, 8, 16, 32, 64)
LOSS_EVERY = 250      # after the early steps, the loss is looked at every N steps
# a run whose loss fell below this share of its step-0 loss trains despite the missing warmup
# (measured, module docstring: the failing fault ends at 0.66, healthy BART at 0.0016-0.021)
PROGRESS = 0.5


def _early() -> Schedule:
    wanted = frozenset(EARLY_STEPS)
    return Schedule(lambda s: s in wanted or (s > 0 and s % LOSS_EVERY == 0),
                    "steps " + ",".join(map(str, EARLY_STEPS)) + f", then every {LOSS_EVERY}")


class LnPlacement(Probe):
    """Detects pre-/post-LN from activations; flags pre-LN without final norm, post-LN without warmup."""

    name = "ln-placement"
    summary = "LayerNorm placement from activations; pre-LN without final norm, post-LN without warmup"
    reads = ("stream", "grad.stream")
    fix = FAULT_NOTES["pre_ln_no_final_norm"][2]
    default_schedule = staticmethod(_early)

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self.placement: str | None = None
        self.evidence: dict[str, Any] = {}
        self.lrs: list[tuple[int, float]] = []
        self.lr_decided = False
        self.loss_steps: list[tuple[int, float]] = []   # (step, loss) at every probed step
        self._hazard: dict | None = None        # post-LN without warmup, awaiting the loss
        self._run: RunContext | None = None
        self._pending: Trace | None = None

    # -- moments ---------------------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        self._run = run
        trace = ds.setup_trace_or_skip(self, run)
        if trace is None:
            return
        self._decide(trace, step=0, run=run)

    def observe(self, trace: Trace, info: StepInfo) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if info.loss is not None:
            out["loss"] = info.loss.detach().float().reshape(1)
        if self.placement is None and trace.streams and self._pending is None:
            self._pending = trace        # setup could not trace: decide from this one in update
        return out

    def update(self, stats: dict[str, Any], info: StepInfo) -> None:
        lr = info.lr
        if lr is None and self._run is not None and self._run.optimizer is not None:
            lr = self._run.optimizer.param_groups[0].get("lr")
        if lr is not None:
            self.lrs.append((info.step, float(lr)))
        if "loss" in stats:
            self.loss_steps.append((info.step, float(stats["loss"][0])))
        if self._pending is not None and self._run is not None:
            trace, self._pending = self._pending, None
            self.skipped = None
            self._decide(trace, step=info.step, run=self._run)
        if not self.lr_decided and info.step >= DECIDE_AT:
            self._warmup_verdict()
        if self._hazard is not None and self._trains():
            self._judge_hazard()

    def finish(self, run: RunContext) -> None:
        if not self.lr_decided:
            self._warmup_verdict()
        if self._hazard is not None:
            self._judge_hazard()

    def on_divergence(self, run: RunContext, info: StepInfo) -> None:
        if self._hazard is not None:            # it bit: the loss went non-finite
            self.loss_steps.append((info.step, float("nan")))

    # -- placement -------------------------------------------------------------------------
    def _decide(self, trace: Trace, step: int, run: RunContext) -> None:
        label, ev = ds.detect_placement(trace)
        ev.update(self._grad_profile(trace))
        self.placement, self.evidence = label, ev
        if label == "unknown":
            self.cover("", "no verdict", "the block outputs could not be tested for a LayerNorm")
        else:
            self.cover("", "checked")          # the placement, from every block output
        words = {"post": "post-LN: every block output is a LayerNorm output",
                 "pre": "pre-LN: no block output is a LayerNorm output",
                 "mixed": "mixed: some block outputs are LayerNorm outputs, some not",
                 "unknown": "unknown: the block outputs could not be tested"}[label]
        self.report("info", f"norm placement {words}", step=step, evidence=ev, fix="")
        if label == "pre":
            self._final_norm(trace, step, run)

    def _grad_profile(self, trace: Trace) -> dict:
        """Per-layer ‖∂L/∂x‖ at the layer outputs, and last/first per stack."""
        per: dict[str, dict[int, float]] = {}
        for stack, points in ds.stack_groups(trace):
            for sp in points:
                g = trace.grads.get(sp.name)
                if g is None or sp.layer is None or sp.kind not in ("sublayer", "layer"):
                    continue
                keep = ds.token_keep(trace, stack, g)
                per.setdefault(stack, {})[sp.layer] = float(g.float()[keep].norm(dim=-1).mean())
        ev = {}
        for stack, layers in per.items():
            norms = [layers[k] for k in sorted(layers)]
            ev[f"grad_{stack}"] = [round(v, 8) for v in norms]
            if len(norms) > 1 and norms[0] > 0:
                ev[f"grad_growth_{stack}"] = round(norms[-1] / norms[0], 3)
        return ev

    def _final_norm(self, trace: Trace, step: int, run: RunContext) -> None:
        outs: list[tuple[str, str, Any]] = [(sp.stack, ds.module_path(sp.name),
                                             ds.signature_at(trace, sp)) for sp in ds.stack_outputs(trace)]
        if not outs and trace.src is not None:     # no stack taps: test the memory instead
            with run.subject.evaluating():
                memory = run.subject.encode(trace.src)                 # [B, S, d] or None
            if memory is not None:
                sp = StreamPoint("memory", "encoder", None, "stack", memory)
                outs.append(("encoder", "", ds.signature_at(trace, sp)))
        for stack, where, sig in outs:
            normalised = ds.is_normalised(sig)
            self.cover(where or stack, "checked" if normalised is not None else "no verdict",
                       "" if normalised is not None else "cannot tell whether the stack output is "
                       "normalised (fewer tokens than features, or a rank-deficient stream)")
            if normalised is not False:
                continue
            self.report(
                "error", f"pre-LN {stack} without a final LayerNorm: its output is not normalised "
                         f"(null ratio {sig.null_ratio:.3g}, per-token std CV {sig.std_cv:.3f})",
                where=where, step=step,
                evidence={"placement": "pre", **sig.as_evidence(),
                          "threshold_null_ratio": ds.NULL_RATIO, "threshold_direct": ds.DIRECT_TOL})

    # -- warmup ----------------------------------------------------------------------------
    def _lr_history(self) -> list[tuple[int, float]]:
        if self.lrs:
            return self.lrs
        run = self._run
        if run is not None and run.lr_schedule is not None:
            horizon = min(run.total_steps or 1000, 1000)
            return [(s, float(run.lr_schedule(s))) for s in range(0, horizon + 1, max(1, horizon // 64))]
        return []

    def _warmup_verdict(self) -> None:
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
        self._hazard = {
            "step": last[0],
            "message": f"post-LN trained without warmup at a high learning rate: lr {lr0:.2g} "
                       f"from step 0, never above {peak / lr0:.2f}x that by step {last[0]}",
            "evidence": {"placement": "post", "lr_step0": lr0, "lr_peak": peak,
                         "lr_peak_step": peak_step, "lr_last": last[1],
                         "steps_seen": [h[0] for h in history][:12],
                         "threshold_lr": HIGH_LR, "threshold_ramp": RAMP}}

    def _trains(self) -> bool:
        """The loss at the latest probed step is below PROGRESS x the step-0 loss."""
        if not self.loss_steps or self.loss_steps[0][0] != 0 or len(self.loss_steps) < 2:
            return False
        first, (_, latest) = self.loss_steps[0][1], self.loss_steps[-1]
        return first > 0 and latest == latest and latest < PROGRESS * first   # NaN: not

    def _judge_hazard(self) -> None:
        """Report the missing warmup: info if the run trains anyway, else a warning."""
        hazard, self._hazard = self._hazard, None
        early = [round(v, 4) for s, v in self.loss_steps if s <= EARLY_STEPS[-1]][:8]
        ev = {**hazard["evidence"], "losses": early,
              "loss_trend": [(s, round(v, 4)) for s, v in self.loss_steps[-4:]],
              "threshold_progress": PROGRESS}
        fix = FAULT_NOTES["no_warmup_high_lr"][2]
        trend = ""
        if len(self.loss_steps) >= 2 and self.loss_steps[0][0] == 0:
            (s0, l0), (s1, l1) = self.loss_steps[0], self.loss_steps[-1]
            trend = f"loss {l0:.3g} at step {s0}, {l1:.3g} at step {s1}"
        if self._trains():
            self.report("info", f"{hazard['message']}; this run trains anyway ({trend}): a hazard "
                        f"if you raise the lr or the depth (by design here)",
                        step=hazard["step"], evidence=ev, fix=fix)
        else:
            self.report("warning", hazard["message"] + (f"; {trend}" if trend else ""),
                        step=hazard["step"], evidence=ev, fix=fix)
