"""Output places: where `run` and `triage` write, checked and locked before any work.

    with claim_output(args.out, default="runs/copy-small-pre", overwrite=False, kind="run") as out:
        ...                                    # out: a Path, locked for this process

The rule, the one TensorBoard and experiment-tracking users expect (a run is never silently
replaced, and one tb/ never holds two runs):

* `--out DIR` given: DIR must be a directory or not exist yet, must not lie under a file, and
  must be writable. If DIR already holds tndebug output (report.json, report.md, checkpoint.pt
  or TensorBoard event files in tb/), it is refused unless `--overwrite`; with `--overwrite`
  the old outputs are removed first (`run`: reports, figures, event files, checkpoint;
  `triage`: reports and figures only, never a checkpoint or tb/ it may be reading).
* no `--out`: the default name if it holds no tndebug output, else the first free of
  `NAME-2`, `NAME-3`, ... (a rerun of the same command never mixes with the last one).
* `run --resume DIR` continues the run in DIR: its own outputs are expected there.
* a directory in use is locked: `.tndebug.lock` holds the pid, created with O_EXCL. A lock
  whose process is gone is stale and taken over; a live one is refused.

Every refusal is a UsageError (one line, exit 2) raised before anything is trained or loaded.
`tndebug.watch(out=, overwrite=)` follows the same rule; its refusals name its keywords
(`names=LIBRARY`), and without `out=` it writes nothing.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tndebug.errors import UsageError

LOCK = ".tndebug.lock"
REPORT_FILES = ("report.json", "report.md")
RUN_FILES = REPORT_FILES + ("checkpoint.pt", "checkpoint.pt.tmp")
MAX_NUMBERED = 1000


@dataclass(frozen=True)
class Naming:
    """How a refusal names the place and the way out: the CLI's flags or the library's keywords."""
    out: str = "--out {}"
    overwrite: str = "--overwrite"
    another: str = "another --out"
    fresh: str = " (without --out a fresh numbered directory is used)"


CLI = Naming()
LIBRARY = Naming(out="out='{}'", overwrite="overwrite=True", another="another out=", fresh="")


def tndebug_outputs(d: Path) -> list[str]:
    """The tndebug outputs already in `d` (relative names), [] when none or no directory."""
    if not d.is_dir():
        return []
    found = [n for n in RUN_FILES if (d / n).is_file()]
    if any((d / "tb").glob("events.out.tfevents.*")):
        found.append("tb/")
    return found


def check_place(d: Path, flag: str = "--out", names: Naming = CLI) -> None:
    """`d` can be a directory we write: not a file, not under a file, writable."""
    place = names.out.format(d) if flag == "--out" else f"{flag} {d}"
    if d.exists() and not d.is_dir():
        raise UsageError(f"{place}: is a file, not a directory; pass a directory path")
    parent = d
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent != d and not parent.is_dir():
        raise UsageError(f"{place}: {parent} is a file, so no directory can be made under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{place}: {parent} is not writable; pass a directory you can write")


def numbered(base: Path, taken=lambda p: bool(tndebug_outputs(p)) or _locked(p)) -> Path:
    """`base` if free, else the first free of base-2, base-3, ..."""
    if not taken(base):
        return base
    for i in range(2, MAX_NUMBERED):
        cand = base.with_name(f"{base.name}-{i}")
        if not taken(cand):
            return cand
    raise UsageError(f"{base}-2 ... {base}-{MAX_NUMBERED - 1} are all taken; pass --out")


def clear_outputs(d: Path, kind: str) -> list[str]:
    """Remove the previous tndebug outputs of `d` that this `kind` of command writes."""
    removed = []
    names = RUN_FILES if kind == "run" else REPORT_FILES
    for n in names:
        if (d / n).is_file():
            (d / n).unlink()
            removed.append(n)
    figures = d / "figures"
    if figures.is_dir():
        for f in figures.glob("*.png"):
            f.unlink()
            removed.append(f"figures/{f.name}")
    if kind == "run":
        for f in (d / "tb").glob("events.out.tfevents.*"):
            f.unlink()
            removed.append(f"tb/{f.name}")
    return removed


# -- the lock ----------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # someone else's live process
        return True
    return True


def _read_lock(path: Path) -> tuple[int | None, str]:
    try:
        text = path.read_text()
    except OSError:
        return None, ""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        return int(fields.get("pid", "")), fields.get("host", "")
    except ValueError:
        return None, fields.get("host", "")


def _locked(d: Path) -> bool:
    """`d` has a lock held by a live process of this host."""
    pid, host = _read_lock(d / LOCK)
    return pid is not None and (host not in ("", socket.gethostname()) or _pid_alive(pid))


def held_here(d: Path) -> bool:
    """`d` is locked by this very process (a claim still open in it, e.g. another watch)."""
    pid, host = _read_lock(Path(d) / LOCK)
    return pid == os.getpid() and host in ("", socket.gethostname())


class OutputLock:
    """`.tndebug.lock` in a directory: O_EXCL create, our pid inside; stale locks taken over."""

    def __init__(self, d: Path, names: Naming = CLI) -> None:
        self.path = d / LOCK
        self.held = False
        self.names = names

    def acquire(self) -> None:
        body = f"pid={os.getpid()}\nhost={socket.gethostname()}\n"
        for _attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid, host = _read_lock(self.path)
                if pid == os.getpid():
                    return                        # already ours (a nested claim)
                if pid is not None and (host not in ("", socket.gethostname()) or _pid_alive(pid)):
                    where = f" on {host}" if host and host != socket.gethostname() else ""
                    raise UsageError(f"{self.path.parent} is in use by another tndebug (pid {pid}"
                                     f"{where}); wait for it, or pass {self.names.another} (if no "
                                     f"tndebug runs there, remove {self.path})") from None
                with contextlib.suppress(FileNotFoundError):   # stale: its process is gone
                    self.path.unlink()
                continue
            except OSError as e:
                raise UsageError(f"{self.names.out.format(self.path.parent)}: cannot write there "
                                 f"({e.strerror}); pass a directory you can write") from None
            with os.fdopen(fd, "w") as f:
                f.write(body)
            self.held = True
            return
        raise UsageError(f"{self.path.parent} is being claimed by another tndebug; try again")

    def release(self) -> None:
        if self.held:
            pid, _ = _read_lock(self.path)
            if pid == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self.held = False


# -- the one entry point -----------------------------------------------------------------------
def resolve_output(out: str | None, default: str, *, overwrite: bool, kind: str,
                   continuing: str | Path | None = None, names: Naming = CLI) -> tuple[Path, bool]:
    """The directory to write, by the rule above, and whether its old outputs are to be
    cleared. Nothing is created or removed here."""
    if out is None:
        if continuing is not None:
            d = Path(continuing)
            check_place(d, "--resume")
            return d, False
        d = Path(default)
        check_place(d)
        return numbered(d), False
    d = Path(out)
    check_place(d, names=names)
    if continuing is not None and d.resolve() == Path(continuing).resolve():
        return d, False
    found = tndebug_outputs(d)
    if found and not overwrite:
        shown = ", ".join(found[:4])
        raise UsageError(f"{names.out.format(d)} already holds tndebug output ({shown}); pass "
                         f"{names.overwrite} to replace it, or {names.another}{names.fresh}")
    return d, bool(found)


@contextlib.contextmanager
def claim_output(out: str | None, default: str, *, overwrite: bool, kind: str,
                 continuing: str | Path | None = None, names: Naming = CLI):
    """Resolve, create, lock and (with --overwrite) clear the output directory; yields it.

    On exit the lock is released; a directory this call created and nothing was written into
    is removed again, so a refused or failed command leaves nothing behind."""
    numbering = out is None and continuing is None
    for attempt in range(5):
        d, clear = resolve_output(out, default, overwrite=overwrite, kind=kind, continuing=continuing,
                                  names=names)
        created = not d.exists()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{names.out.format(d)}: cannot create it ({e.strerror}); pass a "
                             f"directory you can write") from None
        lock = OutputLock(d, names)
        try:
            lock.acquire()
            break
        except UsageError:
            if created:
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not numbering or attempt == 4:
                raise
            # another tndebug took this default name between our look and our lock: number on
    try:
        if clear:
            clear_outputs(d, kind)
        yield d
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):   # only when empty
                d.rmdir()


def triage_default(checkpoint: str | Path) -> str:
    """`triage-<parent>-<stem>` in the current directory (`triage-<stem>` for a file here,
    `triage-<name>` for a directory), so `a/checkpoint.pt` and `b/checkpoint.pt` differ;
    `resolve_output` numbers it when it is taken."""
    p = Path(checkpoint)
    if p.is_dir():
        return f"triage-{p.resolve().name or 'checkpoint'}"
    parent = p.resolve().parent
    if parent == Path.cwd().resolve() or not parent.name:
        return f"triage-{p.stem}"
    return f"triage-{parent.name}-{p.stem}"
