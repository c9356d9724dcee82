"""tndebug's probes in a PyTorch Lightning run (`pip install tndebug[lightning]`).

    from tndebug.integrations.lightning import TndebugCallback
    cb = TndebugCallback(forward=my_forward, out="runs/pl")
    pl.Trainer(max_steps=400, callbacks=[cb]).fit(lit_module, loader)
    cb.report.verdict, cb.exit_code

A thin adapter over `tndebug.watch`. Lightning runs forward and backward inside
`optimizer.step(closure)`, so the optimizer's step pre-hook comes too early; the probes'
moment is Lightning's own `on_before_optimizer_step` (after backward, before the update), the
loss comes from `on_before_backward`. The watched module is `module` (an attribute path of the
LightningModule), else its `.model` when it has one, else the LightningModule itself: the
module your `training_step` calls. `on_train_start` opens the watch with the first optimizer,
its LambdaLR (if any) as the declared schedule and `trainer.global_step` as the start step;
`on_train_end` (or `on_exception`) closes it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

try:
    from pytorch_lightning import Callback
except ImportError:  # pragma: no cover - the `lightning` package's name for the same class
    from lightning.pytorch import Callback

from tndebug.library.watch import Watch


class TndebugCallback(Callback):
    """Args: `forward` (how the probes call the watched module), `module` (its attribute path
    in the LightningModule), `out` (default `<trainer.default_root_dir>/tndebug`), and any
    `tndebug.watch` keyword. After training: `report`, `exit_code`, `watch`."""

    def __init__(self, forward=None, *, module: str | None = None, out: str | Path | None = None,
                 **watch_kwargs) -> None:
        self.forward, self.module, self.out = forward, module, out
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.report = None
        self.exit_code: int | None = None
        self._loss = None

    def _watched(self, pl_module) -> nn.Module:
        if self.module is not None:
            return pl_module.get_submodule(self.module)
        inner = getattr(pl_module, "model", None)
        return inner if isinstance(inner, nn.Module) else pl_module

    def on_train_start(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0] if trainer.optimizers else None
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        schedule = configs[0].scheduler if configs and configs[0].interval == "step" else None
        if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
            schedule = None
        kw = {"lr_schedule": schedule, "start_step": trainer.global_step,
              "total_steps": trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
              **self.watch_kwargs}
        # every rank gets `out`: watch lets rank 0 alone write it, the others say so on stderr
        out = self.out if self.out is not None else Path(trainer.default_root_dir) / "tndebug"
        self.watch = Watch(self._watched(pl_module), opt, forward=self.forward, out=out,
                           hook_optimizer=False, **kw)
        self.watch.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.watch is not None:
            self.watch.step(loss=self._loss)
            self._loss = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close(exception)

    def _close(self, exc) -> None:
        if self.watch is None or self.report is not None:
            return
        self.watch.__exit__(type(exc) if exc is not None else None, exc, None)
        self.report, self.exit_code = self.watch.report, self.watch.exit_code
