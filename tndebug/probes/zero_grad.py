"""zero-grad: do the gradients of one step carry into the next (optimizer.zero_grad forgotten)?

Failure: the loop never clears `.grad` (`optimizer.zero_grad()` missing, or called once before
    the loop), so backward adds each step's gradient to the sum of all earlier ones; the update
    follows a running sum, the loss plateaus or swings.
Symptom: the loss stops improving after a few hundred steps (a generic plateau); the gradient
    norm grows step after step.
Fix: call `optimizer.zero_grad(set_to_none=True)` once per step, before backward (or right
    after `optimizer.step()`).

How it decides (exact, from the gradients as the run leaves them; no extra forward or backward):
* after every `optimizer.step()` (the optimizer's step post-hook) it notes, for a few parameters
  (the TRACKED smallest trainable ones: cheap, and any parameter shows it), the `.grad` tensor
  object and its in-place version counter;
* the first time backward reaches such a parameter after that step (a tensor hook, which runs
  before autograd adds the new gradient into `.grad`), the `.grad` is one of: None (cleared with
  set_to_none), the same tensor modified in place since (zeroed: `zero_grad(set_to_none=False)`),
  or the very same tensor at the very same version, non-zero: the previous step's gradient,
  untouched, about to receive this step's. The last is the bug, exactly: error.
Sharded parameters (FSDP2): backward never reaches the sharded parameter itself (FSDP computes
the gradient of a gathered copy and reduce-scatters it into the shard's `.grad`, adding to what
is there), so the moment is the start of backward through the model instead (a hook on its
output's gradient: before any reduce-scatter of the step), and the test reads this rank's shard
of `.grad` (`tndebug.sharded.local`; each rank decides on its own shard, the findings merge).
Gradient accumulation over micro-batches (several backward calls, one step) is unaffected: only
the first backward after each step is looked at. Clipping and GradScaler's unscale act before
the step, so what the post-hook notes is what the next backward would add to.
"""
from __future__ import annotations

import weakref

import torch

from tndebug.probes.base import Probe, ResumeInfo, RunContext
from tndebug.probes.schedule import own_hooks
from tndebug.sharded import any_sharded, local

TRACKED = 3           # parameters watched: one shows the bug; the smallest keep the check cheap


class ZeroGradProbe(Probe):
    """Gradients that carry across optimizer steps: `optimizer.zero_grad()` forgotten."""

    name = "zero-grad"
    cause = (
        "optimizer.zero_grad() is missing from the training loop (or runs once, before it), "
        "so every backward adds to the sum of all earlier gradients (not in the notes; "
        "without this probe its only sign is loss-health's generic plateau)."
    )
    summary = "gradients carried across optimizer steps (optimizer.zero_grad() forgotten)"
    codes = {
        "grads-accumulate": "gradients carried across optimizer steps (zero_grad forgotten)",
    }
    reads = ()
    fix = ("Call optimizer.zero_grad(set_to_none=True) once per step, before loss.backward() "
           "(or right after optimizer.step()); gradient accumulation zeroes once per optimizer step")
    default_schedule = staticmethod(own_hooks)

    def __init__(self, schedule=None) -> None:
        super().__init__(schedule)
        self._handles: list = []
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._after: dict[int, tuple | None] = {}  # i -> (grad tensor, version) after the last step
        self._armed: set[int] = set()              # parameters whose next backward is looked at
        self._fresh = False
        self.steps = 0                             # optimizer steps seen
        self._start = 0                            # the global step this process began at (resume)
        self.checked_steps = 0                     # steps whose first backward was looked at
        self._carried: set[int] = set()            # steps whose backward found the last step's grad

    def setup(self, run: RunContext) -> None:
        if not self.sees_optimizer_steps(run):
            return
        named = [(n, p) for n, p in run.subject.model.named_parameters() if p.requires_grad]
        if not named:
            self.skip("the model has no trainable parameter")
            return
        self._params = sorted(named, key=lambda np_: np_[1].numel())[:TRACKED]
        me = weakref.ref(self)
        if any_sharded(p for _, p in self._params):
            self._handles.append(run.subject.model.register_forward_hook(
                lambda mod, args, out: _on_output(me, out)))
        else:
            for i, (_, p) in enumerate(self._params):
                self._handles.append(p.register_hook(lambda g, i=i: _incoming(me, i)))
        self._handles.append(run.optimizer.register_step_post_hook(
            lambda opt, args, kwargs: _stepped(me)))

    def on_resume(self, run: RunContext, info: ResumeInfo) -> None:
        self._start = info.step              # steps are counted from here: findings carry the global one

    def after_step(self) -> None:
        """The optimizer stepped: note each tracked .grad (object, version); arm the check."""
        self.steps += 1
        for i, (_, p) in enumerate(self._params):
            g = p.grad
            self._after[i] = None if g is None else (g, local(g)._version)
            self._armed.add(i)
        self._fresh = True                       # the next backward is this step's first

    def incoming(self, i: int) -> None:
        """Backward reaches parameter i: is the previous step's gradient still in .grad?"""
        if i not in self._armed:
            return
        self._armed.discard(i)
        if self._fresh:                              # the step's first backward is seen
            self._fresh = False
            self.checked_steps += 1
        name, p = self._params[i]
        before, now = self._after.get(i), p.grad
        carried = (before is not None and now is before[0] and local(now)._version == before[1]
                   and bool(local(now).detach().ne(0).any()))
        self.cover("", "checked")
        if not carried:
            return
        self._carried.add(self.steps)
        if self.findings:
            return
        step = self._start + self.steps   # the global step whose backward this is
        self.report("error", f"gradients accumulate across optimizer steps: at step {step} the "
                    f".grad of {name} still held step {step - 1}'s gradient when backward added "
                    f"the new one (optimizer.zero_grad() is not called between steps)",
                    where="", step=step,
                    evidence={"parameter": name, "grad_norm_carried": float(now.detach().norm()),
                              "same_tensor": True, "version_unchanged": True,
                              "steps_seen": self.steps, "test": "the .grad object and its "
                              "in-place version are those left by the previous optimizer step"}, code="grads-accumulate")

    def finish(self, run: RunContext) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._params and not self.checked_steps and "" not in self.coverage:
            self.skip("no backward followed an optimizer step (one step or none): nothing to "
                      "compare across steps")
        if self.findings:
            self.findings[0].evidence.update(carried_steps=len(self._carried),
                                             checked_steps=self.checked_steps)


def _incoming(ref, i: int) -> None:
    probe = ref()
    if probe is not None:
        probe.incoming(i)
    return None                       # the gradient passes unchanged


def _on_output(ref, out) -> None:
    """The model's output (a tensor, or a tuple, list or dict of them): the first gradient to
    reach one of them starts backward through the model (FSDP2's moment, see the docstring)."""
    probe = ref()
    if probe is None or not probe._armed or not torch.is_grad_enabled():
        return
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,)
    for t in values:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: _every_incoming(ref))


def _every_incoming(ref) -> None:
    probe = ref()
    if probe is not None:
        for i in range(len(probe._params)):
            probe.incoming(i)


def _stepped(ref) -> None:
    probe = ref()
    if probe is not None:
        probe.after_step()
