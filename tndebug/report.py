"""The report: one value that every reporter formats (`tndebug.report/2`).

    {"schema": "tndebug.report/2",
     "run": {...},                 # what ran: task, preset, norm, faults, seed, steps, device,
                                   # final_loss, exact_match, token_accuracy, wall_s, status, ...
     "verdict": "clean" | "warnings" | "errors" | "incomplete" | "unchecked",
     "probes": {name: {"status": "pass" | "warn" | "fail" | "no verdict" | "skipped"
                                 | "internal error",   # the probe's own code raised
                       "reason"?: str, "steps_observed"?: int,
                       "coverage"?: {where: {"status": "checked" | "no verdict" | "not applicable",
                                             "reason"?: str}}}},
     "first_sign": finding | null, # the earliest warning/error (what a diverged run saw first)
     "findings": [finding, ...],
     "groups": [{"probe", "severity", "message", "fix", "modules": [where, ...], "count",
                 "step", "findings": [index into findings, ...]}, ...]}
                                   # one defect in several modules: findings grouped by probe,
                                   # severity, fix and message up to module names and numbers
     "metrics": {tag: [[step, value], ...]}}
                                   # every scalar the reporters were shown (the probes' metrics,
                                   # tags.py's families, and the trainer's train/, eval/): what
                                   # TensorBoard got; one tag a line. {} when nothing recorded
Keys are stable: add, never rename.

    load_report("runs/x/report.json").metrics_frame().query("layer == 1")   # pandas (frames.py)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tndebug.errors import UsageError
from tndebug.findings import Finding, FindingGroup, group_findings, jsonable, worst
from tndebug.frames import findings_frame, metrics_frame

SCHEMA = "tndebug.report/2"
READS = ("tndebug.report/1", SCHEMA)   # /2 adds each finding's `code`; /1 reads with code "" 


@dataclass
class Report:
    run: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    probes: dict[str, dict] = field(default_factory=dict)
    first_sign: Finding | None = None
    history: dict[str, list] = field(default_factory=dict)   # curves for plots (not in JSON's stable core)
    # tag -> [(step, value), ...]: every scalar recorded (ReportSession.finish fills it)
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """The one verdict rule, for every front-end.

        errors | warnings by the worst finding; else "unchecked" when nothing was checked (no
        probe passed, or a probe that needs training steps observed none); else "incomplete"
        when a probe that applied to this model decided nothing (`incomplete()`: its status is
        "no verdict", with the reason); else clean: every probe that applied ran and passed."""
        w = worst(self.findings)
        if w in ("warning", "error"):
            return {"warning": "warnings", "error": "errors"}[w]
        if self.unchecked():
            return "unchecked"
        return "incomplete" if self.incomplete() else "clean"

    def status(self, name: str) -> str:
        """The one status rule that every reader shows (console, report.md, report.json's
        `verdict`, `assert_clean`): the probe's own status ("pass" | "warn" | "fail" | "no
        verdict" | "internal error" | "skipped"), as the judge left it, except that a pass with a
        part that applies and did not run (`not_run`) is "not run" -- never "passed" beside NOT
        CHECKED (issue 44: missing-scale was passed, partly checked and NOT CHECKED at once)."""
        st = self.probes.get(name, {})
        status = st.get("status", "pass")
        return "not run" if status == "pass" and st.get("not_run") else status

    def unchecked(self) -> list[str]:
        """Why the verdict cannot be clean: the probes that needed training steps and observed
        none, or, when no probe passed, every probe ([] when the report's probes are unknown)."""
        starved = [n for n, st in self.probes.items() if st.get("steps_observed") == 0
                   and st.get("status") not in ("warn", "fail")]
        if starved:
            return starved
        if self.probes and not any(st.get("status") in ("pass", "warn", "fail")
                                   for st in self.probes.values()):
            return list(self.probes)
        return []

    def incomplete(self) -> dict[str, str]:
        """What applied to this model and decided nothing: name -> reason. A probe whose status
        is "no verdict"; and a probe or check with a part that applies but did not run
        (`not_run`, {part: why}: the temperature sweep or the untied-head test without the
        user's data, or on data the checkpoint does not solve). A probe that checked some
        places and not others is "partly checked" (its coverage says where), not here."""
        out = {}
        for n, st in self.probes.items():
            if st.get("status") in ("no verdict", "internal error"):
                out[n] = st.get("reason", "")
            elif st.get("not_run"):
                out[n] = "; ".join(f"{part} not run: {why}" for part, why in st["not_run"].items())
        return out

    def exit_code(self, fail_on: str = "error") -> int:
        """1 when a finding is at or above `fail_on`; else 4 when something that applied could
        not be checked (verdict unchecked or incomplete, or a probe without a verdict beside
        findings below `fail_on`); else 0. `never` always gives 0."""
        if fail_on == "never":
            return 0
        if any(f.at_least(fail_on) for f in self.findings):
            return 1
        return 4 if (self.unchecked() or self.incomplete()) else 0

    def groups(self) -> list[FindingGroup]:
        """The findings grouped across the modules they affect (`group_findings`); `members`
        index `self.findings`."""
        return group_findings(self.findings)

    def findings_frame(self):
        """A pandas DataFrame, one row per finding: probe, code, severity, where, step, layer,
        head, rank, message, fix, then each evidence key as a column `evidence.<key>` (nested
        keys joined with dots). The same frame from report.json (`load_report`)."""
        return findings_frame(self)

    def metrics_frame(self):
        """A long pandas DataFrame of every recorded scalar, one row per (tag, step): step, tag,
        family, stack, kind, layer, head, stat, module, site, name, value; the columns between
        are the tag families' parts (tndebug/tags.py), blank where a tag has none."""
        return metrics_frame(self)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "run": self.run, "verdict": self.verdict, "probes": self.probes,
                "first_sign": self.first_sign.to_dict() if self.first_sign else None,
                "findings": [f.to_dict() for f in self.findings],
                "groups": [g.to_dict() for g in self.groups()],
                "metrics": {tag: [list(p) for p in series] for tag, series in self.metrics.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        if d.get("schema") not in READS:
            raise ValueError(f"not a {SCHEMA} report (schema={d.get('schema')!r})")
        fs = d.get("first_sign")
        return cls(run=d["run"], findings=[Finding.from_dict(f) for f in d["findings"]],
                   probes=d.get("probes", {}), first_sign=Finding.from_dict(fs) if fs else None,
                   metrics={tag: [(int(s), v) for s, v in series]
                            for tag, series in (d.get("metrics") or {}).items()})

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    def to_json(self) -> str:
        """report.json's text: indented, but each metric tag's series on one line (a run's
        thousands of points would otherwise take four lines each)."""
        d = self.to_dict()
        metrics = d.pop("metrics")
        text = json.dumps(d, indent=2, default=jsonable)
        lines = [f"    {json.dumps(tag)}: {json.dumps(series, default=jsonable)}"
                 for tag, series in metrics.items()]
        body = "{\n" + ",\n".join(lines) + "\n  }" if lines else "{}"
        return text[:-2] + f',\n  "metrics": {body}\n}}\n'


def load_report(path: str | Path) -> Report:
    """The Report in a report.json written by `tndebug run`, `triage`, `tndebug.watch(out=)`
    or `check(out=)`; `path` is the file or the directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"load_report: no such file {path}; pass a report.json or the "
                         f"directory holding it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"load_report: {path} is not a tndebug report.json ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:80]})") from None
    if not isinstance(data, dict) or data.get("schema") not in READS:
        raise UsageError(f"load_report: {path} is JSON but no tndebug report (schema="
                         f"{data.get('schema') if isinstance(data, dict) else None!r}); pass the "
                         f"report.json that tndebug wrote")
    return Report.from_dict(data)
