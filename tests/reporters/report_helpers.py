"""A tiny probed loop that feeds a ReportSession, and stand-in probes that emit every metric
family the real probes emit (tags as in tndebug/reporters/tensorboard.py)."""
from __future__ import annotations

import torch

from tndebug.config import ModelConfig
from tndebug.harness import copy_batch, noam, smoothed_loss
from tndebug.inject import make_model
from tndebug.probes.base import Probe, RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.probes.schedule import every, never
from tndebug.report import Report
from tndebug.subject import tndebug_subject


class StandInAttention(Probe):
    """Per-head entropy / max_prob / similarity, per-layer diversity, resid RMS, grad norm."""
    name = "stand-in-attention"
    summary = "metrics only"
    reads = ("attn.probs", "stream", "ffn.hidden")
    fix = "nothing to fix"

    def __init__(self, model=None, schedule=None) -> None:
        super().__init__(schedule or every(4))
        self.model = model

    def observe(self, trace, info):
        stats = {}
        for r in trace.records():
            if r.probs is None:
                continue
            p = r.probs                                                  # [B, h, T, S]
            ent = -(p * p.clamp_min(1e-12).log()).sum(-1) / (p > 0).sum(-1).clamp(min=2).log()
            stats[f"attn/{r.tag}/entropy"] = ent.mean((0, 2))
            stats[f"attn/{r.tag}/max_prob"] = p.amax(-1).mean((0, 2))
            v = p.transpose(0, 1).reshape(p.shape[1], -1)
            v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)
            sim = v @ v.T - torch.eye(v.shape[0])
            stats[f"attn/{r.tag}/similarity"] = sim.amax(-1)
        for s in trace.streams:
            if s.kind == "layer":
                stats[f"depth/{s.stack}/layer{s.layer}/resid_rms"] = s.x.pow(2).mean().sqrt()
        if self.model is not None:
            for stack in ("encoder", "decoder"):
                for i, layer in enumerate(getattr(self.model, stack).layers):
                    gs = [q.grad.norm() for q in layer.parameters() if q.grad is not None]
                    if gs:
                        stats[f"grad/{stack}/layer{i}/norm"] = torch.stack(gs).norm()
        return stats

    def update(self, stats, info):
        self.cover("", "checked")                  # it reads every trace it is given
        for key, val in stats.items():
            if key.startswith("attn/"):
                prefix, metric = key.rsplit("/", 1)
                for h, v in enumerate(val.tolist()):
                    self.metric(info.step, f"{prefix}/head{h}/{metric}", v)
                if metric == "similarity":
                    self.metric(info.step, f"{prefix}/diversity", 1 - float(val.mean()))
            else:
                self.metric(info.step, key, float(val))


class StandInFinding(Probe):
    """Reports a warning at step 4 and an error at the end (named after a real probe, so that
    the notes' probable cause applies)."""
    name = "missing-scale"
    summary = "findings only"
    reads = ()
    fix = "Divide the scores by sqrt(d_k)."

    def __init__(self) -> None:
        super().__init__(every(4))

    def update(self, stats, info):
        if info.step == 4:
            self.report("warning", "entropy fell below the floor", where="encoder.layers.0.self_attn",
                        step=4, evidence={"entropy": 0.012345, "threshold": 0.05}, layer=0, head=2)

    def finish(self, run):
        self.report("error", "scores were never scaled", where="decoder.layers.1.cross_attn",
                    step=0, evidence={"score_std": 8.01, "threshold": 3.0})


class Skipper(Probe):
    name = "stand-in-skipped"
    summary = "always skips"
    reads = ()

    def __init__(self) -> None:
        super().__init__(never())

    def setup(self, run):
        self.cover("", "not applicable", "needs a GPU")


def run_tiny(session, steps: int = 9, probes=None, cfg: ModelConfig | None = None,
             status: str = "completed") -> Report:
    """Train `steps` steps of the copy task with the session attached; return the Report."""
    cfg = cfg or ModelConfig.tiny()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = make_model(cfg)
    schedule = noam(cfg.d_model, 10)
    opt = torch.optim.Adam(model.parameters(), lr=schedule(0), betas=(0.9, 0.98), eps=1e-9)
    run = RunContext(subject=tndebug_subject(model), optimizer=opt, lr_schedule=schedule,
                     criterion=lambda lg, t: smoothed_loss(lg, t, pad=cfg.pad_id), total_steps=steps)
    probes = probes if probes is not None else [StandInAttention(model), StandInFinding(), Skipper()]
    engine = ProbeEngine(probes, run, sinks=session.sinks)
    loss = torch.tensor(float("nan"))
    with engine, session.progress(steps) as bar:
        engine.setup()
        for step in range(steps):
            lr = schedule(step)
            for group in opt.param_groups:
                group["lr"] = lr
            src, tgt_in, tgt_out = copy_batch(g, 16, 8, cfg.src_vocab)
            engine.begin_step(step, src, tgt_in)
            logits = model(src, tgt_in)
            loss = run.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            engine.end_step(StepInfo(step, lr=lr, loss=loss.detach(), logits=logits.detach(),
                                     src=src, tgt_in=tgt_in, tgt_out=tgt_out))
            opt.step()
            session.log_scalars(step, {"train/loss": loss.detach(), "train/lr": lr})
            bar.update(step + 1, loss=loss.detach(), lr=lr)
        session.log_scalars(steps - 1, {"eval/accuracy": 0.5})
        findings = engine.finish()
    run_info = {"task": "copy", "preset": "tiny", "norm": cfg.norm, "faults": list(cfg.faults),
                "seed": 0, "steps": steps, "device": "cpu", "final_loss": float(loss.detach()),
                "exact_match": 0.25, "token_accuracy": 0.5, "status": status}
    if status != "completed":
        run_info["stopped_at"] = steps - 1
    return Report(run=run_info, findings=findings, probes=engine.statuses(),
                  first_sign=engine.first_sign)
