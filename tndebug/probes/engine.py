"""The probe engine: attaches probes to a run, captures traces on scheduled steps only, and
syncs all probes' device statistics to the host once per probed step.

    engine = ProbeEngine(probes, run)
    with engine:                          # every hook is removed on exit, even on error
        engine.setup()
        for step ...:
            trace = engine.begin_step(step, src, tgt_in)     # None on off-schedule steps
            loss = ...; loss.backward()
            engine.end_step(StepInfo(step, lr, loss, ...))  # before optimizer.step()
        findings = engine.finish()
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch

from tndebug.capture.source import module_place
from tndebug.findings import Finding
from tndebug.probes.raised import by_tndebug, raised_in
from tndebug.probes.base import Probe, ResumeInfo, RunContext, StepInfo
from tndebug.probes.budget import Budget
from tndebug.probes._tolerance import computing_in
from tndebug.capture.trace import Trace

Reducer = Callable[[torch.Tensor], torch.Tensor]
SNAPSHOT_READS = frozenset({"attn.probs", "stream", "grad.stream"})   # what the figures draw


def failure_reason(what: str, e: BaseException) -> str:
    """Why a probe that raised has no verdict, saying whose code raised: tndebug's own (a bug
    to report) or the model's, on an input the probe gave it (`raised.by_tndebug`)."""
    where = raised_in(e)
    whose = ("tndebug's own code (a tndebug bug: please report it)" if by_tndebug(e)
             else "the model's code") + (f" at {where}" if where else "")
    return f"{what} raised {type(e).__name__}: {e} (in {whose})"


class ProbeEngine:
    def __init__(self, probes: Iterable[Probe], run: RunContext, sinks: Iterable[Any] = (),
                 reducer: Reducer | None = None, budget: Budget | None = None) -> None:
        self.probes = list(probes)
        self.budget = budget            # thins probed steps to a share of the step time (watch)
        self.run = run
        self.sinks = list(sinks)
        self.reducer = reducer          # all-reduce of the packed statistics (DDP), or None
        self._stack = contextlib.ExitStack()
        self._trace: Trace | None = None
        self._due: list[Probe] = []
        self.first_sign: Finding | None = None   # the earliest warning/error, for diverged runs
        self.probe_seconds = 0.0
        self.steps_run = 0              # 1 + the highest step begun (a run's steps, global)
        self.host_only = False          # the step begun needs no batch (its probes are host_only)
        self.seconds_by_probe: dict[str, float] = {p.name: 0.0 for p in self.probes}
        for p in self.probes:
            p.mode = run.mode
        if budget is not None:          # the closing snapshot comes, and the budget pays for it
            budget.final_reserve = (run.total_steps is not None
                                    and any(hasattr(s, "on_trace") for s in self.sinks))

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "ProbeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._trace = None

    def _guard(self, probe: Probe, what: str, fn, *args):
        """Run one probe moment; a crashing probe is skipped, never the whole run."""
        t0 = time.perf_counter()
        try:
            with computing_in(self.run.compute_dtype):      # exact tests' tolerances (_tolerance.py)
                return fn(*args)
        except Exception as e:  # noqa: BLE001 - a probe's bug must not kill training
            if by_tndebug(e):       # tndebug's own bug: an internal error, never a pass
                if probe.internal_error is None:
                    probe.internal_error = failure_reason(what, e)
            else:                   # the model raised and the probe did not catch it
                probe.interrupted = True
                if probe.skipped is None:
                    probe.skip(failure_reason(what, e))
            return None
        finally:
            self.seconds_by_probe[probe.name] = self.seconds_by_probe.get(probe.name, 0.0) + \
                time.perf_counter() - t0

    def _note_findings(self) -> None:
        """first_sign: the earliest warning or error by step (a step-less one counts as 0),
        revisited whenever findings arrive: a probe that judges late (loss-health at step 10,
        reported after ln-placement's step-16 warning) may have seen it first. On a tie the
        one reported first stays."""
        for p in self.probes:
            for f in p.findings:
                if f.severity in ("warning", "error") and (
                        self.first_sign is None or (f.step or 0) < (self.first_sign.step or 0)):
                    self.first_sign = f

    def setup(self) -> None:
        t0 = time.perf_counter()
        for p in self.probes:
            self._guard(p, "setup", p.setup, self.run)
        self.probe_seconds += time.perf_counter() - t0
        self._note_findings()
        self._drain_metrics()

    def resume(self, info: ResumeInfo) -> None:
        for p in self.probes:
            self._guard(p, "on_resume", p.on_resume, self.run, info)
        self._note_findings()

    def diverged(self, info: StepInfo) -> None:
        """The loss went non-finite: let every probe look at the batch (replays may sync)."""
        if self._trace is not None:         # a capture still open from begin_step
            self._stack.close()
            self._stack = contextlib.ExitStack()
            self._trace = None
        for p in self.probes:
            self._guard(p, "on_divergence", p.on_divergence, self.run, info)
        self._note_findings()
        self._drain_metrics()

    def wants(self, step: int) -> bool:
        return any(p.schedule(step) for p in self.probes)

    def begin_step(self, step: int, src: torch.Tensor | None = None,
                   tgt: torch.Tensor | None = None) -> Trace | None:
        self.steps_run = max(self.steps_run, step + 1)   # the run's steps so far (global)
        due = [p for p in self.probes if p.schedule(step)]
        final = self._final_snapshot(step)
        if self.budget is not None:
            due = self._within_budget(due, final, step)
        self._due = due
        self.host_only = bool(self._due) and not final and all(p.host_only for p in self._due)
        if not self._due and not final:
            return None
        reads = frozenset(r for p in self._due for r in p.reads) | (SNAPSHOT_READS if final else frozenset())
        trace = Trace(step=step, src=src, tgt=tgt, pad_id=self.run.subject.data_pad_id)
        if reads and self.run.subject.capture is not None:
            self._stack.enter_context(self.run.subject.capture.recording(reads, trace))
        self._trace = trace
        return trace

    def _within_budget(self, due: list[Probe], final: bool, step: int) -> list[Probe]:
        """The due probes this step can afford: over budget, only first observations, the
        probes that capture nothing (the loss, the lr: a sync at most) and those whose first
        sight of a bug is the point (`budget_exempt`: nan-scores) stay (budget.py; the
        front-end times the step and records it)."""
        # the last step is never thinned where a rank takes the closing snapshot (each rank
        # asks its budget, whose answer is the ranks' agreed one: rank 0 alone has the sinks)
        last = final or (self.run.total_steps is not None and self.budget.reserves_final
                         and step == self.run.total_steps - 1)
        # a look the budget never defers makes this step's cost fixed (budget.fixed_s)
        self.budget.fixed_next = last or any(p.reads and p.observed_steps == 0 for p in due)
        if not last and any(p.reads for p in due) and not self.budget.allows():
            kept = [p for p in due if not p.reads or p.observed_steps == 0
                    or getattr(p, "budget_exempt", False)]
            for p in due:
                if p not in kept and p.skipped is None and not p.applies_nowhere():
                    # a probe that skipped itself, or applies nowhere, defers nothing
                    self.budget.thin(p.name)
            due = kept
        return due

    def _final_snapshot(self, step: int) -> bool:
        """The last training step is captured for the sinks (the figures show the model as it
        ended, whatever the probes' schedules), without any probe observing it."""
        return (self.run.total_steps is not None and step == self.run.total_steps - 1
                and any(hasattr(s, "on_trace") for s in self.sinks))

    def end_step(self, info: StepInfo) -> None:
        if self._trace is None:
            return
        t0 = time.perf_counter()
        self._stack.close()                 # hooks off before the optimizer step
        self._stack = contextlib.ExitStack()
        trace, self._trace = self._trace, None
        if info.logits is not None and trace.logits is None:
            trace.logits = info.logits
        collected = []
        for p in self._due:
            stats = self._guard(p, "observe", p.observe, trace, info)
            collected.append((p, stats or {}))
        host = self._to_host(collected)
        for (p, _), stats in zip(collected, host):
            p.observed_steps += 1         # observed, not checked: the probe says what it examined
            self._guard(p, "update", p.update, stats, info)
        for sink in self.sinks:
            on_trace = getattr(sink, "on_trace", None)
            if on_trace is not None:
                on_trace(info.step, trace)
        self.probe_seconds += time.perf_counter() - t0
        self._note_findings()
        self._drain_metrics()

    def finish(self) -> list[Finding]:
        for p in self.probes:
            if self.steps_run:
                p.steps_run = self.steps_run          # what a schedule that needs more can say
            self._guard(p, "finish", p.finish, self.run)
        self._locate()
        self._note_findings()
        self._drain_metrics()
        return self.findings()

    def findings(self) -> list[Finding]:
        return [f for p in self.probes for f in p.findings]

    def _locate(self) -> None:
        """A finding on a module that no recorded op located gets a place in the model's code:
        the module's own forward where that is the user's (or transformers') code (its def line,
        marked so), else, for torch's modules (an embedding, a norm, a Linear), the line of the
        model's code that calls it (capture/source.module_place)."""
        model = getattr(getattr(self.run, "subject", None), "model", None)
        if model is None:
            return
        modules = dict(model.named_modules())
        for p in self.probes:
            for i, f in enumerate(p.findings):
                if f.source or f.where not in modules or not f.where:
                    continue
                source = module_place(model, f.where, modules, by_output=p.places_by_output)
                if source is not None:
                    p.findings[i] = replace(f, source=source)

    def statuses(self, findings: list[Finding] | None = None) -> dict[str, dict]:
        """probe name -> {"status", "reason"?, "steps_observed"?, "coverage"?}.

        `findings`: the list the report carries, when it is not the probes' own (under DDP,
        every rank's, gathered to rank 0): fail / warn follow it. Coverage is this process's;
        every rank runs the same setup on the same batches and probes the same steps."""
        mine = None if findings is None else \
            {p.name: [f for f in findings if f.probe == p.name] for p in self.probes}
        return {p.name: p.status_entry(None if mine is None else mine[p.name]) for p in self.probes}

    # -- internals -------------------------------------------------------------------------
    def _to_host(self, collected):
        """Pack every tensor statistic into one buffer: one reduction, one device->host copy."""
        flat, layout = [], []
        for _, stats in collected:
            for key, val in stats.items():
                if isinstance(val, torch.Tensor):
                    layout.append((key, val.shape, val.numel()))
                    flat.append(val.detach().reshape(-1).to(torch.float32))
        if flat:
            packed = torch.cat(flat)
            if self.reducer is not None:
                packed = self.reducer(packed)
            packed = packed.cpu()
        out, offset = [], 0
        for _, stats in collected:
            host = {}
            for key, val in stats.items():
                if isinstance(val, torch.Tensor):
                    n = val.numel()
                    host[key] = packed[offset:offset + n].reshape(val.shape)
                    offset += n
                else:
                    host[key] = val
            out.append(host)
        return out

    def _drain_metrics(self) -> None:
        for p in self.probes:
            if p.metrics:
                for sink in self.sinks:
                    on_metric = getattr(sink, "on_metric", None)
                    if on_metric is not None:
                        for step, tag, value in p.metrics:
                            on_metric(step, tag, value)
                p.metrics.clear()
