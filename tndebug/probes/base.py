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

Coverage: a probe says what it examined with `cover(where, status, reason)`, per module
(`where` in the model's naming, "" for the run): "checked", "no verdict" (it was there but
could not be decided, and why) or "not applicable". Its `status()` is "pass" only where
something was checked; silence is not a pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from tndebug.findings import Finding, user_path
from tndebug.probes.schedule import Schedule, every
from tndebug.sharded import norms
from tndebug.subject import Subject
from tndebug.capture.trace import Trace, check_reads


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
    # {id(parameter): its gradient's L2 norm (fp32 device scalar)} when backward freed each
    # gradient as it was made (triage's one pass: a weight-sized .grad per parameter held at
    # once was most of its peak memory); None when the gradients are in each `.grad`
    grad_norms: dict[int, torch.Tensor] | None = None


def grad_norm_of(p: torch.nn.Parameter, info: StepInfo | None) -> torch.Tensor | None:
    """The L2 norm (fp32) of `p`'s gradient at this step, or None where it got none: from
    `info.grad_norms` when the step freed the gradients as backward made them, else `p.grad`
    (a sharded one's over every rank: `tndebug.sharded.norms`)."""
    return grad_norms_of([p], info)[0]


def grad_norms_of(params, info: StepInfo | None) -> list[torch.Tensor | None]:
    """`grad_norm_of` for each of `params`, in one fused norm (and, for FSDP2's sharded
    gradients, one all-reduce: every rank calls it at the same step)."""
    params = list(params)
    if info is not None and info.grad_norms is not None:
        return [info.grad_norms.get(id(p)) for p in params]
    have = [i for i, p in enumerate(params) if p.grad is not None]
    out: list[torch.Tensor | None] = [None] * len(params)
    for i, n in zip(have, norms([params[i].grad for i in have]) if have else []):
        out[i] = n
    return out


@dataclass
class ResumeInfo:
    step: int                                 # the global step training resumes at
    lr_before: float | None = None            # last lr applied before the checkpoint was written
    had_optimizer_state: bool = True          # the checkpoint carried optimizer state


from tndebug.errors import ProbeError  # noqa: E402,F401 - torch-free there (the CLI's parser)


# Coverage of one place, weakest first: a later cover() for the same place only upgrades.
COVERAGE = ("not applicable", "no verdict", "checked")
NO_STEP = "never observed a training step"
# The reason of a decoder-only probe on an encoder-decoder: one text, so that reports list such
# probes together ("SKIPPED label-shift, lm-decoding: ...").
DECODER_ONLY = "a decoder-only probe; this model is an encoder-decoder"
# The same on an encoder-only model (BERT-style): the decoder-only probes say it with this one.
DECODER_ONLY_ON_ENCODER = "a decoder-only probe; this model is encoder-only"


def not_decoder_only(kind: str) -> str:
    """Why a decoder-only probe does not apply to a Subject of `kind`."""
    return DECODER_ONLY_ON_ENCODER if kind == "encoder" else DECODER_ONLY


class Probe:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""       # one line for `tndebug probes`
    reads: ClassVar[tuple[str, ...]] = ()
    fix: ClassVar[str] = ""           # default fix text, from the notes
    # the probable cause its findings point to (report.md), in the tutorial notes' words with
    # their citations ([note 001]), or "(not in the notes)"
    cause: ClassVar[str] = ""
    codes: ClassVar[dict[str, str]] = {}   # kind -> one line: every finding's code (probe/kind)
    default_schedule: ClassVar[Callable[[], Schedule]] = staticmethod(lambda: every(100))
    # True when the probe's verdict rests on training steps (gradients, the loss, the lr): in a
    # training run (mode "train") that observed none of its steps it has no verdict, whatever
    # its setup examined, and the report is "unchecked".
    needs_steps: ClassVar[bool] = False
    # True when observe/update use only StepInfo's host numbers (step, lr): a step on which only
    # such probes are due needs no batch, no trace and no device sync (`ProbeEngine.host_only`).
    host_only: ClassVar[bool] = False
    # True when the probe's findings on a module are about that module's output (the stream
    # a block returns): such a finding is placed at the line that made the output (a block's
    # residual add); another probe's finding on a module is about its inner computation (the
    # rotary, the cache, the heads' order), and the output's line (`return self.out_proj(y)`)
    # would name a line that is not the bug's: it gets the module's forward def.
    places_by_output: ClassVar[bool] = False

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
        self.internal_error: str | None = None            # the probe's own code raised (a tndebug bug)
        self.interrupted = False                          # a moment raised: what it checked is unfinished
        self.not_run: dict[str, str] = {}                 # part -> why: applies, did not run (INCOMPLETE)
        self.coverage: dict[str, dict[str, str]] = {}     # where -> {"status", "reason"?}
        self.observed_steps = 0                           # training steps observed (the engine counts)
        self.steps_run: int | None = None                 # the run's steps, set by the engine at finish
        self.mode: str | None = None                      # run.mode, set by the engine

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
               head: int | None = None, code: str = "", source: dict | None = None) -> Finding:
        """A finding of kind `code`, reported as "<probe>/<code>". A probe that declares `codes`
        (every built-in one) must name a declared kind; one that declares none (a user's own
        probe) may omit it and gets "<probe>/finding"."""
        if self.codes and code not in self.codes:
            raise ProbeError(f"{self.name}: finding code {code!r} is not declared in "
                             f"{type(self).__name__}.codes")
        code = code or "finding"
        f = Finding(self.name, severity, message, where=where, step=step,
                    evidence=dict(evidence or {}), fix=self.fix if fix is None else fix,
                    layer=layer, head=head, code=f"{self.name}/{code}", source=source)
        self.findings.append(f)
        return f

    def already(self, where: str = "", severity: str | None = None) -> bool:
        """True when a finding for `where` (at `severity`, if given) was already reported."""
        return any(f.where == where and (severity is None or f.severity == severity)
                   for f in self.findings)

    def sees_optimizer_steps(self, run: RunContext) -> bool:
        """For a probe that hooks the optimizer itself (`schedule.own_hooks`): True when there
        are steps to see; else it says why (not applicable in triage, no verdict without an
        optimizer) and returns False."""
        if run.mode != "train":
            self.cover("", "not applicable", "no training steps (triage)")
            return False
        if run.optimizer is None:
            self.skip("no optimizer given: its steps cannot be seen")
            return False
        return True

    def metric(self, step: int, tag: str, value: float) -> None:
        """A scalar for the reporters, tag `family/stack/layerN/headM/metric`."""
        self.metrics.append((step, tag, float(value)))

    def cover(self, where: str, status: str, reason: str = "") -> None:
        """Say what was examined at `where` (module path in the model's naming; "" = the run).

        `status` is "checked", "no verdict" (there, but nothing could be decided: say why) or
        "not applicable". A later call for the same `where` only upgrades it (checked beats
        no verdict beats not applicable); the first reason at the kept status stays.
        """
        if status not in COVERAGE:
            raise ProbeError(f"{self.name}: coverage status {status!r}; valid: {', '.join(COVERAGE)}")
        where, reason = user_path(where), user_path(reason)        # as the user's model prints it
        old = self.coverage.get(where)
        rank = COVERAGE.index(status)
        if old is None or rank > COVERAGE.index(old["status"]):
            self.coverage[where] = {"status": status, **({"reason": reason} if reason else {})}
        elif rank == COVERAGE.index(old["status"]) and reason and "reason" not in old:
            old["reason"] = reason
        if status == "checked":
            self.checked = True

    def applies_nowhere(self) -> bool:
        """Every place it looked said "not applicable" (lm-decoding on an encoder-decoder)."""
        return bool(self.coverage) and all(c["status"] == "not applicable"
                                           for c in self.coverage.values())

    def skip(self, reason: str, where: str | None = None) -> None:
        """Nothing could be decided: at `where` (coverage "no verdict"), or, without `where`,
        by the probe as a whole (`self.skipped`, the status's reason)."""
        if where is not None:
            self.cover(where, "no verdict", reason)
        else:
            self.skipped = reason

    def status(self, findings: list[Finding] | None = None) -> str:
        """fail | warn | internal error | pass | no verdict | skipped.

        fail / warn from the findings (`findings`: another list to judge, e.g. every rank's
        under DDP); else "pass" only if something was checked; "no verdict" when the probe was
        applicable but decided nothing (or, with `needs_steps`, a training run gave it no
        step); "skipped" when it never ran or nothing applied anywhere.
        """
        findings = self.findings if findings is None else findings
        if any(f.severity == "error" for f in findings):
            return "fail"
        if any(f.severity == "warning" for f in findings):
            return "warn"
        if self.internal_error:
            return "internal error"         # never "pass": what it checked before it raised is unknown
        if self.interrupted:
            return "no verdict"
        if self._starved():
            return "no verdict"
        if self.checked:
            return "pass"
        if self.skipped or any(c["status"] == "no verdict" for c in self.coverage.values()):
            return "no verdict"
        if self.observed_steps and not self.coverage:
            return "no verdict"             # it ran, and said nothing about what it examined
        return "skipped"

    def steps_needed(self, probed: int) -> int | None:
        """How many steps a run needs for `probed` steps of this probe's schedule (None past
        a million)."""
        seen = 0
        for step in range(1_000_000):
            if self.schedule(step):
                seen += 1
                if seen >= probed:
                    return step + 1
        return None

    def needs_more(self, probed: int) -> str:
        """"needs N steps; this run had M" where the run was too short for `probed` steps of
        the schedule, else ""."""
        need = self.steps_needed(probed)
        if need is None or self.steps_run is None or self.steps_run >= need:
            return ""
        return f"needs {need} steps; this run had {self.steps_run}"

    def _starved(self) -> bool:
        return self.needs_steps and self.mode == "train" and self.observed_steps == 0

    def reason(self) -> str:
        """Why the status is what it is: the probe's own skip reason, else (for no verdict or
        skipped) the first reason among its coverage at that level."""
        if self.internal_error:
            return self.internal_error
        if self._starved():
            more = self.needs_more(1)
            return f"{NO_STEP} ({self.schedule.__doc__}: {more})" if more else NO_STEP
        if self.skipped:
            return self.skipped
        if self.checked:
            return ""
        for level in ("no verdict", "not applicable"):
            for c in self.coverage.values():
                if c["status"] == level and c.get("reason"):
                    return c["reason"]
        if self.observed_steps and not self.coverage:
            return f"observed {self.observed_steps} steps but reported nothing it checked"
        return ""

    def status_entry(self, findings: list[Finding] | None = None) -> dict:
        """The report's `probes[name]`: {"status", "reason"?, "steps_observed"?, "coverage"?}."""
        out: dict[str, Any] = {"status": self.status(findings)}
        why = self.reason()
        if why:
            out["reason"] = why
        if self.needs_steps and self.mode == "train":
            out["steps_observed"] = self.observed_steps
        if self.coverage:
            out["coverage"] = {w: dict(c) for w, c in self.coverage.items()}
        if self.not_run:
            out["not_run"] = dict(self.not_run)
        return out

    def part_not_run(self, part: str, why: str) -> None:
        """A part of this probe's test that applies to the model and could not run (`why` says
        what it needs): the verdict cannot be clean (Report.incomplete, the NOT CHECKED line)."""
        self.not_run[part] = why
