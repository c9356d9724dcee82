"""The terminal summary's words, without rich (console.py sets them): numbers and evidence to a
few digits, the rows the table shows and their counts, the result and shape lines, and what
each probe could only partly check.
"""
from __future__ import annotations

from tndebug.report import Report
from tndebug.reporters.common import coverage_counts, no_verdict_places, reasons_text, \
    sorted_groups

EVIDENCE_ITEMS = 4           # scalar evidence items in the terminal; all of it is in report.md


def fmt_number(v) -> str:
    """A number to 3 significant digits (an int as it is)."""
    if isinstance(v, int):
        return str(v)
    return f"{v:.3g}"


def console_evidence(f, sep: str = ", ", limit: int = EVIDENCE_ITEMS) -> str:
    """At most `limit` named numbers at 3 significant digits, then the rule they were judged
    by (`threshold`), and how many items more report.md holds; never a nested dict."""
    items = list(f.evidence.items())
    numbers = [(k, v) for k, v in items if _number(v) and not k.startswith("threshold")]
    parts = [f"{k}={fmt_number(v)}" for k, v in numbers[:limit]]
    rule = f.evidence.get("threshold")
    rule = (fmt_number(rule) if _number(rule) else rule if isinstance(rule, str) and len(rule) <= 60
            else None)
    if rule is not None:
        parts.append(f"threshold: {rule}")
    rest = [k for k, _ in items if k not in dict(numbers[:limit]) and not (rule and k == "threshold")]
    if rest and not parts:
        parts.append(f"{', '.join(rest[:4])}{', ...' if len(rest) > 4 else ''} (in report.md)")
    elif rest:
        parts.append(f"(+{len(rest)} more)")
    return sep.join(parts)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shown_groups(report: Report, verbose: bool = False):
    """The table's rows: every group of findings, except that with a CLEAN verdict the info
    ones are left to report.md (one line says how many) unless `verbose`."""
    rows = sorted_groups(report)
    if report.verdict == "clean" and not verbose:
        rows = [(g, fs) for g, fs in rows if g.severity != "info"]
    return rows


def rows_counts_text(report: Report) -> str:
    """`1 error, 0 warnings, 2 info`, counting the table's rows (one per group of findings)."""
    c = {"error": 0, "warning": 0, "info": 0}
    for g, _ in sorted_groups(report):
        c[g.severity] += 1
    return (f"{c['error']} error{'s' * (c['error'] != 1)}, "
            f"{c['warning']} warning{'s' * (c['warning'] != 1)}, {c['info']} info")


def _seconds(s: float) -> str:
    """12.3 s, 20m05s, 2h03m: at most 7 characters, so the result line fits 80 columns."""
    if s < 100:
        return f"{s:.1f} s"
    m = int(round(s)) // 60
    return f"{m}m{int(round(s)) % 60:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def result_text(report: Report) -> str | None:
    """What a `tndebug run` achieved, in one line of at most 80 columns: the held-out task result
    and the training and whole-run times (report.json's run.exact_match, token_accuracy,
    train_s, wall_s). None for triage, check and watch, which train nothing of their own."""
    run = report.run
    if "train_s" not in run or "wall_s" not in run:
        return None
    em, acc = run.get("exact_match"), run.get("token_accuracy")
    task = (f"held-out: exact match {em:.1%}, token accuracy {acc:.1%}" if em is not None
            and acc is not None else "held-out: not evaluated")
    return f"{task}; train {_seconds(run['train_s'])}, wall {_seconds(run['wall_s'])}"


SHAPES = {"seq2seq": "encoder-decoder", "decoder": "decoder-only (GPT-style, causal)",
          "encoder": "encoder-only (BERT-style, bidirectional)"}


def shape_text(report: Report) -> str | None:
    """Triage of the user's own code: which shape's tests ran and how that was decided
    (run.arch, run.arch_from), since a decoder-only and an encoder-only model are called alike;
    None elsewhere."""
    run = report.run
    if run.get("layout") != "user code" or not run.get("arch_from"):
        return None
    return f"read as {SHAPES.get(run.get('arch'), run.get('arch'))}: {run['arch_from']}"


def same_reason_together(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Probes skipped for one reason on one row: `label-shift, lm-decoding: <reason>`."""
    names: dict[str, list[str]] = {}
    for name, why in rows:
        names.setdefault(why, []).append(name)
    return [(", ".join(n), why) for why, n in names.items()]


def partly_checked(report: Report) -> list[tuple[str, str]]:
    """(probe, `4 of 6 places checked; 2 no verdict: where: why`, and the part it could not
    run) for probes with a verdict that could not decide everywhere."""
    out = []
    for name, st in report.probes.items():
        places, reason = no_verdict_places(st), st.get("reason", "")
        # the reason is the NOT CHECKED line's, printed above: named here, not repeated
        unrun = "; ".join(f"{part} not run (see NOT CHECKED)" for part in st.get("not_run", {}))
        status = report.status(name)                    # the one status rule
        if status not in ("pass", "warn", "fail") or not (places or reason or unrun):
            continue                # "not run": NOT CHECKED says it, once
        parts = []
        if places:
            c = coverage_counts(st)
            parts.append(f"{c['checked']} of {c['checked'] + c['no verdict']} places checked; "
                         f"{c['no verdict']} no verdict: {reasons_text(places, limit=1)}")
        if reason:
            parts.append(reason)
        if unrun:
            parts.append(unrun)
        out.append((name, "; ".join(parts)))
    return out
