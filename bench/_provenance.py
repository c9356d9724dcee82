"""Where a results file came from, recorded the same way by every bench script.

    from _provenance import Provenance               # with bench/ on sys.path, as the scripts do
    prov = Provenance.start(__file__, argv)          # before the measurement
    ...
    result["provenance"] = prov.finish()             # just before writing the results file

The block holds the commit, whether the code that the measurement ran was clean (`clean`, and
the uncommitted paths when not), the machine, the load average before and after, the exact
command, and the wall time. A results file written from a dirty tree says so (`clean: false`,
`dirty`), and `provenance_line()` puts the same in a results .md, so it is never quoted as if a
commit reproduced it. `python -m bench all` (bench/__main__.py) regenerates every results file.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a measurement runs: the package, the bench scripts, the test corpora the scripts import
# (tests/foreign: bench/foreign.py; tests/api: watch_overhead.py; tests/zoo: triage_speed.py;
# tests/realbugs: realbugs.py) and the package's set-up. bench/results/ is what the scripts
# write, so its changes do not count.
CODE_PATHS = ("tndebug", "bench", "tests/foreign", "tests/api", "tests/zoo", "tests/realbugs",
              "pyproject.toml", ":(exclude)bench/results")
ENV_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")
PACKAGES = ("torch", "transformers", "numpy", "tndebug")


def _git(*args: str, root: Path = ROOT) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def tree_state(root: Path = ROOT) -> dict:
    """The commit, the uncommitted (and untracked) paths among CODE_PATHS, and a hash of those
    paths' committed trees (equal at start and end: the code did not move under the run)."""
    commit = _git("rev-parse", "HEAD", root=root).strip()
    status = _git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS, root=root)
    dirty = sorted({line[3:].split(" -> ")[-1] for line in status.splitlines() if line.strip()})
    trees = _git("ls-tree", "HEAD", "--", *[p for p in CODE_PATHS if not p.startswith(":")], root=root)
    return {"commit": commit or "unknown (not a git checkout)", "clean": bool(commit) and not dirty,
            "dirty": dirty, "code_tree": hashlib.sha256(trees.encode()).hexdigest()[:16]}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"host": platform.node(), "platform": platform.platform(), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "packages": versions}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def command(script: str | Path, argv: list[str] | None) -> str:
    """The command line that reproduces this run, from the repository root."""
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    path = Path(script).resolve()
    shown = str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_KEYS[:3] if k in os.environ]
    return shlex.join(["python", shown, *args]) if not env else " ".join(env) + " " + shlex.join(["python", shown, *args])


class Provenance:
    """Taken at the start of a measurement; `finish()` returns the block for its results file."""

    def __init__(self, script: str | Path, argv: list[str] | None = None, root: Path = ROOT) -> None:
        self.root = root
        self.command = command(script, argv)
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.load_before = load()
        self.tree = tree_state(root)
        self._t0 = time.monotonic()

    @classmethod
    def start(cls, script: str | Path, argv: list[str] | None = None, root: Path = ROOT) -> "Provenance":
        return cls(script, argv, root)

    def finish(self) -> dict:
        end = tree_state(self.root)
        moved = end["code_tree"] != self.tree["code_tree"] or end["dirty"] != self.tree["dirty"]
        block = {"commit": self.tree["commit"], "clean": self.tree["clean"] and not moved,
                 "dirty": self.tree["dirty"], "code_tree": self.tree["code_tree"],
                 "command": self.command,
                 "invoked_by": os.environ.get("TNDEBUG_BENCH_RUNNER"),   # `python -m bench all`
                 "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
                 "machine": machine(), "started": self.started,
                 "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "wall_s": round(time.monotonic() - self._t0, 1),
                 "load_before": self.load_before, "load_after": load()}
        if moved:
            block["code_changed_during_run"] = {"commit_at_end": end["commit"], "dirty_at_end": end["dirty"]}
        return block


def provenance_line(block: dict) -> str:
    """One markdown line for a results .md: the commit (and a loud note when not clean), the
    machine, the load before and after, the command."""
    m = block["machine"]
    state = "clean tree" if block["clean"] else (
        "**DIRTY tree** (uncommitted: " + (", ".join(block["dirty"][:8]) or "the code changed during the run")
        + "): no commit reproduces these figures; do not quote them")
    return (f"* Provenance: commit `{block['commit'][:12]}`, {state}; {m['cpus']} CPUs ({m['cpu']}), "
            f"torch {m['packages'].get('torch')}; load average (1, 5, 15 min) before "
            f"{block['load_before']}, after {block['load_after']}; {block['wall_s']} s; "
            f"command `{block['command']}`")
