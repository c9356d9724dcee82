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
import copy
import math
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tndebug.config import ModelConfig
from tndebug import judge
from tndebug.data import as_lm, data_generator, eval_set, get_task, misshift
from tndebug.errors import UsageError
from tndebug.inject import make_model
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
    from tndebug.probes import _MODULES, parse_probe_spec, probe_class
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
            if e.name != f"tndebug.probes.{_MODULES[name]}":
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


def check_resume_fits(model_cfg: ModelConfig, state: dict) -> None:
    """A checkpoint whose weights do not fit the model is a UsageError before any work: the
    model is built on the meta device (no memory, no init) and loaded there."""
    try:
        with torch.device("meta"):
            model = make_model(apply_config_faults(model_cfg))
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: checked when loaded
        return
    weights = distributed.unwrap_state_dict(state["model"])
    # load_state_dict(assign=True) writes its switch into the dict's `_metadata` (torch 2.x), so
    # the run's own load of the same dict would swap new Parameters into the model, away from
    # the optimizer's (which then stepped orphans; the model's .grad summed forever): a copy
    trial = OrderedDict(weights)
    if getattr(weights, "_metadata", None) is not None:
        trial._metadata = copy.deepcopy(weights._metadata)
    try:   # assign: meta tensors take the checkpoint's (shapes are still checked), no copy
        model.load_state_dict(trial, assign=True)
    except RuntimeError as e:
        raise UsageError(f"checkpoint does not fit this model: {ckpt.describe_mismatch(e)}") from None
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    saved, have = sum(len(g.get("params", ())) for g in groups), len(list(model.parameters()))
    if groups and saved != have and not model_cfg.has("warmup_restart_on_resume"):
        raise UsageError(f"the checkpoint's optimizer state is for {saved} parameter tensors, this "
                         f"model has {have}: a --fault that changes the parameters (shared_qkv "
                         f"shares them) cannot be added on resume; start a new run with it")


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
    autocast = autocast_factory(device, train_cfg.amp)
    if out_dir is None and session is not None:
        out_dir = session.out_dir
    if not dist.is_main:
        out_dir = None                       # rank 0 alone writes the checkpoint

    torch.manual_seed(train_cfg.seed)
    g = data_generator(train_cfg.seed, "train")
    model = make_model(model_cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                           fused=device.type == "cuda")   # fused: GradScaler needs no host sync
    scaler = torch.amp.GradScaler("cuda") if train_cfg.amp == "fp16" else None
    schedule = declared_schedule(model_cfg, train_cfg)
    criterion = LabelSmoothingLoss(train_cfg.label_smoothing, model_cfg.pad_id,
                                   smooth_pad=model_cfg.has("label_smoothing_on_pad"),
                                   raw_logits=model_cfg.has("kl_raw_logits"))

    sched_step = global_step = 0
    last_lr = None
    state = None
    if resume is not None:
        state = resume if isinstance(resume, dict) else ckpt.load_checkpoint(resume, device)
        try:
            model.load_state_dict(distributed.unwrap_state_dict(state["model"]))
        except RuntimeError as e:
            raise UsageError(f"checkpoint does not fit this model: {ckpt.describe_mismatch(e)}") from None
        global_step, last_lr = int(state["global_step"]), state.get("last_lr")
        if model_cfg.has("warmup_restart_on_resume"):   # fault: schedule and Adam state from zero
            sched_step = 0
        else:
            sched_step = int(state["schedule_step"])
            if state.get("optimizer") is not None:
                opt.load_state_dict(state["optimizer"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"], g)
    end_step = global_step + train_cfg.steps

    compute_dtype = AMP_DTYPES.get(train_cfg.amp, next(model.parameters()).dtype)
    run = RunContext(subject=tndebug_subject(model), optimizer=opt, criterion=criterion,
                     lr_schedule=schedule, compute_dtype=compute_dtype, device=str(device),
                     total_steps=end_step)
    probe_list, unavailable = build_probes(probes)
    # the probes' cost within a share of the measured step time, as in watch (probes/budget.py);
    # under DDP the ranks agree on the measurements, so every rank probes the same steps
    budget = Budget(train_cfg.probe_budget, agree=dist.agree_max if dist.active else None) \
        if train_cfg.probe_budget is not None else None
    engine = ProbeEngine(probe_list, run, sinks=getattr(session, "sinks", ()), reducer=dist.reducer,
                         budget=budget)
    train_model = dist.wrap(model)           # probes stay on `model` (ddp.module)
    lm = model_cfg.arch == "decoder"         # one sequence per row (data.as_lm), model(ids)
    losses = distributed.LossLog(dist)       # the loss stays on the device until read
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def save(status: str) -> Path:
        """checkpoint.pt (atomically: tmp + rename) at the state after `global_step` steps."""
        return ckpt.save_checkpoint(Path(out_dir) / ckpt.FILENAME, {
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "schedule_step": sched_step, "global_step": global_step, "last_lr": last_lr,
            "model_config": model_cfg.to_dict(), "train_config": train_cfg.to_dict(),
            "rng": ckpt.rng_state(g), "status": status})

    history: dict[str, list] = {"step": [], "loss": [], "lr": []}
    status, tokens, acc, error = "completed", 0, None, None
    lrs: dict[int, float] = {}
    every_step = distributed.reads_loss_every_step(device, dist)   # else at log steps only
    rng_devices = [device] if device.type == "cuda" else []
    progress = session.progress(end_step) if session is not None else contextlib.nullcontext()
    t_train, cpu_train = time.perf_counter(), time.process_time()
    with engine, progress as bar, dist.terminable():
        with torch.random.fork_rng(devices=rng_devices):   # probes never shift the training RNG
            engine.setup()
            if state is not None:
                engine.resume(ResumeInfo(global_step, lr_before=last_lr,
                                         had_optimizer_state=bool(opt.state)))
        model.train()
        step = global_step
        try:
            for step in range(global_step, end_step):
                lr = schedule(sched_step)
                for group in opt.param_groups:
                    group["lr"] = lr
                batch = task.batch(g, train_cfg.batch_size, train_cfg.pad_share)
                if lm:
                    batch = as_lm(batch)
                    if model_cfg.has("lm_labels_unshifted"):        # fault: loss(logits, ids)
                        batch = misshift(batch, 0)
                    elif model_cfg.has("lm_labels_shifted_twice"):  # fault: shifted in data and loss
                        batch = misshift(batch, 2)
                tokens += batch.ntokens                    # counted on the host, before the copy
                part = dist.shard(batch)                   # this rank's rows of the global batch
                src, tgt_in, tgt_out = distributed.to_device(part, device)
                t_step, own0 = time.perf_counter(), engine.probe_seconds   # the budget's step
                probed = engine.begin_step(step, src, tgt_in) is not None and not engine.host_only
                t_begin = time.perf_counter() - t_step     # the engine's own time, as below
                with autocast():
                    logits = train_model(tgt_in) if lm else train_model(src, tgt_in)   # [B, T, V]
                loss = criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
                if dist.active:                            # DDP's mean gradient = the global batch's
                    loss = loss * dist.loss_weight(batch, part)
                opt.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)            # probes see true gradients
                else:
                    loss.backward()
                engine.end_step(StepInfo(step, lr=lr, loss=loss.detach(), logits=logits.detach(),
                                         src=src, tgt_in=tgt_in, tgt_out=tgt_out))
                losses.add(step, loss)
                lrs[step] = lr
                loss_value = None
                if every_step or step % train_cfg.log_every == 0 or step + 1 == end_step:
                    flushed = losses.flush()               # one host sync (one all-reduce in DDP)
                    for s, value in flushed:
                        history["step"].append(s)
                        history["loss"].append(value)
                        history["lr"].append(lrs.pop(s))
                    loss_value = flushed[-1][1]
                    if not all(math.isfinite(v) for _, v in flushed):
                        status = "diverged"        # every rank sees the same mean: all stop here
                        engine.diverged(StepInfo(step, lr=lr, loss=loss.detach(), src=src,
                                                 tgt_in=tgt_in, tgt_out=tgt_out))
                        break
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if budget is not None:     # forward to update; `own`: the engine's share,
                    budget.record(time.perf_counter() - t_step, probed,     # paid every step
                                  own=t_begin + engine.probe_seconds - own0)
                sched_step, global_step, last_lr = sched_step + 1, step + 1, lr
                if out_dir is not None and train_cfg.save_every and global_step % train_cfg.save_every == 0 \
                        and global_step < end_step:          # the last one is written below
                    save("running")
                if session is not None and (step % train_cfg.log_every == 0 or step + 1 == end_step):
                    acc = _batch_accuracy(logits, tgt_out, model_cfg.pad_id)
                    session.log_scalars(step, {"train/loss": loss_value, "train/lr": lr,
                                               "train/token_acc": acc})
                if session is not None:
                    bar.update(step + 1, loss=loss_value, lr=lr, acc=acc)
        except KeyboardInterrupt:
            status = "interrupted"
        except Exception as e:  # noqa: BLE001 - under DDP rank 0 still writes the report
            if not dist.active:
                raise
            status, error = "failed", dist.failed(e, step)   # other ranks raise RankFailed here
        train_s = time.perf_counter() - t_train
        train_cpu_s = time.process_time() - cpu_train   # all threads; an upper bound on idle wall time
        findings = dist.gather_findings(engine.finish())

    path = None
    if out_dir is not None:
        path = save(status)

    scores: dict[str, Any] = {"exact_match": None, "token_accuracy": None}
    t_eval = time.perf_counter()
    if evaluate_at_end and status not in ("interrupted", "failed") and dist.is_main:
        held_out = eval_set(task, train_cfg.eval_size, train_cfg.seed, train_cfg.pad_share)
        with torch.random.fork_rng(devices=rng_devices):
            scores = evaluate(model, held_out, autocast=autocast if train_cfg.amp != "none" else None)
        if session is not None:
            session.log_scalars(global_step, {"eval/exact_match": scores["exact_match"],
                                              "eval/token_accuracy": scores["token_accuracy"]})
    eval_s = time.perf_counter() - t_eval

    tail = [x for x in history["loss"][-10:] if math.isfinite(x)]
    run_info = {
        "task": task.name, "preset": preset_name(model_cfg), "arch": model_cfg.arch, "norm": model_cfg.norm,
        "norm_kind": model_cfg.norm_kind, "pos": model_cfg.pos,
        "faults": list(model_cfg.faults), "seed": train_cfg.seed, "steps": train_cfg.steps,
        "device": str(device), "amp": train_cfg.amp, "dtype": str(compute_dtype).replace("torch.", ""),
        "batch_size": train_cfg.batch_size, "warmup": train_cfg.warmup, "lr_factor": train_cfg.lr_factor,
        "final_loss": sum(tail) / len(tail) if tail else (history["loss"][-1] if history["loss"] else None),
        "final_lr": last_lr, "exact_match": scores["exact_match"],
        "token_accuracy": scores["token_accuracy"], "eval_size": train_cfg.eval_size,
        "status": status, "stopped_at_step": global_step,
        "resumed_from_step": int(state["global_step"]) if state is not None else None,
        "wall_s": round(time.perf_counter() - t_start, 3), "train_s": round(train_s, 3),
        "train_cpu_s": round(train_cpu_s, 3),
        "eval_s": round(eval_s, 3), "probe_s": round(engine.probe_seconds, 3),
        "probe_s_by_probe": {k: round(v, 3) for k, v in engine.seconds_by_probe.items()},
        "tokens_per_s": round(tokens / train_s, 1) if train_s > 0 else None,
        "peak_gpu_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "checkpoint": str(path) if path else None,
        "world_size": dist.world, "error": error,
        "probe_budget": budget.summary() if budget is not None else None,
    }
    statuses = engine.statuses(findings)      # every rank's findings under DDP
    report = judge.conclude(run_info, findings, statuses,
                            judge.Context(skipped=unavailable, history=history))
    return TrainResult(report, model, opt, engine, path)


def _batch_accuracy(logits: torch.Tensor, tgt_out: torch.Tensor, pad: int) -> float:
    """Teacher-forced token accuracy of one batch (argmax vs target, real positions only)."""
    real = tgt_out != pad
    return float(((logits.argmax(-1) == tgt_out) & real).sum()) / max(int(real.sum()), 1)

