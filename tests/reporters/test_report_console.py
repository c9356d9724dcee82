"""Terminal output: readable without colour, severity as a word, progress on stderr."""
import io
import re

from tndebug.findings import Finding
from tndebug.report import Report
from tndebug.reporters import console

ANSI = re.compile(r"\x1b\[")


def sample_report(status="completed") -> Report:
    findings = [Finding("missing-scale", "error", "scores were never scaled",
                        where="encoder.layers.0.self_attn", step=0,
                        evidence={"score_std": 8.01, "threshold": 3.0}, fix="divide by sqrt(d_k)"),
                Finding("head-collapse", "warning", "two heads are identical",
                        where="decoder.layers.1.cross_attn", step=40, head=2,
                        evidence={"similarity": 0.999, "threshold": 0.99}),
                Finding("lr-schedule", "info", "warmup is short", step=None)]
    run = {"task": "copy", "status": status, **({"stopped_at": 57} if status != "completed" else {})}
    return Report(run=run, findings=findings, first_sign=findings[0],
                  probes={"missing-scale": {"status": "fail"}, "head-collapse": {"status": "warn"},
                          "lr-schedule": {"status": "pass"},
                          "label-smoothing": {"status": "skipped", "reason": "no criterion given"}})


def render(report, monkeypatch, no_color=True) -> str:
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    console.print_summary(report, console.make_console(buf), {"report": "out/report.json"})
    return buf.getvalue()


def test_severity_words_without_colour(monkeypatch):
    out = render(sample_report(), monkeypatch)
    assert not ANSI.search(out)
    for word in ("ERROR", "WARN", "INFO"):
        assert re.search(rf"^\s*{word}\s", out, re.M), word
    assert "verdict: ERRORS" in out and "1 error, 1 warning, 1 info" in out
    assert "encoder.layers.0.self_attn" in out and "score_std=8.01" in out and "divide by sqrt(d_k)" in out
    assert "probes passed (1): lr-schedule" in out
    assert "SKIPPED label-smoothing: no criterion given" in out


def test_forced_colour_still_has_words(monkeypatch):
    buf = io.StringIO()
    c = console.Console(file=buf, force_terminal=True, color_system="standard", width=140)
    console.print_summary(sample_report(), c)
    out = buf.getvalue()
    assert ANSI.search(out)
    plain = ANSI.sub("", re.sub(r"\x1b\[[0-9;]*m", "", out))
    assert "ERROR" in plain and "WARN" in plain


def test_status_and_first_sign_are_prominent(monkeypatch):
    out = render(sample_report("diverged"), monkeypatch)
    head = out.split("severity")[0]                # above the table
    assert "RUN DIVERGED at step 57" in head
    assert "first sign: missing-scale at step 0 in encoder.layers.0.self_attn" in head


def test_clean_report(monkeypatch):
    out = render(Report(run={}, probes={"nan-scores": {"status": "pass"}}), monkeypatch)
    assert "verdict: CLEAN" in out and "no findings" in out and "RUN" not in out


def test_progress_plain_lines_on_a_pipe():
    buf = io.StringIO()
    with console.progress(50, "training", console.make_console(buf)) as bar:
        for step in range(50):
            bar.update(step + 1, loss=2.0 - step / 50, lr=1e-3)
    lines = buf.getvalue().splitlines()
    assert 5 <= len(lines) <= 12, lines                      # every tenth, not every step
    assert lines[-1].startswith("training: step 50/50")
    assert "loss 1.02" in lines[-1] and "lr 0.001" in lines[-1] and "step/s" in lines[-1]


def test_progress_interrupted_prints_last_step():
    buf = io.StringIO()
    try:
        with console.progress(100, "training", console.make_console(buf)) as bar:
            for step in range(100):
                bar.update(step + 1, loss=1.0, acc=None)
                if step == 14:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert buf.getvalue().splitlines()[-1].startswith("training: step 15/100")


def test_progress_live_on_a_terminal():
    import torch
    buf = io.StringIO()
    c = console.Console(file=buf, force_terminal=True, width=120)
    with console.progress(10, "training", c) as bar:
        for step in range(10):
            bar.update(step + 1, loss=torch.tensor(0.5), lr=2e-4)
    out = buf.getvalue()
    assert "10/10" in out and "loss 0.5" in out and "step/s" in out


def test_narrow_terminal_stacks_message_evidence_fix():
    buf = io.StringIO()
    console.print_summary(sample_report(), console.Console(file=buf, width=100, highlight=False))
    out = buf.getvalue()
    assert "message / evidence / fix" in out
    assert "evidence: score_std=8.01" in out and "threshold: 3" in out   # 3 significant digits
    assert "fix: divide by sqrt(d_k)" in out


def test_nested_evidence_is_named_not_dumped(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)     # a pipe's width (pytest-xdist's workers set 80)
    r = Report(run={}, findings=[Finding("mask-broadcast", "error", "future keys visible", step=0,
                                         evidence={"modules": {"decoder.layers.0.self_attn": {"mass": 1.0}},
                                                   "thresholds": {"mass": 1e-6}})])
    buf = io.StringIO()
    console.print_summary(r, console.make_console(buf))
    out = buf.getvalue()
    assert "modules, thresholds (in report.md)" in out and "decoder.layers.0.self_attn" not in out


def _live(width: int, total: int = 60) -> str:
    buf = io.StringIO()
    c = console.Console(file=buf, force_terminal=True, width=width, color_system=None)
    with console.progress(total, "training", c) as bar:
        for step in range(total):
            bar.update(step + 1, loss=7.314e4, lr=32.27, acc=0.1238)
    return buf.getvalue().split("\r")[-1]


def test_progress_bar_reads_right_at_80_columns():
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", _live(80)).strip()
    assert "…" not in last and len(last) <= 80, last
    assert "60/60" in last and "loss 7.314e+04" in last and "lr 32.27" in last
    assert "step/s" in _live(160) and "100%" in _live(160)


def test_findings_table_reads_right_at_80_columns():
    """Nothing wider than the console; a module path is broken only after a dot."""
    from tndebug.findings import PATH
    from tests.reporters.test_report_groups import six_module_report
    for report in (sample_report(), six_module_report()):
        known = {p for f in report.findings for p in PATH.findall(f.message) + [f.where] if p}
        for width in (80, 110):
            buf = io.StringIO()
            console.print_summary(report, console.Console(file=buf, width=width, highlight=False))
            out = buf.getvalue()
            assert max(len(line) for line in out.splitlines()) <= width
            for line in out.splitlines():
                for word in re.findall(r"[A-Za-z_][\w.]*\w\.?", line):
                    if "." not in word.strip(".") or word in known:
                        continue
                    head = word.endswith(".") and any(k.startswith(word) for k in known)
                    tail = any(k.endswith("." + word) for k in known)
                    assert head or tail, (width, word, line)
