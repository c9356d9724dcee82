"""`tndebug run`: train a Transformer on a synthetic task with probes attached, then report.

Thin: parse and check the flags, then call `tndebug.train.run_training`.
"""
from __future__ import annotations

import sys

from tndebug.config import NORMS, PRESETS, ModelConfig
from tndebug.data import TASKS
from tndebug.errors import UsageError
from tndebug.faults import FAULTS
from tndebug.train.config import AMPS, DEVICES, TrainConfig, model_config, preset_name

_D = TrainConfig()


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run", help="train on a synthetic task with probes attached, then report",
        description="Train an encoder-decoder Transformer on a synthetic task (Adam, Noam schedule, "
                    "label smoothing) with probes attached; write checkpoint.pt and report.json "
                    "into --out. Exit 0 clean, 1 findings at or above --fail-on (or a diverged "
                    "run), 2 bad input, 130 interrupted.",
        epilog="examples:  tndebug run            (copy task, small preset, all probes)\n"
               "           tndebug run --fault no_scale --norm post\n"
               "           tndebug run --resume runs/copy-small-pre --steps 200",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=tuple(TASKS), default=None,
                   help="synthetic task: " + "; ".join(f"{t.name}: {t.summary}" for t in TASKS.values())
                   + " (default copy)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="model size: tiny (tests), small (CPU default), base (the paper's) (default small)")
    p.add_argument("--norm", choices=NORMS, default=None,
                   help="LayerNorm placement: pre (x + f(norm(x)), final norm) or post (the paper's "
                        "norm(x + f(x))) (default pre)")
    p.add_argument("--fault", action="append", default=[], metavar="NAME",
                   help="switch on a fault (repeatable, or comma-separated); `tndebug faults` lists them")
    p.add_argument("--probe", default="all", metavar="all|none|a,b",
                   help="probes to attach; `tndebug probes` lists them (default all)")
    p.add_argument("--seed", type=int, default=None, help="seed for the model, dropout and data (default 0)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps; with --resume, steps *more* (default {_D.steps})")
    p.add_argument("--batch-size", type=int, default=None, help=f"sequences per step (default {_D.batch_size})")
    p.add_argument("--warmup", type=int, default=None, help=f"Noam warmup steps (default {_D.warmup})")
    p.add_argument("--lr-factor", type=float, default=None,
                   help=f"Noam factor: lr = factor * d_model^-0.5 * min(s^-0.5, s*warmup^-1.5) "
                        f"(default {_D.lr_factor})")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: CUDA when available, else CPU (default auto)")
    p.add_argument("--amp", choices=AMPS, default="none",
                   help="autocast dtype: bf16, or fp16 with a GradScaler (CUDA only) (default none)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train in N processes with DistributedDataParallel: relaunches this command "
                        "under torchrun (gloo on CPU, NCCL with one GPU each); the global batch is "
                        "split over them; same as `torchrun --standalone --nproc-per-node=N -m "
                        "tndebug run ...` (default 1)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where checkpoint.pt and report.json go (default runs/<task>-<preset>-<norm>"
                        "[-faults]; with --resume, the checkpoint's directory)")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a run directory or checkpoint.pt: model, optimizer, lr "
                        "schedule and RNG state; --fault may add faults (e.g. warmup_restart_on_resume)")
    p.add_argument("--fail-on", choices=("error", "warning", "never"), default="error",
                   help="exit 1 when a finding is at least this severe (default error)")
    p.add_argument("--format", choices=("text", "json", "md"), default="text",
                   help="what goes to stdout at the end: the findings table, the JSON report, or "
                        "the Markdown report (default text)")
    p.set_defaults(func=main, run_parser=p)


def parse_faults(values: list[str]) -> list[str]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    for n in names:
        if n not in FAULTS:
            raise UsageError(f"unknown fault {n!r}; `tndebug faults` lists the {len(FAULTS)} faults")
    return list(dict.fromkeys(names))


def check_probes(spec: str) -> str:
    from tndebug.probes import ProbeError, parse_probe_spec
    try:
        parse_probe_spec(spec)
    except ProbeError as e:
        raise UsageError(str(e)) from None
    return spec


def default_out(task: str, preset: str, norm: str, faults) -> str:
    return f"runs/{task}-{preset}-{norm}" + (f"-{'+'.join(faults)}" if faults else "")


def configs(args):
    """The flags -> (ModelConfig, TrainConfig, resume state | None, out dir)."""
    faults = parse_faults(args.fault)
    for name in ("steps", "batch_size", "warmup"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "steps" else 1):
            raise UsageError(f"--{name.replace('_', '-')} {v}: must be {'>= 0' if name == 'steps' else '>= 1'}")
    given = {k: getattr(args, k) for k in ("batch_size", "warmup", "lr_factor") if getattr(args, k) is not None}
    if args.resume is None:
        task, preset, norm = args.task or "copy", args.preset or "small", args.norm or "pre"
        mcfg = model_config(task, preset, norm, faults)
        tcfg = TrainConfig(task=task, steps=_D.steps if args.steps is None else args.steps,
                           seed=args.seed or 0, device=args.device, amp=args.amp, **given)
        return mcfg, tcfg, None, args.out or default_out(task, preset, norm, faults)

    from pathlib import Path

    from tndebug.train.checkpoint import load_checkpoint, resolve
    path = resolve(args.resume)
    state = load_checkpoint(path)
    try:
        mcfg = ModelConfig.from_dict(state["model_config"])
        tcfg = TrainConfig.from_dict(state["train_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: unreadable configuration in checkpoint: {e}") from None
    have = {"task": tcfg.task, "preset": preset_name(mcfg), "norm": mcfg.norm, "seed": tcfg.seed}
    for flag, value in have.items():
        asked = getattr(args, flag)
        if asked is not None and asked != value:
            raise UsageError(f"--{flag} {asked} conflicts with the checkpoint ({flag} {value}); "
                             f"drop the flag or start a new run")
    mcfg = mcfg.with_faults(*faults)
    tcfg = tcfg.replace(steps=_D.steps if args.steps is None else args.steps,
                        device=args.device, amp=args.amp, **given)
    return mcfg, tcfg, state, args.out or str(path.parent if Path(args.resume).is_file() else args.resume)


def relaunch_argv(args) -> list[str]:
    """The same `run` command without --nproc: what each torchrun worker parses."""
    argv = ["run"]
    for action in args.run_parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "nproc") or value in (None, action.default):
            continue
        for v in value if isinstance(value, list) else [value]:
            argv += [action.option_strings[0], str(v)]
    return argv


def main(args) -> int:
    from tndebug.train import distributed
    from tndebug.train.loop import autocast_factory, resolve_device

    check_probes(args.probe)
    autocast_factory(resolve_device(args.device), args.amp)   # bad --device/--amp: one line, no output yet
    mcfg, tcfg, state, out = configs(args)
    if args.nproc > 1 and not distributed.under_torchrun():
        distributed.Dist(world=args.nproc).check_batch(tcfg.batch_size)
        return distributed.launch(relaunch_argv(args), args.nproc, device=args.device)
    dist = distributed.init_from_env(args.device, error_dir=out)   # LOCAL outside torchrun
    try:
        if not dist.is_main:                 # rank 0 alone reports; the others train
            return _worker(mcfg, tcfg, state, args, dist)
        return distributed.report_exit(_train(mcfg, tcfg, state, out, args, dist))
    finally:
        dist.close()


def _worker(mcfg, tcfg, state, args, dist) -> int:
    from tndebug.train import distributed, run_training
    try:
        run_training(mcfg, tcfg, probes=args.probe, resume=state, dist=dist)
    except distributed.RankFailed as e:
        print(f"tndebug: error: {e}", file=sys.stderr)
        return 3
    return 0


def _train(mcfg, tcfg, state, out, args, dist) -> int:
    from tndebug.reporters.session import ReportSession
    from tndebug.train import run_training

    with ReportSession(out, fmt=args.format) as session:     # closes TensorBoard on any exit
        what = (f"{tcfg.task}, {preset_name(mcfg)} preset, {mcfg.norm}-LN"
                + (f", faults {'+'.join(mcfg.faults)}" if mcfg.faults else "")
                + (f", resuming at step {int(state['global_step'])}" if state else ""))
        print(f"tndebug run: {what}; {tcfg.steps} steps -> {out}", file=sys.stderr)
        if dist.active:
            print(f"tndebug run: {dist.world} processes ({dist.backend}), global batch "
                  f"{tcfg.batch_size}", file=sys.stderr)
        result = run_training(mcfg, tcfg, probes=args.probe, session=session, resume=state, dist=dist)
        report = result.report
        missing = [n for n, s in report.probes.items() if s.get("reason", "").startswith("not available")]
        if missing:
            print(f"tndebug: note: {len(missing)} probes not installed, skipped: {', '.join(missing)}",
                  file=sys.stderr)
        code = session.finish(report, args.fail_on)
    status = report.run["status"]
    if status == "interrupted":
        return 130
    if status == "failed":                   # a rank failed under DDP; the report says which
        print(f"tndebug: error: {report.run['error']} (report: {out}/report.json)", file=sys.stderr)
        return 3
    if status == "diverged":
        print(f"tndebug: training diverged (loss not finite) at step {report.run['stopped_at_step']}",
              file=sys.stderr)
        if args.fail_on != "never":
            return max(code, 1)
    return code
