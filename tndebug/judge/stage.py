"""The judge stage: what happens to the probes' findings after they report, run once, in one
declared order (`PASSES`), by `conclude` -- the tail that every front-end calls.

    report = conclude(run, findings, statuses, Context(one_pass=True, probe_fresh=..., ...))

`findings` and `statuses` are the probes' own (ProbeResult, or the engine's at the end of a
run); everything else the front-end knows and the judge cannot (how to rebuild the model fresh,
the Hugging Face model and config, the user's module paths, its own checks' findings) comes in
the `Context`. A pass whose input the context lacks does nothing: `tndebug run` and `watch`
(many steps, no file, no fresh model) go through the same passes as `triage DIR`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from tndebug.findings import Finding
from tndebug.judge import fresh, nan, status
from tndebug.judge.arch import arch_hints
from tndebug.judge.collateral import explained_by_update_fault
from tndebug.hf.wording import hf_fix, hf_where, scale_fields, with_scale_field, with_switches
from tndebug.judge.scale import scale_at_init, unscaled_error
from tndebug.probes.base import COVERAGE
from tndebug.probes.missing_scale_sweep import sweep_findings
from tndebug.report import Report

AT_INIT = ("missing-scale", "label-shift", "variance-drift")   # re-judged on a fresh init


@dataclass
class Context:
    """What only the front-end knows. Every field is optional; an absent one skips its pass."""
    one_pass: bool = False
    """One probed forward and backward (triage, check): one finding per (probe, where, severity)
    and statuses for the front-end's own checks. A training run's (run, watch) keep every step's."""
    # -- the fresh initialisation (judge/fresh.py, judge/scale.py)
    probe_fresh: Callable[[Sequence[str]], Any] | None = None
    """names -> ProbeResult of those probes on the model built again by its own constructor,
    seeded (judge.fresh.seeded), no weights loaded; None: nothing to build."""
    fresh_how: str = ""                       # how the fresh model is built (said in evidence)
    package_code: str | Callable[[], str] = ""
    """The installed package whose unmodified code the model runs (hf.wording.package_code), or a
    function giving it, called only when a missing scale is re-judged; "": the user's code."""
    at_init: Sequence[str] = AT_INIT          # which probes' findings are re-judged at init
    probe_names: Sequence[str] = ()           # the probes run (the code tests re-run on NaN weights)
    weights_finite: bool | None = None        # the file's weights (None: no file)
    # -- the front-end's own checks
    first: list[Finding] = field(default_factory=list)     # the file's, listed before the probes'
    checks: list[Finding] = field(default_factory=list)    # after them (heads, sweep, kv order)
    notes: list[Finding] = field(default_factory=list)     # joined after dedupe (adapter notes)
    # -- wording
    hf_model: Any = None                      # a transformers model: findings in its terms
    hf_switches: dict = field(default_factory=dict)        # hf.wording.scale_switches(config)
    rename: Callable[[str], str] | None = None             # tndebug's module path -> the user's
    # -- statuses
    not_run: list[tuple[str, str, str]] = field(default_factory=list)   # (name, part, why)
    sweep: dict | None = None                 # the temperature sweep's evidence (its findings)
    failed: dict[str, str] = field(default_factory=dict)    # probe -> why it was switched off
    skipped: dict[str, str] = field(default_factory=dict)   # probe -> why it never ran
    order: Sequence[str] | None = None        # the statuses' order (the console's)
    # -- the report
    started: float | None = None              # time.perf_counter() at the front-end's start:
    """run["wall_s"] then counts the judge too, and run["timings_s"]["judge"] is its share."""
    history: dict | None = None
    select: Sequence[str] | None = None
    ignore: Sequence[str] | None = None


@dataclass
class Judged:
    """The stage's state between passes."""
    findings: list[Finding]
    statuses: dict[str, dict]
    run: dict


# -- the passes, in their order ----------------------------------------------------------------------
def nan_weights(j: Judged, ctx: Context) -> None:
    """Weights non-finite in the file: what the probes measured through them is withdrawn."""
    if ctx.weights_finite is False:
        j.findings, j.statuses = nan.not_judged_on_nan(j.findings, j.statuses)


def code_on_fresh(j: Judged, ctx: Context) -> None:
    """Weights non-finite in the file: the exact tests of the code run on a fresh init."""
    if ctx.weights_finite is False and ctx.probe_fresh is not None:
        j.findings, j.statuses = fresh.code_on_fresh(j.findings, j.statuses, ctx.probe_fresh,
                                                     ctx.probe_names, ctx.fresh_how)


def scale(j: Judged, ctx: Context) -> None:
    """A missing 1/sqrt(d_k) folded into the init, or the package's own design: info."""
    if ctx.probe_fresh is None or "missing-scale" not in ctx.at_init:
        return
    library = ctx.package_code
    if callable(library):
        library = library() if any(map(unscaled_error, j.findings)) else ""
    j.findings, j.statuses = scale_at_init(j.findings, j.statuses, ctx.probe_fresh,
                                           ctx.fresh_how, library)


def label_shift(j: Judged, ctx: Context) -> None:
    """Input repeated by trained weights and by a fresh init alike: no verdict on the labels."""
    if ctx.probe_fresh is not None and "label-shift" in ctx.at_init:
        j.findings, j.statuses = fresh.shift_at_init(j.findings, j.statuses, ctx.probe_fresh,
                                                     ctx.fresh_how)


def growth(j: Judged, ctx: Context) -> None:
    """Stream growth of trained weights that a fresh init does not show: info."""
    if ctx.probe_fresh is not None and "variance-drift" in ctx.at_init:
        j.findings, j.statuses = fresh.growth_at_init(j.findings, j.statuses, ctx.probe_fresh,
                                                      ctx.fresh_how)


def rank(j: Judged, ctx: Context) -> None:
    """Rank collapse of trained weights that a fresh init shows too: the code's."""
    if ctx.probe_fresh is not None and "variance-drift" in ctx.at_init:
        j.findings, j.statuses = fresh.rank_at_init(j.findings, j.statuses, ctx.probe_fresh,
                                                    ctx.fresh_how)


def gather(j: Judged, ctx: Context) -> None:
    """The front-end's own checks join the probes' findings: the file's first, the rest after,
    then the temperature sweep's, missing-scale's (probes/missing_scale_sweep.py)."""
    j.findings = [*ctx.first, *j.findings, *ctx.checks, *sweep_findings(ctx.sweep)]


def wording(j: Judged, ctx: Context) -> None:
    """Findings in the user's terms: a fix's hint, Hugging Face fixes and module paths, the
    user's module names (findings and coverage)."""
    hints = arch_hints(j.run)           # judge/arch.py: a decoder read by a guess
    if hints:
        j.findings = [replace(f, fix=f.fix.rstrip(". ") + "." + hints[f.code])
                      if f.code in hints else f for f in j.findings]
    if ctx.hf_model is not None:
        fields = scale_fields(getattr(ctx.hf_model, "config", None))
        j.findings = [hf_where(with_switches(hf_fix(f), ctx.hf_switches)
                               if ctx.hf_switches else with_scale_field(hf_fix(f), fields),
                               ctx.hf_model)
                      for f in j.findings]
    if ctx.rename is not None:
        j.findings = [renamed(f, ctx.rename) for f in j.findings]
        for st in j.statuses.values():
            if st.get("coverage"):
                st["coverage"] = renamed_coverage(st["coverage"], ctx.rename)


def dedupe(j: Judged, ctx: Context) -> None:
    """One pass: one finding per (probe, where, severity); the front-end's notes after."""
    if ctx.one_pass:
        j.findings = status.dedupe(j.findings)
    j.findings += ctx.notes


def statuses(j: Judged, ctx: Context) -> None:
    """The checks that are no probes get their status, and the parts that applied and did not
    run, the probes switched off or never run, theirs; in the front-end's order."""
    st = j.statuses
    if ctx.one_pass:
        st.update(status.checks_statuses(j.findings, st))
    if ctx.sweep is not None:
        status.sweep_not_run(st, ctx.sweep)
    for name, part, why in ctx.not_run:
        status.part_not_run(st, name, part, why)
    for name, why in ctx.failed.items():     # switched off by the front-end after it raised
        if st.get(name, {}).get("status") == "internal error":
            continue          # tndebug's own bug, as every front-end says it (Probe.status)
        st[name] = {**st.get(name, {}), "status": "no verdict", "reason": f"failed: {why}"}
    st.update({name: {"status": "skipped", "reason": why} for name, why in ctx.skipped.items()})
    if ctx.order is not None:
        order = {n: i for i, n in enumerate(ctx.order)}
        j.statuses = {k: st[k] for k in sorted(st, key=lambda k: (order.get(k, len(order)), k))}


def nan_story(j: Judged, ctx: Context) -> None:
    """One story per NaN: a gradient or loss non-finite after a non-finite forward is info."""
    j.findings, j.statuses = nan.after_nan_forward(j.findings, j.statuses)


def update_story(j: Judged, ctx: Context) -> None:
    """One story per broken update: the dynamic symptoms of a found update fault are info."""
    j.findings, touched = explained_by_update_fault(j.findings)
    for name in touched:
        status.restatus(j.statuses, j.findings, name)


def selected(j: Judged, ctx: Context) -> None:
    """--select / --ignore."""
    j.findings, j.statuses, j.run = status.select(j.findings, j.statuses, j.run, ctx.select,
                                                  ctx.ignore)


PASSES: tuple[tuple[str, Callable[[Judged, Context], None]], ...] = (
    ("nan-weights", nan_weights),       # the probes' findings alone, first: the file's NaN
    ("code-on-fresh", code_on_fresh),
    ("scale-at-init", scale),
    ("shift-at-init", label_shift),
    ("growth-at-init", growth),
    ("rank-at-init", rank),
    ("gather", gather),                 # then every finding
    ("wording", wording),
    ("dedupe", dedupe),
    ("statuses", statuses),
    ("nan-story", nan_story),
    ("update-story", update_story),
    ("select", selected),
)


def conclude(run: dict, findings: list[Finding], statuses: dict[str, dict],
             context: Context | None = None) -> Report:
    """The Report of a front-end: the probes' `findings` and `statuses` through every pass of
    PASSES, then the first sign (judge.status.first_sign: the earliest warning or error)."""
    ctx = context or Context()
    j = Judged(list(findings), statuses, run)
    for _, judge in PASSES:
        judge(j, ctx)
    if ctx.started is not None:
        now = time.perf_counter() - ctx.started
        if isinstance(j.run.get("timings_s"), dict):
            laps = j.run["timings_s"]
            laps["judge"] = round(now - sum(laps.values()), 3)
        j.run["wall_s"] = round(now, 3)
    return Report(run=j.run, findings=j.findings, probes=j.statuses,
                  first_sign=status.first_sign(j.findings), history=ctx.history or {})


def select_codes(report: Report, select=None, ignore=None) -> Report:
    """A concluded report with only the `select`ed finding kinds and without the `ignore`d ones
    (the select pass again, for a front-end that learns them after concluding: the CLI)."""
    if not select and not ignore:
        return report
    kept, probes, run = status.select(report.findings, report.probes, report.run, select, ignore)
    sign = report.first_sign if report.first_sign in kept else status.first_sign(kept)
    return Report(run=run, findings=kept, probes=probes, first_sign=sign, history=report.history)


# -- the user's module names ---------------------------------------------------------------------------
def renamed(f: Finding, rename: Callable[[str], str]) -> Finding:
    if not f.where:
        return f
    new = rename(f.where)
    if new == f.where:
        return f
    return replace(f, where=new, evidence={**f.evidence, "tndebug_where": f.where})


def renamed_coverage(coverage: dict[str, dict], rename: Callable[[str], str]) -> dict[str, dict]:
    """Coverage in the user's module names, like the findings (the stronger entry where two
    names meet)."""
    merged: dict[str, dict] = {}
    for where, c in coverage.items():
        new = rename(where) if where else where
        old = merged.get(new)
        if old is None or COVERAGE.index(c["status"]) > COVERAGE.index(old["status"]):
            merged[new] = c
    return merged
