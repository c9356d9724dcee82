"""Report.findings_frame() / metrics_frame() and tndebug.load_report (tndebug/frames.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

import tndebug
from tndebug.frames import FIRST, finding_columns, metric_columns
from tndebug import tags
from tndebug.report import Report
from tndebug.reporters.session import ReportSession
from tndebug.train import TrainConfig, model_config, run_training

STEPS = 40
SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "no_scale" / "report.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"clean": (report, out), "errors": ...}: tiny runs of STEPS steps, every probe, written
    by a ReportSession as `tndebug run` writes them (TensorBoard on, figures off)."""
    out = {}
    for name, faults in (("clean", ()), ("errors", ("no_scale",))):
        d = tmp_path_factory.mktemp(name)
        session = ReportSession(d, tensorboard=True, figures=False, echo=False)
        result = run_training(model_config("copy", "tiny", faults=faults),
                              TrainConfig(steps=STEPS, batch_size=16, eval_size=16, device="cpu"),
                              probes="all", session=session)
        session.finish(result.report, fail_on="never")
        out[name] = (result.report, d)
    return out


@pytest.mark.parametrize("name,verdict", [("clean", "clean"), ("errors", "errors")])
def test_findings_frame_has_a_row_per_finding_and_the_evidence_as_columns(runs, name, verdict):
    report, _ = runs[name]
    assert report.verdict == verdict
    f = report.findings_frame()
    assert list(f.columns[:len(FIRST)]) == list(FIRST)
    assert list(f.columns[:len(finding_columns())]) == finding_columns()
    assert len(f) == len(report.findings)
    assert {f"evidence.{k}" for x in report.findings for k in x.evidence
            if not isinstance(x.evidence[k], dict)} <= set(f.columns)
    assert str(f["step"].dtype) == "Int64"
    if name == "errors":
        errors = f[f.severity == "error"]
        assert "missing-scale" in set(errors.probe)
        assert errors["evidence.scale_x_sqrt_dk"].notna().any()
        assert set(errors.code) <= {x.code for x in report.findings}


@pytest.mark.parametrize("name", ["clean", "errors"])
def test_metrics_frame_is_every_recorded_scalar_one_row_each(runs, name):
    report, _ = runs[name]
    m = report.metrics_frame()
    assert list(m.columns) == metric_columns()
    assert len(m) == sum(len(s) for s in report.metrics.values()) > 0
    assert m.step.is_monotonic_increasing
    assert (m.step < STEPS + 1).all()
    # the training curve and the probes' families
    loss = m[m.tag == "train/loss"]                  # logged every log_every steps and the last
    curve = dict(zip(report.history["step"], report.history["loss"]))
    assert list(loss.step) == [s for s in curve if s % 10 == 0 or s == STEPS - 1]
    assert list(loss.value) == pytest.approx([curve[s] for s in loss.step])
    assert {"head", "depth", "grad", "scale", "diversity"} <= set(m.family.dropna())
    parsed = m.tag.map(lambda t: tags.parse(t) is not None)
    assert (m.family.notna() == parsed).all()
    # head diversity: per head, with head as a column -> a layer x head table
    h = m.query("family == 'head' and kind == 'enc_self' and stat == 'entropy'")
    last = h[h.step == h.step.max()].pivot(index="layer", columns="head", values="value")
    cfg = model_config("copy", "tiny")
    assert last.shape == (cfg.n_layers, cfg.n_heads)
    assert last.notna().all().all()
    assert set(m[m.kind == "cross"]["stack"]) == {"decoder"}     # m.stack is DataFrame.stack
    assert str(m.layer.dtype) == "Int64" and str(m["head"].dtype) == "Int64"


def test_metrics_frame_holds_what_tensorboard_got(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tndebug.reporters.tensorboard import SAME_AS
    report, d = runs["errors"]
    acc = EventAccumulator(str(d / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    m = report.metrics_frame()
    series = {tag: list(zip(g.step, g.value)) for tag, g in m.groupby("tag", sort=False)}
    tb_tags = [t for t in acc.Tags()["scalars"] if not t.startswith(("hparams/", "nonfinite/"))]
    assert len(tb_tags) > 50
    for tag in tb_tags:
        tb = [(e.step, e.value) for e in acc.Scalars(tag)]
        if tag in SAME_AS.values():          # the trainer's tag, or the probe's at a step it missed
            ours = {s: v for t, sv in SAME_AS.items() if sv == tag for s, v in series.get(t, [])}
            ours.update(series.get(tag, []))
            assert all(ours[s] == pytest.approx(v, rel=1e-6, nan_ok=True) for s, v in tb), tag
        else:
            assert [s for s, _ in tb] == [s for s, _ in series[tag]], tag
            assert [v for _, v in tb] == pytest.approx([v for _, v in series[tag]], rel=1e-6,
                                                       nan_ok=True), tag
    assert set(series) - set(tb_tags) <= set(SAME_AS)


@pytest.mark.parametrize("name", ["clean", "errors"])
def test_load_report_gives_the_same_frames_as_the_report_in_memory(runs, name):
    report, d = runs[name]
    for path in (d, d / "report.json", str(d / "report.json")):
        loaded = tndebug.load_report(path)
        assert isinstance(loaded, Report) and loaded.verdict == report.verdict
        assert_frame_equal(loaded.findings_frame(), report.findings_frame())
        assert_frame_equal(loaded.metrics_frame(), report.metrics_frame())


def test_report_json_keeps_a_metric_tag_a_line(runs):
    report, d = runs["clean"]
    text = (d / "report.json").read_text()
    assert json.loads(text)["metrics"] == json.loads(json.dumps(report.to_dict()))["metrics"]
    lines = [ln for ln in text.splitlines() if ln.startswith('    "train/loss": [[')]
    assert len(lines) == 1


def test_a_report_written_before_metrics_loads_with_empty_frames(tmp_path):
    d = json.loads(SAMPLE.read_text())
    d.pop("metrics", None)
    (tmp_path / "report.json").write_text(json.dumps(d))
    r = tndebug.load_report(tmp_path)
    assert r.metrics == {}
    m = r.metrics_frame()
    assert list(m.columns) == metric_columns() and len(m) == 0
    assert len(r.findings_frame()) == len(d["findings"])
    assert list(Report(run={}).findings_frame().columns) == finding_columns()


def test_check_out_reaches_the_frames_through_the_loader(tmp_path):
    from tndebug.inject import make_model
    model = make_model(model_config("copy", "tiny", faults=("no_scale",)))
    report = tndebug.check(model, out=tmp_path / "c", probes="missing-scale,head-collapse")
    loaded = tndebug.load_report(tmp_path / "c")
    assert "missing-scale" in set(loaded.findings_frame().probe)
    assert_frame_equal(loaded.findings_frame(), report.findings_frame())
    assert_frame_equal(loaded.metrics_frame(), report.metrics_frame())
    assert (loaded.metrics_frame().family == "head").any()


@pytest.mark.parametrize("argv", [["run", "--steps", "abc"], ["--help"], ["run", "--nope"]])
def test_the_cli_refusing_a_flag_does_not_import_pandas(argv):
    code = ("import sys\nfrom tndebug.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
