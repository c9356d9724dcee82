"""`tndebug run`: train a Transformer on a synthetic task with probes attached, then report.

Thin: parse and check the flags, then call `tndebug.train.run_training`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

from tndebug.commands.flags import (BATCH, NPROC, SEED, STEPS, THREADS as THREADS_ARG, WARMUP, HelpFormatter,
                                    add_code_options, add_fail_on, add_verbose, lr_factor, nonneg_int, out_path,
                                    probe_budget)
from tndebug.config import ARCHS, NORM_KINDS, NORMS, POSITIONS, PRESETS, ModelConfig
from tndebug.errors import SigTerm, UsageError
from tndebug.faults import FAULTS
from tndebug.probes.budget import DEFAULT_FRACTION       # statistics only: no torch
from tndebug.task_names import SUMMARIES as TASKS
from tndebug.train.config import AMPS, DECODER_DROPOUT, DECODER_RUN, DEVICES, TrainConfig, model_config, \
    preset_name

_D = TrainConfig()
THREADS = 1      # --threads: see its help and bench/results/default_run.md


OUTPUT_RULE = (
    "Outputs: --out DIR is refused (exit 2, before training) when it is a file, lies under a "
    "file, is not writable, is in use by another tndebug (.tndebug.lock), or already holds a "
    "tndebug run, unless --overwrite (which removes the old reports, figures, checkpoint and "
    "TensorBoard events first, so tb/ never mixes two runs). Without --out a fresh directory "
    "is used: runs/<task>-<preset>-<norm>[-faults], or the first free of NAME-2, NAME-3, ... "
    "--resume continues in the checkpoint's directory.")
EXITS = ("Exit codes: 0 clean: no finding at or above --fail-on, and every probe that applies "
         "checked the model; 1 findings at or above it, or a diverged run; 4 no such finding, but "
         "something that applies could not be checked (verdict INCOMPLETE or UNCHECKED; the "
         "console says what and why); 2 bad input or usage (one line); 3 internal error, or a failed rank "
         "under --nproc; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM). Interrupted or "
         "terminated, the run still writes its checkpoint and report.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run", help="train on a synthetic task with probes attached, then report",
        description="Train an encoder-decoder Transformer on a synthetic task (Adam, Noam "
                    "schedule, label smoothing) with probes attached; write checkpoint.pt, "
                    "report.json, report.md and tb/ into --out.\n\n" + OUTPUT_RULE + "\n\n" + EXITS,
        epilog="examples:  tndebug run            (copy task, small preset, all probes)\n"
               "           tndebug run --fault no_scale --norm post\n"
               "           tndebug run --resume runs/copy-small-pre --steps 200",
        formatter_class=HelpFormatter)
    p.add_argument("--task", choices=tuple(TASKS), default=None,
                   help="synthetic task: " + "; ".join(f"{name}: {summary}" for name, summary in TASKS.items())
                   + " (default copy)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="model size: tiny (tests), small (CPU default), base (the paper's) (default small)")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="seq2seq: the paper's encoder-decoder; decoder: one causal stack (GPT-style) "
                        "reading prompt + continuation, loss on the continuation (default seq2seq)")
    p.add_argument("--norm", choices=NORMS, default=None,
                   help="LayerNorm placement: pre (x + f(norm(x)), final norm) or post (the paper's "
                        "norm(x + f(x))) (default pre)")
    p.add_argument("--norm-kind", choices=NORM_KINDS, default=None,
                   help="the normalisation at that placement: layernorm (the paper's) or rmsnorm "
                        "(x / rms(x) * g: no centring, no bias) (default layernorm)")
    p.add_argument("--pos", choices=POSITIONS, default=None,
                   help="positions: sinusoidal (the paper's table, added at the embedding), "
                        "rotary (RoPE: q and k rotated by position in every self-attention, "
                        "nothing added at the embedding; --arch decoder only) or learned (a "
                        "trained table added at the embedding, GPT-2's wpe) (default sinusoidal)")
    p.add_argument("--tie-embeddings", action="store_true", default=None,
                   help="share the target token embedding and the output head's weights (paper "
                        "§3.4; nanoGPT's wte / lm_head); needs one vocabulary for source and "
                        "target (default: untied)")
    p.add_argument("--fault", action="append", default=[], metavar="NAME",
                   help="switch on a fault (repeatable, or comma-separated); `tndebug faults` lists them")
    p.add_argument("--probe", default="all", metavar="all|none|a,b",
                   help="probes to attach; `tndebug probes` lists them (default all)")
    p.add_argument("--probe-budget", type=probe_budget, default=DEFAULT_FRACTION, metavar="SHARE|none",
                   help="the share of the measured step time the probed steps may cost: over it, "
                        "scheduled looks are deferred (each probe still looks once, nan-scores "
                        "every time it is due, the setup's exact tests and the closing snapshot "
                        "always run); report.json's run.probe_budget says what was deferred; "
                        "none: every scheduled look, and a run that repeats bit for bit; with "
                        "--nproc the ranks agree on the measured times, so all thin the same "
                        "steps (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=None,
                   help="seed for the model, dropout and data (default 0)")
    p.add_argument("--steps", type=STEPS, default=None,
                   help=f"optimizer steps; with --resume, steps *more* (default {_D.steps}; "
                        f"--arch decoder {DECODER_RUN['steps']})")
    p.add_argument("--batch-size", type=BATCH, default=None,
                   help=f"sequences per step (default {_D.batch_size})")
    p.add_argument("--warmup", type=WARMUP, default=None,
                   help=f"Noam warmup steps, >= 1 (default {_D.warmup}; --arch decoder "
                        f"{DECODER_RUN['warmup']})")
    p.add_argument("--lr-factor", type=lr_factor, default=None,
                   help=f"Noam factor, a finite number > 0: lr = factor * d_model^-0.5 * "
                        f"min(s^-0.5, s*warmup^-1.5); with --fault no_warmup_high_lr it scales "
                        f"that fault's constant lr the same way (default {_D.lr_factor}; "
                        f"--arch decoder {DECODER_RUN['lr_factor']}, dropout 0)")
    p.add_argument("--save-every", type=nonneg_int, default=None, metavar="N",
                   help=f"also write checkpoint.pt every N steps (atomically), so a killed run "
                        f"loses at most N steps; 0: only at the end. A save of the small preset "
                        f"costs ~0.008 s against ~0.035 s a step on one CPU thread, so "
                        f"{_D.save_every} keeps saving under 1%% of training time "
                        f"(default {_D.save_every})")
    p.add_argument("--threads", type=THREADS_ARG, default=THREADS, metavar="N",
                   help="torch intra-op threads for this run (restored after it). One is the "
                        "default: on an idle 2-core machine a second thread ran the small preset "
                        "only 1.2x faster (34 vs 28 step/s) for 1.6x the CPU, and beside one busy "
                        "process 2.4x slower (12 vs 28 step/s); "
                        "bench/results/default_run.md (default %(default)s)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: CUDA when available, else CPU (default auto)")
    p.add_argument("--amp", choices=AMPS, default="none",
                   help="autocast dtype: bf16, or fp16 with a GradScaler (CUDA only) (default none)")
    p.add_argument("--nproc", type=NPROC, default=1, metavar="N",
                   help="train in N processes with DistributedDataParallel: relaunches this command "
                        "under torchrun (gloo on CPU, NCCL with one GPU each); the global batch is "
                        "split over them; same as `torchrun --standalone --nproc-per-node=N -m "
                        "tndebug run ...` (default 1)")
    p.add_argument("--out", type=out_path, default=None, metavar="DIR",
                   help="where checkpoint.pt, report.json, report.md and tb/ go (default "
                        "runs/<task>-<preset>-<norm>[-faults], numbered -2, -3, ... when taken; "
                        "with --resume, the checkpoint's directory); see Outputs above")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the tndebug outputs already in --out (the old reports, figures, "
                        "checkpoint and TensorBoard events are removed first)")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a run directory or checkpoint.pt: model, optimizer, lr "
                        "schedule and RNG state; --fault may add faults (e.g. warmup_restart_on_resume)")
    add_fail_on(p)
    add_code_options(p)
    p.add_argument("--format", choices=("text", "json", "md"), default="text",
                   help="what goes to stdout at the end: the findings table, the JSON report, or "
                        "the Markdown report (default text)")
    add_verbose(p)
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


def default_out(task: str, preset: str, norm: str, faults, arch: str = "seq2seq",
                norm_kind: str = "layernorm", pos: str = "sinusoidal") -> str:
    kind = "-decoder" if arch == "decoder" else ""
    kind += ("-rmsnorm" if norm_kind == "rmsnorm" else "") + (f"-{pos}" if pos != "sinusoidal" else "")
    return f"runs/{task}-{preset}-{norm}{kind}" + (f"-{'+'.join(faults)}" if faults else "")


def configs(args):
    """The flags -> (ModelConfig, TrainConfig, resume state | None, default out, resumed dir).

    The numbers were checked by argparse (`flags.py`); here only what needs the checkpoint."""
    faults = parse_faults(args.fault)
    given = {k: getattr(args, k) for k in ("batch_size", "warmup", "lr_factor", "save_every")
             if getattr(args, k) is not None}
    budget = getattr(args, "probe_budget", DEFAULT_FRACTION)
    given["probe_budget"] = None if budget == "none" else budget
    if args.resume is None:
        task, preset, norm = args.task or "copy", args.preset or "small", args.norm or "pre"
        arch = args.arch or "seq2seq"
        norm_kind, pos = args.norm_kind or "layernorm", args.pos or "sinusoidal"
        lm = arch == "decoder"
        try:
            mcfg = model_config(task, preset, norm, faults, arch=arch, norm_kind=norm_kind, pos=pos,
                                tie_embeddings=bool(args.tie_embeddings),
                                **({"dropout": DECODER_DROPOUT} if lm else {}))
        except ValueError as e:
            msg = str(e)
            hint = (" (pass --arch decoder)" if "only in a decoder model" in msg else
                    " (pass --pos rotary)" if "needs pos='rotary'" in msg else "")
            raise UsageError(f"{msg}{hint}") from None
        defaults = {**vars(_D), **(DECODER_RUN if lm else {})}
        given = {**{k: defaults[k] for k in ("warmup", "lr_factor")}, **given}
        tcfg = TrainConfig(task=task, steps=defaults["steps"] if args.steps is None else args.steps,
                           seed=args.seed or 0, device=args.device, amp=args.amp, **given)
        return mcfg, tcfg, None, default_out(task, preset, norm, faults, arch, norm_kind, pos), None

    from tndebug.train.checkpoint import load_checkpoint, resolve
    path = resolve(args.resume)
    state = load_checkpoint(path)
    try:
        mcfg = ModelConfig.from_dict(state["model_config"])
        tcfg = TrainConfig.from_dict(state["train_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: unreadable configuration in checkpoint: {e}") from None
    have = {"task": tcfg.task, "preset": preset_name(mcfg), "norm": mcfg.norm, "seed": tcfg.seed,
            "arch": mcfg.arch, "norm_kind": mcfg.norm_kind, "pos": mcfg.pos,
            "tie_embeddings": mcfg.tie_embeddings}
    for flag, value in have.items():
        asked = getattr(args, flag)
        if asked is not None and asked != value:
            raise UsageError(f"--{flag.replace('_', '-')} {asked} conflicts with the checkpoint ({flag} {value}); "
                             f"drop the flag or start a new run")
    mcfg = mcfg.with_faults(*faults)
    tcfg = tcfg.replace(steps=_D.steps if args.steps is None else args.steps,
                        device=args.device, amp=args.amp, **given)
    from tndebug.train.checkpoint import check_resume_fits
    check_resume_fits(mcfg, state)                 # before anything is written
    return mcfg, tcfg, state, str(path.parent), path.parent


def relaunch_argv(args) -> list[str]:
    """The same `run` command without --nproc: what each torchrun worker parses."""
    argv = ["run"]
    for action in args.run_parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "nproc") or value in (None, action.default):
            continue
        if action.nargs == 0:                # a switch (--overwrite): the flag alone
            argv.append(action.option_strings[0])
            continue
        for v in value if isinstance(value, list) else [value]:
            argv += [action.option_strings[0], str(v)]
    return argv


class _SigTermAsInterrupt:
    """Inside: the first SIGTERM raises SigTerm (a KeyboardInterrupt) where the program is, so
    the loop stops as on Ctrl-C and still writes its checkpoint and report; later ones are
    ignored until the outputs are written. Only in the main thread of a process that is not a
    torchrun worker (there `Dist.terminable` owns SIGTERM)."""

    def __init__(self) -> None:
        self.received = False
        self._old = None

    def _on_term(self, signum, frame):
        if not self.received:
            self.received = True
            raise SigTerm()

    def __enter__(self):
        import threading
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def main(args) -> int:
    from tndebug.commands import cheap   # torch-free: a bad code is one line, fast
    check_probes(args.probe)
    cheap.codes(args.select, "--select")
    cheap.codes(args.ignore, "--ignore")
    parse_faults(args.fault)
    cheap.out_place(args.out)
    early = None
    if args.resume is not None:          # a missing run or checkpoint: one line before torch
        from tndebug.paths import run_checkpoint
        run_checkpoint(args.resume)
    if args.resume is None:              # a bad --out or flag combination is refused before torch
        from tndebug.outputs import resolve_output
        resolve_output(args.out, "runs/run", overwrite=args.overwrite, kind="run")   # claimed below
        early = configs(args)            # torch-free without --resume (ModelConfig, TrainConfig)
    from tndebug.train.loop import autocast_factory, resolve_device
    from tndebug import judge            # torch: only once the flags parsed (a bad flag is refused before it)
    args.select = judge.codes_option(args.select, "--select")     # bad codes: one line, before work
    args.ignore = judge.codes_option(args.ignore, "--ignore")
    autocast_factory(resolve_device(args.device), args.amp)   # bad --device/--amp: one line, no output yet
    mcfg, tcfg, state, default, resumed = early or configs(args)
    if args.nproc > 1:                   # before any directory is made (claimed below)
        from tndebug.train import distributed
        distributed.Dist(world=args.nproc).check_batch(tcfg.batch_size)
    with _torch_threads(args.threads):
        return _main(args, mcfg, tcfg, state, default, resumed)


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to `n` inside, the previous count restored on exit (main()
    also runs in-process: the tests, `tndebug.cli.main` from Python)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _main(args, mcfg, tcfg, state, default, resumed) -> int:
    from tndebug.outputs import claim_output
    from tndebug.train import distributed

    launched = distributed.under_torchrun() and os.environ.get(distributed.EXIT_FILE_ENV)
    if distributed.under_torchrun() and (launched or os.environ.get("RANK") != "0"):
        out = args.out or default      # `launch` (or torchrun's rank 0) claimed the directory
        claim = contextlib.nullcontext(out)
    else:
        claim = claim_output(args.out, default, overwrite=args.overwrite, kind="run",
                             continuing=resumed)
    with claim as out:
        out = str(out)
        if args.nproc > 1 and not distributed.under_torchrun():
            distributed.Dist(world=args.nproc).check_batch(tcfg.batch_size)
            args.out, args.overwrite = out, False   # the workers write where this process claimed
            return distributed.launch(relaunch_argv(args), args.nproc, device=args.device)
        dist = distributed.init_from_env(args.device, error_dir=out)   # LOCAL outside torchrun
        try:
            if not dist.is_main:                 # rank 0 alone reports; the others train
                return _worker(mcfg, tcfg, state, args, dist)
            signals = _SigTermAsInterrupt() if not dist.active else contextlib.nullcontext()
            with signals:
                return distributed.report_exit(_train(mcfg, tcfg, state, out, args, dist, signals))
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


def _train(mcfg, tcfg, state, out, args, dist, signals=None) -> int:
    from tndebug.reporters.session import ReportSession
    from tndebug.train import run_training

    resume_step = int(state["global_step"]) if state else None    # TensorBoard purges from it
    with ReportSession(out, fmt=args.format, resume_step=resume_step,
                       verbose=args.verbose) as session:   # closes TB
        what = (f"{tcfg.task}, {preset_name(mcfg)} preset, {mcfg.norm}-LN"
                + (", RMSNorm" if mcfg.norm_kind == "rmsnorm" else "")
                + (", decoder-only" if mcfg.arch == "decoder" else "")
                + (f", {mcfg.pos} positions" if mcfg.pos != "sinusoidal" else "")
                + (", tied head" if mcfg.tie_embeddings else "")
                + (f", faults {'+'.join(mcfg.faults)}" if mcfg.faults else "")
                + (f", resuming at step {int(state['global_step'])}" if state else ""))
        print(f"tndebug run: {what}; {tcfg.steps} steps -> {out}", file=sys.stderr)
        if dist.active:
            print(f"tndebug run: {dist.world} processes ({dist.backend}), global batch "
                  f"{tcfg.batch_size}", file=sys.stderr)
        result = run_training(mcfg, tcfg, probes=args.probe, session=session, resume=state, dist=dist)
        from tndebug import judge
        report = judge.select_codes(result.report, args.select, args.ignore)
        missing = [n for n, s in report.probes.items() if s.get("reason", "").startswith("not available")]
        if missing:
            print(f"tndebug: note: {len(missing)} probes not installed, skipped: {', '.join(missing)}",
                  file=sys.stderr)
        code = session.finish(report, args.fail_on)
    status = report.run["status"]
    if status == "interrupted":
        how = "terminated (SIGTERM)" if getattr(signals, "received", False) else "interrupted"
        print(f"tndebug: {how} at step {report.run['stopped_at_step']}; checkpoint and report "
              f"written to {out}", file=sys.stderr)
        return 143 if how.startswith("terminated") else 130
    if status == "failed":                   # a rank failed under DDP; the report says which
        print(f"tndebug: error: {report.run['error']} (report: {out}/report.json)", file=sys.stderr)
        return 3
    if status == "diverged":
        print(f"tndebug: training diverged (loss not finite) at step {report.run['stopped_at_step']}",
              file=sys.stderr)
        if args.fail_on != "never":
            return max(code, 1)
    return code
