"""A probe's status after the judge, and the report's findings' order: the one place where a
status is written once the probes are done (`Probe.status` writes it inside the engine).

    dedupe(findings)                       # one finding per (probe, where, severity)
    restatus(statuses, findings, name)     # a re-judged probe's failing status from what is kept
    checks_statuses(findings, statuses)    # the checks that are no probes ("checkpoint", ...)
    part_not_run(statuses, name, part, why)  # applies, did not run: the verdict is not clean
    select(findings, statuses, run, select, ignore)   # --select / --ignore

The statuses: "pass" | "warn" | "fail" | "no verdict" | "internal error" | "skipped", and a
`not_run` {part: why} beside any of them (Report.incomplete reads it; the reporters show a pass
with a part not run as "not run", `shown_status`).
"""
from __future__ import annotations

from tndebug.errors import UsageError
from tndebug.findings import Finding, select as choose, severity_rank
from tndebug.probes.codes import all_codes

STATUS_ORDER = ("skipped", "no verdict", "pass", "internal error", "warn", "fail")


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


def sweep_not_run(statuses: dict[str, dict], evidence: dict) -> None:
    """Record a temperature sweep that decided nothing (skipped for want of data, inconclusive,
    every loss non-finite) as a part of missing-scale that did not run, so that the verdict is
    not clean; nothing when missing-scale is not among the probes run."""
    verdict = evidence.get("verdict")
    if "missing-scale" in statuses and verdict in ("skipped", "inconclusive", "non-finite"):
        part_not_run(statuses, "missing-scale", "temperature sweep", evidence.get("reason") or
                     "the held-out loss is non-finite at every alpha")


# -- --select / --ignore ----------------------------------------------------------------------------
def codes_option(value, who: str = "--select") -> list[str]:
    """Finding codes or probe names ("a/b,c" or a list), each known to `tndebug probes
    --codes`; a UsageError names an unknown one."""
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


def select(findings: list[Finding], statuses: dict[str, dict], run: dict, select=None,
           ignore=None) -> tuple[list[Finding], dict[str, dict], dict]:
    """Only the `select`ed finding kinds (codes or probe names; None: all), without the `ignore`d
    ones, as ruff's --select / --ignore. A probe whose warnings or errors were all dropped keeps
    its checks ("pass") and lists the codes dropped (`ignored`); run["codes"] records the
    selection and how many findings it dropped. Returns (findings, statuses, run), new values."""
    if not select and not ignore:
        return findings, statuses, run
    kept = choose(findings, select, ignore)
    dropped = [f for f in findings if f not in kept]
    statuses = {k: dict(v) for k, v in statuses.items()}
    for name, st in statuses.items():
        gone = sorted({f.code for f in dropped if f.probe == name})
        if not gone:
            continue
        restatus(statuses, kept, name)
        st["ignored"] = gone
    run = {**run, "codes": {"select": list(select or []), "ignore": list(ignore or []),
                            "dropped": len(dropped)}}
    return kept, statuses, run
