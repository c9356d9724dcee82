"""Typed findings (issue 20): every finding kind has a stable code `<probe>/<kind>`, declared
once with its meaning, carried by report.json (tndebug.report/2), listed by `tndebug probes
--codes`, and `--select` / `--ignore` take codes or probe names, as ruff does."""
from __future__ import annotations

import json
import re

import pytest

from tndebug import judge
from tndebug.cli import main
from tndebug.probes.codes import all_codes
from tndebug.errors import UsageError
from tndebug.findings import Finding, group_findings
from tndebug.probes import PROBE_NAMES, make_probes, probe_class
from tndebug.probes.base import ProbeError
from tndebug.report import Report

KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def test_every_probe_declares_its_codes_in_kebab_case():
    for name in PROBE_NAMES:
        codes = probe_class(name).codes
        assert codes, name
        assert all(KEBAB.match(k) and v for k, v in codes.items()), (name, codes)


def test_a_built_in_probe_cannot_report_an_undeclared_code():
    probe = make_probes(["missing-scale"])[0]
    with pytest.raises(ProbeError, match="not declared"):
        probe.report("error", "x", code="no-such-kind")
    f = probe.report("error", "x", code="absent")
    assert f.code == "missing-scale/absent"


def test_the_codes_command_lists_every_declared_code(capsys):
    assert main(["probes", "--codes"]) == 0
    out = capsys.readouterr().out
    for name in PROBE_NAMES:
        for kind in probe_class(name).codes:
            assert f"{name}/{kind}" in out
    assert len(out.splitlines()) == len(all_codes())


def test_every_code_is_listed_once_at_its_home():
    """A code a probe declares lives in its `codes`, not again in OTHER_CODES (issue 46:
    head-collapse's shared-projection and duplicated-heads were listed twice)."""
    from tndebug.probes.codes import OTHER_CODES
    codes = [c for c, _ in all_codes()]
    assert len(codes) == len(set(codes)), sorted(c for c in set(codes) if codes.count(c) > 1)
    declared = {f"{n}/{k}" for n in PROBE_NAMES for k in probe_class(n).codes}
    assert not declared & set(OTHER_CODES)


def test_a_faulted_run_reports_codes_and_ignore_drops_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    args = ["run", "--preset", "tiny", "--steps", "10", "--fault", "no_scale",
            "--probe", "missing-scale"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 1
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    assert a["schema"] == "tndebug.report/2"
    assert {f["code"] for f in a["findings"]} == {"missing-scale/absent"}
    assert main([*args, "--out", str(tmp_path / "b"), "--ignore", "missing-scale/absent"]) == 0
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    assert b["findings"] == [] and b["verdict"] == "clean"
    assert b["probes"]["missing-scale"] == {**b["probes"]["missing-scale"], "status": "pass",
                                            "ignored": ["missing-scale/absent"]}
    assert b["run"]["codes"] == {"select": [], "ignore": ["missing-scale/absent"], "dropped": 1}
    out = capsys.readouterr()
    assert "1 finding left out (--ignore missing-scale/absent)" in out.out + out.err


def test_select_keeps_only_the_named_kinds_and_a_probe_name_means_all_its_codes():
    fs = [Finding("mask-broadcast", "error", "a", code="mask-broadcast/causal-leak"),
          Finding("missing-scale", "error", "b", code="missing-scale/absent"),
          Finding("missing-scale", "info", "c", code="missing-scale/folded-into-weights")]
    probes = {"mask-broadcast": {"status": "fail"}, "missing-scale": {"status": "fail"}}
    r = judge.conclude({}, fs, probes, judge.Context(select=["missing-scale"]))
    assert [f.code for f in r.findings] == ["missing-scale/absent", "missing-scale/folded-into-weights"]
    assert r.probes["mask-broadcast"]["status"] == "pass"
    r = judge.conclude({}, fs, {k: dict(v) for k, v in probes.items()},
                       judge.Context(ignore=["missing-scale/absent"]))
    assert [f.code for f in r.findings] == ["mask-broadcast/causal-leak",
                                            "missing-scale/folded-into-weights"]


def test_bad_codes_are_a_usage_error():
    with pytest.raises(UsageError, match="no such finding code or probe"):
        judge.codes_option("mask-broadcast/nope")
    assert judge.codes_option("mask-broadcast, missing-scale/absent") == [
        "mask-broadcast", "missing-scale/absent"]


def test_findings_group_by_code_not_by_wording():
    one = Finding("mask-broadcast", "error", "decoder: the decoder sees the future", where="a",
                  code="mask-broadcast/causal-leak", fix="f")
    two = Finding("mask-broadcast", "error", "other words entirely for the same kind", where="b",
                  code="mask-broadcast/causal-leak", fix="f")
    (group,) = group_findings([one, two])
    assert group.wheres == ("a", "b")


def test_a_report_of_schema_1_still_reads_with_empty_codes():
    d = Report(run={}, findings=[Finding("nan-scores", "error", "x")]).to_dict()
    d["schema"] = "tndebug.report/1"
    for f in d["findings"]:
        f.pop("code")
    again = Report.from_dict(d)
    assert again.findings[0].code == ""
