"""Output places: where `run` and `triage` write, checked and locked before any work.

    with claim_output(args.out, default="runs/copy-small-pre", overwrite=False, kind="run") as out:
        ...                                    # out: a Path, locked for this process

The rule, the one TensorBoard and experiment-tracking users expect (a run is never silently
replaced, and one tb/ never holds two runs):

* `--out DIR` given: DIR must be a non-empty path, a directory or not there yet, not under a
  file, and writable. If DIR already holds tndebug output (what its `.tndebug-manifest.json`
  lists, or files recognisably tndebug's: tndebug/manifest.py), it is refused unless
  `--overwrite`, which removes exactly those files first (`run`: reports, figures, event files,
  checkpoint; `triage`: reports and figures only, never a checkpoint or tb/ it may be reading).
  A file of the user's where tndebug would write (their own report.md, or TensorBoard events
  in tb/) is refused with or without `--overwrite`: nothing of the user's is changed.
* no `--out`: the default name if it holds no tndebug output, else the first free of
  `NAME-2`, `NAME-3`, ... (a rerun of the same command never mixes with the last one).
* `run --resume DIR` continues the run in DIR: its own outputs are expected there.
* a directory in use is locked: `.tndebug.lock` holds the pid, created with O_EXCL. A lock
  whose process is gone is stale and taken over; a live one is refused.

Every refusal is a UsageError (one line, exit 2) raised before anything is trained or loaded.
A command that ends without writing a report or a checkpoint (it failed before its first step)
removes the files it made, so the next run into DIR is not refused for them.
`tndebug.watch(out=, overwrite=)` follows the same rule; its refusals name its keywords
(`names=LIBRARY`), and without `out=` it writes nothing.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from tndebug import manifest
from tndebug.errors import UsageError

LOCK = ".tndebug.lock"
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


SHOWN = ("report.json", "report.md", "checkpoint.pt", "checkpoint.pt.tmp", "tb/", "figures/")


def _shown(entries) -> list[str]:
    """Relative names as a refusal shows them: figures/ and tb/ once, report files first."""
    tops = {e.split("/")[0] + "/" if "/" in e else e for e in entries}
    first = [n for n in SHOWN if n in tops and n != "figures/"]
    return first or sorted(tops)


def tndebug_outputs(d: Path) -> list[str]:
    """The tndebug outputs already in `d` (tndebug/manifest.py decides), as shown: [] when none."""
    return _shown(manifest.ours(d))


def writes(kind: str) -> tuple[str, ...]:
    """The names a `kind` of command writes (triage: its tb/ is placed by reporters/oneshot.py)."""
    return manifest.WRITES if kind == "run" else manifest.REPORTS


def check_empty(out: str, names: "Naming") -> None:
    """An empty or blank --out would write into the current directory: refused."""
    if not str(out).strip():
        place = names.out.format(out) if names is not CLI else f"--out {out!r}"
        raise UsageError(f"{place}: an empty path; pass a directory path" + names.fresh)


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


def _taken(p: Path) -> bool:
    return bool(manifest.ours(p)) or bool(manifest.foreign(p, manifest.WRITES)) or _locked(p)


def numbered(base: Path, taken=_taken) -> Path:
    """`base` if free, else the first free of base-2, base-3, ..."""
    if not taken(base):
        return base
    for i in range(2, MAX_NUMBERED):
        cand = base.with_name(f"{base.name}-{i}")
        if not taken(cand):
            return cand
    raise UsageError(f"{base}-2 ... {base}-{MAX_NUMBERED - 1} are all taken; pass --out")


def clear_outputs(d: Path, kind: str) -> list[str]:
    """Remove what tndebug wrote in `d` (its manifest, or recognisably tndebug's files) that this
    `kind` of command writes; never a file of the user's."""
    return manifest.remove(d, {e for e in manifest.ours(d) if manifest.tndebug_name(e, writes(kind))})


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
    check_empty(out, names)
    d = Path(out)
    check_place(d, names=names)
    if continuing is not None and d.resolve() == Path(continuing).resolve():
        return d, False
    theirs = manifest.foreign(d, writes(kind))
    if theirs:
        shown = ", ".join(theirs[:4]) + (f" (+{len(theirs) - 4} more)" if len(theirs) > 4 else "")
        raise UsageError(f"{names.out.format(d)} holds {shown}, which tndebug did not write and "
                         f"would write over (nothing is removed); pass {names.another}{names.fresh}")
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
        with manifest.tracking(d):
            before, listed = manifest.snapshot(d), manifest.read(d)
            try:
                yield d
            finally:
                _settle(d, before, listed)
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):   # only when empty
                d.rmdir()


def _settle(d: Path, before: dict, listed: set[str]) -> None:
    """After the command: what it wrote (tndebug-named files new or changed since `before`, and
    what `manifest.record` listed) goes in the manifest; a command that wrote neither a report
    nor a checkpoint (it failed before its first step, or was refused) removes what it made."""
    after = manifest.snapshot(d)
    wrote = {n for n, key in after.items() if before.get(n) != key}
    wrote |= {n for n in manifest.read(d) - listed if n in after}
    if wrote & set(manifest.KEEPS):
        manifest.add(d, wrote)
    elif wrote:
        manifest.remove(d, {n for n in wrote if n not in before})


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
