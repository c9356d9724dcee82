"""variance-drift: healthy tiny runs are clean; a missing residual is a rank collapse at step 0."""
from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.probes import probe_class
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.variance_drift import VarianceDrift
from tndebug.subject import Subject
from tndebug.capture.trace import StreamPoint, Trace


def alarms(findings):
    return [f for f in findings if f.probe == "variance-drift" and f.severity != "info"]


def test_registered():
    assert probe_class("variance-drift") is VarianceDrift


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_tiny_is_clean(norm):
    probe = VarianceDrift()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=3)
    assert alarms(findings) == []
    assert probe.placement == norm          # found from the activations
    assert probe.checked


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_no_residual_is_a_rank_collapse_at_step0(norm):
    probe = VarianceDrift()
    _, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm).with_faults("no_residual"),
                                       [probe], steps=2)
    found = {f.where: f for f in alarms(findings)}
    # the cross-attention sublayer averages the memory into one vector for every query
    assert set(found) == {"decoder.layers.0.sublayer.1", "encoder.layers.1.sublayer.0"}
    dec = found["decoder.layers.0.sublayer.1"]
    assert dec.severity == "error" and dec.step == 0 and dec.layer == 0
    assert dec.evidence["r"] < 0.002 and dec.evidence["threshold_r_error"] == 0.02
    enc = found["encoder.layers.1.sublayer.0"]
    assert enc.step == 0 and enc.evidence["kept"] < 0.2
    for f in (dec, enc):    # the output keeps nothing of the input: the residual add is missing
        assert f.evidence["cause"] == "missing" and f.evidence["retention"] < 0.3
    assert "x + dropout(sublayer(x))" in dec.fix


def test_metrics_use_the_reporters_tags():
    probe = VarianceDrift()
    seen = []

    class Sink:
        def on_metric(self, step, tag, value):
            seen.append(tag)

    train_with_probes(ModelConfig.tiny(), [probe], steps=1, sinks=[Sink()])
    assert "depth/encoder/layer1/resid_rms" in seen and "depth/decoder/layer0/rank" in seen


def test_growth_beyond_envelope_warns():
    """A stream whose RMS grows 100x across depth (synthetic trace) is a warning."""
    probe = VarianceDrift()
    probe.placement = "pre"
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, 16, generator=g)
    trace = Trace(src=torch.full((4, 6), 3), tgt=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("src_embed.hook_out", "embed", None, "embed", x0),
                     StreamPoint("enc.0", "encoder", 0, "layer", x0 * 10 + torch.randn(4, 6, 16, generator=g)),
                     StreamPoint("enc.1", "encoder", 1, "layer", x0 * 100 + torch.randn(4, 6, 16, generator=g))]
    stats = probe.observe(trace, StepInfo(5))
    probe.update(stats, StepInfo(5))
    (f,) = probe.findings
    assert f.severity == "warning" and f.where == "encoder" and f.evidence["growth"] > 24


def collapsing_trace(collapsed: bool):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 6, 16, generator=g)
    top = torch.randn(4, 1, 16, generator=g).expand(4, 6, 16) if collapsed else x0 + 0.5
    trace = Trace(src=torch.full((4, 6), 3), tgt=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("dec_embed", "embed", None, "embed", x0),
                     StreamPoint("dec.0", "decoder", 0, "layer", x0 * 2),
                     StreamPoint("dec.1", "decoder", 1, "layer", top.clone())]
    return trace


def test_collapse_that_appears_during_training_gets_the_lr_fix():
    probe = VarianceDrift()
    for step, collapsed in ((0, False), (100, True), (200, True)):
        probe.update(probe.observe(collapsing_trace(collapsed), StepInfo(step)), StepInfo(step))
    (f,) = alarms(probe.findings)
    assert f.severity == "error" and f.where == "dec.1" and f.step == 100
    assert "during training" in f.message and "learning rate" in f.fix
    assert f.evidence["cause"] == "dynamic"


def test_residual_swamped_at_init_is_a_warning_not_a_missing_residual():
    """The input survives in the output (retention ~1) but a huge common vector is added."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 6, 16, generator=g)
    trace = Trace(src=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("enc_embed", "embed", None, "embed", x0),
                     StreamPoint("enc.0", "encoder", 0, "layer", x0 + 300 * torch.ones(16))]
    probe = VarianceDrift()
    probe.update(probe.observe(trace, StepInfo(0)), StepInfo(0))
    (f,) = alarms(probe.findings)
    assert f.severity == "warning" and f.evidence["cause"] == "swamped"
    assert f.evidence["retention"] > 0.99 and f.evidence["r"] < 0.02


def partly_collapsing_trace(noise: float):
    """dec.1 replaces its input by one vector per sequence plus `noise` of fresh noise: r falls
    from ~0.9 to ~noise, and the output keeps nothing of the input (retention ~0)."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 6, 16, generator=g)
    top = torch.randn(4, 1, 16, generator=g).expand(4, 6, 16) + noise * torch.randn(4, 6, 16, generator=g)
    trace = Trace(src=torch.full((4, 6), 3), tgt=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("dec_embed", "embed", None, "embed", x0),
                     StreamPoint("dec.0", "decoder", 0, "layer", x0 * 2),
                     StreamPoint("dec.1", "decoder", 1, "layer", top)]
    return trace


def test_triage_reports_one_finding_per_module_in_its_own_words():
    """Triage checks the same weights twice (setup's random batch, then the probed batch): a
    warning then an error at one module is one finding, the error, and nothing 'during
    training' in a run that trains nothing (issue 19)."""
    probe = VarianceDrift()
    probe.mode = "triage"
    probe._check({k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                  for k, v in probe.observe(partly_collapsing_trace(0.08), None).items()}, 0, emit=False)
    assert [f.severity for f in alarms(probe.findings)] == ["warning"]
    probe.update(probe.observe(partly_collapsing_trace(0.0), StepInfo(0)), StepInfo(0))
    (f,) = [f for f in probe.findings if f.where == "dec.1"]
    assert f.severity == "error" and f.evidence["cause"] == "missing" and f.evidence["r"] < 0.002
    assert "during training" not in f.message and "in the trained weights" not in f.message
    assert "x + dropout(sublayer(x))" in f.fix


def swamped_trace(logits: str):
    """Retention ~1 (the residual is there) under a huge common vector, with logits that vary
    over the positions or are the same at every position."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 6, 16, generator=g)
    trace = Trace(src=torch.full((4, 6), 3), tgt=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("enc_embed", "embed", None, "embed", x0),
                     StreamPoint("enc.0", "encoder", 0, "layer", x0 + 300 * torch.ones(16))]
    trace.logits = (torch.randn(4, 6, 11, generator=g) if logits == "vary"
                    else torch.randn(4, 1, 11, generator=g).expand(4, 6, 11).clone())
    return trace


@pytest.mark.parametrize("logits", ["vary", "collapsed"])
def test_collapse_of_trained_weights_that_keep_token_differences_is_info(logits):
    """A statistic of a model still learning is not a defect (issue 19): a half-trained
    BlenderbotSmall (r = 0.002, retention 0.99, logits varying) and HF LED / Megatron-BERT on
    the plateau of their targets' prior (retention 0.96-0.99, logits the same at every
    position) are info with their reason, collapsed logits included."""
    probe = VarianceDrift()
    probe.mode = "triage"
    probe.update(probe.observe(swamped_trace(logits), StepInfo(0)), StepInfo(0))
    (f,) = [f for f in probe.findings if f.where == "enc.0"]
    assert f.evidence["retention"] > 0.99 and f.evidence["r"] < 0.02
    assert f.severity == "info" and f.evidence["cause"] == "statistic" and f.fix == ""
    assert "not a defect shown" in f.message
    if logits == "vary":
        assert f.evidence["logits_r"] > 0.5
    else:
        assert f.evidence["logits_r"] < f.evidence["threshold_r_error"]
        assert "one answer whatever its input" in f.message


@pytest.mark.parametrize("logits", ["vary", "collapsed"])
def test_collapse_at_the_first_check_is_judged_as_code(logits):
    """The same traces at `tndebug run`'s first check (step 0: the code at initialisation): a
    swamped residual is a warning, an error with the logits collapsed too; at_init (triage's
    fresh-init re-judge) gives the same from the evidence."""
    probe = VarianceDrift()
    probe._check({k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                  for k, v in probe.observe(swamped_trace(logits), None).items()}, 0, emit=False)
    (f,) = [f for f in probe.findings if f.where == "enc.0"]
    want = ("warning", "swamped") if logits == "vary" else ("error", "output")
    assert (f.severity, f.evidence["cause"]) == want
    assert VarianceDrift.at_init(f.evidence) == want
    assert "during training" not in f.message


def test_at_init_needs_a_collapse():
    """at_init: no finding for a stream that keeps its rank; a missing residual keeps its
    r-decided severity."""
    ev = {"r": 0.5, "kept": 0.9, "retention": 0.95, "logits_r": 0.9}
    assert VarianceDrift.at_init(ev) is None
    assert VarianceDrift.at_init({**ev, "r": 0.001, "retention": 0.05}) == ("error", "missing")
    assert VarianceDrift.at_init({**ev, "r": 0.1, "kept": 0.1, "retention": 0.05}) == ("warning", "missing")


# -- the same bug written by hand ----------------------------------------------------------
class HandBlock(nn.Module):
    """A user's pre-LN block that forgot the residual adds: x = f(norm(x))."""

    def __init__(self, d: int, h: int, cross: bool) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.src_attn = nn.MultiheadAttention(d, h, batch_first=True) if cross else None
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))

    def forward(self, x, pad, mem=None, mem_pad=None, causal=None):
        y = self.ln1(x)
        x = self.attn(y, y, y, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]  # bug
        if self.src_attn is not None:
            y = self.ln2(x)
            x = self.src_attn(y, mem, mem, key_padding_mask=mem_pad, need_weights=False)[0]      # bug
        return self.mlp(self.ln3(x))                                                            # bug


class HandSeq2Seq(nn.Module):
    def __init__(self, vocab=11, d=32, h=4, n=2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(64, d))
        self.enc = nn.ModuleList([HandBlock(d, h, False) for _ in range(n)])
        self.dec = nn.ModuleList([HandBlock(d, h, True) for _ in range(n)])
        self.enc_norm, self.dec_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def embed(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]   # [B, T, d]

    def forward(self, src, tgt):
        src_pad, tgt_pad = src == 0, tgt == 0
        T = tgt.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)   # True = blocked (nn.MultiheadAttention)
        x = self.embed(src)
        for blk in self.enc:
            x = blk(x, src_pad)
        mem = self.enc_norm(x)
        y = self.embed(tgt)
        for blk in self.dec:
            y = blk(y, tgt_pad, mem, src_pad, causal)
        return self.out(self.dec_norm(y))


class HookCapture:
    """A user-side capture: forward hooks on the blocks, nothing of tndebug's naming."""

    def __init__(self, model: HandSeq2Seq) -> None:
        self.points = [(f"enc.{i}", b, "encoder", i, "layer") for i, b in enumerate(model.enc)]
        self.points += [(f"dec.{i}", b, "decoder", i, "layer") for i, b in enumerate(model.dec)]
        self.points += [("enc_norm", model.enc_norm, "encoder", None, "stack"),
                        ("dec_norm", model.dec_norm, "decoder", None, "stack")]

    @contextmanager
    def recording(self, reads, trace):
        handles = []
        for name, mod, stack, layer, kind in self.points:
            def hook(m, i, o, name=name, stack=stack, layer=layer, kind=kind):
                trace.streams.append(StreamPoint(name, stack, layer, kind, o.detach()))
            handles.append(mod.register_forward_hook(hook))
        try:
            yield trace
        finally:
            for h in handles:
                h.remove()


def hand_subject(model):
    return Subject(model, lambda m, s, t, pad: m(s, t), pad_id=0, bos_id=1, src_vocab=11,
                   tgt_vocab=11, capture=HookCapture(model))


def test_hand_written_missing_residual_is_caught():
    probe = VarianceDrift()
    probe.setup(RunContext(subject=hand_subject(HandSeq2Seq())))
    found = {f.where: f for f in alarms(probe.findings)}
    assert found["dec.0"].severity == "error" and found["dec.0"].step == 0
    assert found["dec.0"].evidence["r"] < 0.002
    assert set(found) <= {"dec.0", "enc.0", "enc.1"}


def test_hand_written_healthy_is_clean():
    model = HandSeq2Seq()

    def fixed(blk):
        def forward(x, pad, mem=None, mem_pad=None, causal=None):
            y = blk.ln1(x)
            x = x + blk.attn(y, y, y, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]
            if blk.src_attn is not None:
                y = blk.ln2(x)
                x = x + blk.src_attn(y, mem, mem, key_padding_mask=mem_pad, need_weights=False)[0]
            return x + blk.mlp(blk.ln3(x))
        return forward

    for blk in [*model.enc, *model.dec]:
        blk.forward = fixed(blk)
    probe = VarianceDrift()
    probe.setup(RunContext(subject=hand_subject(model)))
    assert alarms(probe.findings) == [] and probe.checked
    assert not math.isnan(probe.max_growth.get("decoder", float("nan")))


def test_depth_profile_matches_the_definitions_point_by_point():
    """r, RMS and retention as written in the module docstring, one point and one sequence
    at a time with boolean indexing, against the one-pass version the probe uses."""
    from tndebug.probes import _depth_stats as ds
    torch.manual_seed(0)
    xs = list(torch.randn(4, 3, 7, 16))
    xs[2] = xs[1] + 0.1 * torch.randn(3, 7, 16)              # a residual-like successor
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[0, 5:] = False
    keep[2, 1:] = False                                      # one real token: NaN for it
    got = ds.depth_profile(xs, keep)

    def centred(x, b):
        t = x[b][keep[b]]
        return t - t.mean(0)

    for p, x in enumerate(xs):
        seqs = [b for b in range(3) if keep[b].sum() >= 2]
        r = sum(float(centred(x, b).norm() / x[b][keep[b]].norm()) for b in seqs) / len(seqs)
        rms = float(x[keep].pow(2).mean().sqrt())
        assert float(got[p, 0]) == pytest.approx(r, rel=1e-5)
        assert float(got[p, 1]) == pytest.approx(rms, rel=1e-5)
        if p == 0:
            assert math.isnan(float(got[p, 2]))
            continue
        cos = [float(torch.dot(centred(xs[p - 1], b).flatten(), centred(x, b).flatten())
                     / (centred(xs[p - 1], b).norm() * centred(x, b).norm())) for b in seqs]
        assert float(got[p, 2]) == pytest.approx(sum(cos) / len(cos), rel=1e-4, abs=1e-6)
    assert float(got[2, 2]) > 0.9 > float(got[1, 2])        # the residual-like point keeps its input


def _post_ln_growth(input_scale: float, top_scale: float):
    """A post-LN stack (placement set) whose input has RMS ~input_scale, first block ~1 and
    second ~top_scale (synthetic trace); the probe's findings."""
    probe = VarianceDrift()
    probe.placement = "post"
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, 16, generator=g)
    trace = Trace(src=torch.full((4, 6), 3), tgt=torch.full((4, 6), 3))
    trace.streams = [StreamPoint("embed_project", "embed", None, "embed", x0 * input_scale),
                     StreamPoint("enc.0", "encoder", 0, "layer", x0 + 0.1 * torch.randn(4, 6, 16, generator=g)),
                     StreamPoint("enc.1", "encoder", 1, "layer", top_scale * x0)]
    probe.update(probe.observe(trace, StepInfo(0)), StepInfo(0))
    return [f for f in probe.findings if f.code == "variance-drift/stream-growth"]


def test_post_ln_growth_is_measured_along_depth_not_from_a_small_input():
    """ELECTRA's projected embedding (RMS ~0.1) into a post-LN stack (block outputs ~1) is no
    growth; a post-LN stack whose blocks grow 10x from the first is still a warning."""
    assert _post_ln_growth(0.1, 1.0) == []
    (f,) = _post_ln_growth(1.0, 10.0)
    assert f.severity == "warning" and f.evidence["growth"] > 6


# -- the wide setup pass stops before the output head ------------------------------------------
def _gpt_subject(n_embd: int, patch=None):
    import sys
    from pathlib import Path
    from tndebug.capture.generic import GenericCapture
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))
    import nanogpt
    torch.manual_seed(0)
    model = nanogpt.build("manual", n_embd=n_embd, n_head=4, vocab_size=50).eval()
    if patch is not None:
        patch(model)
    s = Subject(model, nanogpt.forward, pad_id=0, bos_id=1, src_vocab=50, tgt_vocab=50,
                capture=GenericCapture(model, kind="decoder"), kind="decoder", max_len=32)
    s.capture.discover(lambda: nanogpt.forward(model, torch.randint(2, 50, (1, 8)), 0))
    return s


def test_wide_setup_pass_stops_before_the_head_and_records_the_same_stream():
    """A model wider than 64 gets a wide pass for the null-vector test: it stops as the output
    head (lm_head, found from the gradient pass's module order) is called, so its logits are
    never computed, and the stream points are those of the whole forward, value for value."""
    from tndebug.probes import _depth_setup as ds
    s = _gpt_subject(96)
    run = RunContext(subject=s)
    trace = ds.setup_trace(run)
    grads = ds.setup_grads(run, trace)
    assert trace is not grads and ds.output_head(s, grads) == "lm_head"
    assert trace.logits is None                       # the head never ran
    with s.evaluating():
        whole = s.trace(trace.src, trace.tgt, reads=("grad.stream",))
    assert whole.logits is not None
    assert [p.name for p in trace.streams] == [p.name for p in whole.streams]
    for a, b in zip(trace.streams, whole.streams):
        assert torch.equal(a.x, b.x)
    probe = VarianceDrift()
    probe.setup(run)                                   # the logits' r comes from the gradient pass
    assert probe.checked and alarms(probe.findings) == []


def test_no_head_module_means_no_stop():
    """A head written as x @ E.T in forward (no module gives the logits): no stop point."""
    from tndebug.probes import _depth_setup as ds
    def head_in_forward(model):
        weight = model.lm_head.weight
        del model.lm_head
        model.lm_head = lambda x: x @ weight.T          # not a module: nothing to hook
    s = _gpt_subject(96, head_in_forward)
    run = RunContext(subject=s)
    trace = ds.setup_trace(run)
    assert ds.output_head(s, ds.setup_grads(run, trace)) is None and trace.logits is not None
