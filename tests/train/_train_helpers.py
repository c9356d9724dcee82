"""Shared bits for the training tests: a tiny run and a probe that records what it is told."""
from __future__ import annotations

import torch

from tndebug.probes.base import Probe
from tndebug.train import TrainConfig, model_config, run_training


class Spy(Probe):
    """Records every moment the engine calls, in order."""
    name = "spy"
    reads = ("logits",)
    default_schedule = staticmethod(lambda: (lambda step: True))

    def __init__(self, on_setup=None, on_observe=None):
        super().__init__()
        self.calls, self.lrs, self.steps = [], [], []
        self.resumed = None
        self._on_setup, self._on_observe = on_setup, on_observe

    def setup(self, run):
        self.calls.append("setup")
        self.run = run
        if self._on_setup:
            self._on_setup(run)

    def on_resume(self, run, info):
        self.calls.append("resume")
        self.resumed = info

    def observe(self, trace, info):
        self.calls.append("observe")
        self.steps.append((trace.step, info.step))
        self.lrs.append(info.lr)
        if self._on_observe:
            self._on_observe(trace, info)
        return {"loss": info.loss}

    def update(self, stats, info):
        self.calls.append("update")
        self.cover("", "checked")                  # it judged the loss finite or not
        if not torch.isfinite(stats["loss"]).all():
            self.report("warning", "loss is not finite", step=info.step)

    def finish(self, run):
        self.calls.append("finish")


def tiny_run(steps=5, *, faults=(), probes="none", **kw):
    cfg = model_config("copy", "tiny", faults=faults)
    tcfg = TrainConfig(steps=steps, device="cpu", eval_size=kw.pop("eval_size", 16),
                       batch_size=kw.pop("batch_size", 16))
    return run_training(cfg, tcfg, probes=probes, **kw)
