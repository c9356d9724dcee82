"""The training loop: data task, Adam + Noam, label-smoothed loss, probes, checkpoint, evaluation.

    result = run_training(model_config("copy", "small"), TrainConfig(steps=400), probes="all",
                          session=ReportSession("runs/copy"))
    result.report.run["exact_match"]

The ProbeEngine is driven as in `tndebug/harness.py`: setup() once (then resume() after a
checkpoint is loaded), begin_step() before the forward pass, end_step() after backward and
before optimizer.step(), finish() at the end. The training-loop faults are read here (the
trainer may read them; probes never do).
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tndebug.config import ModelConfig
from tndebug import judge
from tndebug.data import as_lm, data_generator, eval_set, get_task, misshift
from tndebug.errors import UsageError
from tndebug.inject import make_model
from tndebug.probes import MODULES, parse_probe_spec, probe_class
from tndebug.probes.base import Probe, ResumeInfo, RunContext, StepInfo
from tndebug.probes.budget import Budget
from tndebug.probes.engine import ProbeEngine
from tndebug.report import Report
from tndebug.subject import tndebug_subject
from tndebug.train import checkpoint as ckpt
from tndebug.train import distributed
from tndebug.train.config import TrainConfig, apply_config_faults, preset_name
from tndebug.train.evaluate import evaluate
from tndebug.train.loss import LabelSmoothingLoss
from tndebug.train.schedule import constant, noam

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TrainResult(NamedTuple):
    report: Report
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    engine: ProbeEngine
    checkpoint: Path | None        # where the checkpoint was written, if anywhere


# -- pieces ------------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available here (use --device cpu or auto)")
    return torch.device(name)


def autocast_factory(device: torch.device, amp: str):
    """A zero-argument callable giving the autocast context for `amp` ("none" -> no-op)."""
    if amp == "none":
        return contextlib.nullcontext
    if amp == "fp16" and device.type != "cuda":
        raise UsageError("--amp fp16 needs CUDA (it uses a GradScaler); use --amp bf16 on CPU")
    dtype = AMP_DTYPES[amp]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def build_probes(spec) -> tuple[list[Probe], dict[str, str]]:
    """'all' | 'none' | 'a,b' | [names] | [Probe objects] -> (probes, {name: why unavailable}).

    An unknown name raises ProbeError; a probe whose module is not installed yet is left out
    and reported as skipped.
    """
    if spec is None:
        return [], {}
    if isinstance(spec, (list, tuple)) and all(isinstance(p, Probe) for p in spec):
        return list(spec), {}
    names = parse_probe_spec(spec) if isinstance(spec, str) else parse_probe_spec(",".join(spec))
    probes, missing = [], {}
    for name in names:
        try:
            probes.append(probe_class(name)())
        except ModuleNotFoundError as e:
            if e.name != f"tndebug.probes.{MODULES[name]}":
                raise
            missing[name] = f"not available: module {e.name} is not installed"
    return probes, missing


# The fault no_warmup_high_lr: a constant lr of HIGH_LR_X times the peak this run's own Noam
# schedule would reach, from step 0. 5x is the paper's factor 1 against our default factor 0.2,
# the setting TrainConfig's comment notes "spikes or stalls" even with warmup; relative to the
# run's own peak, it means the same in every preset, and --lr-factor scales it as it scales Noam.
HIGH_LR_X = 5.0


def declared_schedule(cfg: ModelConfig, train_cfg: TrainConfig):
    """The lr schedule as the user wrote it: step -> lr."""
    schedule = noam(cfg.d_model, train_cfg.warmup, train_cfg.lr_factor)
    if cfg.has("no_warmup_high_lr"):     # fault: HIGH_LR_X x the Noam peak from step 0, no warmup
        return constant(HIGH_LR_X * noam_peak(cfg.d_model, train_cfg.warmup, train_cfg.lr_factor))
    return schedule


def noam_peak(d_model: int, warmup: int, factor: float) -> float:
    """The largest lr of noam(d_model, warmup, factor): at step warmup - 1 (s = warmup)."""
    return noam(d_model, warmup, factor)(warmup - 1)


# -- the loop ----------------------------------------------------------------------------------
def run_training(model_cfg: ModelConfig, train_cfg: TrainConfig, *, probes="none", session=None,
                 out_dir: str | Path | None = None, resume: str | Path | dict | None = None,
                 evaluate_at_end: bool = True, dist: distributed.Dist | None = None) -> TrainResult:
    """Train `train_cfg.steps` steps with probes attached; evaluate; write the checkpoint.

    Args:
        model_cfg: the model (its vocabularies must match the task; see `model_config`).
        train_cfg: the run (task, steps, batch, schedule, seed, device, amp).
        probes: 'all' | 'none' | 'a,b' | list of names | list of Probe objects.
        session: a ReportSession (progress, scalars, probe sinks), or None for a silent run.
        out_dir: where checkpoint.pt goes (default: session.out_dir; None and no session: nowhere).
        resume: a run directory, checkpoint file, or loaded checkpoint dict to continue from;
            `train_cfg.steps` more steps are taken and the lr schedule continues where it stopped.
        evaluate_at_end: greedy-decode the held-out set (exact match, token accuracy).
        dist: the process group under torchrun (`distributed.init_from_env`); None: one process.
            Every rank calls this; only rank 0 writes the checkpoint and gets all findings.

    Returns:
        TrainResult(report, model, optimizer, engine, checkpoint). `report.run` holds the
        figures (see `Report`); the caller writes report.json (ReportSession.finish does).
    """
    t_start = time.perf_counter()
    model_cfg = apply_config_faults(model_cfg)
    task = get_task(train_cfg.task)
    if (model_cfg.src_vocab, model_cfg.tgt_vocab) != (task.src_vocab, task.tgt_vocab):
        raise ValueError(f"model vocabularies {model_cfg.src_vocab}/{model_cfg.tgt_vocab} do not fit "
                         f"task {task.name!r} ({task.src_vocab}/{task.tgt_vocab}); use model_config()")
    dist = dist or distributed.LOCAL
    dist.check_batch(train_cfg.batch_size)
    device = resolve_device(train_cfg.device)
    if out_dir is None and session is not None:
        out_dir = session.out_dir
    if not dist.is_main:
        out_dir = None                       # rank 0 alone writes the checkpoint
    t = _Training(model_cfg, train_cfg, task, device, dist, session, out_dir)
    if resume is not None:
        t.restore(resume)
    t.attach(probes, t.global_step + train_cfg.steps)
    t.train()
    path = t.save(t.status) if out_dir is not None else None
    scores, eval_s = t.evaluate(evaluate_at_end)
    run_info = t.run_info(scores, path, eval_s, time.perf_counter() - t_start)
    statuses = t.engine.statuses(t.findings)      # every rank's findings under DDP
    report = judge.conclude(run_info, t.findings, statuses,
                            judge.Context(skipped=t.unavailable, history=t.history))
    return TrainResult(report, t.model, t.opt, t.engine, path)


class _Training:
    """One run of `run_training`: the model, optimizer and schedule built, the checkpoint's
    state restored, the probes attached, then trained step by step (`train`)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, task, device: torch.device,
                 dist: distributed.Dist, session, out_dir) -> None:
        self.model_cfg, self.cfg, self.task, self.device = model_cfg, train_cfg, task, device
        self.dist, self.session, self.out_dir = dist, session, out_dir
        self.autocast = autocast_factory(device, train_cfg.amp)
        torch.manual_seed(train_cfg.seed)
        self.g = data_generator(train_cfg.seed, "train")
        self.model = model = make_model(model_cfg).to(device)
        self.opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                                    fused=device.type == "cuda")   # fused: GradScaler needs no host sync
        self.scaler = torch.amp.GradScaler("cuda") if train_cfg.amp == "fp16" else None
        self.schedule = declared_schedule(model_cfg, train_cfg)
        self.criterion = LabelSmoothingLoss(train_cfg.label_smoothing, model_cfg.pad_id,
                                            smooth_pad=model_cfg.has("label_smoothing_on_pad"),
                                            raw_logits=model_cfg.has("kl_raw_logits"))
        self.sched_step = self.global_step = 0
        self.last_lr = None
        self.state = None                     # the checkpoint resumed from
        self.history: dict[str, list] = {"step": [], "loss": [], "lr": []}
        self.status, self.tokens, self.acc, self.error = "completed", 0, None, None
        self.rng_devices = [device] if device.type == "cuda" else []

    def restore(self, resume) -> None:
        """The checkpoint's weights, step, lr and RNG; its schedule step, optimizer and scaler
        state unless the fault warmup_restart_on_resume starts them from zero."""
        self.state = state = resume if isinstance(resume, dict) else \
            ckpt.load_checkpoint(resume, self.device)
        try:
            self.model.load_state_dict(ckpt.unwrap_state_dict(state["model"]))
        except RuntimeError as e:
            raise UsageError(f"checkpoint does not fit this model: {ckpt.describe_mismatch(e)}") from None
        self.global_step, self.last_lr = int(state["global_step"]), state.get("last_lr")
        if self.model_cfg.has("warmup_restart_on_resume"):   # fault: schedule and Adam state from zero
            self.sched_step = 0
        else:
            self.sched_step = int(state["schedule_step"])
            if state.get("optimizer") is not None:
                self.opt.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"], self.g)

    def attach(self, probes, end_step: int) -> None:
        """The probes and their engine (with the budget), the model wrapped for DDP."""
        self.end_step = end_step
        cfg, dist = self.cfg, self.dist
        self.compute_dtype = AMP_DTYPES.get(cfg.amp, next(self.model.parameters()).dtype)
        run = RunContext(subject=tndebug_subject(self.model), optimizer=self.opt,
                         criterion=self.criterion, lr_schedule=self.schedule,
                         compute_dtype=self.compute_dtype, device=str(self.device),
                         total_steps=end_step)
        probe_list, self.unavailable = build_probes(probes)
        # the probes' cost within a share of the measured step time, as in watch (probes/budget.py);
        # under DDP the ranks agree on the measurements, so every rank probes the same steps
        self.budget = Budget(cfg.probe_budget, agree=dist.agree_max if dist.active else None) \
            if cfg.probe_budget is not None else None
        self.engine = ProbeEngine(probe_list, run, sinks=getattr(self.session, "sinks", ()),
                                  reducer=dist.reducer, budget=self.budget)
        self.train_model = dist.wrap(self.model)      # probes stay on `model` (ddp.module)
        self.lm = self.model_cfg.arch == "decoder"    # one sequence per row (data.as_lm), model(ids)
        self.losses = distributed.LossLog(dist)       # the loss stays on the device until read
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def save(self, status: str) -> Path:
        """checkpoint.pt (atomically: tmp + rename) at the state after `global_step` steps."""
        return ckpt.save_checkpoint(Path(self.out_dir) / ckpt.FILENAME, {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "schedule_step": self.sched_step, "global_step": self.global_step,
            "last_lr": self.last_lr, "model_config": self.model_cfg.to_dict(),
            "train_config": self.cfg.to_dict(), "rng": ckpt.rng_state(self.g), "status": status})

    def train(self) -> None:
        """setup (or resume), then the steps; `status`, `error`, `findings` and the times."""
        engine, dist = self.engine, self.dist
        self.lrs: dict[int, float] = {}
        self.every_step = distributed.reads_loss_every_step(self.device, dist)   # else at log steps only
        session = self.session
        progress = session.progress(self.end_step) if session is not None else contextlib.nullcontext()
        t_train, cpu_train = time.perf_counter(), time.process_time()
        with engine, progress as bar, dist.terminable():
            with torch.random.fork_rng(devices=self.rng_devices):   # probes never shift the training RNG
                engine.setup()
                if self.state is not None:
                    engine.resume(ResumeInfo(self.global_step, lr_before=self.last_lr,
                                             had_optimizer_state=bool(self.opt.state)))
            self.model.train()
            step = self.global_step
            try:
                for step in range(self.global_step, self.end_step):
                    if not self.step(step, bar):
                        break
            except KeyboardInterrupt:
                self.status = "interrupted"
            except Exception as e:  # noqa: BLE001 - under DDP rank 0 still writes the report
                if not dist.active:
                    raise
                self.status, self.error = "failed", dist.failed(e, step)   # other ranks raise RankFailed here
            self.train_s = time.perf_counter() - t_train
            self.train_cpu_s = time.process_time() - cpu_train   # all threads; an upper bound on idle wall time
            self.findings = dist.gather_findings(engine.finish())

    def batch(self):
        """The step's global batch, the loop's faults applied (a decoder-only model: one row)."""
        batch = self.task.batch(self.g, self.cfg.batch_size, self.cfg.pad_share)
        if self.lm:
            batch = as_lm(batch)
            if self.model_cfg.has("lm_labels_unshifted"):        # fault: loss(logits, ids)
                batch = misshift(batch, 0)
            elif self.model_cfg.has("lm_labels_shifted_twice"):  # fault: shifted in data and loss
                batch = misshift(batch, 2)
        return batch

    def step(self, step: int, bar) -> bool:
        """One training step with the probes' moments; False when the loss diverged."""
        engine, dist, cfg, opt = self.engine, self.dist, self.cfg, self.opt
        lr = self.schedule(self.sched_step)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = self.batch()
        self.tokens += batch.ntokens               # counted on the host, before the copy
        part = dist.shard(batch)                   # this rank's rows of the global batch
        src, tgt_in, tgt_out = distributed.to_device(part, self.device)
        t_step, own0 = time.perf_counter(), engine.probe_seconds   # the budget's step
        probed = engine.begin_step(step, src, tgt_in) is not None and not engine.host_only
        t_begin = time.perf_counter() - t_step     # the engine's own time, as below
        with self.autocast():
            logits = self.train_model(tgt_in) if self.lm else self.train_model(src, tgt_in)   # [B, T, V]
        loss = self.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        if dist.active:                            # DDP's mean gradient = the global batch's
            loss = loss * dist.loss_weight(batch, part)
        opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(opt)              # probes see true gradients
        else:
            loss.backward()
        engine.end_step(StepInfo(step, lr=lr, loss=loss.detach(), logits=logits.detach(),
                                 src=src, tgt_in=tgt_in, tgt_out=tgt_out))
        self.losses.add(step, loss)
        self.lrs[step] = lr
        loss_value = None
        if self.every_step or step % cfg.log_every == 0 or step + 1 == self.end_step:
            flushed = self.losses.flush()          # one host sync (one all-reduce in DDP)
            for s, value in flushed:
                self.history["step"].append(s)
                self.history["loss"].append(value)
                self.history["lr"].append(self.lrs.pop(s))
            loss_value = flushed[-1][1]
            if not all(math.isfinite(v) for _, v in flushed):
                self.status = "diverged"           # every rank sees the same mean: all stop here
                engine.diverged(StepInfo(step, lr=lr, loss=loss.detach(), src=src,
                                         tgt_in=tgt_in, tgt_out=tgt_out))
                return False
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        if self.budget is not None:     # forward to update; `own`: the engine's share,
            self.budget.record(time.perf_counter() - t_step, probed,     # paid every step
                               own=t_begin + engine.probe_seconds - own0)
        self.sched_step, self.global_step, self.last_lr = self.sched_step + 1, step + 1, lr
        if self.out_dir is not None and cfg.save_every and self.global_step % cfg.save_every == 0 \
                and self.global_step < self.end_step:   # the last one is written after the loop
            self.save("running")
        if self.session is not None and (step % cfg.log_every == 0 or step + 1 == self.end_step):
            self.acc = _batch_accuracy(logits, tgt_out, self.model_cfg.pad_id)
            self.session.log_scalars(step, {"train/loss": loss_value, "train/lr": lr,
                                            "train/token_acc": self.acc})
        if self.session is not None:
            bar.update(step + 1, loss=loss_value, lr=lr, acc=self.acc)
        return True

    def evaluate(self, at_end: bool) -> tuple[dict[str, Any], float]:
        """(exact match and token accuracy on the held-out set, seconds): greedy decoding, on
        rank 0, unless the run was interrupted or failed."""
        scores: dict[str, Any] = {"exact_match": None, "token_accuracy": None}
        t_eval = time.perf_counter()
        cfg = self.cfg
        if at_end and self.status not in ("interrupted", "failed") and self.dist.is_main:
            held_out = eval_set(self.task, cfg.eval_size, cfg.seed, cfg.pad_share)
            with torch.random.fork_rng(devices=self.rng_devices):
                scores = evaluate(self.model, held_out,
                                  autocast=self.autocast if cfg.amp != "none" else None)
            if self.session is not None:
                self.session.log_scalars(self.global_step, {
                    "eval/exact_match": scores["exact_match"],
                    "eval/token_accuracy": scores["token_accuracy"]})
        return scores, time.perf_counter() - t_eval

    def run_info(self, scores: dict, path: Path | None, eval_s: float, wall_s: float) -> dict:
        """report.json's `run`: what was trained, how it ended, its figures and timings."""
        model_cfg, cfg, history, device = self.model_cfg, self.cfg, self.history, self.device
        tail = [x for x in history["loss"][-10:] if math.isfinite(x)]
        train_s, engine = self.train_s, self.engine
        return {
            "task": self.task.name, "preset": preset_name(model_cfg), "arch": model_cfg.arch,
            "norm": model_cfg.norm, "norm_kind": model_cfg.norm_kind, "pos": model_cfg.pos,
            "faults": list(model_cfg.faults), "seed": cfg.seed, "steps": cfg.steps,
            "device": str(device), "amp": cfg.amp,
            "dtype": str(self.compute_dtype).replace("torch.", ""),
            "batch_size": cfg.batch_size, "warmup": cfg.warmup, "lr_factor": cfg.lr_factor,
            "final_loss": sum(tail) / len(tail) if tail else (history["loss"][-1] if history["loss"] else None),
            "final_lr": self.last_lr, "exact_match": scores["exact_match"],
            "token_accuracy": scores["token_accuracy"], "eval_size": cfg.eval_size,
            "status": self.status, "stopped_at_step": self.global_step,
            "resumed_from_step": int(self.state["global_step"]) if self.state is not None else None,
            "wall_s": round(wall_s, 3), "train_s": round(train_s, 3),
            "train_cpu_s": round(self.train_cpu_s, 3),
            "eval_s": round(eval_s, 3), "probe_s": round(engine.probe_seconds, 3),
            "probe_s_by_probe": {k: round(v, 3) for k, v in engine.seconds_by_probe.items()},
            "tokens_per_s": round(self.tokens / train_s, 1) if train_s > 0 else None,
            "peak_gpu_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "checkpoint": str(path) if path else None,
            "world_size": self.dist.world, "error": self.error,
            "probe_budget": self.budget.summary() if self.budget is not None else None,
        }


def _batch_accuracy(logits: torch.Tensor, tgt_out: torch.Tensor, pad: int) -> float:
    """Teacher-forced token accuracy of one batch (argmax vs target, real positions only)."""
    real = tgt_out != pad
    return float(((logits.argmax(-1) == tgt_out) & real).sum()) / max(int(real.sum()), 1)
