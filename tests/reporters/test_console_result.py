"""`tndebug run`'s summary says what the run achieved: the held-out exact match and token
accuracy, the training and whole-run times (report.json's run), in one line of <= 80 columns."""
import io

from tndebug.report import Report
from tndebug.reporters import console


def _report(**run) -> Report:
    return Report(run={"task": "copy", "status": "completed", **run}, findings=[],
                  probes={"nan-scores": {"status": "pass"}})


def _summary(report, monkeypatch) -> list[str]:
    monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    console.print_summary(report, console.make_console(buf))
    return buf.getvalue().splitlines()


def test_a_run_shows_its_result_and_times(monkeypatch):
    r = _report(exact_match=0.984375, token_accuracy=0.99805, train_s=12.34, wall_s=14.06)
    line = "held-out: exact match 98.4%, token accuracy 99.8%; train 12.3 s, wall 14.1 s"
    assert console.result_text(r) == line
    assert line in _summary(r, monkeypatch)


def test_long_runs_and_full_marks_fit_80_columns():
    r = _report(exact_match=1.0, token_accuracy=1.0, train_s=1234.5, wall_s=7384.0)
    line = console.result_text(r)
    assert line == "held-out: exact match 100.0%, token accuracy 100.0%; train 20m34s, wall 2h03m"
    assert len(line) <= 80


def test_a_run_that_was_not_evaluated_still_shows_its_times():
    r = _report(exact_match=None, token_accuracy=None, train_s=3.0, wall_s=3.5, status="interrupted")
    assert console.result_text(r) == "held-out: not evaluated; train 3.0 s, wall 3.5 s"


def test_triage_check_and_watch_train_nothing_of_their_own(monkeypatch):
    for run in ({"mode": "triage", "wall_s": 2.0}, {"mode": "watch", "wall_s": 9.0, "steps": 30}):
        r = _report(**run)
        assert console.result_text(r) is None
        assert not any(ln.startswith("held-out:") for ln in _summary(r, monkeypatch))
