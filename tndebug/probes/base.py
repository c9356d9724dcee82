"""The probe contract.

A probe is one class in one file: a `name`, the trace parts it `reads`, a `schedule`
(`step -> bool`), and four moments:

* `setup(run)`      once before training: static and behavioural (exact) tests; may sync.
* `observe(trace, info)` on scheduled steps, after backward and before the optimizer step:
  returns a dict of *device* tensors (statistics reduced on the device). No `.item()` here.
* `update(stats, info)` the same dict, now on the host (the engine syncs once per step for
  all probes together); accumulate, emit metrics with `self.metric`, findings with `self.report`.
* `finish(run)`     the verdict at the end; may add findings.

`on_resume(run, info)` is called when training continues from a checkpoint, and
`on_divergence(run, info)` when the loss turns non-finite (on any step, scheduled or not), so
that a probe can replay the batch and name the first sign without probing every step.
Probes decide from tensors and behaviour only: never from config flags or fault switches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from tndebug.findings import Finding
from tndebug.probes.schedule import Schedule, every
from tndebug.subject import Subject
from tndebug.trace import Trace, check_reads


@dataclass
class RunContext:
    """What a probe may know about the run: behaviour, never configuration switches."""
    subject: Subject
    optimizer: torch.optim.Optimizer | None = None
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (logits [N,V], target [N]) -> loss
    lr_schedule: Callable[[int], float] | None = None   # the schedule the user declared: step -> lr
    compute_dtype: torch.dtype = torch.float32           # autocast dtype, or the parameters' dtype
    device: str = "cpu"
    total_steps: int | None = None
    mode: str = "train"                                  # "train" | "triage" (weights only, no optimizer)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepInfo:
    step: int
    lr: float | None = None
    loss: torch.Tensor | None = None          # scalar, on device
    logits: torch.Tensor | None = None        # [B, T, V] detached
    src: torch.Tensor | None = None
    tgt_in: torch.Tensor | None = None
    tgt_out: torch.Tensor | None = None
    grads_ready: bool = True


@dataclass
class ResumeInfo:
    step: int                                 # the global step training resumes at
    lr_before: float | None = None            # last lr applied before the checkpoint was written
    had_optimizer_state: bool = True          # the checkpoint carried optimizer state


class ProbeError(ValueError):
    """A probe is misdeclared (unknown tap, bad schedule)."""


class Probe:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""       # one line for `tndebug probes`
    reads: ClassVar[tuple[str, ...]] = ()
    fix: ClassVar[str] = ""           # default fix text, from the notes
    default_schedule: ClassVar[Callable[[], Schedule]] = staticmethod(lambda: every(100))

    def __init__(self, schedule: Schedule | None = None) -> None:
        if not self.name:
            raise ProbeError(f"{type(self).__name__} has no name")
        try:
            check_reads(self.name, self.reads)
        except ValueError as e:
            raise ProbeError(str(e)) from None
        self.schedule = schedule or self.default_schedule()
        self.findings: list[Finding] = []
        self.metrics: list[tuple[int, str, float]] = []   # (step, tag, value), drained by the engine
        self.skipped: str | None = None                   # reason, when nothing could be checked
        self.checked = False                              # something was actually examined

    # -- the four moments (override what you need) ---------------------------------------
    def setup(self, run: RunContext) -> None:
        pass

    def observe(self, trace: Trace, info: StepInfo) -> dict[str, torch.Tensor]:
        return {}

    def update(self, stats: dict[str, Any], info: StepInfo) -> None:
        pass

    def on_resume(self, run: RunContext, info: ResumeInfo) -> None:
        pass

    def on_divergence(self, run: RunContext, info: StepInfo) -> None:
        pass

    def finish(self, run: RunContext) -> None:
        pass

    # -- helpers -------------------------------------------------------------------------
    def report(self, severity: str, message: str, *, where: str = "", step: int | None = None,
               evidence: dict | None = None, fix: str | None = None, layer: int | None = None,
               head: int | None = None) -> Finding:
        f = Finding(self.name, severity, message, where=where, step=step,
                    evidence=dict(evidence or {}), fix=self.fix if fix is None else fix,
                    layer=layer, head=head)
        self.findings.append(f)
        return f

    def already(self, where: str = "", severity: str | None = None) -> bool:
        """True when a finding for `where` (at `severity`, if given) was already reported."""
        return any(f.where == where and (severity is None or f.severity == severity)
                   for f in self.findings)

    def metric(self, step: int, tag: str, value: float) -> None:
        """A scalar for the reporters, tag `family/stack/layerN/headM/metric`."""
        self.metrics.append((step, tag, float(value)))

    def skip(self, reason: str) -> None:
        self.skipped = reason

    def status(self) -> str:
        """pass | warn | fail | skipped."""
        if any(f.severity == "error" for f in self.findings):
            return "fail"
        if any(f.severity == "warning" for f in self.findings):
            return "warn"
        if self.skipped and not self.checked:
            return "skipped"
        return "pass"
