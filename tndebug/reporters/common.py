"""Small formatting helpers shared by the console and Markdown reporters (no rich, no TB)."""
from __future__ import annotations

import math
import re

from tndebug.findings import Finding, FindingGroup, severity_rank
from tndebug.report import Report

SEVERITY_WORD = {"error": "ERROR", "warning": "WARN", "info": "INFO"}
VERDICT_WORD = {"clean": "CLEAN", "warnings": "WARNINGS", "errors": "ERRORS", "incomplete": "INCOMPLETE",
                "unchecked": "UNCHECKED"}
STATUS_KEYS = ("stopped_at_step", "stopped_at", "step")   # where run["status"] != completed stopped


def fmt_value(v) -> str:
    """Numbers to 4 significant digits, everything else as str."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        if not v:
            return "none"
        inner = ", ".join(fmt_value(x) for x in v[:8])
        return f"[{inner}{', ...' if len(v) > 8 else ''}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {fmt_value(x)}" for k, x in list(v.items())[:8]) + "}"
    return str(v)


def where_text(f: Finding) -> str:
    w = f.where or "(run)"
    if f.head is not None:
        w += f" head {f.head}"
    return w


def sorted_findings(report: Report) -> list[Finding]:
    """Errors first, then warnings, then info; earliest step first within a severity."""
    return sorted(report.findings,
                  key=lambda f: (-severity_rank(f.severity), f.step if f.step is not None else -1))


def sorted_groups(report: Report) -> list[tuple[FindingGroup, list[Finding]]]:
    """(group, its findings) for one defect across modules: errors first, then warnings, then
    info; earliest step first within a severity."""
    groups = [(g, [report.findings[i] for i in g.members]) for g in report.groups()]
    return sorted(groups, key=lambda gf: (-severity_rank(gf[0].severity),
                                          gf[0].step if gf[0].step is not None else -1))


def places_text(fs: list[Finding], limit: int | None = None) -> str:
    """`a, b, c (+3 more)`: the places of a group's findings, heads included."""
    places = list(dict.fromkeys(where_text(f) for f in fs))
    shown = places if limit is None else places[:limit]
    rest = len(places) - len(shown)
    return ", ".join(shown) + (f" (+{rest} more)" if rest else "")


def group_where_text(fs: list[Finding]) -> str:
    """The place of a group of one; `N places` (modules, heads or the run) for more."""
    places = list(dict.fromkeys(where_text(f) for f in fs))
    if len(places) == 1:
        return places[0]
    noun = "modules" if all(f.where for f in fs) else "places"
    return f"{len(places)} {noun}"


def break_at_dots(path: str, width: int) -> str:
    """A module path on lines of at most `width`, broken only after a dot (a part longer than
    `width` keeps its own line)."""
    if len(path) <= width or width < 1:
        return path
    lines, line = [], ""
    for part in path.replace(" ", " \0").split("\0"):      # spaces (`x head 2`) break too
        for piece in re.split(r"(?<=\.)", part):
            if line and len(line) + len(piece) > width:
                lines.append(line.rstrip())
                line = ""
            line += piece
    return "\n".join(lines + [line.rstrip()])


def counts(report: Report) -> dict[str, int]:
    c = {"error": 0, "warning": 0, "info": 0}
    for f in report.findings:
        c[f.severity] += 1
    return c


def counts_text(report: Report) -> str:
    c = counts(report)
    return (f"{c['error']} error{'s' * (c['error'] != 1)}, "
            f"{c['warning']} warning{'s' * (c['warning'] != 1)}, {c['info']} info")


def run_status(report: Report) -> tuple[str, int | None]:
    """("completed" | "interrupted" | "diverged" | ..., the step it stopped at or None)."""
    status = str(report.run.get("status", "completed"))
    for key in STATUS_KEYS:
        if report.run.get(key) is not None:
            return status, report.run[key]
    return status, None


def status_text(report: Report) -> str | None:
    """"DIVERGED at step 123" for a run that did not complete, else None."""
    status, step = run_status(report)
    if status == "completed":
        return None
    return status.upper() + (f" at step {step}" if step is not None else "")


def first_sign_text(report: Report) -> str | None:
    f = report.first_sign
    if f is None:
        return None
    at = f" at step {f.step}" if f.step is not None else ""
    where = f" in {f.where}" if f.where and not f.message.startswith(f.where) else ""   # once
    return f"{f.probe}{at}{where}: {f.message}"


def probe_groups(report: Report) -> dict[str, list[tuple[str, str]]]:
    """status -> [(probe, reason)] for pass | warn | fail | internal error | no verdict | skipped
    | not run, as `Report.status` says (the one status rule): a probe that passed what it
    checked while a part of it that applies did not run is "not run", said once by the NOT
    CHECKED line, never also "passed"."""
    out: dict[str, list[tuple[str, str]]] = {"pass": [], "warn": [], "fail": [], "internal error": [],
                                             "no verdict": [], "skipped": [], "not run": []}
    for name, st in report.probes.items():
        out.setdefault(report.status(name), []).append((name, st.get("reason", "")))
    return out


def coverage_counts(st: dict) -> dict[str, int]:
    """{"checked", "no verdict", "not applicable"} -> how many places, from probes[name]."""
    c = {"checked": 0, "no verdict": 0, "not applicable": 0}
    for entry in st.get("coverage", {}).values():
        c[entry["status"]] = c.get(entry["status"], 0) + 1
    return c


def no_verdict_places(st: dict) -> list[tuple[str, str]]:
    """[(where, reason)] of the places a probe could not decide ("(run)" for "")."""
    return [(w or "(run)", c.get("reason", "")) for w, c in st.get("coverage", {}).items()
            if c["status"] == "no verdict"]


def reasons_text(places: list[tuple[str, str]], limit: int = 2) -> str:
    """`a, b: why; c: other reason (+3 more)`: places grouped by reason, at most `limit` reasons."""
    by: dict[str, list[str]] = {}
    for where, why in places:
        by.setdefault(why or "no reason given", []).append(where)
    parts = []
    for why, wheres in list(by.items())[:limit]:
        shown = ", ".join(wheres[:2]) + (f" (+{len(wheres) - 2} more)" if len(wheres) > 2 else "")
        parts.append(f"{shown}: {why}")
    rest = sum(len(w) for w in list(by.values())[limit:])
    return "; ".join(parts) + (f" (+{rest} more)" if rest else "")


def incomplete_text(report: Report) -> str | None:
    """What could not be checked, in one sentence (the probes without a verdict and why); None
    when every probe that applied decided, or when the verdict is unchecked."""
    missing = report.incomplete()
    if not missing or report.verdict == "unchecked":
        return None
    parts = [f"{n} ({why})" if why else n for n, why in missing.items()]
    many = len(missing) != 1
    return (f"{len(missing)} probe{'s' * many} that appl{'y' if many else 'ies'} to this model "
            f"could not check it: " + "; ".join(parts))


def unchecked_text(report: Report) -> str | None:
    """What an "unchecked" verdict means, in one sentence; None for any other verdict."""
    if report.verdict != "unchecked":
        return None
    names = report.unchecked()
    starved = [n for n in names if report.probes[n].get("steps_observed") == 0]
    if starved:
        return (f"{len(starved)} probe{'s' * (len(starved) != 1)} that need training "
                f"observed no step: {', '.join(starved)}")
    return "nothing was checked: no probe reached a verdict"


def clipped(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut at a space and marked with `…` (a log line
    that stops mid-word, "at pos", reads as a bug of its own)."""
    if len(text) <= width:
        return text
    cut = text[:width - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(",;:(") + "…"


def brief_text(report: Report, paths: dict[str, str] | None = None, limit: int = 5) -> str:
    """A few plain lines for a log (what `tndebug.watch` writes to stderr): the verdict and
    counts, the findings at warning or above by code (their steps), what could not be checked,
    and where the full report is."""
    status, step = run_status(report)
    lines = [f"tndebug: verdict {VERDICT_WORD[report.verdict]} ({counts_text(report)})"
             + (f"; run {status} at step {step}" if status != "completed" and step is not None
                else "")]
    shown = [f for f in sorted_findings(report) if f.severity in ("error", "warning")]
    for f in shown[:limit]:
        at = f" at step {f.step}" if f.step is not None else ""
        lines.append(f"  {SEVERITY_WORD[f.severity]} {f.code or f.probe}{at}: "
                     f"{clipped(f.message.splitlines()[0], 100)}")
    if len(shown) > limit:
        lines.append(f"  (+{len(shown) - limit} more)")
    for what, text in (("UNCHECKED", unchecked_text(report)), ("NOT CHECKED", incomplete_text(report))):
        if text:
            lines.append(f"  {what}: {text}")
    lines += [f"  {label}: {path}" for label, path in (paths or {}).items()]
    return "\n".join(lines)


def _full_value(v) -> str:
    """A value of the evidence as `-v` shows it: numbers at 3 significant digits, dicts and lists
    opened (`{delta=1.95, tol=2.76e-05}`), text as it is."""
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}={_full_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_full_value(x) for x in v) + "]"
    return str(v)


def full_evidence(f, sep: str = ", ") -> str:
    """Every item of the evidence (`-v`), each named, numbers at 3 significant digits."""
    return sep.join(f"{k}={_full_value(v)}" for k, v in f.evidence.items())
