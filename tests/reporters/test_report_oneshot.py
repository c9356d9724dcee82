"""One probed step (triage, check): the evidence figure of a mask finding, the finding each
figure illustrates, the finite-data note of a single snapshot, and a deferred session that
writes nothing until finish."""
import torch

from tndebug.findings import Finding
from tndebug.report import Report
from tndebug.reporters import figures_common, plots
from tndebug.reporters.plots_evidence import forbidden_mass, mask_figures
from tndebug.reporters.recorder import Recorder
from tndebug.reporters.session import ReportSession
from tndebug.capture.trace import AttentionRecord, Trace

SRC = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])           # pad 0
TGT = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 0]])


def one_step(causal: bool = True, nan: bool = False) -> Recorder:
    """A Recorder that saw one step of a 2-layer, 2-head model; decoder self-attention uniform
    over the allowed keys (causal) or over every key (a leak), NaN everywhere with `nan`."""
    T = S = 4
    allowed = torch.ones(T, S).tril() if causal else torch.ones(T, S)
    dec = (allowed / allowed.sum(-1, keepdim=True)).expand(2, 2, T, S).clone()
    keep = (SRC != 0).float()[:, None, None, :]                           # [b, 1, 1, S]
    enc = (keep / keep.sum(-1, keepdim=True)).expand(2, 2, T, S).clone()
    if nan:
        dec[:] = enc[:] = float("nan")
    att = {}
    for i in range(2):
        for site, kind, p in ((f"encoder.layers.{i}.self_attn", "enc_self", enc),
                              (f"decoder.layers.{i}.self_attn", "dec_self", dec)):
            att[site] = AttentionRecord(site, kind, i, probs=p)
    rec = Recorder()
    rec.on_trace(0, Trace(step=0, src=SRC, tgt=TGT, attention=att))
    return rec


def leak_finding() -> Finding:
    return Finding("mask-broadcast", "error", "decoder.layers.0.self_attn: real queries put up "
                   "to 0.750 of their attention on future keys (no causal mask)",
                   where="decoder.layers.0.self_attn", step=0,
                   evidence={"behaviour": {"causality": {"delta": 0.5, "tol": 1e-5, "finite": True}},
                             "modules": {"decoder.layers.0.self_attn": {"forbidden_mass_max": 0.75}},
                             "thresholds": {"forbidden_mass": 1e-6}})


def test_forbidden_mass_is_zero_when_masked_and_shows_the_leak():
    healthy = forbidden_mass(one_step(causal=True).attention_snapshot()[0], "dec_self")
    leak = forbidden_mass(one_step(causal=False).attention_snapshot()[0], "dec_self")
    assert healthy.shape == (2, 2) and abs(healthy).max() < 1e-6
    assert abs(leak - 0.75).max() < 1e-6                   # query 0 of 4 uniform keys: 3/4 future
    enc = forbidden_mass(one_step().attention_snapshot()[0], "enc_self")
    assert abs(enc).max() < 1e-6                           # pads masked in the encoder


def test_mask_evidence_figure_only_for_a_mask_finding(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(figures_common, "save", lambda fig, path: figs.append(fig))
    rec = one_step(causal=False)
    info = Finding("nan-scores", "info", "fill -1e9 would overflow float16", where="", step=0)
    assert mask_figures(rec, [info], tmp_path) == []
    (p,) = mask_figures(rec, [info, leak_finding()], tmp_path)
    assert p.findings == (1,) and p.name == "mask_dec_self_1.png"
    bars, heat, _bar = figs[-1].axes
    assert [round(b.get_width()) for b in bars.patches] == [750000, 50000]   # measured / threshold
    assert heat.get_xlabel() == "head" and heat.get_ylabel() == "layer"
    assert p.labels["0.x"].startswith("measured / its threshold")


def test_figures_link_to_warnings_and_errors_of_their_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(figures_common, "save", lambda fig, path: None)
    rec = one_step(causal=False)
    info = Finding("nan-scores", "info", "advisory", where="decoder.layers.0.self_attn", step=0)
    report = Report(run={"mode": "triage"}, findings=[info, leak_finding()])
    by = {p.name: p.findings for p in plots.make_figures(rec, report, tmp_path)}
    assert by["attention_dec_self.png"] == (1,) and by["attention_enc_self.png"] == ()
    assert by["mask_dec_self_1.png"] == (1,)


def test_one_nan_snapshot_says_so(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(figures_common, "save", lambda fig, path: figs.append(fig))
    rec = one_step(nan=True)
    att = plots.figure_attention_maps(rec, "dec_self", tmp_path)
    assert "Magenta: 64 NaN/Inf cells" in att.caption          # 2 layers x 2 heads x 16
    ent = plots.figure_entropy(rec, tmp_path)
    assert "no finite data (step 0)" in ent.caption            # not an entropy of 0
    assert any("no finite data" in t.get_text() for t in figs[-1].axes[0].texts)
    sim = plots.figure_similarity(rec, tmp_path)
    assert "no finite data (step 0)" in sim.caption            # not "identical heads"
    healthy = plots.figure_similarity(one_step(), tmp_path)
    assert "no finite data" not in healthy.caption


def test_deferred_session_writes_nothing_until_finish(tmp_path):
    out = tmp_path / "out"
    session = ReportSession(out, fmt="json", defer=True, echo=False)
    rec = one_step(causal=False)
    for sink in session.sinks:                              # what the engine does at step 0
        sink.on_metric(0, "attn/dec_self/layer0/head0/entropy", 0.5)
    assert not list(out.rglob("*"))
    session.sinks[-1].on_trace(0, Trace(step=0, src=SRC, tgt=TGT,
                                        attention={a.site: AttentionRecord(a.site, a.kind, a.layer,
                                                                           probs=a.probs)
                                                   for a in rec.last.attention}))
    assert not list(out.rglob("*"))
    session.finish(Report(run={"mode": "triage"}, findings=[leak_finding()]), fail_on="never")
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert (out / "report.json").is_file()
