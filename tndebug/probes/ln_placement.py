"""ln-placement: which LayerNorm placement the model uses, and the combinations that break it.

Failure: (1) pre-LN blocks `x + f(norm(x))` with no final LayerNorm after the stack, so the
    memory and the generator read an unnormalised, growing stream; (2) post-LN blocks
    `norm(x + f(x))` trained without warmup at a high learning rate (Xiong et al. 2020); (3) a
    pre-LN sublayer written `x = norm(x); x = x + f(x)`, whose residual carries norm(x).
Symptom: (1) every block output fails the LayerNorm identity (pre-LN) and so does the stack
    output; (2) post-LN, and the applied lr is ≥ 1e-4 from the first step with no rising ramp,
    and the run shows the symptom (a loss that stops falling, gradient spikes, divergence): the
    hazard is a risk, not a verdict, until the run shows it.
Fix: (1) add the final LayerNorm (annotated `Encoder.norm`); (2) use a warmup schedule
    (Noam) or pre-LN.

How it decides (tensors and behaviour only; FAILURE_MODES 2.6, 6):
* placement: a LayerNorm output x = γ ⊙ z + β satisfies Σ_i x_i/γ_i = const for every token,
  so the token-centred block outputs have a null vector (σ_min/σ_rms ~1e-7), whatever γ and β
  training gave; pre-LN block outputs do not (≥ 1e-2). All block outputs normalised -> post;
  none -> pre. Reported as info, with the gradient profile at init as evidence (post-LN
  gradients grow toward the output, pre-LN ones do not).
* stack outputs: the last "stack" stream point of each stack (else the encoder memory).
* the residuals (ln_placement_residual.py): a residual that carries norm(x), a block with no
  skip path.
* the warmup hazard (ln_placement_warmup.py): post-LN without warmup at a high lr, a warning
  only once the run shows its symptom.
Setup traces a random batch itself (forward and backward, eval mode); the training traces of
the early steps are used only when setup could not run the model. Sharded parameters (FSDP2):
the gradient norm from the ranks' local shards, summed over the ranks (`grad_norms_of`).
"""
from __future__ import annotations

from typing import Any

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes import _depth_setup, _depth_stats as ds
from tndebug.probes import _norm_gain
from tndebug.probes.base import Probe, RunContext, StepInfo, grad_norms_of
from tndebug.probes.ln_placement_residual import ResidualTests
from tndebug.probes.ln_placement_warmup import DECIDE_AT, SYMPTOM_EVERY, WarmupTests
from tndebug.probes.schedule import Schedule
from tndebug.capture.trace import StreamPoint, Trace

EARLY_STEPS = (0, 1, 2, 4, 8, 16)   # the placement fallback and the lr history


class LnPlacement(ResidualTests, WarmupTests, Probe):
    """Detects pre-/post-LN from activations; flags pre-LN without final norm, post-LN without warmup."""

    name = "ln-placement"
    places_by_output = True           # residual findings: the block's residual add
    cause = (
        "The paper is Post-LN norm(x + sublayer(x)); the annotated code is pre-norm for "
        "brevity and then needs a final LayerNorm [note 003]. Pre-LN trains more stably "
        "without warmup, and Post-LN needs warmup and a modest lr [notes 002, 003]."
    )
    summary = "LayerNorm placement from activations; pre-LN without final norm, post-LN without warmup"
    codes = {
        "placement": "the norm placement found (pre-LN, post-LN), advisory",
        "no-final-norm": "a pre-LN stack without a final LayerNorm",
        "residual-normalised": "the residual carries the normalised input (x = norm(x); x = x + f(x))",
        "residual-missing": "a block whose output keeps none of its input: a sublayer without its residual",
        "norm-collapsed": "a norm whose output is the same for every token (its gain is 0)",
        "no-warmup-shows": "post-LN without warmup at a high lr, and its symptom shows",
        "no-warmup-hazard": "post-LN without warmup at a high lr, no symptom (advisory)",
    }
    reads = ("stream", "grad.stream")
    fix = FAULT_NOTES["pre_ln_no_final_norm"][2]

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule or self._own_schedule())
        self.placement: str | None = None
        self.evidence: dict[str, Any] = {}
        self.lrs: list[tuple[int, float]] = []
        self.lr_decided = False
        self.loss_steps: list[tuple[int, float]] = []   # (step, loss) at every probed step
        self.grad_steps: list[tuple[int, float]] = []   # (step, parameter-gradient norm)
        self.hazard: dict | None = None        # post-LN without warmup, awaiting the loss
        self.run_context: RunContext | None = None
        self._pending: Trace | None = None

    # -- moments ---------------------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        self.run_context = run
        self._collapsed_norms(run.subject)
        trace = _depth_setup.setup_trace_or_skip(self, run)
        if trace is None:
            return
        self._decide(trace, step=0, run=run)

    def _collapsed_norms(self, subject) -> None:
        """Norms whose gain collapsed to 0 (`_norm_gain`): one error at the first, the others
        counted, shown in this forward pass: what follows each sees one input for every token."""
        found = _norm_gain.collapsed(subject)
        if not found:
            return
        c = found[0]
        more = f" (+{len(found) - 1} more norms)" if len(found) > 1 else ""
        self.report("error", f"{c.module} gives every token the same output (its tokens differ "
                    f"by {c.out_spread:.1e} of its scale after it, {c.in_spread:.2g} before): "
                    f"its gain is 0, so what follows it sees one input for every token{more}",
                    where=c.module, step=0, code="norm-collapsed",
                    evidence={"in_spread": c.in_spread, "out_spread": c.out_spread,
                              "modules": [x.module for x in found],
                              "threshold_in_varies": _norm_gain.IN_VARIES,
                              "threshold_out_same": _norm_gain.OUT_SAME},
                    fix=f"{c.module}.weight is 0: reload the weights it was trained with (a key "
                        f"that did not load, or a conversion that zeroed it), or initialise it "
                        f"with nn.init.ones_ (norms that scale by 1 + weight, as Gemma's, keep "
                        f"zeros)")

    def _own_schedule(self) -> Schedule:
        """Steps 0, 1, 2, 4, 8, 16; then every SYMPTOM_EVERY while the warmup hazard is open."""
        early = frozenset(EARLY_STEPS)
        return Schedule(lambda s: s in early or (self.hazard is not None and s > DECIDE_AT
                                                 and s % SYMPTOM_EVERY == 0),
                        "steps " + ",".join(map(str, EARLY_STEPS)) +
                        f", then every {SYMPTOM_EVERY} while post-LN runs without warmup")

    def observe(self, trace: Trace, info: StepInfo) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if info.loss is not None:
            out["loss"] = info.loss.detach().float().reshape(1)
        if self.placement in (None, "post") and (self.hazard is not None or not self.lr_decided):
            norm = self._grad_norm(info)
            if norm is not None:
                out["grad_norm"] = norm
        if self.placement is None and trace.streams and self._pending is None:
            self._pending = trace        # setup could not trace: decide from this one in update
        return out

    def _grad_norm(self, info: StepInfo):
        """‖∇θ L‖ over every parameter with a gradient (a device scalar, no sync), or None."""
        model = self.run_context.subject.model if self.run_context is not None else None
        norms = [n for n in grad_norms_of(model.parameters(), info) if n is not None] \
            if model is not None else []
        if not norms:
            return None
        return torch.stack(norms).norm().reshape(1)

    def update(self, stats: dict[str, Any], info: StepInfo) -> None:
        lr = info.lr
        if lr is None and self.run_context is not None and self.run_context.optimizer is not None:
            lr = self.run_context.optimizer.param_groups[0].get("lr")
        if lr is not None:
            self.lrs.append((info.step, float(lr)))
        if "loss" in stats:
            self.loss_steps.append((info.step, float(stats["loss"][0])))
        if "grad_norm" in stats:
            self.grad_steps.append((info.step, float(stats["grad_norm"][0])))
        if self._pending is not None and self.run_context is not None:
            trace, self._pending = self._pending, None
            self.skipped = None
            self._decide(trace, step=info.step, run=self.run_context)
        if not self.lr_decided and info.step >= DECIDE_AT:
            self.warmup_verdict()
        if self.hazard is not None:
            symptom = self.symptom(info.step)
            if symptom is not None:
                self.report_hazard(symptom)

    def finish(self, run: RunContext) -> None:
        if not self.lr_decided:
            self.warmup_verdict()
        if self.hazard is not None:
            self.report_hazard(self.symptom(None))

    def on_divergence(self, run: RunContext, info: StepInfo) -> None:
        if self.hazard is not None:            # it bit: the loss went non-finite
            self.loss_steps.append((info.step, float("nan")))
            self.report_hazard(self.symptom(info.step))

    # -- placement -------------------------------------------------------------------------
    def _decide(self, trace: Trace, step: int, run: RunContext) -> None:
        label, ev = ds.detect_placement(trace, run)
        ev.update(self._grad_profile(_depth_setup.setup_grads(run, trace)))
        self.placement, self.evidence = label, ev
        self.reads = ()           # decided: later steps need the loss and gradients only
        if label == "unknown":
            self.cover("", "no verdict", "the block outputs could not be tested for a LayerNorm")
        else:
            self.cover("", "checked")          # the placement, from every block output
        words = {"post": "post-LN: every block output is a LayerNorm output",
                 "pre": "pre-LN: no block output is a LayerNorm output",
                 "mixed": "mixed: some block outputs are LayerNorm outputs, some not",
                 "unknown": "unknown: the block outputs could not be tested"}[label]
        self.report("info", f"norm placement {words}", step=step, evidence=ev, fix="", code="placement")
        if label == "pre":
            self._final_norm(trace, step, run)
        if label in ("pre", "mixed"):
            self.residual_input(run, step, inline=label == "pre")
        self.residual_missing(trace, run, step)

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
                          "threshold_null_ratio": ds.NULL_RATIO, "threshold_direct": ds.DIRECT_TOL}, code="no-final-norm")

