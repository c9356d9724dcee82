"""Regenerate every results file the README and docs quote, with one command.

    python -m bench --list                 # the jobs, their commands, the files each writes, minutes
    python -m bench all                    # every job, into bench/results/ (and sample_runs/)
    python -m bench all --quick            # a short version of each, into a scratch folder
    python -m bench run overhead hf_triage # some jobs

Each job is its bench script(s) in a child process, run from the repository root; each script
records its own provenance (bench/_provenance.py: commit, clean tree, machine, load before and
after, the exact command). The timings mean something only on a quiet machine: this runner
prints the load before each job and warns above 1.5 on 2 cores. `--quick` checks that every
script runs and writes its file; its figures are not evidence and never land in bench/results/.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobs import JOBS, Job, by_name  # noqa: E402
from _provenance import ROOT, tree_state  # noqa: E402

# a 1-minute load above this on 2 cores means other work competes with the timings: the issue's
# bound for a "quiet machine" (load stated, <= 1.5)
QUIET_LOAD = 1.5


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def commands(job: Job, quick: bool, out: Path | None) -> list[list[str]]:
    chosen = job.quick if quick else job.commands
    return [[sys.executable, *(a.replace("{out}", str(out)) for a in cmd)] for cmd in chosen]


def show(cmd: list[str]) -> str:
    return shlex.join(["python", *cmd[1:]])


def listing(jobs: list[Job], quick: bool) -> str:
    lines = []
    for job in jobs:
        extra = f"  [needs {job.needs}: skipped by `all` without it]" if job.needs else ""
        lines.append(f"{job.name}: {job.what}{extra}")
        for cmd in commands(job, quick, Path("{out}") if quick else None):
            lines.append(f"    $ {show(cmd)}")
        lines.append("    writes: " + (", ".join(job.writes) if not quick else "files under {out} (scratch)"))
        lines.append(f"    about {job.minutes:g} min on 2 quiet cores" + (" (quick: well under one)" if quick else ""))
    total = sum(j.minutes for j in jobs if not j.needs)
    lines.append(f"total (without the GPU job): about {total:g} min on 2 quiet cores"
                 + ("" if quick else f", plus up to 2 min before each job for the load to settle"))
    return "\n".join(lines)


def wait_quiet(seconds: float) -> None:
    """Let the 1-minute load settle below QUIET_LOAD (the last job's own processes raise it for a
    minute or two after they end), for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5)


def run_job(job: Job, quick: bool, out: Path | None, runner: str) -> tuple[int, float]:
    load = os.getloadavg()[0]
    warn = f"  WARNING: load {load:.2f} > {QUIET_LOAD}: timings will not be evidence" if load > QUIET_LOAD else ""
    print(f"== {job.name} (load {load:.2f}){warn}", file=sys.stderr, flush=True)
    env = {**os.environ, "TNDEBUG_BENCH_RUNNER": runner,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    for cmd in commands(job, quick, out):
        print(f"   $ {show(cmd)}", file=sys.stderr, flush=True)
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code not in job.ok_codes:
            return code, time.monotonic() - t0
    return 0, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default=None, choices=("all", "run", "list"),
                    help="all: every job; run NAME...: those jobs; list: what would run")
    ap.add_argument("names", nargs="*", help="the jobs of `run`")
    ap.add_argument("--list", action="store_true", help="show what would run and stop")
    ap.add_argument("--quick", action="store_true", help="a short version of each job, into --out-dir")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="scratch folder of --quick (default: a new temporary folder)")
    ap.add_argument("--keep-going", action="store_true", help="run the other jobs after a failure")
    ap.add_argument("--wait-quiet", type=float, default=None, metavar="S",
                    help=f"before each job, wait up to S seconds for the 1-minute load to fall below "
                         f"{QUIET_LOAD} (default 120; 0 with --quick)")
    args = ap.parse_args(argv)
    if args.what == "run" and not args.names:
        ap.error("run needs job names: " + ", ".join(j.name for j in JOBS))
    try:
        jobs = [by_name(n) for n in args.names] if args.what == "run" else list(JOBS)
    except KeyError as e:
        ap.error(str(e.args[0]))
    if args.list or args.what in (None, "list"):
        print(listing(jobs, args.quick))
        return 0
    cuda = _cuda()
    if args.what == "all":
        skipped = [j.name for j in jobs if j.needs == "cuda" and not cuda]
        jobs = [j for j in jobs if j.name not in skipped]
        if skipped:
            print(f"skipped (no CUDA): {', '.join(skipped)}", file=sys.stderr)
    out = None
    if args.quick:
        out = args.out_dir or Path(tempfile.mkdtemp(prefix="tndebug-bench-quick-"))
        out.mkdir(parents=True, exist_ok=True)
        print(f"quick: results go to {out}", file=sys.stderr)
    state = tree_state()
    if not state["clean"]:
        print(f"NOTE: the tree is not clean ({', '.join(state['dirty'][:6])}...): every results file "
              "written now records `clean: false` and must not be quoted", file=sys.stderr)
    runner = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    failed, t0 = [], time.monotonic()
    wait = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 120.0)
    for job in jobs:
        wait_quiet(wait)
        code, seconds = run_job(job, args.quick, out, runner)
        print(f"== {job.name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s",
              file=sys.stderr, flush=True)
        if code != 0:
            failed.append(job.name)
            if not args.keep_going:
                break
    print(f"done in {time.monotonic() - t0:.0f} s; failed: {', '.join(failed) or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
