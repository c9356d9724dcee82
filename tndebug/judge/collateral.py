"""One story per broken update: symptoms of training dynamics that follow a found fault in the
optimizer's updates are that fault's consequences, not defects of their own.

A re-judgement after the probes (the judge's update-story pass, after the nan-story pass:
judge/stage.py). Two findings say the updates themselves are wrong:

* zero-grad/grads-accumulate: every update follows the running sum of all earlier gradients,
  not the current one (an exact test on the `.grad` tensors);
* lr-schedule/lr-too-high: one update moves the weights by a large share of their norm (the
  update-to-weight ratio, measured on the weights).

Training under such updates produces, by its dynamics, what other probes see as symptoms: a loss
that never leaves the uniform level or explodes (loss-health), tokens whose differences collapse
during training, or a residual stream that grows past its envelope during training
(variance-drift). Measured on the char-level nanoGPT-style loop of bench/first_contact.py (seed
3, 600 steps): zero_grad forgotten gave loss-health/stuck-uniform (CE 4.59 > 0.95 ln V, the
loop's loss 5.2 at the end) beside zero-grad's error from step 1; an lr 100x too high (ratio 2.9
at step 0) gave a rank collapse "during training" at step 8 (r 0.017, cause dynamic) and a
stream growth of 72x at step 2. Each symptom is real, and each has the cause's fix: separate
errors would send the user after three defects where there is one.

The rule reads the findings' evidence, not the model: a symptom is the cause's consequence only
when (a) it is dynamic - the collapse's evidence says it appeared after the first check (cause
"dynamic"), the growth was within its bar at the first check, the loss levels are judged over
training by construction - and (b) it was seen at or after the step from which the cause was in
effect (zero-grad: its first carried step, and the carry held on at least half of the steps it
checked, so the updates were mostly wrong; lr-too-high: the first sampled step above its bar).
A structural symptom (a collapse at initialisation: a missing residual) is never explained by an
update and keeps its severity.

Then the symptom becomes info that says "likely a consequence of" the cause, with the cause's fix
and `evidence.follows`; the cause keeps the highest severity among itself and what it explains
(a verdict does not change: an lr warning that explains an error becomes that error) and lists
them (`evidence.explains`). Returns the findings and the names of the probes whose status must
be recomputed.
"""
from __future__ import annotations

from dataclasses import replace

from tndebug.findings import Finding, severity_rank

ZERO_GRAD = "zero-grad/grads-accumulate"
LR_TOO_HIGH = "lr-schedule/lr-too-high"
# the carry held on at least this share of the checked steps: most updates followed stale sums
# (a single carried step, e.g. a resume's, leaves the loss's course to the healthy steps)
CARRIED_SHARE = 0.5
LOSS_SYMPTOMS = ("loss-health/stuck-uniform", "loss-health/loss-exploded", "loss-health/loss-spike")
RANK = "variance-drift/rank-collapse"
GROWTH = "variance-drift/stream-growth"


def _cause_from(f: Finding) -> int | None:
    """The step from which cause `f` was in effect, or None when it does not explain dynamics."""
    if f.severity not in ("warning", "error"):
        return None
    ev = f.evidence or {}
    if f.code == ZERO_GRAD:
        checked, carried = ev.get("checked_steps"), ev.get("carried_steps")
        if not checked or carried is None or carried < CARRIED_SHARE * checked:
            return None
        return f.step or 0
    if f.code == LR_TOO_HIGH:
        first = ev.get("first_step", ev.get("step", f.step))
        return int(first) if first is not None else None
    return None


def _dynamic(f: Finding) -> bool:
    """`f` is a symptom that training dynamics produce, seen during training (not at init)."""
    if f.severity not in ("warning", "error"):
        return False
    ev = f.evidence or {}
    if f.code in LOSS_SYMPTOMS:
        return True
    if f.code == RANK:
        return ev.get("cause") == "dynamic"
    if f.code == GROWTH:
        first, bar = ev.get("growth_first_check"), ev.get("threshold")
        return first is not None and bar is not None and first <= bar
    return False


def _what(f: Finding) -> str:
    """The cause in a few words, from its evidence."""
    ev = f.evidence or {}
    if f.code == ZERO_GRAD:
        return (f"gradients carried across optimizer steps ({ev.get('carried_steps')} of "
                f"{ev.get('checked_steps')} checked steps)")
    return f"an lr whose optimizer step moves the weights by {ev.get('update_ratio')}x their norm"


def explained_by_update_fault(findings: list[Finding]) -> tuple[list[Finding], set[str]]:
    """Findings with the dynamic symptoms of a found update fault re-judged as its consequences
    (module docstring); and the probes whose findings changed."""
    causes = [(f, s) for f in findings if (s := _cause_from(f)) is not None]
    if not causes:
        return findings, set()
    # the earliest cause in effect explains a symptom; on a tie the more severe
    causes.sort(key=lambda c: (c[1], -severity_rank(c[0].severity)))
    since = {id(c): s for c, s in causes}
    explained: dict[int, list[Finding]] = {}
    out: list[Finding] = []
    for f in findings:
        cause = next((c for c, s in causes if c.probe != f.probe and _dynamic(f)
                      and (f.step if f.step is not None else 0) >= s), None)
        if cause is None:
            out.append(f)
            continue
        explained.setdefault(id(cause), []).append(f)
        out.append(replace(
            f, severity="info",
            message=f"{f.message}: likely a consequence of {_what(cause)} ({cause.code}, "
                    f"from step {since[id(cause)]})",
            evidence={**f.evidence, "follows": cause.code, "severity_before": f.severity},
            fix=cause.fix))
    touched = {f.probe for fs in explained.values() for f in fs}
    final = []
    for f in out:
        fs = explained.get(id(f))
        if fs:
            worst = max([f.severity] + [g.severity for g in fs], key=severity_rank)
            seen = "; ".join(f"{g.code} ({g.severity}) at step {g.step or 0}" for g in fs)
            f = replace(f, severity=worst,
                        message=f"{f.message.rstrip('.')}. What it brought about: {seen}.",
                        evidence={**f.evidence, "explains": [g.code for g in fs],
                                  "severity_before": f.severity})
            touched.add(f.probe)
        final.append(f)
    return final, touched
