"""ReportSession end to end: files, stdout per --format, exit codes, idempotent finish."""
import json

import pytest

from tndebug.findings import Finding
from tndebug.report import SCHEMA, Report
from tndebug.reporters.session import ReportSession

PNG = b"\x89PNG\r\n\x1a\n"


def small_report(status="completed") -> Report:
    f = Finding("nan-scores", "warning", "NaN in scores", where="encoder.layers.0.self_attn", step=3,
                evidence={"nan_fraction": 0.25, "threshold": 0.0})
    return Report(run={"task": "copy", "steps": 5, "status": status, "final_loss": 1.5},
                  findings=[f], first_sign=f,
                  probes={"nan-scores": {"status": "warn"},
                          "label-smoothing": {"status": "skipped", "reason": "no criterion"}})


def test_json_format_prints_only_json_on_stdout(tmp_path, capsys):
    s = ReportSession(tmp_path, fmt="json", tensorboard=False, figures=False)
    with s.progress(5) as bar:
        for step in range(5):
            bar.update(step + 1, loss=1.0, lr=1e-3)
            s.log_scalars(step, {"train/loss": 1.0})
    code = s.finish(small_report(), fail_on="warning")
    out, err = capsys.readouterr()
    data = json.loads(out)                           # nothing but the JSON
    assert data["schema"] == SCHEMA and data["verdict"] == "warnings"
    assert data["probes"]["label-smoothing"] == {"status": "skipped", "reason": "no criterion"}
    assert code == 1
    assert "training: step 5/5" in err and "verdict: WARNINGS" in err


def test_md_format_prints_the_markdown(tmp_path, capsys):
    s = ReportSession(tmp_path, fmt="md", tensorboard=False, figures=False)
    s.finish(small_report())
    out, err = capsys.readouterr()
    assert out.startswith("# tndebug report: WARNINGS")
    assert out == (tmp_path / "report.md").read_text()
    assert "verdict: WARNINGS" in err


def test_text_format_prints_the_table(tmp_path, capsys):
    s = ReportSession(tmp_path, fmt="text", tensorboard=False, figures=False)
    assert s.finish(small_report(), fail_on="error") == 0
    out, _ = capsys.readouterr()
    assert "WARN" in out and "nan-scores" in out and "nan_fraction=0.25" in out


@pytest.mark.parametrize("fail_on,code", [("error", 0), ("warning", 1), ("info", 1), ("never", 0)])
def test_exit_codes(tmp_path, fail_on, code):
    s = ReportSession(tmp_path, fmt="json", tensorboard=False, figures=False)
    assert s.finish(small_report(), fail_on=fail_on) == code


def test_finish_is_idempotent_and_close_is_safe(tmp_path, capsys):
    s = ReportSession(tmp_path, fmt="text", tensorboard=True)
    s.log_scalars(0, {"train/loss": 2.0})
    first = s.finish(small_report("interrupted"), fail_on="warning")
    capsys.readouterr()
    assert s.finish(small_report(), fail_on="never") == first == 1
    assert capsys.readouterr().out == ""              # printed once
    s.close()
    s.close()


def test_close_without_finish_flushes_tensorboard(tmp_path):
    from test_report_tensorboard import load
    s = ReportSession(tmp_path, tensorboard=True)
    for step in range(3):
        s.log_scalars(step, {"train/loss": 3.0 - step})
    s.on_metric(2, "attn/enc_self/layer0/head0/entropy", 0.5)
    s.close()                                         # the trainer's `finally` on Ctrl-C
    acc = load(tmp_path / "tb")
    assert [e.value for e in acc.Scalars("train/loss")] == [3.0, 2.0, 1.0]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]


def test_report_json_round_trips(tiny_run):
    data = json.loads((tiny_run["dir"] / "report.json").read_text())
    again = Report.from_dict(data)
    assert again.verdict == "errors" and tiny_run["code"] == 1
    assert data["run"]["status"] == "diverged" and data["first_sign"]["probe"] == "missing-scale"
    assert data["probes"]["stand-in-skipped"]["status"] == "skipped"
    assert {f["severity"] for f in data["findings"]} == {"error", "warning"}


def test_bad_format():
    with pytest.raises(ValueError, match="format 'yaml'"):
        ReportSession("/tmp/never-created-tndebug", fmt="yaml")


def test_a_failing_figure_does_not_lose_the_report(tmp_path, monkeypatch, capsys):
    import tndebug.reporters.plots as plots

    def boom(*a, **k):
        raise RuntimeError("no display")
    monkeypatch.setattr(plots, "figure_curves", boom)
    s = ReportSession(tmp_path, fmt="text", tensorboard=False)
    s.log_scalars(0, {"train/loss": 1.0})
    assert s.finish(small_report(), fail_on="warning") == 1
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.md").exists()
    assert "no display" in capsys.readouterr().err


def test_a_diverged_run_full_of_nan_still_reports(tmp_path, capsys):
    import torch

    from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace
    s = ReportSession(tmp_path, fmt="text", tb_every=1)
    src = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    for step in range(3):
        probs = torch.full((2, 2, 4, 4), float("nan") if step == 2 else 0.25)
        x = torch.full((2, 4, 8), float("inf") if step == 2 else 1.0)
        trace = Trace(step=step, src=src, tgt=src, attention={
            f"encoder.layers.{i}.self_attn": AttentionRecord(f"encoder.layers.{i}.self_attn",
                                                              "enc_self", i, probs=probs)
            for i in range(2)}, streams=[StreamPoint("encoder.layers.0.hook_out", "encoder", 0,
                                                     "layer", x)])
        for sink in s.sinks:
            sink.on_trace(step, trace)
        s.on_metric(step, "attn/enc_self/layer0/head0/entropy", float("nan") if step == 2 else 1.0)
        s.log_scalars(step, {"train/loss": float("nan") if step == 2 else 2.0, "train/lr": 1e-3})
    code = s.finish(small_report("diverged"), fail_on="error")
    assert code == 0
    names = {p.name for p in s.plots}
    assert {"curves.png", "entropy.png", "head_similarity.png", "attention_enc_self.png",
            "depth.png"} <= names, names
    for p in s.plots:
        assert (tmp_path / "figures" / p.name).read_bytes()[:8] == PNG
    assert "RUN DIVERGED" in capsys.readouterr().out


def test_paths_in_reports_are_relative_to_the_run_directory(tmp_path, monkeypatch, capsys):
    """report.json and report.md name the checkpoint as `checkpoint.pt`, not as a path of the
    machine that made it; a file outside the run directory is relative to the current one."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "a"
    s = ReportSession(out, fmt="text", tensorboard=False, figures=False)
    s.finish(Report(run={"status": "completed", "checkpoint": str(out / "checkpoint.pt")}))
    assert json.loads((out / "report.json").read_text())["run"]["checkpoint"] == "checkpoint.pt"
    md = (out / "report.md").read_text()
    assert "| checkpoint | checkpoint.pt |" in md and str(tmp_path) not in md
    (tmp_path / "models").mkdir()
    s = ReportSession(tmp_path / "triage-x", fmt="text", tensorboard=False, figures=False)
    s.finish(Report(run={"mode": "triage", "checkpoint": str(tmp_path / "models" / "m.pt")}))
    data = json.loads((tmp_path / "triage-x" / "report.json").read_text())
    assert data["run"]["checkpoint"] == "models/m.pt"
