"""A small encoder-decoder written by hand (not tndebug's model), for the attention-probe tests.

Bugs are written by hand in the tests by subclassing one method of `HandAttention` or
`HandModel`; nothing here reads tndebug's fault switches. `HandCapture` fills a Trace from
forward hooks on `nn.Identity` taps, the way triage adapts a user's model.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from tndebug.harness import copy_batch
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.subject import Subject
from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace

V, PAD, BOS = 11, 0, 1


class HandNorm(nn.Module):
    """LayerNorm written out: (x - mean) / sqrt(var + eps) * gamma + beta."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gamma, self.beta = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.gamma + self.beta


class HandAttention(nn.Module):
    """Multi-head attention as a tutorial writes it; `keep` is True where a query may attend."""

    TAPS = ("q", "k", "scores", "masked_scores", "probs", "out")

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h, self.d_k = h, d // h
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        for t in self.TAPS:
            setattr(self, f"tap_{t}", nn.Identity())

    def split(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)           # [B, h, T, d_k]

    def merge(self, z):
        B, _, T, _ = z.shape
        return z.transpose(1, 2).reshape(B, T, self.h * self.d_k)        # [B, T, d]

    def score(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.d_k)             # [B, h, T, S]

    def mask(self, s, keep):
        return s.masked_fill(~keep, torch.finfo(s.dtype).min)

    def normalise(self, s, keep):
        return s.softmax(dim=-1)

    def forward(self, xq, xkv, keep):
        q = self.tap_q(self.split(self.wq(xq)))
        k = self.tap_k(self.split(self.wk(xkv)))
        v = self.split(self.wv(xkv))
        s = self.tap_scores(self.score(q, k))
        m = self.tap_masked_scores(self.mask(s, keep))
        p = self.tap_probs(self.normalise(m, keep))
        return self.tap_out(self.wo(self.merge(p @ v)))


class Block(nn.Module):
    """Post-norm layer: x = norm(x + attn(x)); [cross]; x = norm(x + ffn(x))."""

    def __init__(self, d, h, attn_cls, norm_cls, eps, cross: bool) -> None:
        super().__init__()
        self.self_attn = attn_cls(d, h)
        self.src_attn = attn_cls(d, h) if cross else None
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.norms = nn.ModuleList(norm_cls(d, eps=eps) for _ in range(3 if cross else 2))
        self.taps = nn.ModuleList(nn.Identity() for _ in range(3 if cross else 2))

    def forward(self, x, keep, memory=None, memory_keep=None):
        x = self.taps[0](self.norms[0](x + self.self_attn(x, x, keep)))
        if self.src_attn is not None:
            x = self.taps[1](self.norms[1](x + self.src_attn(x, memory, memory_keep)))
        return self.taps[-1](self.norms[-1](x + self.ff(x)))


class HandModel(nn.Module):
    """Embeddings * sqrt(d) + sinusoid PE; `layers` encoder and decoder blocks; generator."""

    def __init__(self, d=32, h=4, layers=1, attn_cls=HandAttention, norm_cls=nn.LayerNorm,
                 eps=1e-5, seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.d = d
        self.src_emb, self.tgt_emb = nn.Embedding(V, d), nn.Embedding(V, d)
        pos = torch.arange(64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("pe", torch.stack([pos.sin(), pos.cos()], -1).flatten(1), persistent=False)
        self.enc = nn.ModuleList(Block(d, h, attn_cls, norm_cls, eps, False) for _ in range(layers))
        self.dec = nn.ModuleList(Block(d, h, attn_cls, norm_cls, eps, True) for _ in range(layers))
        self.src_tap, self.tgt_tap, self.mem_tap = nn.Identity(), nn.Identity(), nn.Identity()
        self.gen = nn.Linear(d, V)

    def src_mask(self, src):
        return (src != PAD)[:, None, None, :]                               # [B, 1, 1, S]

    def tgt_mask(self, tgt):
        T = tgt.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).tril()
        return (tgt != PAD)[:, None, None, :] & causal                     # [B, 1, T, T]

    def embed(self, emb, x):
        return emb(x) * math.sqrt(self.d) + self.pe[: x.shape[1]]

    def encode(self, src):
        x, keep = self.src_tap(self.embed(self.src_emb, src)), self.src_mask(src)
        for blk in self.enc:
            x = blk(x, keep)
        return self.mem_tap(x)

    def forward(self, src, tgt):
        memory = self.encode(src)
        x, keep = self.tgt_tap(self.embed(self.tgt_emb, tgt)), self.tgt_mask(tgt)
        for blk in self.dec:
            x = blk(x, keep, memory, self.src_mask(src))
        return self.gen(x)


class HandCapture:
    """Fills a Trace from forward hooks on the taps; `fields` limits what attention exposes
    (e.g. ("out",) for a model whose attention is fused), `head_average` averages probs."""

    def __init__(self, model: HandModel, fields=HandAttention.TAPS, head_average=False) -> None:
        self.model, self.fields, self.head_average = model, tuple(fields), head_average

    @contextmanager
    def recording(self, reads, trace: Trace):
        handles = []

        def add(mod, fn):
            handles.append(mod.register_forward_hook(lambda m, i, o: fn(o.detach())))

        def keep_order(name, fn):
            def inner(x):
                trace.order.append((name, x))
                fn(x)
            return inner

        for name, mod in self.model.named_modules():
            if isinstance(mod, HandAttention):
                kind = "cross" if name.endswith("src_attn") else "enc_self" if name.startswith("enc") else "dec_self"
                rec = trace.attention[name] = AttentionRecord(name, kind, int(name.split(".")[1]),
                                                              head_averaged=self.head_average)
                for f in self.fields:
                    def setter(x, rec=rec, f=f):
                        if f == "probs" and self.head_average:
                            x = x.mean(1)
                        setattr(rec, f, x)
                    add(getattr(mod, f"tap_{f}"), keep_order(f"{name}.{f}", setter))
            elif isinstance(mod, Block):
                stack = "encoder" if name.startswith("enc") else "decoder"
                for i, tap in enumerate(mod.taps):
                    add(tap, keep_order(f"{name}.taps.{i}", lambda x, n=f"{name}.taps.{i}", st=stack, l=int(name.split(".")[1]):
                                        trace.streams.append(StreamPoint(n, st, l, "sublayer", x))))
        for tap, stack in ((self.model.src_tap, "embed"), (self.model.tgt_tap, "embed"),
                           (self.model.mem_tap, "encoder")):
            n = {id(self.model.src_tap): "src_tap", id(self.model.tgt_tap): "tgt_tap"}.get(id(tap), "mem_tap")
            add(tap, keep_order(n, lambda x, n=n, st=stack: trace.streams.append(
                StreamPoint(n, st, None, "embed" if st == "embed" else "stack", x))))
        try:
            yield trace
        finally:
            for h in handles:
                h.remove()


def hand_subject(model: HandModel, **capture_kw) -> Subject:
    return Subject(model, lambda m, src, tgt, pad: m(src, tgt), pad_id=PAD, bos_id=BOS,
                   src_vocab=V, tgt_vocab=V, encode=lambda m, src, pad: m.encode(src),
                   capture=HandCapture(model, **capture_kw))


def run_probe(subject: Subject, probe, steps: int = 2, compute_dtype=torch.float32, before_step=None):
    """The harness loop for any Subject: setup, `steps` probed Adam steps, finish."""
    g = torch.Generator().manual_seed(0)
    model = subject.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = RunContext(subject=subject, optimizer=opt, compute_dtype=compute_dtype, total_steps=steps)
    with ProbeEngine([probe], run) as engine:
        engine.setup()
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            src, tgt_in, tgt_out = copy_batch(g, 8, 8, V)
            engine.begin_step(step, src, tgt_in)
            logits = model(src, tgt_in)
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            engine.end_step(StepInfo(step, loss=loss.detach(), logits=logits.detach(),
                                     src=src, tgt_in=tgt_in, tgt_out=tgt_out))
            opt.step()
        return engine.finish()
