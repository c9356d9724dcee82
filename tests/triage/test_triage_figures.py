"""Triage shows what it saw (issue 23): figures of the probed pass for user code, built-in
layouts and `tndebug.check(out=)`, each PNG looked at (not blank, labelled axes), linked to
the finding it illustrates in report.json and report.md; tb/ read back with TensorBoard's own
reader; --no-figures; outputs only once triage succeeded, and tb/ never holds two runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triage.conftest import TINY, run_triage_cli, zoo, zoo_spec
from tndebug.reporters.session import ReportSession
from tndebug.triage.run import TriageOptions, triage

MAPS = {"attention_enc_self.png", "attention_dec_self.png", "attention_cross.png"}
ONE_PASS = MAPS | {"entropy.png", "head_similarity.png", "depth.png"}


def user_ckpt(tmp_path: Path, name: str, **bugs) -> Path:
    torch.manual_seed(0)
    m = zoo("annotated").make_model(11, 11, **TINY, **bugs)
    path = tmp_path / f"{name}.pt"
    torch.save({"model": m.state_dict(), "config": {"src_vocab": 11, "tgt_vocab": 11, **TINY, **bugs}},
               path)
    return path


def user_opts(path: Path) -> TriageOptions:
    return TriageOptions(str(path), model=zoo_spec("annotated", "make_model"), adapter="annotated")


def assert_drawn(png: Path) -> None:
    """Opened as an image: a real size, and mostly not one colour."""
    from PIL import Image
    a = np.asarray(Image.open(png).convert("RGB")).astype(float)         # [H, W, 3]
    assert a.shape[0] >= 200 and a.shape[1] >= 300, (png.name, a.shape)
    assert (a < 245).any(-1).mean() > 0.05, f"{png.name} is nearly blank"
    assert a.std() > 20, f"{png.name} is nearly one colour"


def session_triage(opts: TriageOptions, out: Path, **kw) -> tuple:
    session = ReportSession(out, fmt="json", defer=True, echo=False, **kw)
    report = triage(opts, sinks=session.sinks)
    session.finish(report, fail_on="never")
    return report, session


def test_healthy_user_code_figures_are_drawn_labelled_and_illustrate_nothing(tmp_path):
    report, session = session_triage(user_opts(user_ckpt(tmp_path, "ok")), tmp_path / "out")
    names = {p.name for p in session.plots}
    assert names == ONE_PASS, names                           # no evidence figure: no finding
    for p in session.plots:
        assert_drawn(tmp_path / "out" / "figures" / p.name)
        assert any(k.endswith(".x") for k in p.labels) and any(k.endswith(".y") for k in p.labels), \
            (p.name, p.labels)
        assert p.findings == ()
    run = json.loads((tmp_path / "out" / "report.json").read_text())["run"]
    assert {f["file"] for f in run["figures"]} == {f"figures/{n}" for n in ONE_PASS}
    # the figure stage is timed with the other stages (issue 23's cost: bench/triage_speed.py)
    assert run["timings_s"]["figures_cpu"] > 0 and run["timings_s"]["figures"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## Figures") > md.index("## Probes")      # no finding: all under Figures
    for n in ONE_PASS:
        assert f"](figures/{n})" in md


def test_causal_leak_gets_its_evidence_next_to_the_finding(tmp_path):
    report, session = session_triage(user_opts(user_ckpt(tmp_path, "leak", causal=False)),
                                     tmp_path / "out")
    errors = [i for i, f in enumerate(report.findings)
              if f.probe == "mask-broadcast" and f.severity == "error"]
    assert errors, [f.message for f in report.findings]
    evidence = [p for p in session.plots if p.name.startswith("mask_dec_self")]
    assert len(evidence) == 1 and evidence[0].findings == (errors[0],)
    assert_drawn(tmp_path / "out" / "figures" / evidence[0].name)
    maps = next(p for p in session.plots if p.name == "attention_dec_self.png")
    assert errors[0] in maps.findings
    assert not next(p for p in session.plots if p.name == "attention_enc_self.png").findings
    md = (tmp_path / "out" / "report.md").read_text()
    finding_at = md.index("`mask-broadcast`")
    for name in (evidence[0].name, "attention_dec_self.png"):
        assert finding_at < md.index(f"](figures/{name})") < md.index("## Probes"), name
    listed = json.loads((tmp_path / "out" / "report.json").read_text())["run"]["figures"]
    assert next(f for f in listed if f["file"].endswith(evidence[0].name))["findings"] == [errors[0]]


def test_built_in_layout_gets_the_figures(tmp_path):
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dropout=0.0)
    path = tmp_path / "own.pt"
    torch.save({"format": "tndebug.checkpoint/1", "model": make_model(cfg).state_dict(),
                "global_step": 0, "model_config": cfg.to_dict()}, path)
    _, session = session_triage(TriageOptions(str(path)), tmp_path / "out")
    assert ONE_PASS <= {p.name for p in session.plots}
    for p in session.plots:
        assert_drawn(tmp_path / "out" / "figures" / p.name)


def test_cli_writes_tensorboard_read_back_by_its_own_reader(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    out = tmp_path / "out"
    code, _, err = run_triage_cli([user_ckpt(tmp_path, "leak", causal=False), "--model",
                                   zoo_spec("annotated", "make_model"), "--adapter", "annotated",
                                   "--out", out, "--fail-on", "never"], capsys)
    assert code == 0, err
    assert {p.name for p in (out / "figures").glob("*.png")} >= ONE_PASS
    ea = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    ea.Reload()
    tags = ea.Tags()
    assert {f"attn_maps/{k}/layer{i}" for k in ("enc_self", "dec_self", "cross") for i in (0, 1)} \
        <= set(tags["images"])
    assert "attn/dec_self/layer0/head0/entropy" in tags["scalars"]
    assert {e.step for e in ea.Scalars("attn/dec_self/layer0/head0/entropy")} == {0}   # one step
    assert any(t.startswith("hist/stream/") for t in tags["histograms"])
    layout = layout_pb2.Layout()
    layout.ParseFromString(ea.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    assert {"Head diversity", "Head similarity", "Depth"} <= {c.title for c in layout.category}
    text = ea.Tensors("report/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("# tndebug report: ERRORS") and "mask-broadcast" in text


def test_no_figures_and_a_rerun_keeps_one_tensorboard_run(tmp_path, capsys):
    ckpt, out = user_ckpt(tmp_path, "ok"), tmp_path / "out"
    argv = [ckpt, "--model", zoo_spec("annotated", "make_model"), "--adapter", "annotated",
            "--out", out, "--no-figures"]
    assert run_triage_cli(argv, capsys)[0] == 0
    assert not list(out.glob("figures/*.png"))
    run = json.loads((out / "report.json").read_text())["run"]
    assert run.get("figures") is None
    assert {"load", "probes"} <= set(run["timings_s"])            # stages timed, none drawn
    assert not {"figures", "figures_cpu"} & set(run["timings_s"]), run["timings_s"]
    assert "](figures/" not in (out / "report.md").read_text()
    first = list((out / "tb").glob("events.out.tfevents.*"))
    assert len(first) == 1
    assert run_triage_cli([*argv, "--overwrite"], capsys)[0] == 0      # its own tb/ is replaced
    again = list((out / "tb").glob("events.out.tfevents.*"))
    assert len(again) == 1 and again != first


def test_a_training_runs_tb_is_kept_and_none_written(tmp_path, capsys):
    ckpt, out = user_ckpt(tmp_path, "ok"), tmp_path / "run"
    (out / "tb").mkdir(parents=True)
    theirs = out / "tb" / "events.out.tfevents.1.host.1.0"
    theirs.write_bytes(b"")
    (out / "report.json").write_text(json.dumps({"schema": "tndebug.report/1", "run": {"task": "copy"}}))
    code, _, err = run_triage_cli([ckpt, "--model", zoo_spec("annotated", "make_model"),
                                   "--adapter", "annotated", "--out", out, "--overwrite"], capsys)
    assert code == 0
    assert list((out / "tb").glob("events.out.tfevents.*")) == [theirs]
    assert "holds another run's TensorBoard events (kept)" in err
    assert (out / "figures" / "depth.png").is_file()


def test_bad_input_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_triage_cli([user_ckpt(tmp_path, "ok"), "--model",
                                   zoo_spec("annotated", "no_such_factory"), "--out", out], capsys)
    assert code == 2 and not out.exists(), err


def test_check_out_writes_the_same_outputs_and_refuses_a_second_time(tmp_path):
    import tndebug
    from tndebug.errors import UsageError
    torch.manual_seed(0)
    model = zoo("annotated").make_model(11, 11, **TINY, causal=False)
    forward = None                               # The Annotated Transformer's: recognised
    out = tmp_path / "check"
    report = tndebug.check(model, forward, out=out)
    assert report.verdict == "errors"
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["run"]["mode"] == "check" and on_disk["run"]["figures"]
    assert any(f["file"].startswith("figures/mask_dec_self") for f in on_disk["run"]["figures"])
    for f in on_disk["run"]["figures"]:
        assert_drawn(out / f["file"])
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    with pytest.raises(UsageError, match=r"^check: out='.*' already holds tndebug output"):
        tndebug.check(model, forward, out=out)
    tndebug.check(model, forward, out=out, overwrite=True)
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert not (out / ".tndebug.lock").exists()


def test_hugging_face_directory_gets_the_figures(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    folder = tmp_path / "bart"
    transformers.AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(folder)
    report, session = session_triage(TriageOptions(str(folder)), tmp_path / "out")
    assert ONE_PASS <= {p.name for p in session.plots}, [p.name for p in session.plots]
    for p in session.plots:
        assert_drawn(tmp_path / "out" / "figures" / p.name)
    assert len(list((tmp_path / "out" / "tb").glob("events.out.tfevents.*"))) == 1
