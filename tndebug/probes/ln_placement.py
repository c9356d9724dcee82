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
* the residual of each attention sublayer (pre-LN or mixed): output minus the attention's
  output is the input x (healthy) or g * norm(x) + b (the bug), exactly (`_residual`): an error
  (exact; the skip path no longer carries the stream, so Pre-LN's identity path is gone).
* a missing residual (`x = attn(ln_1(x))`, any placement): each block's input is moved while
  every weight inside it is held (`_skip_path`); a block whose output does not move has no
  skip path, exactly: an error naming the sublayer (the attention, or the FFN after it).
  Measured (bench/residual_skip.py): with a residual a block passes 0.40-0.92 of the input's
  share (calibration: tndebug tiny pre/post, nanoGPT at init), without it 0 (bit-identical);
  MIN_SHARE (1e-6) absorbs float32 rounding only.
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
Setup traces a random batch itself (forward and backward, eval mode); the training traces of
the early steps are used only when setup could not run the model. Sharded parameters (FSDP2):
the gradient norm from the ranks' local shards, summed over the ranks (`grad_norms_of`).
"""
from __future__ import annotations

from typing import Any

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes import _depth_stats as ds
from tndebug.probes import _norm_gain
from tndebug.probes._residual import NORM_TOL, normalised_residuals, residual_carries
from tndebug.probes import _skip_path
from tndebug.probes.base import Probe, RunContext, StepInfo, grad_norms_of
from tndebug.probes.schedule import Schedule
from tndebug.capture.source import call_site
from tndebug.capture.trace import StreamPoint, Trace

HIGH_LR = 1e-4        # Xiong et al.: post-LN without warmup diverges at lr ≥ 1e-4 (FAILURE_MODES 6)
# RAMP, DECIDE_AT: no run (e19bac1): a linear or Noam warmup doubles its lr from step 1 to 2.
RAMP = 1.5            # a warmup raises the lr by more than this factor over its first steps
DECIDE_AT = 16        # steps of lr history before the warmup verdict
EARLY_STEPS = (0, 1, 2, 4, 8, 16)   # the placement fallback and the lr history
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


class LnPlacement(Probe):
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
        self._hazard: dict | None = None        # post-LN without warmup, awaiting the loss
        self._run: RunContext | None = None
        self._pending: Trace | None = None

    # -- moments ---------------------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        self._run = run
        self._collapsed_norms(run.subject)
        trace = ds.setup_trace_or_skip(self, run)
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
        return Schedule(lambda s: s in early or (self._hazard is not None and s > DECIDE_AT
                                                 and s % SYMPTOM_EVERY == 0),
                        "steps " + ",".join(map(str, EARLY_STEPS)) +
                        f", then every {SYMPTOM_EVERY} while post-LN runs without warmup")

    def observe(self, trace: Trace, info: StepInfo) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if info.loss is not None:
            out["loss"] = info.loss.detach().float().reshape(1)
        if self.placement in (None, "post") and (self._hazard is not None or not self.lr_decided):
            norm = self._grad_norm(info)
            if norm is not None:
                out["grad_norm"] = norm
        if self.placement is None and trace.streams and self._pending is None:
            self._pending = trace        # setup could not trace: decide from this one in update
        return out

    def _grad_norm(self, info: StepInfo):
        """‖∇θ L‖ over every parameter with a gradient (a device scalar, no sync), or None."""
        model = self._run.subject.model if self._run is not None else None
        norms = [n for n in grad_norms_of(model.parameters(), info) if n is not None] \
            if model is not None else []
        if not norms:
            return None
        return torch.stack(norms).norm().reshape(1)

    def update(self, stats: dict[str, Any], info: StepInfo) -> None:
        lr = info.lr
        if lr is None and self._run is not None and self._run.optimizer is not None:
            lr = self._run.optimizer.param_groups[0].get("lr")
        if lr is not None:
            self.lrs.append((info.step, float(lr)))
        if "loss" in stats:
            self.loss_steps.append((info.step, float(stats["loss"][0])))
        if "grad_norm" in stats:
            self.grad_steps.append((info.step, float(stats["grad_norm"][0])))
        if self._pending is not None and self._run is not None:
            trace, self._pending = self._pending, None
            self.skipped = None
            self._decide(trace, step=info.step, run=self._run)
        if not self.lr_decided and info.step >= DECIDE_AT:
            self._warmup_verdict()
        if self._hazard is not None:
            symptom = self._symptom(info.step)
            if symptom is not None:
                self._report_hazard(symptom)

    def finish(self, run: RunContext) -> None:
        if not self.lr_decided:
            self._warmup_verdict()
        if self._hazard is not None:
            self._report_hazard(self._symptom(None))

    def on_divergence(self, run: RunContext, info: StepInfo) -> None:
        if self._hazard is not None:            # it bit: the loss went non-finite
            self.loss_steps.append((info.step, float("nan")))
            self._report_hazard(self._symptom(info.step))

    # -- placement -------------------------------------------------------------------------
    def _decide(self, trace: Trace, step: int, run: RunContext) -> None:
        label, ev = ds.detect_placement(trace, run)
        ev.update(self._grad_profile(ds.setup_grads(run, trace)))
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
            self._residual_input(run, step, inline=label == "pre")
        self._residual_missing(trace, run, step)

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

    def _residual_input(self, run: RunContext, step: int, inline: bool = False) -> None:
        """Pre-LN sublayers whose residual carries norm(x) instead of x (`_residual`)."""
        subject = run.subject
        src, tgt = ds.probe_batch(subject)
        try:
            with subject.evaluating():
                trace = subject.trace(src, tgt, reads=("stream", "attn.out", "attn.probs"))
        except Exception:  # noqa: BLE001 - the placement is decided; this test is extra
            return
        by_stack: dict[str, list[dict]] = {}
        carried = residual_carries(trace)
        for e in carried:
            self.cover(e["where"], "checked")
            if e["carries"] == "normalised input":
                by_stack.setdefault(e["stack"], []).append(e)
        if not carried and inline:         # no sublayer points: read the adds themselves (pre-LN
            self._residual_by_identity(subject, src, tgt, trace, step)   # only: a Post-LN block
            return                                                      # adds its input, a norm output)
        for stack, bad in by_stack.items():
            first = bad[0]
            self.report(
                "error", f"the residual of {first['where']} carries the normalised input: its "
                f"output is norm(x) + f(norm(x)), not x + f(norm(x)) ({len(bad)} {stack} "
                f"sublayer{'s' if len(bad) > 1 else ''}: {', '.join(e['where'] for e in bad[:3])})",
                where=first["where"], step=step, layer=first["layer"],
                evidence={"sublayers": [e["where"] for e in bad],
                          "rel_to_input": round(first["rel_input"], 6),
                          "rel_to_normalised_input": first["rel_norm"],
                          "threshold": NORM_TOL, "attention": first["attention"]},
                fix="Keep the residual on the unnormalised stream: x = x + f(norm(x)); do not "
                    "assign norm(x) back to x before adding the sublayer's output", code="residual-normalised")

    def _residual_by_identity(self, subject, src, tgt, trace, step: int) -> None:
        """Sublayers written inline (`x = self.norm1(x); x = x + self.attn(x, x, x, mask)`): the
        residual added to an attention output is the very tensor a norm produced and the
        attention read (`_residual.normalised_residuals`, by tensor identity: exact)."""
        sites = [r.site for r in trace.records()]
        try:
            bad = normalised_residuals(subject, src, tgt, sites)
        except Exception:  # noqa: BLE001 - the placement is decided; this test is extra
            return
        if not sites:
            return
        for site in sites:
            self.cover(site, "checked")
        if not bad:
            return
        first = bad[0]
        where = ", ".join(sorted({e["where"] for e in bad})[:3])
        self.report(
            "error", f"the residual of {first['where']} carries the normalised input: "
            f"{first['norm']}'s output is both what the attention reads and what its output is "
            f"added to, so the block computes norm(x) + f(norm(x)), not x + f(norm(x)) "
            f"({len(bad)} attention sublayer{'s' if len(bad) > 1 else ''}: {where})",
            where=first["where"], step=step,
            evidence={"sublayers": [e["where"] for e in bad], "norms": [e["norm"] for e in bad],
                      "test": "the residual operand is the norm's output tensor (identity)"},
            fix="Keep the residual on the unnormalised stream: h = norm(x); x = x + f(h); do not "
                "assign norm(x) back to x before adding the sublayer's output", code="residual-normalised")

    def _residual_missing(self, trace: Trace, run: RunContext, step: int) -> None:
        """Blocks with a sublayer that lost its residual (`_skip_path`): one error per stack."""
        subject = run.subject
        points = {ds.module_path(sp.name): sp for sp in ds.block_points(trace)}
        # 4 sequences: the test is exact, and each weight module's output is kept for the held run
        src, tgt = (x if x is None else x[:4] for x in ds.probe_batch(subject))

        def skips(sites=None):
            def forward():
                subject.logits(src, tgt)
            with subject.evaluating(), torch.no_grad():
                got = _skip_path.block_skips(subject.model, forward, list(points), sites, sites is not None)
            if any(r.reason == _skip_path.FUSED for r in got):   # torch's fused encoder layer runs
                with subject.evaluating(), torch.enable_grad():  # its modules only with grad on
                    got = _skip_path.block_skips(subject.model, forward, list(points), sites,
                                                 sites is not None)
            return got
        try:
            found = skips()
            if any(r.share is not None and r.share < _skip_path.MIN_SHARE for r in found):
                with subject.evaluating():                         # the attention modules, to name
                    found = skips([r.site.split("#")[0] for r in   # the part that lost it
                                   subject.trace(src, tgt, reads=("attn.probs",)).records()])
        except Exception as e:  # noqa: BLE001 - a model the test cannot run: no verdict
            self.cover("", "no verdict", f"the residual test could not run: {type(e).__name__}: {e}")
            return
        by_stack: dict[str, list] = {}
        for r in found:
            if r.share is None:
                self.cover(r.where, "no verdict", f"residual test: {r.reason}")
                continue
            self.cover(r.where, "checked")
            if r.share < _skip_path.MIN_SHARE:
                sp = points.get(r.where)
                by_stack.setdefault(sp.stack if sp is not None else "", []).append((r, sp))
        for stack, bad in by_stack.items():
            r, sp = bad[0]
            parts = [p for p, v in r.by_part.items() if v is not None and v < _skip_path.MIN_SHARE]
            names = [f"the FFN of {r.where} (the sublayer after its attention)" if p == "rest" else p
                     for p in parts]
            what = (f"the residual around {' and around '.join(names)} is missing" if names else
                    f"a residual inside {r.where} is missing")
            blocks = [x.where for x, _ in bad]
            part = next((p for p in parts if p != "rest"), None)
            self.report(
                "error", f"{what}: with every weight inside {r.where} held, moving the block's input "
                f"moves its output by {r.share:.1g} of the input's share (a residual passes "
                f"{_skip_path.MIN_SHARE:g} or more; {r.moves:.2f} with nothing held): the sublayer's "
                f"output replaces the stream instead of adding to it ({len(bad)} "
                f"{stack or 'model'} block{'s' if len(bad) > 1 else ''}: "
                f"{', '.join(blocks[:3])}{' ...' if len(blocks) > 3 else ''})",
                where=part or r.where, step=step,
                # the block's line that calls the sublayer (`x = self.attn(self.ln_1(x))`); the
                # FFN's loss is placed at the line that made the block's output (the engine)
                source=call_site(subject.model, part) if part else None,
                layer=sp.layer if sp is not None else None,
                evidence={"blocks": blocks, "skip_share": r.share,
                          "share_nothing_held": round(r.moves, 4), "weights_held": r.held,
                          "parts_without_residual": [("ffn" if p == "rest" else p) for p in parts],
                          "share_by_part": {("ffn" if p == "rest" else p): (None if v is None else round(v, 4))
                                            for p, v in r.by_part.items()},
                          "threshold": _skip_path.MIN_SHARE,
                          "test": "the block's input moved by its own size, every weight module in "
                                  "the block held at its output without the move"},
                fix="Add each sublayer's output to its input: x = x + self.attn(self.ln_1(x)) "
                    "(pre-LN) or x = norm(x + attn(x)) (post-LN), for the attention and the FFN alike",
                code="residual-missing")

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

    def _symptom(self, step: int | None) -> dict | None:
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

    def _report_hazard(self, symptom: dict | None) -> None:
        """The missing warmup: a warning with its symptom, else info (it did not bite)."""
        hazard, self._hazard = self._hazard, None
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
