"""A minimal probed training loop, for tests and probe calibration.

The real trainer (`tndebug.train`) adds data tasks, evaluation, checkpoints and reporting;
this loop has only what a probe needs to be exercised: random copy data with padding, Adam,
the Noam schedule, label-smoothed loss, and the ProbeEngine calls in the right places.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes import make_probes
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.subject import tndebug_subject


def copy_batch(g: torch.Generator, batch: int, length: int, vocab: int, pad_share: float = 0.5):
    """src = random content (ids >= 2) with right padding; tgt = [BOS] + src."""
    src = torch.randint(2, vocab, (batch, length), generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    padded = torch.rand(batch, generator=g) < pad_share
    lengths = torch.where(padded, lengths, torch.full_like(lengths, length))
    src[torch.arange(length)[None, :] >= lengths[:, None]] = 0
    tgt = torch.cat([torch.ones(batch, 1, dtype=torch.long), src], dim=1)
    return src, tgt[:, :-1], tgt[:, 1:]


def noam(d_model: int, warmup: int, factor: float = 1.0):
    return lambda step: factor * d_model ** -0.5 * min((step + 1) ** -0.5, (step + 1) * warmup ** -1.5)


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float = 0.1, pad: int = 0):
    """KL to the smoothed target; pad column and pad rows get no mass.  logits [N, V], target [N]"""
    V = logits.shape[-1]
    true = torch.full_like(logits, eps / (V - 2))
    true.scatter_(1, target[:, None], 1.0 - eps)
    true[:, pad] = 0
    true[target == pad] = 0
    return F.kl_div(logits.log_softmax(-1), true, reduction="sum") / (target != pad).sum().clamp(min=1)


def train_with_probes(cfg: ModelConfig, probes="all", steps: int = 50, *, seed: int = 0,
                      batch: int = 32, length: int = 10, warmup: int = 100, lr_factor: float = 1.0,
                      sinks=(), before_step=None):
    """Train `steps` steps with probes attached; return (engine, findings, model)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_model(cfg)
    schedule = noam(cfg.d_model, warmup, lr_factor)
    opt = torch.optim.Adam(model.parameters(), lr=schedule(0), betas=(0.9, 0.98), eps=1e-9)
    run = RunContext(subject=tndebug_subject(model), optimizer=opt, lr_schedule=schedule,
                     criterion=lambda lg, t: smoothed_loss(lg, t, pad=cfg.pad_id), total_steps=steps)
    engine = ProbeEngine(make_probes(probes) if not isinstance(probes, list) or
                         (probes and isinstance(probes[0], str)) else probes, run, sinks=sinks)
    with engine:
        engine.setup()
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            src, tgt_in, tgt_out = copy_batch(g, batch, length, cfg.src_vocab)
            if before_step is not None:
                before_step(step, model)
            engine.begin_step(step, src, tgt_in)
            logits = model(src, tgt_in)
            loss = run.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            info = StepInfo(step, lr=opt.param_groups[0]["lr"], loss=loss.detach(),
                            logits=logits.detach(), src=src, tgt_in=tgt_in, tgt_out=tgt_out)
            engine.end_step(info)
            if not torch.isfinite(loss):     # a sync per step: fine for tests, not for the trainer
                engine.diverged(info)
                break
            opt.step()
        findings = engine.finish()
    return engine, findings, model
