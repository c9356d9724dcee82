"""Test-only helpers for the positional-encoding, gradient-flow, loss-health, lr-schedule and
label-smoothing probe tests: hand-written models (bugs written by hand, no fault switch), the
captures a triage adapter would give them, and a small probed training loop with resume.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tndebug.harness import copy_batch, noam, smoothed_loss
from tndebug.probes.base import ResumeInfo, RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.subject import Subject

V, PAD = 11, 0


def sinusoids(n: int, d: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


class HandSeq2Seq(nn.Module):
    """A small user model on torch's own encoder/decoder layers; `embed_cls(V, d)` embeds."""

    def __init__(self, embed_cls, d: int = 32) -> None:
        super().__init__()
        self.src_embed, self.tgt_embed = embed_cls(V, d), embed_cls(V, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, 2, 64, dropout=0.0, batch_first=True), 1)
        self.out = nn.Linear(d, V)

    def encode(self, src):
        return self.encoder(self.src_embed(src), src_key_padding_mask=src == PAD)   # [B, S, d]

    def forward(self, src, tgt):
        T = tgt.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)                  # True = may not attend
        x = self.decoder(self.tgt_embed(tgt), self.encode(src), tgt_mask=causal,
                         tgt_key_padding_mask=tgt == PAD, memory_key_padding_mask=src == PAD)
        return self.out(x)                                                           # [B, T, V]


class EmbedCapture:
    """What a triage adapter records for HandSeq2Seq: each embedding's token part and output."""

    def __init__(self, model: HandSeq2Seq) -> None:
        self.model = model

    @contextmanager
    def recording(self, reads, trace):
        handles = []
        for name in ("src_embed", "tgt_embed"):
            def hook(m, inputs, out, name=name):
                trace.embed[name] = {"tok": m.token_part(inputs[0]).detach(), "out": out.detach()}
            handles.append(getattr(self.model, name).register_forward_hook(hook))
        try:
            yield trace
        finally:
            for h in handles:
                h.remove()


class ReluCapture:
    """Records the output of every nn.ReLU module as an FFN hidden activation."""

    def __init__(self, model: nn.Module) -> None:
        self.relus = [(n.rsplit(".", 1)[0], m) for n, m in model.named_modules()
                      if isinstance(m, nn.ReLU)]

    @contextmanager
    def recording(self, reads, trace):
        handles = [m.register_forward_hook(
            lambda m, i, o, site=site: trace.ffn_hidden.__setitem__(site, o.detach()))
            for site, m in self.relus]
        try:
            yield trace
        finally:
            for h in handles:
                h.remove()


def hand_subject(model: nn.Module, capture=None, *, encode=True, max_len=None) -> Subject:
    return Subject(model, lambda m, s, t, p: m(s, t), pad_id=PAD, bos_id=1, src_vocab=V,
                   tgt_vocab=V, encode=(lambda m, s, p: m.encode(s)) if encode else None,
                   capture=capture, max_len=max_len)


def setup_only(subject: Subject, probes, **run_kw):
    """Run only the probes' setup and finish (static and behavioural tests)."""
    engine = ProbeEngine(probes, RunContext(subject=subject, **run_kw))
    with engine:
        engine.setup()
        return engine.finish()


def probed_loop(subject: Subject, probes, steps: int, *, criterion=None, lr_fn=None,
                optimizer_fn=None, seed: int = 0, batch: int = 16, length: int = 8,
                resume_at: int | None = None, resume_fn=None, set_lr=None, unshifted=False):
    """Train `steps` steps with probes attached; at `resume_at` call `resume_fn(state)`.

    `resume_fn` receives a dict with the model, optimizer and schedule, returns the new
    (optimizer, lr_fn, ResumeInfo) and may rebuild them the way a buggy trainer would.
    `set_lr(opt, step, lr_fn)` applies the lr each step (default: every group to lr_fn(step)).
    `unshifted=True` feeds the targets themselves as decoder input (a target leak).
    Returns (engine, findings).
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = subject.model
    lr_fn = lr_fn or noam(32, 20)
    criterion = criterion or (lambda lg, t: smoothed_loss(lg, t, pad=PAD))
    opt = (optimizer_fn or (lambda ps: torch.optim.Adam(ps, lr=lr_fn(0), betas=(0.9, 0.98),
                                                       eps=1e-9)))(model.parameters())
    run = RunContext(subject=subject, optimizer=opt, criterion=criterion, lr_schedule=lr_fn,
                     total_steps=steps)
    engine = ProbeEngine(probes, run)
    with engine:
        engine.setup()
        for step in range(steps):
            if step == resume_at:
                opt, lr_fn, info = resume_fn({"model": model, "optimizer": opt, "lr_fn": lr_fn,
                                              "step": step})
                run.optimizer = opt
                engine.resume(info)
            if set_lr is None:
                for group in opt.param_groups:
                    group["lr"] = lr_fn(step)
            else:
                set_lr(opt, step, lr_fn)
            src, tgt_in, tgt_out = copy_batch(g, batch, length, V)
            if unshifted:
                tgt_in = tgt_out
            engine.begin_step(step, src, tgt_in)
            logits = model(src, tgt_in)
            loss = criterion(logits.reshape(-1, V), tgt_out.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            engine.end_step(StepInfo(step, lr=opt.param_groups[0]["lr"], loss=loss.detach(),
                                     logits=logits.detach(), src=src, tgt_in=tgt_in,
                                     tgt_out=tgt_out))
            opt.step()
        return engine, engine.finish()


def kinds(findings, probe: str) -> set[tuple[str, str]]:
    """{(severity, where)} of one probe's warnings and errors."""
    return {(f.severity, f.where) for f in findings
            if f.probe == probe and f.severity in ("warning", "error")}


__all__ = ["V", "PAD", "sinusoids", "HandSeq2Seq", "EmbedCapture", "ReluCapture", "hand_subject",
           "setup_only", "probed_loop", "kinds", "ResumeInfo", "F"]
