"""train-mode: does the model take its optimizer steps in training mode?

Failure: `model.eval()` for an evaluation, and no `model.train()` after it: every later step
    trains with the evaluation behaviour (dropout off, batch-norm on its running statistics).
Symptom: nothing crashes; the training loss falls faster than before the evaluation, the
    held-out loss stops following it (no regularisation), batch-norm statistics freeze.
Fix: call `model.train()` after every evaluation (or at the top of each training step).

How it decides (a fact of behaviour at each step): at every `optimizer.step()` (the optimizer's
step pre-hook, so every step is seen, probed or not) it reads the `.training` flag of the
modules whose behaviour differs between the modes: dropout modules with p > 0 and batch-norm
modules. A step taken while any of them is in eval mode is a warning (the mode changes what is
trained); a model in eval mode with no such module is info (nothing we can see changes).
"""
from __future__ import annotations

import weakref

from torch import nn

from tndebug.probes.base import Probe, RunContext
from tndebug.probes.schedule import own_hooks


def mode_sensitive(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that behave differently in train and eval mode: dropout (p > 0), batch-norm."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and getattr(m, "p", 0) > 0:
            out.append((name, m))
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            out.append((name, m))
    return out


class TrainModeProbe(Probe):
    """Optimizer steps taken with the model in eval mode (`model.train()` forgotten)."""

    name = "train-mode"
    cause = (
        "model.eval() for an evaluation was never undone by model.train(): the training "
        "steps run with the modules' evaluation behaviour (no random masking, batch-norm on "
        "frozen running statistics) (not in the notes)."
    )
    summary = "optimizer steps taken in eval mode (model.train() forgotten after an evaluation)"
    codes = {
        "eval-mode-steps": "optimizer steps taken with dropout/batch-norm in eval mode",
        "eval-mode-root": "steps taken with model.training False (no module it changes), advisory",
    }
    reads = ()
    fix = ("Call model.train() after every evaluation (model.eval() switches dropout and "
           "batch-norm to their evaluation behaviour until it is undone)")
    default_schedule = staticmethod(own_hooks)

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._handle = None
        self._model: nn.Module | None = None
        self._sensitive: list[tuple[str, nn.Module]] = []
        self.steps = 0
        self.eval_steps: list[int] = []            # steps taken with a sensitive module in eval
        self._root_eval: list[int] = []            # steps with model.training False (no such module)

    def setup(self, run: RunContext) -> None:
        if not self.sees_optimizer_steps(run):
            return
        self._model = run.subject.model
        self._sensitive = mode_sensitive(self._model)
        me = weakref.ref(self)
        self._handle = run.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: _stepping(me))

    def stepping(self) -> None:
        """An optimizer step is about to be taken: which mode is the model in?"""
        step, self.steps = self.steps, self.steps + 1
        self.cover("", "checked")
        off = [n for n, m in self._sensitive if not m.training]
        if off:
            self.eval_steps.append(step)
            if len(self.eval_steps) == 1:
                self._first_off = off
        elif not self._sensitive and self._model is not None and not self._model.training:
            self._root_eval.append(step)

    def finish(self, run: RunContext) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._model is not None and not self.steps:
            self.skip("no optimizer step was taken")
        ev = {"steps_seen": self.steps, "mode_sensitive_modules": len(self._sensitive)}
        if self.eval_steps:
            first, n = self.eval_steps[0], len(self.eval_steps)
            off = self._first_off
            self.report("warning", f"the model trains in eval mode: {n} of {self.steps} optimizer "
                        f"steps (from step {first}) were taken with {len(off)} of "
                        f"{len(self._sensitive)} dropout/batch-norm modules in eval mode "
                        f"({', '.join(off[:3])}{', ...' if len(off) > 3 else ''})",
                        where=off[0], step=first,
                        evidence={**ev, "eval_steps": n, "first_eval_step": first,
                                  "last_eval_step": self.eval_steps[-1], "modules_off": off[:8]}, code="eval-mode-steps")
        elif self._root_eval:
            self.report("info", f"{len(self._root_eval)} of {self.steps} optimizer steps were "
                        f"taken with the model in eval mode; it has no dropout or batch-norm "
                        f"module, so nothing we can see changes (by design here)",
                        step=self._root_eval[0], evidence={**ev, "eval_steps": len(self._root_eval)}, code="eval-mode-root")


def _stepping(ref) -> None:
    probe = ref()
    if probe is not None:
        probe.stepping()
