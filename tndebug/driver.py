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

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from tndebug.findings import Finding, severity_rank
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
               compute_dtype: torch.dtype = torch.float32, sinks: Iterable[Any] = ()) -> ProbeResult:
    """Run the probes `names` on `subject` in triage mode: every probe's setup (the exact tests),
    one recorded forward and backward of the first `PROBE_BATCH` sequences of `batch`
    (src, tgt_in, tgt_out), no optimizer step, then every probe's finish.

    `sinks` (objects with `on_trace(step, trace)` / `on_metric(step, tag, value)`) see the step as
    the last one of a run: the figures' reads are recorded too. The model's mode is restored and
    its gradients cleared."""
    probes = make_probes(list(names))
    pad_id = subject.pad_id
    sinks = list(sinks)
    run = RunContext(subject=subject, optimizer=None, mode="triage", compute_dtype=compute_dtype,
                     criterion=lambda lg, t: F.cross_entropy(lg.float(), t, ignore_index=pad_id),
                     device=str(subject.device), total_steps=1 if sinks else None)
    src, tgt_in, tgt_out = (t[:PROBE_BATCH].to(subject.device) for t in batch)
    model = subject.model
    was = model.training
    model.eval()
    try:
        with ProbeEngine(probes, run, sinks=sinks) as engine:
            engine.setup()
            engine.begin_step(0, src, tgt_in)
            logits = subject.logits(src, tgt_in)
            loss = run.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            model.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
            engine.end_step(StepInfo(0, loss=loss.detach(), logits=logits.detach(), src=src,
                                     tgt_in=tgt_in, tgt_out=tgt_out))
            findings = engine.finish()
            statuses = engine.statuses()
            seconds = {k: round(v, 3) for k, v in engine.seconds_by_probe.items()}
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
    return ProbeResult(findings, statuses, seconds, (src, tgt_in, tgt_out))


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


def first_sign(findings: list[Finding]) -> Finding | None:
    """The earliest warning or error by step (a step-less one counts as step 0), as the schema
    defines it; on a tie the more severe, then the one listed first."""
    signs = [(f.step or 0, -severity_rank(f.severity), i, f) for i, f in enumerate(findings)
             if f.severity in ("warning", "error")]
    return min(signs, key=lambda s: s[:3])[3] if signs else None


STATUS_ORDER = ("skipped", "no verdict", "pass", "warn", "fail")


def checks_statuses(findings: list[Finding], statuses: dict[str, dict]) -> dict[str, dict]:
    """Statuses for the checks that are not probes (triage's `checkpoint` hygiene, duplicate
    heads read from the weights, ...), and upgrades of a probe's status by such a check's
    finding: name -> entry, only for the names whose entry changes. `checkpoint` is always
    listed: the file was examined."""
    out = {}
    for name in {f.probe for f in findings} | {"checkpoint"}:
        mine = [f for f in findings if f.probe == name]
        st = ("fail" if any(f.severity == "error" for f in mine) else
              "warn" if any(f.severity == "warning" for f in mine) else "pass")
        prev = statuses.get(name, {}).get("status")
        if prev is None or STATUS_ORDER.index(st) > STATUS_ORDER.index(prev):
            out[name] = {**statuses.get(name, {}), "status": st}
    return out


def make_report(run: dict, findings: list[Finding], statuses: dict[str, dict], *,
                history: dict | None = None, sign: Finding | None = None) -> Report:
    """The Report every front-end returns. `sign`: the first sign when the caller knows better
    than the findings' steps (none does today); else `first_sign(findings)`."""
    return Report(run=run, findings=findings, probes=statuses,
                  first_sign=sign if sign is not None else first_sign(findings),
                  history=history or {})
