"""`tndebug.watch`: the probes of `tndebug run` on the user's own model and training loop.

    with tndebug.watch(model, optimizer, forward=my_forward, pad_id=0, out="runs/mine") as dbg:
        for src, tgt in loader:
            loss = criterion(model(src, tgt[:, :-1]), tgt[:, 1:])
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
    dbg.report.verdict, dbg.exit_code

It drives the one `ProbeEngine` as `tndebug run` does, from hooks it registers itself and
removes on exit:

* entering: a `Subject` for the model (`live_subject`: the generic capture, as triage wraps
  user code), every probe's `setup` (the exact tests), `resume` when `start_step > 0`;
* the model's forward pre-hook: the step's batch (`default_batch`, or `batch=`); only on a
  step some probe is scheduled for does it open a recording (`begin_step`), closed again when
  backward starts (its gradient hooks live on the tensors), so nothing else is recorded;
* `Optimizer.register_step_pre_hook`: after backward, before the update: `end_step`, with the
  lr from the optimizer's first param group and the loss (`dbg.step(loss=...)` before the
  step, else the output's `.loss`, else the tensor `backward()` was called on);
* the step post-hook counts the step; a non-finite loss (on the CPU, or on a probed step)
  calls every probe's `on_divergence` once and stops probing (`dbg.diverged`);
* leaving: `finish`, the Report, report.json / report.md / TensorBoard (`out=`), the exit code.

Nothing outlives the block: hooks are removed, the engine, subject and batch references
dropped; the hooks hold the watch through a weak reference. The per-step hooks are
`watch_hooks.WatchHooks` (a mixin of Watch), the pieces they hook in `watch_parts`. A probe that raises is switched
off and reported (an info finding); an error of tndebug's own stops probing, never training.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tndebug import judge
from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.library import args as A
from tndebug.library import ranks
from tndebug.library.live import declared_schedule, live_subject, set_max_len, unwrap
from tndebug.library.watch_hooks import WatchHooks
from tndebug.library.watch_parts import (BACKWARD_TAP, Shielded, StepCapture, WeakHook, brief_session,
                                         dist_from_env, inner_optimizer, optimizes, probe_failed_finding,
                                         quiet_session, run_record)
from tndebug.probes.base import Probe, ProbeError, ResumeInfo, RunContext
from tndebug.probes.budget import DEFAULT_FRACTION, Budget
from tndebug.probes.engine import ProbeEngine
from tndebug.probes.schedule import never
from tndebug.report import Report

MOMENTS = ("setup", "observe", "update", "finish", "on_divergence", "on_resume")
SEVERITIES = ("info", "warning", "error", "never")


class Watch(WatchHooks):
    """A probed training run around the user's own loop. Use `tndebug.watch(...)`.

    After the block: `report` (a `tndebug.report.Report`), `exit_code` (0, or 1 with findings
    at or above `fail_on`), `out` (the run directory or None), `diverged` (the step or None).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 forward: Callable | None = None, pad_id: int | None = 0, bos_id: int | None = None,
                 out: str | Path | None = None, probes: Any = "all", criterion: Callable | None = None,
                 lr_schedule: Any = None, start_step: int = 0, lr_before: float | None = None,
                 total_steps: int | None = None, batch: Callable | None = None,
                 fail_on: str = "error", tensorboard: bool = True, quiet: bool = False,
                 src_vocab: int | None = None, tgt_vocab: int | None = None,
                 hook_optimizer: bool = True, dist: Any = None, overwrite: bool = False,
                 max_len: int | None = None, select=None, ignore=None,
                 budget: float | None = DEFAULT_FRACTION, arch: str | None = None,
                 print_report: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"watch: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(inner_optimizer(optimizer), torch.optim.Optimizer):
            raise UsageError(f"watch: optimizer must be a torch.optim.Optimizer (or None), got "
                             f"{type(optimizer).__name__}")
        if fail_on not in SEVERITIES:
            raise UsageError(f"watch: fail_on={fail_on!r}; expected one of {', '.join(SEVERITIES)}")
        A.callable_or_none(batch, "watch", "batch", "a function (args, kwargs) -> (src, tgt_in"
                           "[, tgt_out]) of the model's call")
        A.callable_or_none(criterion, "watch", "criterion", "a function (logits [N, V], target "
                           "[N]) -> loss, e.g. torch.nn.CrossEntropyLoss(ignore_index=pad_id)")
        A.count(start_step, "watch", "start_step", least=0, none=False)
        A.fraction_or_none(budget, "watch", "budget")
        self._budget = budget
        A.count(total_steps, "watch", "total_steps", least=1)
        probes = A.probe_spec(probes, "watch")
        self._overwrite = bool(overwrite)
        self._sharding = ranks.sharding_of(model)    # "fsdp2" | "ddp" | None, before unwrapping
        self._model = unwrap(model)           # held until the block ends, then only weakly
        self._model_ref = weakref.ref(self._model)
        self._optimizer = inner_optimizer(optimizer) if optimizer is not None else None
        if self._optimizer is not None:
            optimizes(self._optimizer, model, self._model)
        self._forward, self._pad_id, self._bos_id = forward, pad_id, bos_id
        self._arch = arch
        self.out = A.output_dir(out, overwrite=self._overwrite, start_step=start_step,
                                main=A.is_main_process(dist))
        self._claim = contextlib.ExitStack()     # the output directory's lock, held in the block
        self._probe_spec, self._criterion = probes, criterion
        self._schedule, self._schedule_note = declared_schedule(lr_schedule)
        self.start_step, self._lr_before = int(start_step), lr_before
        self._total_steps, self._batch_fn = total_steps, batch
        self.fail_on, self._tensorboard, self._quiet = fail_on, tensorboard, quiet
        self._print_report = bool(print_report)
        self._vocab = (src_vocab, tgt_vocab)
        self._max_len = max_len
        self._codes = (judge.codes_option(select, "watch: select="),
                       judge.codes_option(ignore, "watch: ignore="))
        self._hook_optimizer = hook_optimizer and self._optimizer is not None
        self._dist = dist
        # -- results
        self.report: Report | None = None
        self.exit_code: int | None = None
        self.diverged: int | None = None
        # -- state
        self._state = "new"                  # new | open | closed
        self._engine: ProbeEngine | None = None
        self._subject = None
        self._session = None
        self._handles: list = []
        self._failed: dict[str, str] = {}
        self._own_failure: str | None = None
        self._batch_checked = False
        self._data_findings: list[Finding] | None = None   # of the first batch (live.pad_id_findings)
        self._busy = False
        self._own_s = 0.0                    # seconds in our hooks since the budget's last record
        self._own_since, self._hook_t0 = 0.0, None   # that record's time; the outer hook's start
        self._reset_step(self.start_step)
        self._steps_seen = 0
        self._history: dict[str, list] = {"step": [], "loss": [], "lr": []}

    # -- the block -------------------------------------------------------------------------------
    def __enter__(self) -> "Watch":
        try:
            return self._enter()
        except BaseException:
            self._claim.close()           # a refused entry leaves no lock and no empty directory
            raise

    def _enter(self) -> "Watch":
        if self._state != "new":
            raise UsageError("this tndebug.watch(...) was already used; make a new one per run")
        model = self._model_ref()
        self._handles += ranks.keep_sharded(model, ranks.working(weakref.ref(self)))
        self._t0 = time.perf_counter()
        self._params = list(model.parameters())   # whose .grad the probes' own calls restore
        probes = self._make_probes()
        needs_attention = any(r.startswith("attn.") for p in probes for r in p.reads)
        self._subject, self._info = live_subject(
            model, self._forward, pad_id=self._pad_id, bos_id=self._bos_id,
            src_vocab=self._vocab[0], tgt_vocab=self._vocab[1], need_attention=needs_attention,
            arch=self._arch)
        set_max_len(self._subject, self._max_len, "watch")
        self._pad_id = self._subject.data_pad_id    # NO_PAD (-1) when pad_id=None: no padding
        self._start_id = (self._info.get("hf_ids") or {}).get("start", self._subject.bos_id)
        self._capture = StepCapture(self._subject.capture)
        self._subject.capture = self._capture
        self._dist = self._dist if self._dist is not None else dist_from_env()
        main = self._dist is None or self._dist.is_main
        if self.out is not None and not main:
            ranks.say_not_writing(self._dist.rank, self._dist.world, self.out)
        if self.out is not None and main:
            from tndebug.reporters.session import ReportSession
            # the script's stdout is its own: the full summary there only when asked
            cls = (quiet_session(ReportSession) if self._quiet else ReportSession if self._print_report
                   else brief_session(ReportSession))
            self.out = A.claim_output(self._claim, self.out, overwrite=self._overwrite,
                                      start_step=self.start_step)
            self._session = cls(self.out, tensorboard=self._tensorboard,
                                resume_step=self.start_step or None)
            self._session.plan(self._total_steps)   # snapshots: ~20 a run, fewer if unknown
        for p in probes:
            self._shield(p)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        run = RunContext(subject=self._subject, optimizer=self._optimizer, criterion=self._criterion,
                         lr_schedule=self._schedule, compute_dtype=dtype, device=str(self._device),
                         total_steps=self._total_steps, mode="train")
        self._engine = ProbeEngine(probes, run, sinks=getattr(self._session, "sinks", ()),
                                   reducer=self._dist.reducer if self._dist is not None else None,
                                   budget=None if self._budget is None else Budget(
                                       self._budget, agree=self._dist.agree_max
                                       if self._dist is not None and self._dist.active else None))
        self._rng_devices = [self._device] if self._device.type == "cuda" else []
        self._state = "open"
        self._call(self._engine.setup, full=True)
        if self.start_step > 0:
            lr_before = self._lr_before
            if lr_before is None and self._schedule is not None:
                lr_before = float(self._schedule(self.start_step - 1))
            opt = self._optimizer
            self._call(self._engine.resume, ResumeInfo(
                self.start_step, lr_before=lr_before,
                had_optimizer_state=bool(opt is not None and any(opt.state.values()))), full=True)
        ref = weakref.ref(self)
        self._handles.append(model.register_forward_pre_hook(WeakHook(ref, "_on_forward"),
                                                             with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_hook(WeakHook(ref, "_on_output"), with_kwargs=True))
        head = self._info.get("logits_module")
        if head:                              # the logits come from a child (`generator`)
            self._handles.append(model.get_submodule(head).register_forward_hook(
                WeakHook(ref, "_on_logits"), with_kwargs=True))
        if self._hook_optimizer:
            self._handles.append(self._optimizer.register_step_pre_hook(WeakHook(ref, "_on_opt_step")))
            self._handles.append(self._optimizer.register_step_post_hook(WeakHook(ref, "_on_opt_done")))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._state != "open":
            return False
        status = "completed"
        if exc_type is KeyboardInterrupt:
            status = "interrupted"
        elif exc_type is not None:
            status = "failed"
        elif self.diverged is not None:
            status = "diverged"
        try:
            self._finish(status, None if exc is None else f"{exc_type.__name__}: {exc}")
        except Exception as e:  # noqa: BLE001 - never mask the user's own exception
            if exc_type is None:
                raise
            import sys
            print(f"tndebug: warning: could not write the report: {type(e).__name__}: {e}",
                  file=sys.stderr)
        finally:
            self._release()
        return False

    # -- the user's calls ---------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float | None = None, *, lr: float | None = None) -> None:
        """Tell the watch about this training step (optional with an optimizer).

        With an optimizer: call it before or after `optimizer.step()`; `loss` is then the
        step's loss (before) or checked for divergence (after). Without one, it *is* the probes'
        moment: call it after `loss.backward()` and before the update, once per step.
        """
        if self._state != "open":
            where = "before the block" if self._state == "new" else "after the block"
            raise UsageError(f"dbg.step() called {where}: call it inside `with tndebug.watch(...) "
                             f"as dbg:`, once per training step")
        if lr is not None:
            self._lr = float(lr)
        t = A.scalar_loss(loss)
        if not self._hook_optimizer:
            if t is not None:
                self._loss = t
            self._moment()
            self._advance(self._step + 1)
        elif self._forward_seen == self._step and not self._moment_done:
            if t is not None:
                self._loss = t               # before optimizer.step(): this step's loss
        elif t is not None and t.device.type == "cpu":   # after it: the step just taken
            self._check_finite(self._step - 1, t, self._prev_batch)   # (no sync on a GPU)

    # -- probes ------------------------------------------------------------------------------------
    def _make_probes(self) -> list[Probe]:
        from tndebug.probes import make_probes, parse_probe_spec
        spec = self._probe_spec
        try:
            if isinstance(spec, (list, tuple)) and spec and all(isinstance(p, Probe) for p in spec):
                return list(spec)
            if isinstance(spec, (list, tuple)):
                spec = ",".join(spec)
            return make_probes(parse_probe_spec(spec))
        except ProbeError as e:
            raise UsageError(f"watch: probes={self._probe_spec!r}: {e}") from None

    def _shield(self, probe: Probe) -> None:
        """A probe that raises is reported once and switched off; the engine skips it after."""
        ref = weakref.ref(self)
        for what in MOMENTS:
            setattr(probe, what, Shielded(ref, probe.name, what, getattr(probe, what)))

    def _probe_failed(self, name: str, what: str, e: Exception) -> None:
        if name in self._failed:
            return
        self._failed[name] = f"{what} raised {type(e).__name__}: {e}"
        probe = next(p for p in self._engine.probes if p.name == name)
        probe.schedule = never()
        probe.findings.append(probe_failed_finding(name, what, e, self._step))

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, status: str, error: str | None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        BACKWARD_TAP.unwatch(self)
        self._capture.stop()
        engine = self._engine
        findings = self._call(engine.finish, full=True) or engine.findings()
        findings += self._data_findings or []          # the pad id seen mid-sequence (live.py)
        if self._dist is not None and status in ("failed", "interrupted"):
            self._dist.broken = True           # the others may be mid-step: no collective now
        if self._dist is not None and self._dist.active:
            findings = self._dist.gather_findings(findings)
            self._per_rank = ranks.gather_facts(self._dist, ranks.rank_facts(self, status))
        if self._own_failure is not None:
            findings.append(Finding("watch", "warning", f"tndebug stopped probing: "
                                    f"{self._own_failure}", evidence={"traceback": self._own_tb},
                                    fix="A tndebug bug: training went on without probes; please "
                                        "report it with this traceback", code="watch/stopped"))
        statuses = engine.statuses(findings)
        context = judge.Context(failed=dict(self._failed), history=self._history,
                                select=self._codes[0], ignore=self._codes[1])
        if self._info.get("hf") and status == "completed":   # a missing scale judged where the
            from tndebug.library.check import hf_context            # design is (check does too)
            context = hf_context(context, self._model, self._forward, self._subject,
                                 wording=False, pad_id=self._pad_id, bos_id=self._bos_id,
                                 arch=self._arch)
        run = run_record(self, engine, status, error)
        self.report = judge.conclude(run, findings, statuses, context)
        if self._session is not None:
            self.exit_code = self._session.finish(self.report, self.fail_on)
        else:
            self.exit_code = self.report.exit_code(self.fail_on)
            if self._print_report and not self._quiet and (self._dist is None or self._dist.is_main):
                from tndebug.reporters import console
                console.print_summary(self.report, console.make_console())
        if self._dist is not None:
            self._dist.settle()                # the ranks leave the block once rank 0's report is written

    def _release(self) -> None:
        """Drop every reference to the user's model, graph and data."""
        self._state = "closed"
        if self._engine is not None:
            self._engine.__exit__(None, None, None)
            for p in self._engine.probes:
                for what in MOMENTS:
                    p.__dict__.pop(what, None)
                p._run = None
            self._engine.probes = []
            self._engine.run = None
        self._engine = self._subject = self._capture = self._session = None
        self._claim.close()                   # the output lock (and an empty directory made for it)
        self._params = []
        self._batch = self._prev_batch = self._loss = self._logits = None
        self._optimizer = self._model = None


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs) -> Watch:
    """The probes of `tndebug run` on your own training loop; use it as a context manager.

    Args:
        model: your encoder-decoder (a DDP wrapper is unwrapped).
        optimizer: its optimizer; the probes run in its step pre-hook (after backward, before
            the update). None: call `dbg.step()` after backward instead; lr-schedule then needs
            `dbg.step(lr=...)`.
        forward: `forward(model, src [B, S], tgt [B, T], pad_id) -> logits [B, T, V]`, how the
            probes call your model for their own tests (a Hugging Face encoder-decoder, tndebug's
            and The Annotated Transformer's layout need none).
        pad_id, bos_id: the padding id (0) and the decoder's first id (1; HF: from its config).
        out: the run directory for report.json, report.md, figures/ and tb/ (None: no files);
            one that holds a run is refused unless `overwrite=True` (as `tndebug run --out`).
        overwrite: replace the run in `out` (its reports, figures and TensorBoard events).
        probes: "all" (default schedules), "a,b", a list of names or of Probe objects.
        criterion: `(logits [N, V], target [N]) -> loss`, for label-smoothing's unit test.
        lr_schedule: the declared schedule, `step -> lr` or a LambdaLR, for lr-schedule.
        start_step: the global step the loop starts at (> 0 on resume: the probes' on_resume).
        lr_before: the lr applied last before the checkpoint (default: the schedule's).
        total_steps: the planned number of steps (lr plots, ln-placement's horizon).
        batch: `(args, kwargs) -> (src, tgt_in[, tgt_out])` from your model's call, when the
            default (HF keywords, else the first two 2-D integer tensors) does not fit.
        fail_on: "error" | "warning" | "info" | "never": what makes `exit_code` 1.
        tensorboard, quiet: write out/tb; print no summary at the end.
        print_report: print the whole summary (findings table, probes, files) to stdout at the
            end, as `tndebug run` does; by default a watch with `out=` writes a few lines to
            stderr (verdict, counts, the findings' codes, the files) and leaves stdout to your
            script, and one without `out=` prints nothing.
        select, ignore: finding codes or probe names to keep only / to drop (`tndebug probes
            --codes`), as ruff's --select / --ignore.
        max_len: the longest sequence your model takes (default: its config's
            max_position_embeddings, else found by calling it); the probes' batches fit it.
        budget: the share of your own step time the probed steps may cost (0.03: <= 1.03x);
            over it, scheduled looks are skipped (each probe still looks once; run.probe_budget
            says what was spent and skipped). None: every scheduled look. Under DDP or FSDP2
            the ranks agree on the measured times every 10 steps, so all skip the same looks.
        arch: "decoder" (GPT-style) or "encoder" (BERT-style) for your own one-stack model, which
            both take forward(model, ids, pad_id); None: told from the class name, else decoder.
    Raises:
        tndebug.errors.UsageError on entering, for a model or forward it cannot use.
    """
    return Watch(model, optimizer, **kwargs)
