"""report.md: the verdict, each finding (symptom, evidence, probable cause from the notes, fix,
module path), the probes' statuses, and the figures as relative PNG links."""
from __future__ import annotations

from tndebug.capture.source import also_text, context_lines, source_text
from tndebug.findings import NUMBER, Finding
from tndebug.probes import probe_cause
from tndebug.report import Report
from tndebug.reporters.common import SEVERITY_WORD, VERDICT_WORD, counts_text, coverage_counts, \
    first_sign_text, fmt_value, group_where_text, no_verdict_places, reasons_text, sorted_groups, \
    incomplete_text, status_text, unchecked_text, where_text
from tndebug.reporters.plots import Plot

RUN_KEYS_FIRST = ("status", "task", "preset", "arch", "norm", "faults", "probes", "seed", "steps",
                  "device", "final_loss", "exact_match", "token_accuracy", "wall_s")
STATUS_MARK = {"pass": "pass", "warn": "**WARN**", "fail": "**FAIL**", "no verdict": "*no verdict*",
               "internal error": "**INTERNAL ERROR** (a tndebug bug)",
               "skipped": "skipped", "not run": "*not checked*"}


def _md(text) -> str:
    """Escape the characters that would break a table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(report: Report, plots: list[Plot] = (), *, fig_prefix: str = "figures/",
           with_figures: bool = True) -> str:
    out = [f"# tndebug report: {VERDICT_WORD[report.verdict]}", ""]
    out.append(f"**Verdict: {VERDICT_WORD[report.verdict]}** ({counts_text(report)}).")
    unchecked = unchecked_text(report)
    if unchecked:
        out += ["", f"> **Unchecked:** {unchecked}."]
    missing = incomplete_text(report)
    if missing:
        out += ["", f"> **Not checked:** {missing}."]
    stopped, sign = status_text(report), first_sign_text(report)
    if stopped or sign:
        out.append("")
        if stopped:
            out.append(f"> **RUN {stopped}.**")
        if sign:
            out.append(f"> **First sign:** {sign}")
    out += ["", "## Run", "", "| | |", "|---|---|"]
    keys = [k for k in RUN_KEYS_FIRST if report.run.get(k) is not None] + \
           [k for k in report.run if k not in RUN_KEYS_FIRST and report.run[k] is not None]
    out += [f"| {_md(k)} | {_md(fmt_value(report.run[k]))} |" for k in keys]

    out += ["", "## Findings", ""]
    groups = sorted_groups(report)
    if not groups:
        out.append("No findings.")
    placed: set[str] = set()             # figures shown next to the finding they illustrate
    for i, (g, fs) in enumerate(groups, 1):
        out += _finding(i, fs[0]) if len(fs) == 1 else _group(i, fs)
        out += _figures_of(g.members, plots, placed, fig_prefix) if with_figures else []

    out += ["", "## Probes", "", "| probe | status | reason |", "|---|---|---|"]
    for name, st in report.probes.items():
        status, reason = report.status(name), st.get("reason", "")      # the one status rule
        if status == "not run":                                  # NOT CHECKED's reason
            reason = "; ".join(f"{part} not run: {why}" for part, why in st["not_run"].items())
        out.append(f"| `{name}` | {STATUS_MARK.get(status, status)} | {_md(reason)} |")
    out += _coverage(report)

    rest = [p for p in plots if p.name not in placed]
    if with_figures and rest:
        out += ["", "## Figures", ""] + (["The figures of the findings are shown with them, "
                                          "above.", ""] if placed else [])
        if report.run.get("figures_batch"):          # one batch for every figure (triage)
            out += [f"Every figure shows one batch: {_md(str(report.run['figures_batch']))}.", ""]
        for p in rest:
            if not p.name:
                out += [f"*{p.title}: {p.caption}*", ""]
                continue
            out += [f"### {p.title}", "", f"![{p.title}]({fig_prefix}{p.name})", "", p.caption, ""]
    elif not with_figures:
        out += ["", "*Figures: see report.md and figures/ in the run directory.*"]
    return "\n".join(out).rstrip() + "\n"


def _figures_of(members, plots: list[Plot], placed: set[str], prefix: str) -> list[str]:
    """The figures that illustrate one of these findings and are not shown yet."""
    out = []
    for p in plots:
        if p.name and p.name not in placed and set(p.findings) & set(members):
            placed.add(p.name)
            out += [f"**Figure: {p.title}**", "", f"![{p.title}]({prefix}{p.name})", "",
                    f"*{p.caption}*", ""]
    return out


def _coverage(report: Report) -> list[str]:
    """Per probe, how many places (modules, stacks, the run) were checked, gave no verdict, or
    did not apply; with the reasons for no verdict."""
    rows = [(name, st) for name, st in report.probes.items() if st.get("coverage")]
    if not rows:
        return []
    out = ["", "### Coverage", "",
           "Places each probe examined: modules in the model's naming, `(run)` for the whole run.", "",
           "| probe | checked | no verdict | n/a | why no verdict |", "|---|---|---|---|---|"]
    for name, st in rows:
        c = coverage_counts(st)
        why = reasons_text(no_verdict_places(st), limit=3)
        out.append(f"| `{name}` | {c['checked']} | {c['no verdict']} | {c['not applicable']} | {_md(why)} |")
    return out


def evidence_lines(evidence: dict) -> list[str]:
    """Scalars on one line, thresholds on theirs, nested values as sub-bullets."""
    scalars = [(k, v) for k, v in evidence.items() if not isinstance(v, dict)
               and not k.startswith("threshold")]
    lines = [("- **Evidence:** " + "; ".join(f"`{k}` = {fmt_value(v)}" for k, v in scalars)).rstrip()]
    for k, v in evidence.items():
        if k.startswith("threshold"):
            inner = (", ".join(f"{a}: {fmt_value(b)}" for a, b in v.items())
                     if isinstance(v, dict) else fmt_value(v))
            lines.append(f"  - **{k}:** {inner}")
        elif isinstance(v, dict):
            lines.append(f"  - `{k}`:")
            for a, b in v.items():
                inner = (", ".join(f"{x}={fmt_value(y)}" for x, y in b.items())
                         if isinstance(b, dict) else fmt_value(b))
                lines.append(f"    - `{a}`: {inner}")
    return lines


def source_lines(f: Finding) -> list[str]:
    """`- **Source:** model.py:24 (Class.method)` and the line with two either side."""
    if not f.source:
        return []
    src = f.source
    lines = [f"- **Source:** `{source_text({**src, 'code': ''})}`", "", "  ```python"]
    for n, text in context_lines(src):
        lines.append(f"  {'>' if n == src['line'] else ' '}{n:5d}  {text}")
    lines.append("  ```")
    lines += [f"- **Also:** `{also}`" for also in also_text(src)]
    return lines + [""]


def _finding(i: int, f: Finding) -> list[str]:
    at = f" at step {f.step}" if f.step is not None else ""
    lines = [f"### {i}. {SEVERITY_WORD[f.severity]} `{f.probe}`{at}", "",
             f"- **Symptom:** {f.message}"]
    if f.evidence:
        lines += evidence_lines(f.evidence)
    cause = probe_cause(f.probe)
    if cause:
        lines.append(f"- **Probable cause (from the notes):** {cause}")
    if f.fix:
        lines.append(f"- **Fix:** {f.fix}")
    where = f"`{f.where}`" if f.where else "the run as a whole"
    extra = ", ".join(x for x in (f"layer {f.layer}" if f.layer is not None else "",
                                  f"head {f.head}" if f.head is not None else "",
                                  f"rank {f.rank}" if f.rank is not None else "") if x)
    lines.append(f"- **Where:** {where}" + (f" ({extra})" if extra else ""))
    return lines + source_lines(f) + [""]


def _group(i: int, fs: list[Finding]) -> list[str]:
    """One defect in several places: one block, the places listed with their step and their own
    message where it differs beyond the module's name; the evidence shown is the first's."""
    f = fs[0]
    steps = [x.step for x in fs if x.step is not None]
    at = f" at step {min(steps)}" if steps else ""
    lines = [f"### {i}. {SEVERITY_WORD[f.severity]} `{f.probe}`{at}, in {group_where_text(fs)}", "",
             f"- **Symptom:** {f.message}"]
    if f.evidence:
        ev = evidence_lines(f.evidence)
        lines += [ev[0].replace("- **Evidence:**", f"- **Evidence** (`{where_text(f)}`):", 1)] + ev[1:]
    cause = probe_cause(f.probe)
    if cause:
        lines.append(f"- **Probable cause (from the notes):** {cause}")
    if f.fix:
        lines.append(f"- **Fix:** {f.fix}")
    lines.append(f"- **Where** ({len(fs)} findings, in {group_where_text(fs)}):")
    for x in fs:
        same = (x.message.replace(x.where, f.where) if x.where else x.message) == f.message
        step = f"step {x.step}" if x.step is not None else "no step"
        where = f"`{x.where}`" if x.where else "the run as a whole"
        extra = f" head {x.head}" if x.head is not None else ""
        lines.append(f"  - {where}{extra} ({step})" + ("" if same else _differs(x, f)))
    return lines + source_lines(f) + [""]


def _differs(x: Finding, first: Finding) -> str:
    """`: 69% (77% above)`, the numbers of `x`'s message that differ from the first's; the
    whole message when more than numbers differ."""
    mine = NUMBER.findall(x.message.replace(x.where, first.where) if x.where else x.message)
    theirs = NUMBER.findall(first.message)
    if len(mine) != len(theirs):
        return f": {x.message}"
    diff = [(a, b) for a, b in zip(mine, theirs) if a != b]
    return ": " + ", ".join(f"{a} ({b} above)" for a, b in diff) if diff else f": {x.message}"
