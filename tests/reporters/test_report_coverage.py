"""Coverage in every reporter: "passed" lists only probes that checked something; no verdict and
partly checked probes say why; nothing checked is UNCHECKED, a probe that applied and decided
nothing makes the report INCOMPLETE, never CLEAN (exit 4 for both)."""
import io
import json

from tndebug.findings import Finding
from tndebug.report import Report
from tndebug.reporters import console, markdown
from tndebug.reporters.session import ReportSession

ATTN = [f"encoder.layers.{i}.self_attn" for i in range(3)]


def coverage_report() -> Report:
    info = Finding("ln-placement", "info", "norm placement pre-LN", step=0)
    probes = {
        "missing-scale": {"status": "pass", "coverage": {
            ATTN[0]: {"status": "checked"},
            ATTN[1]: {"status": "no verdict", "reason": "scores are not c*QK^T"},
            ATTN[2]: {"status": "no verdict", "reason": "scores are not c*QK^T"}}},
        "head-collapse": {"status": "no verdict", "reason": "the model exposes no attention capture"},
        "mask-broadcast": {"status": "pass", "coverage": {"": {"status": "checked"}}},
        "lr-schedule": {"status": "skipped", "reason": "no declared lr schedule",
                        "coverage": {"optimizer": {"status": "not applicable",
                                                   "reason": "no declared lr schedule"}}},
    }
    return Report(run={"task": "copy", "status": "completed"}, findings=[info], probes=probes)


def render_console(report, monkeypatch, width=80) -> str:
    monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    c = console.Console(file=buf, width=width, highlight=False, soft_wrap=False, no_color=True)
    console.print_summary(report, c)
    return buf.getvalue()


def test_console_lists_no_verdict_and_partly_checked_probes(monkeypatch):
    out = render_console(coverage_report(), monkeypatch)
    assert "verdict: INCOMPLETE" in out and "CLEAN" not in out
    assert ("NOT CHECKED: 1 probe that applies to this model could not check it: head-collapse "
            "(the model exposes no attention capture)") in " ".join(out.split())
    assert "probes passed (2): missing-scale, mask-broadcast" in out
    assert "probes with no verdict (1):" in out
    assert "NO VERDICT head-collapse: the model exposes no attention capture" in out
    assert "partly checked (1):" in out
    assert "missing-scale: 1 of 3 places checked; 2 no verdict:" in out
    assert "encoder.layers.1.self_attn, encoder.layers.2.self_attn: scores" in out   # wraps under itself
    assert "SKIPPED lr-schedule: no declared lr schedule" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_markdown_has_a_coverage_table():
    md = markdown.render(coverage_report(), with_figures=False)
    assert "| `head-collapse` | *no verdict* | the model exposes no attention capture |" in md
    table = md[md.index("### Coverage"):]
    assert "| probe | checked | no verdict | n/a | why no verdict |" in table
    assert (f"| `missing-scale` | 1 | 2 | 0 | {ATTN[1]}, {ATTN[2]}: scores are not c*QK^T |"
            in table)
    assert "| `lr-schedule` | 0 | 0 | 1 |  |" in table
    assert "`head-collapse`" not in table            # no coverage reported: not in the table


def unchecked_report() -> Report:
    probes = {"mask-broadcast": {"status": "pass", "coverage": {"": {"status": "checked"}}},
              "loss-health": {"status": "no verdict", "reason": "never observed a training step",
                              "steps_observed": 0},
              "lr-schedule": {"status": "no verdict", "reason": "never observed a training step",
                              "steps_observed": 0}}
    return Report(run={"task": "copy", "status": "completed", "steps": 0}, probes=probes)


def test_a_training_probe_without_steps_makes_the_verdict_unchecked(monkeypatch):
    report = unchecked_report()
    assert report.verdict == "unchecked" and report.exit_code() == 4
    assert report.exit_code("never") == 0
    assert report.unchecked() == ["loss-health", "lr-schedule"]
    out = render_console(report, monkeypatch)
    assert "verdict: UNCHECKED" in out and "CLEAN" not in out
    assert "UNCHECKED: 2 probes that need training observed no step: loss-health," in out
    md = markdown.render(report, with_figures=False)
    assert md.startswith("# tndebug report: UNCHECKED")
    assert "> **Unchecked:** 2 probes that need training observed no step" in md


def test_nothing_checked_is_unchecked_and_a_finding_still_wins():
    nothing = Report(run={}, probes={"head-collapse": {"status": "no verdict", "reason": "x"},
                                     "lr-schedule": {"status": "skipped"}})
    assert nothing.verdict == "unchecked" and nothing.unchecked() == ["head-collapse", "lr-schedule"]
    warned = Report(run={}, findings=[Finding("loss-health", "warning", "high")],
                    probes=unchecked_report().probes)
    assert warned.verdict == "warnings"
    clean = Report(run={}, probes={"nan-scores": {"status": "pass"}})
    assert clean.verdict == "clean" and clean.exit_code() == 0
    partly = Report(run={}, probes={"nan-scores": {"status": "pass"},
                                    "head-collapse": {"status": "no verdict", "reason": "x"}})
    assert partly.verdict == "incomplete" and partly.exit_code() == 4
    below = Report(run={}, findings=[Finding("loss-health", "warning", "high")],
                   probes=partly.probes)
    assert below.verdict == "warnings" and below.exit_code("error") == 4 and below.exit_code("warning") == 1


def test_report_json_round_trip_keeps_coverage(tmp_path):
    report = coverage_report()
    path = report.write_json(tmp_path / "report.json")
    data = json.loads(path.read_text())
    assert data["probes"]["missing-scale"]["coverage"][ATTN[1]]["status"] == "no verdict"
    again = Report.from_dict(data)
    assert again.probes == report.probes and again.verdict == report.verdict == "incomplete"
    assert again.incomplete() == {"head-collapse": "the model exposes no attention capture"}
    unchecked = Report.from_dict(json.loads(unchecked_report().write_json(tmp_path / "u.json").read_text()))
    assert unchecked.verdict == "unchecked"


def test_session_writes_the_coverage_to_report_md_and_json(tmp_path, capsys):
    s = ReportSession(tmp_path, fmt="text", tensorboard=False, figures=False)
    code = s.finish(unchecked_report())
    err = capsys.readouterr()
    assert code == 4
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "unchecked"
    assert "UNCHECKED" in (tmp_path / "report.md").read_text()
    assert "verdict: UNCHECKED" in err.out + err.err
