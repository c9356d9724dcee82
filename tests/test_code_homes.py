"""A code is emitted only by the probe it is registered to (issue 46: a finding's whole story
with its rule): every `Finding("<probe>", ...)` and every `code="<probe>/<kind>"` under tndebug/
whose probe is a probe's name sits in that probe's own files, probes/<probe>.py or
probes/<probe>_*.py. A front-end, triage or the judge that has such a finding to give calls a
function of the probe's file with plain values (lr_schedule.no_resume_state, ...). Codes of no
probe (checkpoint/..., watch/..., pad-id/...) may be built where their check is."""
from __future__ import annotations

import ast
from pathlib import Path

from tndebug.probes import PROBE_NAMES, probe_class
from tndebug.probes.codes import OTHER_CODES

PKG = Path(__file__).resolve().parents[1] / "tndebug"


def _head(node: ast.AST) -> str | None:
    """A string constant, or the text before the first placeholder of an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None


def _probes_named(call: ast.Call) -> list[str]:
    """The probe names a call builds a finding for: a `code=` keyword's prefix, and a `Finding`'s
    probe (first argument or probe=)."""
    fn = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    texts = [_head(kw.value) for kw in call.keywords if kw.arg == "code"]
    texts = [t.partition("/")[0] for t in texts if t and "/" in t]
    if fn == "Finding":
        first = call.args[0] if call.args else next(
            (kw.value for kw in call.keywords if kw.arg == "probe"), None)
        if first is not None and _head(first) is not None and "{" not in ast.unparse(first):
            texts.append(_head(first))
    return sorted({t for t in texts if t in PROBE_NAMES})


def _homed(rel: Path, probe: str) -> bool:
    """`rel` (below tndebug/) is one of the probe's own files."""
    mod = probe.replace("-", "_")
    return (len(rel.parts) == 2 and rel.parts[0] == "probes"
            and (rel.name == f"{mod}.py" or rel.name.startswith(f"{mod}_")))


def misplaced(pkg: Path = PKG) -> list[str]:
    """'file:line: probe' for every finding of a probe built outside the probe's own files."""
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                bad += [f"tndebug/{rel.as_posix()}:{node.lineno}: {p}"
                        for p in _probes_named(node) if not _homed(rel, p)]
    return sorted(bad)


def test_every_probe_finding_is_built_in_its_probe_files():
    assert misplaced() == []


def _built_codes(pkg: Path = PKG) -> set[str]:
    """Every whole `code="<probe>/<kind>"` literal under tndebug/ whose probe is a probe's name."""
    out = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                out |= {kw.value.value for kw in node.keywords if kw.arg == "code"
                        and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
                        and kw.value.value.partition("/")[0] in PROBE_NAMES}
    return out


def test_a_probe_code_is_registered_in_its_probe():
    """The codes a probe's files build for triage or check are declared in the probe's own
    `codes` (listed under it by `tndebug probes --codes`), not in OTHER_CODES, which keeps the
    codes of no probe."""
    assert sorted(c for c in OTHER_CODES if c.partition("/")[0] in PROBE_NAMES) == []
    built = _built_codes()
    assert "mask-broadcast/tndebug-masks" in built       # the scan sees them
    undeclared = sorted(c for c in built
                        if c.partition("/")[2] not in probe_class(c.partition("/")[0]).codes)
    assert undeclared == []


def test_the_home_check_can_fail(tmp_path):
    """Found however the finding is built (a helper's code=, an f-string code, Finding's probe);
    a probe's split file is home; codes of no probe and formatted probe names are not judged."""
    fake = tmp_path / "tndebug"
    (fake / "probes").mkdir(parents=True)
    (fake / "triage").mkdir()
    (fake / "probes" / "missing_scale_sweep.py").write_text(
        "Finding('missing-scale', 'error', 'x', code='missing-scale/sweep-mismatch')\n")
    (fake / "probes" / "head_weights.py").write_text(
        "Finding('head-collapse', 'error', 'x', code='head-collapse/duplicated-heads')\n")
    (fake / "triage" / "h.py").write_text(
        "_f('lr-schedule', 'info', 'x', code='lr-schedule/no-resume-state')\n"
        "Finding('checkpoint', 'error', 'x', code='checkpoint/config-mismatch')\n"
        "Finding(name, 'error', 'x', code=f'{name}/probe-failed')\n"
        "Finding('mask-broadcast', 'info', 'x')\n"
        "replace(f, code=f'positional-encoding/{kind}')\n")
    assert misplaced(fake) == [
        "tndebug/probes/head_weights.py:1: head-collapse",
        "tndebug/triage/h.py:1: lr-schedule",
        "tndebug/triage/h.py:4: mask-broadcast",
        "tndebug/triage/h.py:5: positional-encoding"]
