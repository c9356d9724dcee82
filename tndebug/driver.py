"""The probe driver: the one place that drives the probe engine over a model and turns what the
probes concluded into a `Report`.

    result = probe_once(subject, names, batch, compute_dtype=dtype)   # triage, HF triage, check
    report = make_report(run, findings, statuses, history=...)        # every front-end

`tndebug run` and `tndebug.watch` step the engine themselves (their steps are the user's or the
trainer's), then build their report here; triage and `check` probe one forward and backward
through `probe_once`. The rules that every front-end shares live here once: which finding is the
first sign, one finding per (probe, place, severity), the statuses of triage's own checks, and
(in `Report.verdict`) what the verdict is.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from tndebug.findings import Finding, select as choose, severity_rank
from tndebug.judge_collateral import explained_by_update_fault
from tndebug.memory import give_back_freed  # noqa: F401 - triage calls it as driver.give_back_freed
from tndebug.probes import make_probes
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.report import Report
from tndebug.subject import Subject

PROBE_BATCH = 8          # sequences of the held-out batch the probes' forward and backward see


@dataclass
class ProbeResult:
    """What one probed forward and backward gave: the probes' findings, their statuses
    (`Report.probes`), the seconds inside each probe, and the sinks' view of the step."""
    findings: list[Finding]
    statuses: dict[str, dict]
    seconds: dict[str, float]
    batch: tuple = ()                            # (src, tgt_in, tgt_out) the probes saw
    extras: dict[str, Any] = field(default_factory=dict)


def probe_once(subject: Subject, names: Iterable[str], batch, *,
               compute_dtype: torch.dtype = torch.float32, sinks: Iterable[Any] = (),
               token_names: dict[int, str] | None = None) -> ProbeResult:
    """Run the probes `names` on `subject` in triage mode: every probe's setup (the exact tests),
    one recorded forward and backward of the first `PROBE_BATCH` sequences of `batch`
    (src, tgt_in, tgt_out), no optimizer step, then every probe's finish.

    `sinks` (objects with `on_trace(step, trace)` / `on_metric(step, tag, value)`) see the step as
    the last one of a run: the figures' reads are recorded too. The model's mode is restored and
    its gradients cleared. `token_names` ({id: token}, from a saved tokenizer) go to the sinks
    that label tokens (`on_tokens`: the Recorder, for the figures' axes); this recorded batch
    is the only one the sinks see, so every figure of the pass shows it."""
    probes = make_probes(list(names))
    pad_id = subject.pad_id
    sinks = list(sinks)
    for sink in sinks:
        if token_names and hasattr(sink, "on_tokens"):
            sink.on_tokens(dict(token_names))
    run = RunContext(subject=subject, optimizer=None, mode="triage", compute_dtype=compute_dtype,
                     criterion=lambda lg, t: F.cross_entropy(lg.float(), t, ignore_index=pad_id),
                     device=str(subject.device), total_steps=1 if sinks else None)
    src, tgt_in, tgt_out = (t[:PROBE_BATCH].to(subject.device) for t in batch)
    model = subject.model
    was = model.training
    model.eval()
    give_back_freed()                # what loading and the caller's own passes freed
    try:
        with ProbeEngine(probes, run, sinks=sinks) as engine:
            engine.setup()
            give_back_freed()        # the setups' freed traces, before the pass's gradients
            engine.begin_step(0, src, tgt_in)
            logits = subject.logits(src, tgt_in)
            loss = run.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            model.zero_grad(set_to_none=True)
            norms: dict[int, torch.Tensor] = {}
            if loss.requires_grad:
                with norms_as_freed(model, norms):
                    loss.backward()
            engine.end_step(StepInfo(0, loss=loss.detach(), logits=logits.detach(), src=src,
                                     tgt_in=tgt_in, tgt_out=tgt_out, grad_norms=norms))
            findings = engine.finish()
            statuses = engine.statuses()
            seconds = {k: round(v, 3) for k, v in engine.seconds_by_probe.items()}
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    return ProbeResult(findings, statuses, seconds, (src, tgt_in, tgt_out))


@contextmanager
def norms_as_freed(model: torch.nn.Module, norms: dict[int, torch.Tensor]):
    """During a backward: keep each parameter's gradient norm in `norms` ({id(p): fp32 device
    scalar}) and free the gradient as soon as it is whole. The probes read only norms from a
    triage pass (StepInfo.grad_norms), and a weight-sized `.grad` for every parameter at once
    was the pass's peak (GPT-2 small: 0.5 GB of 2.1). A parameter used twice (a tied head) gets
    one call, after both contributions are summed."""
    def keep(p: torch.Tensor) -> None:
        if p.grad is not None:
            g = p.grad.detach()
            g = g.coalesce().values() if g.is_sparse else g      # a row-sparse vocabulary matrix
            norms[id(p)] = torch.linalg.vector_norm(g, dtype=torch.float32)
            p.grad = None

    handles = [p.register_post_accumulate_grad_hook(keep)
               for p in model.parameters() if p.requires_grad]
    try:
        yield norms
    finally:
        for h in handles:
            h.remove()


# -- findings -------------------------------------------------------------------------------------
def dedupe(findings: list[Finding]) -> list[Finding]:
    """One finding per (probe, where, severity); the first stays (a probe's own beats a hygiene
    check's copy, which comes after it)."""
    seen, out = set(), []
    for f in findings:
        key = (f.probe, f.where, f.severity)
        if key in seen:
            continue
        seen.add(key)
        out.append(f)
    return out


NAN_FORWARD = "nan-scores/nonfinite-forward"
DOWNSTREAM_OF_NAN = ("gradient-flow/nonfinite-grad", "loss-health/nonfinite-loss")


def after_nan_forward(findings: list[Finding], statuses: dict[str, dict]):
    """One story per NaN. A gradient or a loss that is non-finite at or after the step whose
    forward nan-scores found non-finite (its first op named, an error) is that NaN carried on (a
    NaN in a padded row is multiplied by a zero weight in the loss, and the product is NaN):
    gradient-flow's and loss-health's errors there are info that says so, with nan-scores' fix,
    not second and third defects with an initialisation or learning-rate fix (the real-bug
    corpus' fully masked query rows got the gradient one; sample_runs/neg_inf_fill_all_masked
    both, "NaN to lr/warmup" among them). A gradient that goes non-finite before any forward
    does (an exploding update) stays an error.
    Returns (findings, statuses), the demoted probes' status following their own findings."""
    nan = [f for f in findings if f.code == NAN_FORWARD and f.severity == "error"]
    if not nan:
        return findings, statuses
    first = min(nan, key=lambda f: f.step or 0)
    out, touched = [], set()
    for f in findings:
        if f.code in DOWNSTREAM_OF_NAN and f.severity in ("warning", "error") \
                and (f.step or 0) >= (first.step or 0):
            f = replace(f, severity="info",
                        message=f"{f.message}: carried back from the non-finite forward at step "
                                f"{first.step or 0} ({first.where or 'the model'}; nan-scores)",
                        evidence={**f.evidence, "follows": NAN_FORWARD, "follows_where": first.where},
                        fix=first.fix)
            touched.add(f.probe)
        out.append(f)
    for name in touched:
        restatus(statuses, out, name)
    return out, statuses


def first_sign(findings: list[Finding]) -> Finding | None:
    """The earliest warning or error by step (a step-less one counts as step 0), as the schema
    defines it; on a tie the more severe, then the one listed first."""
    signs = [(f.step or 0, -severity_rank(f.severity), i, f) for i, f in enumerate(findings)
             if f.severity in ("warning", "error")]
    return min(signs, key=lambda s: s[:3])[3] if signs else None


STATUS_ORDER = ("skipped", "no verdict", "pass", "internal error", "warn", "fail")


def status_of(findings: list[Finding], name: str) -> str:
    """A check's status from its own findings: "fail" with an error, "warn" with a warning,
    else "pass"."""
    mine = [f.severity for f in findings if f.probe == name]
    return "fail" if "error" in mine else "warn" if "warning" in mine else "pass"


def restatus(statuses: dict[str, dict], findings: list[Finding], name: str) -> None:
    """In place: a probe whose findings were re-judged (demoted, dropped, judged at init) gets
    its failing status again from the findings kept; a pass, a no verdict or a skip stays."""
    st = statuses.get(name)
    if st and st.get("status") in ("fail", "warn"):
        st["status"] = status_of(findings, name)


def checks_statuses(findings: list[Finding], statuses: dict[str, dict]) -> dict[str, dict]:
    """Statuses for the checks that are not probes (triage's `checkpoint` hygiene, duplicate
    heads read from the weights, ...), and upgrades of a probe's status by such a check's
    finding: name -> entry, only for the names whose entry changes. `checkpoint` is always
    listed: the file was examined. Only a warning or an error raises a probe's own status: an
    info finding (a note that a sweep was skipped) is no check, and "no verdict" stays."""
    out = {}
    for name in {f.probe for f in findings} | {"checkpoint"}:
        st = status_of(findings, name)
        prev = statuses.get(name, {}).get("status")
        if st == "pass" and prev is not None:
            continue            # an info note checks nothing: a probe's no verdict stays
        if prev is None or STATUS_ORDER.index(st) > STATUS_ORDER.index(prev):
            out[name] = {**statuses.get(name, {}), "status": st}
    return out


def part_not_run(statuses: dict[str, dict], name: str, part: str, why: str) -> None:
    """Record in place that `part` of probe or check `name` applies to this model and did not
    run (`why` says what it needs): the verdict then cannot be clean (Report.incomplete)."""
    entry = statuses.setdefault(name, {"status": "pass"})
    entry.setdefault("not_run", {})[part] = why


def make_report(run: dict, findings: list[Finding], statuses: dict[str, dict], *,
                history: dict | None = None, sign: Finding | None = None,
                select=None, ignore=None) -> Report:
    """The Report every front-end returns. `sign`: the first sign when the caller knows better
    than the findings' steps (none does today); else `first_sign(findings)`. `select` /
    `ignore`: see `select_codes`."""
    findings, statuses = after_nan_forward(findings, statuses)
    findings, touched = explained_by_update_fault(findings)
    for name in touched:
        restatus(statuses, findings, name)
    report = Report(run=run, findings=findings, probes=statuses,
                    first_sign=sign if sign is not None else first_sign(findings),
                    history=history or {})
    return select_codes(report, select, ignore)


def codes_option(value, who: str = "--select") -> list[str]:
    """Finding codes or probe names ("a/b,c" or a list), each known to `tndebug probes
    --codes`; a UsageError names an unknown one."""
    from tndebug.probes.codes import all_codes
    from tndebug.errors import UsageError
    if value is None:
        return []
    if not isinstance(value, str) and not (isinstance(value, (list, tuple, set, frozenset))
                                           and all(isinstance(v, str) for v in value)):
        raise UsageError(f"{who.rstrip('=')}={value!r}: expected finding codes or probe names, a string "
                         f"'a/b,c' or a list of strings")
    items = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    known = [c for c, _ in all_codes()]
    for item in items:
        if not any(c == item or c.startswith(item.rstrip("/") + "/") or c.startswith("<probe>/")
                   and item.endswith("/" + c.split("/", 1)[1]) for c in known):
            raise UsageError(f"{who} {item!r}: no such finding code or probe; `tndebug probes "
                             f"--codes` lists them")
    return items


def select_codes(report: Report, select=None, ignore=None) -> Report:
    """The report with only the `select`ed finding kinds (codes or probe names; None: all) and
    without the `ignore`d ones, as ruff's --select / --ignore. A probe whose warnings or errors
    were all dropped keeps its checks ("pass") and lists the codes dropped (`ignored`);
    run["codes"] records the selection and how many findings it dropped."""
    if not select and not ignore:
        return report
    kept = choose(report.findings, select, ignore)
    dropped = [f for f in report.findings if f not in kept]
    statuses = {k: dict(v) for k, v in report.probes.items()}
    for name, st in statuses.items():
        gone = sorted({f.code for f in dropped if f.probe == name})
        if not gone:
            continue
        restatus(statuses, kept, name)
        st["ignored"] = gone
    run = {**report.run, "codes": {"select": list(select or []), "ignore": list(ignore or []),
                                   "dropped": len(dropped)}}
    sign = report.first_sign if report.first_sign in kept else first_sign(kept)
    return Report(run=run, findings=kept, probes=statuses, first_sign=sign,
                  history=report.history)
