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
dropped; the hooks hold the watch through a weak reference. A probe that raises is switched
off and reported (an info finding); an error of tndebug's own stops probing, never training.
"""
from __future__ import annotations

import contextlib
import math
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tndebug import driver
from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.library import args as A
from tndebug.library.live import declared_schedule, default_batch, live_subject, pad_id_findings, \
    set_max_len, unwrap
from tndebug.probes._raised import by_tndebug, raised_in
from tndebug.probes.base import Probe, ProbeError, ResumeInfo, RunContext, StepInfo
from tndebug.probes.budget import DEFAULT_FRACTION, Budget
from tndebug.probes.engine import ProbeEngine
from tndebug.probes.schedule import never
from tndebug.report import Report
from tndebug.capture.adapters import first_tensor

MOMENTS = ("setup", "observe", "update", "finish", "on_divergence", "on_resume")
SEVERITIES = ("info", "warning", "error", "never")


class Watch:
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
                 budget: float | None = DEFAULT_FRACTION) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"watch: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(_inner_optimizer(optimizer), torch.optim.Optimizer):
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
        self._model = unwrap(model)           # held until the block ends, then only weakly
        self._model_ref = weakref.ref(self._model)
        self._optimizer = _inner_optimizer(optimizer) if optimizer is not None else None
        self._forward, self._pad_id, self._bos_id = forward, pad_id, bos_id
        self.out = A.output_dir(out, overwrite=self._overwrite, start_step=start_step,
                                main=A.is_main_process(dist))
        self._claim = contextlib.ExitStack()     # the output directory's lock, held in the block
        self._probe_spec, self._criterion = probes, criterion
        self._schedule, self._schedule_note = declared_schedule(lr_schedule)
        self.start_step, self._lr_before = int(start_step), lr_before
        self._total_steps, self._batch_fn = total_steps, batch
        self.fail_on, self._tensorboard, self._quiet = fail_on, tensorboard, quiet
        self._vocab = (src_vocab, tgt_vocab)
        self._max_len = max_len
        self._codes = (driver.codes_option(select, "watch: select="),
                       driver.codes_option(ignore, "watch: ignore="))
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
        self._t0 = time.perf_counter()
        self._params = list(model.parameters())   # whose .grad the probes' own calls restore
        probes = self._make_probes()
        needs_attention = any(r.startswith("attn.") for p in probes for r in p.reads)
        self._subject, self._info = live_subject(
            model, self._forward, pad_id=self._pad_id, bos_id=self._bos_id,
            src_vocab=self._vocab[0], tgt_vocab=self._vocab[1], need_attention=needs_attention)
        set_max_len(self._subject, self._max_len, "watch")
        self._pad_id = self._subject.pad_id
        self._start_id = (self._info.get("hf_ids") or {}).get("start", self._subject.bos_id)
        self._capture = _StepCapture(self._subject.capture)
        self._subject.capture = self._capture
        self._dist = self._dist if self._dist is not None else _dist_from_env()
        main = self._dist is None or self._dist.is_main
        if self.out is not None and main:
            from tndebug.reporters.session import ReportSession
            cls = _quiet(ReportSession) if self._quiet else ReportSession
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
                                   budget=Budget(self._budget) if self._budget is not None
                                   and (self._dist is None or not self._dist.active) else None)
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
        self._handles.append(model.register_forward_pre_hook(_Hook(ref, "_on_forward"),
                                                             with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_hook(_Hook(ref, "_on_output"), with_kwargs=True))
        head = self._info.get("logits_module")
        if head:                              # the logits come from a child (`generator`)
            self._handles.append(model.get_submodule(head).register_forward_hook(
                _Hook(ref, "_on_logits"), with_kwargs=True))
        if self._hook_optimizer:
            self._handles.append(self._optimizer.register_step_pre_hook(_Hook(ref, "_on_opt_step")))
            self._handles.append(self._optimizer.register_step_post_hook(_Hook(ref, "_on_opt_done")))
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

    # -- hooks (through weak references) ----------------------------------------------------------
    def _on_forward(self, module, args, kwargs):
        if self._busy or self._stopped() or not module.training or not torch.is_grad_enabled():
            return None
        if self._forward_seen == self._step:          # gradient accumulation: one batch a step
            return None
        self._forward_seen = self._step
        got = (self._user_batch(args, kwargs) if self._batch_fn is not None
               else default_batch(args, kwargs, self._pad_id, self._start_id, self._subject.kind))
        if got is not None and len(got) == 2:
            got = (got[0], got[1], None)
        if self._data_findings is None:                   # the first batch seen: its pads
            self._data_findings = pad_id_findings(got, self._pad_id, self._step)
        self._batch = got
        src, tgt_in = (got[0], got[1]) if got is not None else (None, None)
        self._busy = True
        self._step_t0 = time.perf_counter()       # the step's time, for the probes' budget
        try:
            self._capture.step_mode = True
            trace = self._engine.begin_step(self._step, src, tgt_in)
        except Exception as e:  # noqa: BLE001 - never break the user's forward
            self._own_error("begin_step", e)
            return None
        finally:
            self._capture.step_mode = False
            self._busy = False
        if trace is not None:
            self._open = True
            self._recording = self._capture.is_recording
        # the loss: on a probed step, and on every CPU step (the NaN check costs nothing there)
        if self._recording or (self._loss is None and self._device.type == "cpu"):
            _BACKWARD.watch(self)
        return None

    def _user_batch(self, args, kwargs):
        """`batch=`'s value for the model's call, checked: at its first call a bad one (None, a
        wrong shape, or the function raising) is a UsageError out of the user's forward; later,
        a step whose value does not fit is a step with no batch."""
        first, self._batch_checked = not self._batch_checked, True
        try:
            got = self._batch_fn(args, kwargs)
        except Exception as e:  # noqa: BLE001 - the user's function may raise anything
            if not first:
                return None
            raise UsageError(f"watch: batch= raised {type(e).__name__}: {e} (it is called as "
                             f"batch(args, kwargs) with the model's positional and keyword "
                             f"arguments)") from None
        try:
            return A.user_batch(got)
        except UsageError:
            if first:
                raise
            return None

    def _on_output(self, module, args, kwargs, output):
        if not self._open or self._output_seen or self._busy:
            return None
        self._output_seen = True          # the recording stays open until backward starts:
                                          # closing it here would unhook modules mid-dispatch
        self._on_logits(module, args, kwargs, output)
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0 and self._loss is None:
            self._loss = loss.detach()
        return None

    def _on_logits(self, module, args, kwargs, output):
        if not self._open or self._logits is not None or self._busy:
            return None
        logits = first_tensor(output)
        tgt_in = self._batch[1] if self._batch is not None else None
        if logits is not None and tgt_in is not None and logits.dim() == 3 \
                and tuple(logits.shape[:2]) == tuple(tgt_in.shape) \
                and logits.shape[-1] == self._subject.tgt_vocab:
            self._logits = logits.detach()
        return None

    def _on_opt_step(self, optimizer, args, kwargs):
        self._moment()
        return None

    def _on_opt_done(self, optimizer, args, kwargs):
        self._advance(self._step + 1)
        return None

    def _saw_backward(self, tensors) -> None:
        t = tensors if isinstance(tensors, torch.Tensor) else (
            tensors[0] if isinstance(tensors, (tuple, list)) and tensors else None)
        if self._loss is None and isinstance(t, torch.Tensor) and t.numel() == 1:
            self._loss = t.detach().reshape(())
        _BACKWARD.unwatch(self)
        self._capture.stop()              # forward done: backward fills the gradients only

    # -- the probes' moment ---------------------------------------------------------------------
    def _moment(self) -> None:
        """After backward, before the update: end_step (on probed steps) and the NaN check."""
        if self._moment_done or self._state != "open":
            return
        self._moment_done = True
        _BACKWARD.unwatch(self)
        self._capture.stop()
        step, loss = self._step, self._loss
        lr = self._lr if self._lr is not None else self._optimizer_lr()
        self._steps_seen += 1
        if self._open:
            self._open = False
            # a step of host_only probes (lr-schedule's every step) needs no batch: no target
            src, tgt_in, tgt_out = (None, None, None) if self._engine.host_only \
                else _complete(self._batch, self._pad_id)
            info = StepInfo(step, lr=lr, loss=loss, logits=self._logits, src=src, tgt_in=tgt_in,
                            tgt_out=tgt_out)
            self._call(self._engine.end_step, info, full=self._recording)
            if loss is not None and self._recording:
                value = float(loss)            # this step synced for the probes already
                self._history["step"].append(step)
                self._history["loss"].append(value)
                self._history["lr"].append(lr)
                if self._session is not None:
                    self._session.log_scalars(step, {"train/loss": value, "train/lr": lr})
        if loss is not None and (self._recording or loss.device.type == "cpu"):
            self._check_finite(step, loss, self._batch, lr)
        if self._engine.budget is not None and self._step_t0 is not None:
            self._engine.budget.record(time.perf_counter() - self._step_t0, probed=self._recording,
                                       own=self._own_s)
            self._step_t0, self._own_s = None, 0.0
        self._logits = None

    def _check_finite(self, step: int, loss: torch.Tensor, batch, lr: float | None = None) -> None:
        if self.diverged is not None or self._stopped() or (self._dist is not None and self._dist.active):
            return                            # under DDP the ranks' losses differ: loss-health judges
        if math.isfinite(float(loss)):          # a scalar: on the CPU, or a step synced already
            return
        self.diverged = step
        src, tgt_in, tgt_out = _complete(batch, self._pad_id)
        self._call(self._engine.diverged, StepInfo(step, lr=lr, loss=loss, src=src, tgt_in=tgt_in,
                                                   tgt_out=tgt_out), full=True)

    def _advance(self, step: int) -> None:
        if not self._moment_done and self._forward_seen == self._step:
            self._moment()                      # a step that never reached the optimizer hook
        self._prev_batch = self._batch
        self._reset_step(step)

    def _reset_step(self, step: int) -> None:
        self._step = step
        self._forward_seen: int | None = None
        self._moment_done = False
        self._open = self._recording = self._output_seen = False
        self._step_t0: float | None = None
        self._own_s = getattr(self, "_own_s", 0.0)   # seconds in our hooks since the last record
        self._loss: torch.Tensor | None = None
        self._logits = None
        self._lr: float | None = None
        if not hasattr(self, "_batch"):
            self._batch = self._prev_batch = None

    # -- engine calls ----------------------------------------------------------------------------
    def _call(self, fn, *args, full: bool = True):
        """Run engine code: probes' model calls bypass the hooks; RNG, grads (full) and the
        train/eval mode come back as they were; an error of ours stops probing, not training."""
        model = self._model_ref()
        was = model.training if model is not None else None
        grads = [(p, p.grad) for p in self._params] if full and model is not None else ()
        self._busy = True
        try:
            rng = torch.random.fork_rng(devices=self._rng_devices) if full else contextlib.nullcontext()
            with rng:
                return fn(*args)
        except Exception as e:  # noqa: BLE001
            self._own_error(getattr(fn, "__name__", "engine"), e)
            return None
        finally:
            for p, g in grads:
                p.grad = g
            if was is not None and model.training != was:
                model.train(was)
            self._busy = False

    def _own_error(self, what: str, e: Exception) -> None:
        if self._own_failure is None:
            self._own_failure = f"{what} at step {self._step}: {type(e).__name__}: {e}"
            self._own_tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])

    def _stopped(self) -> bool:
        return self._state != "open" or self._own_failure is not None or self.diverged is not None

    def _optimizer_lr(self) -> float | None:
        if self._optimizer is None or not self._optimizer.param_groups:
            return None
        lr = self._optimizer.param_groups[0].get("lr")
        return float(lr) if lr is not None else None

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
            setattr(probe, what, _Shielded(ref, probe.name, what, getattr(probe, what)))

    def _probe_failed(self, name: str, what: str, e: Exception) -> None:
        if name in self._failed:
            return
        self._failed[name] = f"{what} raised {type(e).__name__}: {e}"
        probe = next(p for p in self._engine.probes if p.name == name)
        probe.schedule = never()
        frames = traceback.format_exception(type(e), e, e.__traceback__)
        probe.findings.append(Finding(
            name, "info", f"probe {name} failed at {what} (step {self._step}): "
            f"{type(e).__name__}: {e}; switched off, training went on", step=self._step,
            evidence={"moment": what, "error": f"{type(e).__name__}: {e}",
                      "traceback": "".join(frames[-3:]).strip()},
            fix=("A tndebug bug, not yours: the rest of the report stands; please report it "
                 "with this traceback") if by_tndebug(e) else
                (f"Your model's code raised on the probe's input (at {raised_in(e)}): the "
                 f"probe could not check it; the rest of the report stands"), code=f"{name}/probe-failed"))

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, status: str, error: str | None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        _BACKWARD.unwatch(self)
        self._capture.stop()
        engine = self._engine
        findings = self._call(engine.finish, full=True) or engine.findings()
        findings += self._data_findings or []          # the pad id seen mid-sequence (live.py)
        if self._dist is not None and status in ("failed", "interrupted"):
            self._dist.broken = True           # the others may be mid-step: no collective now
        if self._dist is not None and self._dist.active:
            findings = self._dist.gather_findings(findings)
        if self._own_failure is not None:
            findings.append(Finding("watch", "warning", f"tndebug stopped probing: "
                                    f"{self._own_failure}", evidence={"traceback": self._own_tb},
                                    fix="A tndebug bug: training went on without probes; please "
                                        "report it with this traceback", code="watch/stopped"))
        statuses = engine.statuses(findings)
        for name, why in self._failed.items():
            statuses[name] = {**statuses.get(name, {}), "status": "no verdict",
                              "reason": f"failed: {why}"}
        hist = self._history
        tail = [x for x in hist["loss"][-10:] if math.isfinite(x)]
        opt = self._optimizer
        run = {"mode": "watch", "model": type(self._subject.model).__name__,
               "adapter": self._info.get("adapter"), "pad_id": self._pad_id,
               "bos_id": self._subject.bos_id, "src_vocab": self._subject.src_vocab,
               "tgt_vocab": self._subject.tgt_vocab,
               "attention_modules": self._info.get("attention_modules"),
               "probe_inputs": self._subject.inputs(),
               "optimizer": type(opt).__name__ if opt is not None else None,
               "lr_schedule": ("declared" if self._schedule is not None else None),
               "start_step": self.start_step, "steps": self._steps_seen,
               "stopped_at_step": self._step, "status": status, "error": error,
               "diverged_at_step": self.diverged, "device": str(self._device),
               "final_loss": sum(tail) / len(tail) if tail else None,
               "final_lr": self._optimizer_lr(),
               "world_size": self._dist.world if self._dist is not None else 1,
               "wall_s": round(time.perf_counter() - self._t0, 3),
               "probe_s": round(engine.probe_seconds, 3),
               "probe_s_by_probe": {k: round(v, 3) for k, v in engine.seconds_by_probe.items()}}
        if engine.budget is not None:
            run["probe_budget"] = engine.budget.summary()
        notes = [n for n in (self._schedule_note, self._info.get("adapter_note"),
                             _thinned_note(engine.budget)) if n]
        if opt is None:
            notes.append("no optimizer: steps are the dbg.step() calls; the lr is dbg.step(lr=) "
                         "or unknown, so lr-schedule has nothing to compare")
        if self._steps_seen == 0:
            notes.append("no training step was observed (no optimizer.step() and no dbg.step() "
                         "inside the block, or the model was never called in train mode)")
        if notes:
            run["notes"] = notes
        self.report = driver.make_report(run, findings, statuses, history=hist,
                                         select=self._codes[0], ignore=self._codes[1])
        if self._session is not None:
            self.exit_code = self._session.finish(self.report, self.fail_on)
        else:
            self.exit_code = self.report.exit_code(self.fail_on)
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
        select, ignore: finding codes or probe names to keep only / to drop (`tndebug probes
            --codes`), as ruff's --select / --ignore.
        max_len: the longest sequence your model takes (default: its config's
            max_position_embeddings, else found by calling it); the probes' batches fit it.
        budget: the share of your own step time the probed steps may cost (0.03: <= 1.03x);
            over it, scheduled looks are skipped (each probe still looks once; run.probe_budget
            says what was spent and skipped). None: every scheduled look (one process only:
            under DDP the ranks must probe the same steps, so no budget applies).
    Raises:
        tndebug.errors.UsageError on entering, for a model or forward it cannot use.
    """
    return Watch(model, optimizer, **kwargs)


# -- helpers --------------------------------------------------------------------------------------
class _Hook:
    """A hook that holds the watch weakly: the model never keeps a watch alive."""

    def __init__(self, ref, method: str) -> None:
        self.ref, self.method = ref, method

    def __call__(self, *args):
        w = self.ref()
        if w is None or w._state != "open":
            return None
        t0 = time.perf_counter()
        try:
            return getattr(w, self.method)(*args)
        except UsageError:
            raise                         # a bad argument of the user's (batch=): refused, clearly
        except Exception as e:  # noqa: BLE001 - the user's training goes on
            w._own_error(self.method, e)
            return None
        finally:
            w._own_s += time.perf_counter() - t0     # every step's cost of the watch (budget)


class _Shielded:
    def __init__(self, ref, name: str, what: str, fn) -> None:
        self.ref, self.name, self.what, self.fn = ref, name, what, fn
        self.__name__ = what

    def __call__(self, *args):
        w = self.ref()
        if w is not None and self.name in w._failed:
            return {} if self.what == "observe" else None
        try:
            return self.fn(*args)
        except Exception as e:
            if w is not None:
                w._probe_failed(self.name, self.what, e)
            raise


class _StepCapture:
    """The subject's capture, with the step's recording closeable at the end of the forward
    (its gradient hooks live on the tensors and still fire in backward)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.step_mode = False
        self._open = None

    @property
    def is_recording(self) -> bool:
        return self._open is not None

    @contextlib.contextmanager
    def recording(self, reads, trace=None):
        if not self.step_mode:
            with self.inner.recording(reads, trace) as t:
                yield t
            return
        cm = self.inner.recording(reads, trace)
        t = cm.__enter__()
        self._open = cm
        try:
            yield t
        finally:
            self.stop()

    def stop(self) -> None:
        cm, self._open = self._open, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _BackwardTap:
    """`torch.autograd.backward` patched only between a probed step's forward and its
    optimizer step: the tensor backward is called on is the step's loss."""

    def __init__(self) -> None:
        self._orig = None
        self._watch = None

    def watch(self, w: Watch) -> None:
        if self._orig is not None:
            return
        self._watch = weakref.ref(w)
        self._orig = orig = torch.autograd.backward
        tap = self

        def backward(tensors, *args, **kwargs):
            target = tap._watch() if tap._watch is not None else None
            if target is not None:
                try:
                    target._saw_backward(tensors)
                except Exception:  # noqa: BLE001
                    pass
            return orig(tensors, *args, **kwargs)
        self._patched = backward
        torch.autograd.backward = backward

    def unwatch(self, w: Watch | None = None) -> None:
        if self._orig is None or (w is not None and self._watch is not None and self._watch() is not w):
            return
        if torch.autograd.backward is self._patched:
            torch.autograd.backward = self._orig
        self._orig = self._watch = self._patched = None


_BACKWARD = _BackwardTap()


def _complete(batch, pad_id: int):
    """(src, tgt_in, tgt_out): the target, when the call gave none, is tgt_in shifted left
    (computed here, on the steps that need it, not in every forward)."""
    if batch is None:
        return None, None, None
    src, tgt_in, tgt_out = batch
    if tgt_out is None and isinstance(tgt_in, torch.Tensor) and tgt_in.dim() == 2:
        from tndebug.library.live import shift_left
        tgt_out = shift_left(tgt_in, pad_id)
    return src, tgt_in, tgt_out


def _inner_optimizer(opt):
    """accelerate's / Lightning's wrapper -> the torch optimizer whose hooks fire."""
    seen = 0
    while not type(opt).__module__.startswith("torch.optim") and \
            isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) and seen < 4:
        opt, seen = opt.optimizer, seen + 1
    return opt


def _thinned_note(budget: Budget | None) -> str | None:
    if budget is None or not budget.thinned:
        return None
    each = ", ".join(f"{name} {n}" for name, n in sorted(budget.thinned.items()))
    return (f"probes thinned to keep their cost within {budget.fraction:.0%} of your step time "
            f"(budget=): scheduled steps skipped: {each}; each probe still looked at least once")


def _dist_from_env():
    """The process group the user started (DDP), as the trainer's Dist; None in one process."""
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2:
        return None
    from tndebug.train.distributed import Dist
    backend = tdist.get_backend()
    # host-side ints and objects (the reducer's size check, gathered findings) go over gloo;
    # every rank enters the watch at the same point, so this collective is matched
    control = tdist.new_group(backend="gloo") if backend == "nccl" else None
    return Dist(rank=tdist.get_rank(), world=tdist.get_world_size(), backend=backend,
                control=control)


def _quiet(session_cls):
    class QuietSession(session_cls):
        """Files only: no summary on the console."""
        def _print(self, report, md, paths):
            return None
    return QuietSession
