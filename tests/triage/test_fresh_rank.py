"""A statistic of a model still learning is not a defect (issue 19): trained weights whose stream
is dominated by one learned vector, so that the model gives one answer at every position (HF LED
after 150 copy steps, Megatron-BERT on masked random ids: bench/hf_unseen.py HELD-OUT), are info;
the same stream made by the code at initialisation is the code's rank collapse, an error.
Triage's fresh-init re-judge (tndebug/judge/fresh.py rank_at_init) tells the two apart."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tndebug import driver
from tndebug.capture.trace import StreamPoint
from tndebug.subject import Subject
from tndebug.judge.fresh import rank_at_init, seeded

V, D = 11, 32


class Block(nn.Module):
    """A pre-LN block with its residual adds: x + attn(ln(x)), x + ffn(ln(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))

    def forward(self, x, pad, causal=None):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))                        # [B, T, D]


class Seq2Seq(nn.Module):
    """Encoder and decoder of two blocks each (no cross-attention: enough for the stream)."""

    def __init__(self, swamp: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.enc = nn.ModuleList([Block(), Block()])
        self.dec = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, V)
        if swamp:
            put_common_vector(self, swamp)

    def forward(self, src, tgt):
        x = self.tok(src)
        for blk in self.enc:
            x = blk(x, src == 0)
        T = tgt.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)       # True = blocked
        y = self.tok(tgt) + x.mean(1, keepdim=True)               # [B, T, D]
        for blk in self.dec:
            y = blk(y, tgt == 0, causal)
        return self.out(self.norm(y))                             # [B, T, V]


def put_common_vector(model: Seq2Seq, size: float) -> None:
    """The first block of each stack adds one vector (norm `size`) to every token through its
    FFN output bias: the stream is that vector plus the tokens, and after the final norm every
    position gives nearly the same logits, the shape a model on its targets' prior has."""
    g = torch.Generator().manual_seed(7)
    c = torch.randn(D, generator=g)
    with torch.no_grad():
        for blk in (model.enc[0], model.dec[0]):
            blk.ffn[2].bias.copy_(size * c / c.norm())


class Capture:
    def __init__(self, model: Seq2Seq) -> None:
        self.points = [(f"enc.{i}", b, "encoder", i) for i, b in enumerate(model.enc)]
        self.points += [(f"dec.{i}", b, "decoder", i) for i, b in enumerate(model.dec)]
        self.embed = model.tok

    @contextmanager
    def recording(self, reads, trace):
        handles = [self.embed.register_forward_hook(
            lambda m, i, o: trace.streams.append(StreamPoint("tok", "embed", None, "embed", o.detach())))]
        for name, mod, stack, layer in self.points:
            def hook(m, i, o, name=name, stack=stack, layer=layer):
                trace.streams.append(StreamPoint(name, stack, layer, "layer", o.detach()))
            handles.append(mod.register_forward_hook(hook))
        try:
            yield trace
        finally:
            for h in handles:
                h.remove()


def subject(model: Seq2Seq) -> Subject:
    return Subject(model, lambda m, s, t, pad: m(s, t), pad_id=0, bos_id=1, src_vocab=V,
                   tgt_vocab=V, capture=Capture(model))


def batch():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, V, (8, 10), generator=g)
    tgt = torch.cat([torch.ones(8, 1, dtype=torch.long), src[:, :-1]], 1)
    return src, tgt, src


def triaged(model: Seq2Seq, build):
    """variance-drift on the checkpoint `model` in triage mode, then the fresh-init re-judge on
    `build()` (the user's constructor, seeded)."""
    b = batch()
    probed = driver.probe_once(subject(model), ["variance-drift"], b)
    fresh = lambda names: driver.probe_once(subject(seeded(build).eval()), names, b)  # noqa: E731
    findings, statuses = rank_at_init(list(probed.findings), probed.statuses, fresh)
    return [f for f in findings if f.code == "variance-drift/rank-collapse"], statuses


def test_weights_that_learned_one_answer_are_not_a_rank_collapse():
    """Healthy code whose trained weights put one vector on every token: r falls under 0.02 at
    the first block, the logits are the same at every position (the false alarm's shape); the
    fresh initialisation of the code is clean, so it stays info."""
    torch.manual_seed(0)
    model = Seq2Seq()
    put_common_vector(model, 300.0)                      # "training" moved the weights there
    found, statuses = triaged(model.eval(), Seq2Seq)
    assert found, "the statistic is reported"
    assert {f.severity for f in found} == {"info"}
    for f in found:
        assert f.evidence["r"] < 0.02 and f.evidence["retention"] >= 0.3
        assert f.evidence["cause"] == "statistic" and f.evidence["judged_on"] == "fresh init"
        assert "keeps the tokens apart" in f.message
    assert any(f.evidence["logits_r"] < 0.02 for f in found)        # one answer at every position
    assert statuses["variance-drift"]["fresh_init"]["collapsed_at_init"] == []


def test_code_that_collapses_the_stream_at_init_is_an_error():
    """The same stream made by the constructor (the code swamps its residual at every
    initialisation, the logits collapsed too): the fresh init collapses where the checkpoint
    does, so the checkpoint's info becomes the code's error."""
    build = lambda: Seq2Seq(swamp=300.0)                             # noqa: E731
    torch.manual_seed(0)
    found, statuses = triaged(build().eval(), build)
    errors = [f for f in found if f.severity == "error"]
    assert errors, [(f.severity, f.where, f.message) for f in found]
    for f in errors:
        assert f.evidence["cause"] == "output" and f.evidence["judged_on"] == "fresh init"
        assert f.evidence["init_r"] < 0.02 and "the code collapses the stream" in f.message
    assert {f.where for f in errors} <= set(statuses["variance-drift"]["fresh_init"]["collapsed_at_init"])
    assert statuses["variance-drift"]["status"] == "fail"
