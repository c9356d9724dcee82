"""gradient-flow: do gradients reach every layer, finitely and without spikes; do the ReLUs fire?

Decided from parameter gradients after backward (grouped by layer from parameter names, e.g.
`encoder.layers.3`) and from the FFN hidden activations (`Trace.ffn_hidden`):

* non-finite gradient in any group -> error (the first group in parameter order);
* the total norm above SPIKE x the median of its last WINDOW probed norms and above every
  earlier total -> warning (the first such step), naming the layer whose norm rose most.
  Single layers are not judged alone: in healthy runs they reach 15x their median (Post-LN,
  small, mid-training; embeddings 13.6x, since their norms follow the batch's tokens) while
  the total stays within 6.3x. Near convergence a hard batch gives the total 6x its median
  (no dropout) yet stays below the early-training peak; an explosion does not;
* the total norm above EXPLODE x its first probed value at EXPLODE_RUN probed steps in a row
  -> error (gradients exploded), naming the first of those steps, the layer group whose norm
  grew most against its own first value, and the lr there;
* a group whose gradient is zero or absent at every probed step -> warning;
* dead ReLUs: the share of hidden units never active over >= MIN_TOKENS tokens in a layer
  above DEAD_SHARE at setup (random batches, eval mode; the setup stops once every layer is
  under the share, since more tokens only lower it), or above DEAD_SHARE_TRAINING in any
  MIN_TOKENS-token window of training -> warning.

Sharded parameters (FSDP2): each gradient's norm from the ranks' local shards, squared and
summed over the ranks (`tndebug.sharded.norms`, one all-reduce a probed step): no gather.
"""
from __future__ import annotations

import math

import torch

from tndebug.faults import FAULT_NOTES
from tndebug.probes._misc_stats import (RunningMedian, first_reason, group_parameters,
                                        layer_group, metric_tag)
from tndebug import tags
from tndebug.probes import _norm_gain
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.schedule import every
from tndebug.sharded import norms
from tndebug.capture.trace import Trace

# Set on harness tiny/small runs (FAILURE_MODES 7f-7g; 0ba0d77, 2ce87c7); held out by seed only.
MIN_TOKENS = 4096     # FAILURE_MODES 7f
SETUP_ROWS = 16       # rows per forward of the dead-unit test at setup (memory, not the statistic)
# Healthy tiny/small, pre/post, dropout 0/0.1/0.3: at most 31% of a layer's units never fire at
# init on 4096 random tokens (FFN bias -3: 98-100%), so 0.5 (FAILURE_MODES 7f) there.  During
# training on the copy task's narrow inputs the top decoder FFN of an unfaulted small Post-LN
# model (whose loss stalls near the unigram level at the harness lr) passes through 68% for
# ~150 steps and recovers, so training windows warn above 0.9.
DEAD_SHARE, DEAD_SHARE_TRAINING = 0.5, 0.9
SPIKE = 10.0          # FAILURE_MODES 7g; the healthy total reaches 6.3x its running median
WINDOW, MIN_HISTORY = 20, 5
# Gradients at init are the largest a healthy run sees: tiny Pre-/Post-LN copy runs (120-400
# steps, default Noam lr) stay at or below 1x their step-0 total (at most 0.27x after step 0),
# while `--norm post --lr-factor 2000 --warmup 1` reaches 523x at step 10 and 752x at step 20.
# Two orders of magnitude is an explosion whatever the model; a loss scale left on for one step
# (1000x once) is a spike, hence two probed steps in a row.
EXPLODE, EXPLODE_RUN = 100.0, 2
_NOTE = FAULT_NOTES["dead_relu_init"][2]
# A unit fires when its activation is positive, or clearly negative: GELU and SiLU pass negative
# values (GELU's minimum -0.17 at x = -0.75, SiLU's -0.28 at -1.28) with a gradient that still
# flows, so a GELU unit whose input stays in [-3, 0] is alive, not dead (a trained RoFormer, GELU:
# 53% of the units never positive, all of them down to -0.17..-0.006: bench/hf_unseen.py DEV).
# Under -1e-3 in output their input is above ~-3.4 (GELU) / ~-9 (SiLU), where the derivative is
# still >= ~1e-3; a ReLU never goes negative, so its test is h > 0 as before.
NEG_FIRES = 1e-3


def _fires(h: torch.Tensor) -> torch.Tensor:
    return (h > 0) | (h < -NEG_FIRES)


def _settled(ever: dict[str, torch.Tensor]) -> bool:
    """The setup's dead-unit verdict is final once every layer has at most DEAD_SHARE of its
    units never fired: a unit that fired stays fired, so more tokens can only lower the share.
    A healthy GPT-2-small-size model settles on the first slice (512 tokens; 1 forward of 8).
    Only a layer over the share is judged on all the tokens (its warning counts them)."""
    return bool(ever) and all(1.0 - float(a.float().mean()) <= DEAD_SHARE for a in ever.values())


class GradientFlowProbe(Probe):
    """Failure: a bad FFN initialisation (a large negative bias) leaves most ReLU units never active,
    so their weights get no gradient; gradients explode (no warmup, a too-high lr, no clipping) or
    never reach a layer (a detached or unused block).
    Symptom: the loss falls slowly or not at all; NaN/inf loss after a spike; part of the model does
    not change.
    Fix: Xavier-initialise the FFN's first Linear with its default bias (no negative constant), keep
    residual + LayerNorm around every sublayer, and use warmup (and clipping) for a high lr.
    """

    name = "gradient-flow"
    cause = (
        "Residual connections let gradients go straight back to earlier layers, and without "
        "residual+LayerNorm a deep Transformer cannot be trained [note 002]. A wrong LN "
        "order or a bad init (use Xavier) destabilises gradients [notes 000, 001, 002]."
    )
    summary = "per-layer gradient norms (non-finite, spikes, no gradient) and dead ReLU units"
    codes = {
        "dead-units": "FFN units that never fire on the probe batch (dead ReLUs)",
        "nonfinite-grad": "a non-finite gradient in a layer group",
        "grad-spike": "the total gradient norm spikes against its running median",
        "grads-exploded": "the total gradient norm stays far above its first value",
        "no-gradient": "a layer group that receives no gradient",
    }
    reads = ("ffn.hidden",)
    fix = ("Keep residual + LayerNorm around every sublayer and Xavier init (notes 002, 000); "
           "use warmup and gradient clipping when the lr is high [notes 000, 002]")
    default_schedule = staticmethod(lambda: every(10))
    needs_steps = True           # the gradient checks need backward passes

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._groups: dict[str, list] = {}
        self._indexed: set[str] = set()          # groups inside an indexed layer list
        self._median: dict[str, RunningMedian] = {}
        self._peak: dict[str, float] = {}         # largest norm seen so far, per group
        self._zero_steps: dict[str, int] = {}
        self._grad_steps = 0
        self._nonfinite = False
        self._spiked = False
        self._first: tuple[int, float, dict[str, float]] | None = None   # step, total, per group
        self._over: list[tuple] = []             # (step, total, lr, norms) above EXPLODE x first
        self._exploded = False
        self._window: dict[str, list] = {}      # site -> [ever-active mask (host), tokens]
        self._index: dict[tuple, torch.Tensor] = {}   # which group each present gradient is in

    # -- setup: dead units at init --------------------------------------------------------------
    def setup(self, run: RunContext) -> None:
        subject = run.subject
        self._groups = group_parameters(subject.model)
        self._indexed = {g for g in self._groups if layer_group(g + ".")[2] is not None}
        for group in self._groups:          # upgraded to checked when a gradient is examined
            self.cover(group, "no verdict", "no gradient was observed")
        if not self._groups:
            self.cover("", "no verdict", "the model has no trainable parameters")
        ever: dict[str, torch.Tensor] = {}
        varies: dict[str, bool] = {}      # the hidden activations differ between tokens
        tokens = 0
        def slices():
            """Two seeded random batches in slices of rows: the same tokens (eval mode: each
            row's activations are its own), but one slice's hidden activations held at a time
            (64x32 tokens of 12 layers x 3072 units are 300 MB)."""
            for i in range(2):
                g = torch.Generator().manual_seed(100 + i)
                src, tgt = subject.random_batch(batch=64, src_len=32, tgt_len=32,
                                                pad_share=0.0, generator=g)
                for rows in range(0, src.shape[0], SETUP_ROWS):
                    yield src[rows:rows + SETUP_ROWS], tgt[rows:rows + SETUP_ROWS]

        try:
            with subject.evaluating():
                for src, tgt in slices():
                    trace = subject.trace(src, tgt, reads=("ffn.hidden",))
                    tokens += (src if src.numel() else tgt).numel()   # decoder-only: no src
                    for site, h in trace.ffn_hidden.items():
                        act = _fires(h).reshape(-1, h.shape[-1]).any(0)            # [d_ff]
                        ever[site] = act if site not in ever else ever[site] | act
                        flat = h.reshape(-1, h.shape[-1])
                        varies[site] = varies.get(site, False) or bool(
                            (flat.amax(0) - flat.amin(0)).max() > 0)
                    del trace
                    if _settled(ever):
                        break
        except Exception as e:  # noqa: BLE001
            self.skip(f"dead-unit test at init could not run: {first_reason(e)}", where="")
            return
        if not ever:                # e.g. an FFN the capture does not recognise: say so
            self.skip("no FFN found (no hidden activations in the trace); dead-unit test not run",
                      where="")
            return
        collapsed = None
        for site, act in ever.items():
            if not varies.get(site, True) and 1.0 - act.float().mean().item() > DEAD_SHARE:
                # the same hidden activations for every token: dead ReLUs (inputs that vary, all
                # below 0) or an input that carries no token, as after a norm whose gain is 0
                # (ln-placement names it). Only the second leaves the units' fate unshown.
                if collapsed is None:
                    collapsed = [c.module for c in _norm_gain.collapsed(subject)]
                if collapsed:
                    self.cover(site, "no verdict", f"the FFN's hidden activations are the same "
                               f"for every token and {collapsed[0]} gives every token one "
                               f"output (ln-placement/norm-collapsed): dead units not judged")
                    continue
            self._judge_dead(site, act.cpu(), tokens, 0, "on random inputs", DEAD_SHARE)

    def _judge_dead(self, site: str, ever_active: torch.Tensor, tokens: int, step: int,
                    when: str, threshold: float) -> None:
        dead = 1.0 - ever_active.float().mean().item()
        self.cover(site, "checked")
        self.metric(step, metric_tag(site, "relu", "dead_fraction"), dead)
        if dead > threshold and not self.already(site):
            self.report("warning", f"{dead:.0%} of the FFN units in {site} never fire on "
                        f"{tokens} tokens {when}", where=site, step=step, fix=_NOTE,
                        evidence={"dead_fraction": dead, "threshold": threshold,
                                  "units": int(ever_active.numel()), "tokens": tokens}, code="dead-units")

    # -- per step --------------------------------------------------------------------------------
    def observe(self, trace: Trace, info: StepInfo) -> dict[str, torch.Tensor]:
        stats: dict = {}
        if info.grads_ready and self._groups:
            stats["grad_norm"], stats["grad_present"] = self._group_norms(info.grad_norms)
        for site, h in trace.ffn_hidden.items():
            stats[f"active/{site}"] = _fires(h).reshape(-1, h.shape[-1]).any(0)  # [d_ff]
            stats[f"tokens/{site}"] = h.numel() // h.shape[-1]
        return stats

    def _group_norms(self, freed: dict[int, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, list[bool]]:
        """L2 norm of each layer group's gradients [G], on the device: one fused norm over every
        gradient, then a segment sum of squares (a loop of per-tensor ops cost 2 ms a step on
        `tiny`, most of this probe's overhead). `freed` holds each parameter's norm where the
        step freed the gradients as backward made them (StepInfo.grad_norms)."""
        grads, owner, present = [], [], []
        for i, params in enumerate(self._groups.values()):
            if freed is None:
                mine = [p.grad for _, p in params if p.grad is not None]
            else:
                mine = [freed[id(p)] for _, p in params if id(p) in freed]
            grads += mine
            owner += [i] * len(mine)
            present.append(bool(mine))
        device = next(iter(self._groups.values()))[0][1].device
        out = torch.zeros(len(self._groups), device=device)
        if grads:
            key = (tuple(owner), str(device))
            index = self._index.get(key)
            if index is None:          # the set of present gradients rarely changes: cache it
                index = self._index[key] = torch.tensor(owner, device=device)
            if freed is None:
                sq = torch.stack(norms(grads)).pow(2)    # FSDP2: over every rank's shard
            else:
                sq = torch.stack([g.to(device) for g in grads]).pow(2)
            out.index_add_(0, index, sq)
        return out.sqrt(), present

    def update(self, stats, info: StepInfo) -> None:
        if "grad_norm" in stats:
            self._grads(stats["grad_norm"].tolist(), stats["grad_present"], info.step, info.lr)
        for key, act in stats.items():
            if not key.startswith("active/"):
                continue
            site = key.removeprefix("active/")
            mask, tokens = self._window.get(site, (torch.zeros_like(act, dtype=torch.bool), 0))
            mask, tokens = mask | act.bool(), tokens + stats[f"tokens/{site}"]
            if tokens >= MIN_TOKENS:
                self._judge_dead(site, mask, tokens, info.step,
                                 f"of training up to step {info.step}", DEAD_SHARE_TRAINING)
                mask, tokens = torch.zeros_like(mask), 0
            self._window[site] = (mask, tokens)

    def _grads(self, norms: list[float], present: list[bool], step: int, lr=None) -> None:
        names = list(self._groups)
        self._grad_steps += 1
        for group, has in zip(names, present):
            if has:
                self.cover(group, "checked")
        finite = [math.isfinite(n) for n in norms]
        if not all(finite):
            if not self._nonfinite:
                bad = [g for g, ok in zip(names, finite) if not ok]
                self._nonfinite = True
                self.report("error", f"non-finite gradient in {bad[0]} at step {step} "
                            f"({len(bad)} of {len(names)} layer groups)", where=bad[0], step=step,
                            evidence={"groups": bad, "norm": norms[names.index(bad[0])],
                                      "threshold": "finite"}, code="nonfinite-grad")
            return
        total = math.sqrt(sum(n * n for n in norms))
        self.metric(step, tags.GRAD_OUTSIDE.build(module="total"), total)
        ratios: dict[str, float] = {}                   # layer -> norm / its running median
        for group, norm, has in zip(names, norms, present):
            self.metric(step, metric_tag(group), norm)
            if not has or norm == 0.0:
                self._zero_steps[group] = self._zero_steps.get(group, 0) + 1
            if group in self._indexed:
                ratio, _, _ = self._against_history(group, norm)
                if ratio is not None:
                    ratios[group] = ratio
        self._explosion(step, total, dict(zip(names, norms)), lr)
        ratio, med, peak = self._against_history("total", total)
        if ratio is not None and ratio > SPIKE and total > peak and not self._spiked:
            self._spiked = True               # the first spike is the finding; later ones metrics
            where = max(ratios, key=ratios.get) if ratios else "total"
            self.report("warning", f"gradient spike at step {step}: total norm {total:.3g} is "
                        f"{ratio:.0f}x its running median and above its earlier peak; "
                        f"largest rise in {where} (x{ratios.get(where, ratio):.0f})",
                        where=where, step=step,
                        evidence={"norm": total, "running_median": med, "ratio": ratio,
                                  "threshold_ratio": SPIKE, "window": WINDOW,
                                  "earlier_peak": peak,
                                  "layer_ratios": {g: r for g, r in ratios.items() if r > SPIKE}}, code="grad-spike")

    def _explosion(self, step: int, total: float, norms: dict[str, float], lr) -> None:
        """Error when the total norm stays above EXPLODE x its first probed value."""
        if self._first is None:
            self._first = (step, total, norms)
            return
        step0, total0, norms0 = self._first
        if self._exploded or total0 <= 0:
            return
        if total <= EXPLODE * total0:
            self._over = []
            return
        self._over.append((step, total, lr, norms))
        if len(self._over) < EXPLODE_RUN:
            return
        self._exploded = self._spiked = True      # the spike warning would say less, later
        begin, total_b, lr_b, norms_b = self._over[0]
        growth = {g: n / norms0[g] for g, n in norms_b.items() if norms0.get(g, 0) > 0}
        where = max(growth, key=growth.get) if growth else ""
        at = ", ".join(f"{t:.3g} at step {s} ({t / total0:.0f}x)" for s, t, _, _ in self._over)
        lr_text = f"; the lr is {lr_b:.3g} at step {begin}" if lr_b is not None else ""
        self.report("error", f"gradients exploded from step {begin}: total norm {at}, against "
                    f"{total0:.3g} at step {step0}; largest growth in {where} "
                    f"(x{growth.get(where, 0):.3g}){lr_text}: likely a too-high lr or too short "
                    f"a warmup (Post-LN needs warmup most), with no gradient clipping",
                    where=where, step=begin,
                    evidence={"norm": total_b, "first_norm": total0, "first_step": step0,
                              "ratio": total_b / total0, "threshold_ratio": EXPLODE,
                              "threshold_steps_in_a_row": EXPLODE_RUN, "lr": lr_b,
                              "steps": [s for s, *_ in self._over],
                              "layer_growth": {g: r for g, r in sorted(
                                  growth.items(), key=lambda kv: -kv[1])[:4]}}, code="grads-exploded")

    def _against_history(self, group: str, norm: float):
        """(norm / running median or None, median, earlier peak); then records `norm`."""
        hist = self._median.setdefault(group, RunningMedian(WINDOW))
        peak = self._peak.get(group, 0.0)
        med = hist.median() if len(hist) >= MIN_HISTORY else None
        hist.push(norm)
        self._peak[group] = max(peak, norm)
        if not med:
            return None, med, peak
        return norm / med, med, peak

    def finish(self, run: RunContext) -> None:
        if self._grad_steps < 3 or self._nonfinite:
            return
        for group, zeros in self._zero_steps.items():
            if zeros == self._grad_steps and not self.already(group):
                self.cover(group, "checked")      # judged: no gradient at any probed step
                self.report("warning", f"no gradient reaches {group} at any of "
                            f"{self._grad_steps} probed steps", where=group,
                            evidence={"probed_steps": self._grad_steps, "zero_steps": zeros,
                                      "threshold": "zero at every probed step"}, code="no-gradient")
