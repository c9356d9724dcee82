"""variance-drift: rank collapse and runaway growth of the residual stream along depth.

Failure: a sublayer replaces the stream instead of adding to it (`x = f(x)`, no residual),
    so attention averages tokens into one vector (rank collapse, Dong et al. 2021); or the
    stream's scale runs away with depth.
Symptom: the centred ratio r = ‖X − 1x̄ᵀ‖_F / ‖X‖_F of a sequence's tokens drops to ~0 at one
    sublayer (no_residual: 0.3-0.5 -> 0.000-0.04 at init); the RMS profile grows far beyond
    what healthy runs with the same norm placement show.
Fix: keep `x + dropout(sublayer(x))` around every sublayer (the notes' fix for no_residual).

How it decides (tensors only; FAILURE_MODES 5a-5b):
* r per stream point, per sequence over non-pad tokens, averaged over sequences. A sublayer
  whose output keeps < DROP of its input's r is an abrupt collapse: error if r < R_ERROR,
  warning if r < R_WARN. r < R_FLOOR anywhere is an error however it got there. A slow
  decline (deep post-LN decoders reach r ≈ 0.02 at init) is not flagged.
* a collapse present at the first check (setup, step 0) is structural: the residual add is
  missing. One that appears later is dynamic (post-LN under too large updates) and gets the
  learning-rate fix instead. Where the sublayer keeps its input's token differences
  (retention >= RETAIN), a collapse at the first check is an error when the logits are
  collapsed too, else a warning; in trained weights (a later step, or triage) it is info, a
  statistic of a model still learning or of its data (collapsed logits included: a model on
  the plateau of its targets' prior gives one answer whatever its input). Triage judges it
  again on a fresh initialisation of the same code (tndebug/judge/fresh.py).
* one finding per module (the stronger); triage's words say "in the trained weights".
* growth G = max RMS of the block outputs / RMS of the stack's input (post-LN: of the first
  block's output when that is larger), against the healthy envelope of the placement
  (pre/post, detected from the activations): > 3x -> warning.
Runs once at setup on a random batch (step 0) and then on the training traces.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tndebug.findings import severity_rank
from tndebug.faults import FAULT_NOTES
from tndebug.probes import _depth_setup, _depth_stats as ds
from tndebug import tags
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.schedule import log_spaced
from tndebug.capture.trace import Trace

# Calibrated on healthy runs: tndebug.harness tiny (300 steps, seeds 0-2) and small (200-300
# steps, seeds 0-1), pre and post, dropout 0/0.1/0.3; tndebug.train small 400 steps (seeds
# 0-1, pre and post); tiny/small/base at init. The one alarm: a small post-LN run (dropout 0,
# peak lr 8.8e-3) that failed to train, flagged "during training" (see DYNAMIC_FIX).
R_FLOOR = 0.002   # complete collapse wherever it happens (healthy minimum 0.012; base post-LN decoder 0.023 at init)
R_ERROR = 0.02    # after an abrupt drop
R_WARN = 0.2      # after an abrupt drop
DROP = 0.2        # r_out / r_in of one sublayer (healthy minimum 0.33 in training, 0.68 at init;
                  # no_residual 0.00-0.10)
GROWTH_ENVELOPE = {"pre": 18.0, "post": 2.0}  # max healthy G per placement (measured 17.7, 1.8)
GROWTH_FACTOR = 3.0


# A collapse that appears only after the first check is not a missing residual: deep post-LN
# stacks lose rank under too-large updates (Noci et al. 2022; seen: small post-LN, dropout 0,
# peak lr 8.8e-3, loss stuck at 1.6 while r fell to 5e-4 at the top decoder layer).
RETAIN = 0.3      # centred input-output correlation of a sublayer; healthy ≥ 0.85, heads
                  # as copies ≥ 0.65, no_residual ≤ 0.07 (tiny/small/base at init)
SWAMPED_FIX = ("Check the sublayer's initialisation and output scale (e.g. heads that are copies add "
               "up h-fold: see head-collapse); keep x + dropout(sublayer(x)).")
DYNAMIC_FIX = ("Lower the peak learning rate or lengthen the warmup; post-LN stacks lose rank under "
               "large updates, pre-LN is more robust. " + FAULT_NOTES["no_warmup_high_lr"][2])


class VarianceDrift(Probe):
    """Residual-stream RMS and rank ratio along depth; catches a missing residual at step 0."""

    name = "variance-drift"
    places_by_output = True           # the stream a block returns
    cause = (
        "A sublayer whose output replaces the stream (x = sublayer(x), no residual add) "
        "stops gradients and collapses the tokens, and without residual+LayerNorm a deep "
        "Transformer cannot be trained [note 002]. Pre-LN growth of the stream with depth is "
        "expected (our sim: 2.15 at layer 3). A low rank ratio in trained weights while the "
        "sublayer keeps its input's token differences is a statistic of a model still learning "
        "or of its data, not a defect (a half-trained BlenderbotSmall passes through r = 0.002; "
        "a model on the plateau of its targets' prior gives one answer at every position); "
        "the code's own collapse shows at initialisation."
    )
    summary = "residual-stream rank collapse (missing residual) and RMS growth along depth"
    codes = {
        "rank-collapse": "tokens nearly identical along depth (rank collapse)",
        "stream-growth": "the residual stream RMS grows beyond the healthy envelope",
    }
    reads = ("stream",)
    fix = FAULT_NOTES["no_residual"][2]
    default_schedule = staticmethod(lambda: log_spaced(100))

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self.placement: str | None = None
        self.placement_evidence: dict = {}
        self.max_growth: dict[str, float] = {}
        self.first_growth: dict[str, float] = {}     # G at the stack's first check (init)
        self.seen: set[str] = set()              # stacks checked at least once
        self.flagged: set[tuple[str, str]] = set()   # (stack, severity | "dynamic")

    # -- moments ---------------------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        trace = _depth_setup.setup_trace_or_skip(self, run)
        if trace is None:
            return
        self._detect_placement(trace, run)
        stats = self.observe(trace, None)
        if "logits_r" not in stats and trace.logits is None:
            # the wide pass stopped before the output head: the logits' r from the gradient
            # pass (the first probe batch, same draw), over its own tokens
            grads = _depth_setup.setup_grads(run, trace)
            if grads.logits is not None and grads.logits.dim() == 3:
                keep = ds.token_keep(grads, "decoder", grads.logits)
                stats["logits_r"] = ds.depth_profile([grads.logits], keep)[0, 0]
        if "depth" not in stats:
            self.skip("the capture's stream points could not be profiled")
            return
        self._check({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in stats.items()},
                    step=0, emit=False)

    def observe(self, trace: Trace, info: StepInfo | None) -> dict[str, Any]:
        names, meta, vals = [], [], []
        for stack, points in ds.stack_groups(trace):
            run: list = []                  # consecutive points of one shape, computed together
            for sp in points + [None]:
                if run and (sp is None or sp.x.shape != run[-1].x.shape):
                    keep = ds.token_keep(trace, stack, run[0].x)
                    vals.append(ds.depth_profile([p.x for p in run], keep))
                    run = []
                if sp is not None:
                    run.append(sp)
                    names.append(sp.name)
                    meta.append((stack, sp.layer, sp.kind))
        if not vals:
            return {}
        out = {"depth": torch.cat(vals), "names": names, "meta": meta}   # depth [n_points, 3]
        logits = info.logits if info is not None and info.logits is not None else trace.logits
        if logits is not None and logits.dim() == 3:
            keep = ds.token_keep(trace, "decoder", logits)
            out["logits_r"] = ds.depth_profile([logits], keep)[0, 0]       # r of the logits
        return out

    def update(self, stats: dict[str, Any], info: StepInfo) -> None:
        self._check(stats, info.step, emit=True)

    # -- checks ----------------------------------------------------------------------------
    def _check(self, stats: dict[str, Any], step: int, emit: bool) -> None:
        if "depth" not in stats:
            return
        depth = stats["depth"].tolist()
        rows = list(zip(stats["names"], stats["meta"], depth))
        by_stack: dict[str, list] = {}
        for name, (stack, layer, kind), (r, rms, rho) in rows:
            by_stack.setdefault(stack, []).append((name, layer, kind, r, rms, rho))
        for stack, pts in by_stack.items():
            judged = any(kind != "embed" and not math.isnan(r) for _, _, kind, r, _, _ in pts)
            self.cover(stack, "checked" if judged else "no verdict",
                       "" if judged else "the rank ratio is undefined at every stream point")
            if emit:
                self._metrics(step, stack, pts)
            self._rank(step, stack, pts, stats.get("logits_r"))
            self._growth(step, stack, pts)

    def _metrics(self, step: int, stack: str, pts) -> None:
        last: dict[int, tuple[float, float]] = {}
        for _, layer, kind, r, rms, _ in pts:
            if layer is not None and kind in ("sublayer", "layer"):
                last[layer] = (r, rms)
        for layer, (r, rms) in sorted(last.items()):
            self.metric(step, tags.DEPTH.build(stack=stack, layer=layer, stat="resid_rms"), rms)
            self.metric(step, tags.DEPTH.build(stack=stack, layer=layer, stat="rank"), r)

    @staticmethod
    def _first_collapse(pts) -> tuple[str, int] | None:
        """(severity, index) of the first point whose rank ratio is below R_FLOOR, or dropped
        abruptly (by DROP) below R_ERROR (error); else the first abrupt drop below R_WARN."""
        hit = None
        for i, (_, _, kind, r, _, _) in enumerate(pts):
            if kind == "embed" or math.isnan(r):
                continue
            r_in = pts[i - 1][3] if i > 0 else float("nan")
            abrupt = not math.isnan(r_in) and r_in > 0 and r / r_in < DROP
            sev = None
            if r < R_FLOOR or (abrupt and r < R_ERROR):
                sev = "error"
            elif abrupt and r < R_WARN:
                sev = "warning"
            if sev == "error":
                return sev, i
            if sev == "warning" and hit is None:
                hit = (sev, i)
        return hit

    def _rank(self, step: int, stack: str, pts, logits_r=None) -> None:
        hit = self._first_collapse(pts)
        first = stack not in self.seen
        self.seen.add(stack)
        if hit is None:
            return
        sev, i = hit
        name, layer, _, r, _, rho = pts[i]
        r_in = pts[i - 1][3] if i > 0 else float("nan")
        kept = r / r_in if r_in and not math.isnan(r_in) else float("nan")
        lr_ = float(logits_r) if logits_r is not None else float("nan")
        # why: a residual that is missing (the output has forgotten its input), one that is
        # swamped by its sublayer at init, or a collapse that training brought about. Triage
        # trains nothing: both of its checks judge the same trained weights.
        trained = self.mode == "triage" or not first or (stack, "dynamic") in self.flagged
        if math.isnan(rho) or rho < RETAIN:
            if self.mode != "triage" and trained:
                cause, fix = "dynamic", DYNAMIC_FIX
                self.flagged.add((stack, "dynamic"))
            else:
                cause, fix = "missing", None
        elif not trained:
            # at initialisation (the first check of `tndebug run`: the code, no training yet) the
            # sublayer keeps its input's token differences under a common component that swamps
            # them; with the logits collapsed too the collapse is shown where it matters
            cause, fix = ("output", SWAMPED_FIX) if lr_ < R_ERROR else ("swamped", SWAMPED_FIX)
            sev = "error" if lr_ < R_ERROR else "warning"
        else:
            # trained weights whose sublayer keeps its input's token differences (retention >=
            # RETAIN, the residual is there): a common component the weights learned dominates
            # the stream. A statistic of the weights, whatever the logits do:
            # * logits that still vary: a half-trained HF BlenderbotSmall shows r = 0.002 at its
            #   second encoder layer (retention 0.99, logits r 0.11), r = 0.19 a few hundred
            #   steps later;
            # * logits the same at every position (r < R_ERROR): the model gives one answer, its
            #   targets' frequencies, whatever the input. bench/hf_unseen.py HELD-OUT: LED after
            #   150 copy steps (loss 4.81 = ln 124, the prior; r 0.03, retention 0.96, logits r
            #   0.010; after 600 steps loss 4.69, logits r 0.026, clean) and Megatron-BERT on
            #   masked random ids, whose masked token no input predicts (loss 4.78 = ln 124; r
            #   0.08, retention 0.99, logits r 0.001); both clean at a fresh initialisation.
            #   Any model on the plateau of its prior, or on targets its input does not predict,
            #   is there, whatever its code: what shows a defect is the same code collapsing at
            #   initialisation (run's first check above; triage re-judges a fresh init of the
            #   user's code, tndebug/judge/fresh.py rank_at_init) or a sublayer that forgets
            #   its input (retention < RETAIN).
            cause, fix, sev = "statistic", "", "info"
        where = ds.module_path(name)
        if (stack, sev) in self.flagged or (stack, "error") in self.flagged \
                or not self._stronger(where, sev):
            return
        self.flagged.add((stack, sev))
        when = " in the trained weights" if self.mode == "triage" else " during training"
        how = _collapse_how(cause, when, rho, lr_)
        self.report(
            sev, f"rank collapse in the {stack}: tokens at {where} are nearly identical "
                 f"(r={r:.4f}, from {r_in:.3f} at its input){how}",
            where=where, step=step, layer=layer, fix=fix,
            evidence={"r": round(r, 5), "r_input": round(r_in, 5), "kept": round(kept, 4),
                      "retention": round(rho, 4), "input": ds.module_path(pts[i - 1][0]) if i else "",
                      "logits_r": None if math.isnan(lr_) else round(lr_, 5), "mode": self.mode,
                      "cause": cause, "threshold_r_error": R_ERROR, "threshold_r_warning": R_WARN,
                      "threshold_kept": DROP, "threshold_r_floor": R_FLOOR,
                      "threshold_retention": RETAIN, "placement": self.placement}, code="rank-collapse")

    @staticmethod
    def at_init(ev: dict) -> tuple[str, str] | None:
        """(severity, cause) that a rank finding's evidence `ev` earns at initialisation (the
        first check: the code, no training), or None where it is no finding there. Triage's
        fresh-init re-judge (tndebug/judge/fresh.py) reads the fresh model's findings by it."""
        r, kept, rho, lr_ = (float("nan") if ev.get(k) is None else float(ev[k])
                             for k in ("r", "kept", "retention", "logits_r"))
        abrupt = not math.isnan(kept) and kept < DROP
        if r < R_FLOOR or (abrupt and r < R_ERROR):
            sev = "error"
        elif abrupt and r < R_WARN:
            sev = "warning"
        else:
            return None
        if math.isnan(rho) or rho < RETAIN:
            return sev, "missing"
        return ("error", "output") if lr_ < R_ERROR else ("warning", "swamped")

    def _stronger(self, where: str, severity: str) -> bool:
        """One rank finding per module, the stronger: False when `where` already has one at
        least as severe; else drop the weaker one and return True."""
        mine = [f for f in self.findings if f.where == where and f.message.startswith("rank collapse")]
        if any(severity_rank(f.severity) >= severity_rank(severity) for f in mine):
            return False
        self.findings = [f for f in self.findings if f not in mine]
        return True

    def _growth(self, step: int, stack: str, pts) -> None:
        if not pts or self.placement not in GROWTH_ENVELOPE:
            return
        base = pts[0][4]
        blocks = [(name, rms) for name, _, kind, _, rms, _ in pts if kind in ("sublayer", "layer")]
        if not blocks or not base > 0:
            return
        name, top = max(blocks, key=lambda b: b[1])
        if self.placement == "post" and blocks[0][1] > base:
            # a post-LN block's output has its norm's scale, whatever its input's: a stack input
            # below the first block's output (ELECTRA's embeddings_project, embedding_size <
            # hidden_size: RMS 0.11 at init into a first LayerNorm that gives 1.0) is no growth
            # along depth. Measured from the first block then; where the input is ~1 (every
            # run GROWTH_ENVELOPE was set on) the two bases are ~equal and so is G.
            base = blocks[0][1]
        g = top / base
        self.max_growth[stack] = max(self.max_growth.get(stack, 0.0), g)
        self.first_growth.setdefault(stack, g)
        limit = GROWTH_FACTOR * GROWTH_ENVELOPE[self.placement]
        if g > limit and not self.already(stack, "warning"):
            self.report(
                "warning", f"residual stream RMS grows {g:.1f}x across the {stack} "
                           f"(healthy {self.placement}-LN runs stay within "
                           f"{GROWTH_ENVELOPE[self.placement]:.0f}x)",
                where=stack, step=step,
                evidence={"growth": round(g, 3), "rms_top": round(top, 4), "rms_input": round(pts[0][4], 4),
                          "rms_base": round(base, 4),
                          "at": ds.module_path(name), "placement": self.placement,
                          "healthy_envelope": GROWTH_ENVELOPE[self.placement],
                          "threshold": limit,
                          # within the envelope at the first check: it grew during training
                          "growth_first_check": round(self.first_growth[stack], 3)},
                fix="Check the residual adds and the LayerNorm placement; with pre-LN keep a final "
                    "LayerNorm and warmup. " + FAULT_NOTES["no_warmup_high_lr"][2], code="stream-growth")

    def _detect_placement(self, trace: Trace, run: RunContext | None = None) -> None:
        try:
            label, ev = ds.detect_placement(trace, run)
        except Exception:  # noqa: BLE001 - the growth check is optional
            return
        if label in ("pre", "post"):
            self.placement, self.placement_evidence = label, ev


def _collapse_how(cause: str, when: str, rho: float, lr_: float) -> str:
    """The rank-collapse message's account of its cause (see VarianceDriftProbe._rank)."""
    out = ("nan" if math.isnan(lr_) else f"{lr_:.3g}")
    return {"missing": "; its output keeps nothing of its input (no residual add)",
            "swamped": "; the residual is there but the sublayer's output swamps it",
            "dynamic": when,
            "output": (f"; the residual is there but the sublayer's output swamps it, and the "
                       f"logits are collapsed too (r={out} < {R_ERROR})"),
            "statistic": (f"{when}, but the sublayer keeps its input's token differences "
                          f"(retention {rho:.2f} >= {RETAIN})"
                          + (f" and the logits still vary over the positions (r={out} >= {R_ERROR})"
                             if lr_ >= R_ERROR else
                             f"; the logits are nearly the same at every position (r={out} < "
                             f"{R_ERROR}): the model gives one answer whatever its input, as one "
                             f"that has learned only its targets' frequencies does"
                             if lr_ < R_ERROR else " (the logits were not captured)")
                          + ": a statistic of the weights, not a defect shown (a model still "
                            "learning, or trained on targets its input does not predict, passes "
                            "through this; judge it by its held-out loss)")}[cause]
