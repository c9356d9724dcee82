"""What tndebug wrote in an output directory: `.tndebug-manifest.json`, and nothing else decides.

    {"format": "tndebug.manifest/1", "written": ["checkpoint.pt", "figures/curves.png",
                                                  "report.json", "report.md", "tb/events..."]}

A directory "holds tndebug output" when its manifest lists files that are still there, or (a
directory from a version before the manifest) when it holds files that are recognisably
tndebug's: a report.json whose schema is `tndebug.report/...`, a checkpoint.pt whose pickle says
`tndebug.checkpoint/...`, and beside either of them the report.md, figures and tb/ events of that
run (report.md only when it starts with tndebug's heading, figures only those the report lists).
A bare report.md, a figures/ or tb/ of the user's are never tndebug's, and `--overwrite` removes
only what `ours` returns. A manifest entry counts only when it is a name tndebug writes
(`WRITES`) inside the directory: a hand-edited manifest cannot make tndebug delete data.csv.

Who records: `outputs.claim_output` compares the tndebug-named files before and after the command
(new or changed ones are its own) and adds them; TensorBoard's event file is recorded as soon as
it is opened (`record`), so a run killed before its report still has it listed.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import threading
import zipfile
from pathlib import Path

MANIFEST = ".tndebug-manifest.json"
FORMAT = "tndebug.manifest/1"
# every name tndebug writes in an output directory (figures: tndebug/reporters/plots*.py)
FIGURES = ("curves.png", "entropy.png", "head_similarity.png", "depth.png", "attention_*.png",
           "mask_*.png")
WRITES = ("report.json", "report.json.tmp", "report.md", "checkpoint.pt", "checkpoint.pt.tmp",
          "tb/events.out.tfevents.*") + tuple(f"figures/{f}" for f in FIGURES)
REPORTS = ("report.json", "report.json.tmp", "report.md") + tuple(f"figures/{f}" for f in FIGURES)
KEEPS = ("report.json", "checkpoint.pt")   # a command that wrote neither made nothing worth keeping
EMPTY_EVENTS = 128       # bytes: an event file this small holds only its header (88 bytes), no data
_SCHEMA = re.compile(rb'"schema"\s*:\s*"tndebug\.report/')

_tracked: dict[Path, set[str]] = {}       # resolved directory -> its manifest's entries
_lock = threading.Lock()


def tndebug_name(rel: str, names: tuple[str, ...] = WRITES) -> bool:
    """`rel` (a relative posix path) is a name tndebug writes (one of `names`)."""
    return any(rel.count("/") == p.count("/") and fnmatch.fnmatchcase(rel, p) for p in names)


def _inside(d: Path, rel: str) -> bool:
    try:
        return (d / rel).resolve().is_relative_to(d.resolve()) and ".." not in Path(rel).parts
    except (OSError, RuntimeError):
        return False


def read(d: Path) -> set[str]:
    """The manifest's entries that tndebug may own (names it writes, inside `d`); {} when none."""
    try:
        data = json.loads((Path(d) / MANIFEST).read_text())
        entries = data.get("written", []) if isinstance(data, dict) else []
    except (OSError, ValueError):
        return set()
    return {e for e in entries if isinstance(e, str) and tndebug_name(e) and _inside(Path(d), e)}


def write(d: Path, entries: set[str]) -> None:
    """The manifest listing `entries` (atomically); removed when there are none."""
    path = Path(d) / MANIFEST
    if not entries:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "written": sorted(entries)}, indent=1) + "\n")
    os.replace(tmp, path)


def candidates(d: Path) -> list[str]:
    """The files in `d` named as tndebug names its outputs (whoever wrote them)."""
    d = Path(d)
    if not d.is_dir():
        return []
    found = [n for n in WRITES if "/" not in n and (d / n).is_file()]
    for sub in ("figures", "tb"):
        if (d / sub).is_dir() and not (d / sub).is_symlink():
            found += [f"{sub}/{p.name}" for p in sorted((d / sub).iterdir())
                      if p.is_file() and tndebug_name(f"{sub}/{p.name}")]
    return found


def snapshot(d: Path) -> dict[str, tuple[int, int, int]]:
    """candidate -> (inode, size, mtime): a later snapshot tells what was written in between."""
    out = {}
    for rel in candidates(d):
        with contextlib.suppress(OSError):
            st = (Path(d) / rel).stat()
            out[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


# -- recognising a directory from before the manifest ----------------------------------------------
def _report_json(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return bool(_SCHEMA.search(f.read(4096)))
    except OSError:
        return False


def _checkpoint(p: Path) -> bool:
    """A zip written by torch.save whose pickle holds "tndebug.checkpoint/" (read, never run)."""
    try:
        with zipfile.ZipFile(p) as z:
            pkl = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
            return bool(pkl) and pkl[0].file_size < 1 << 24 and \
                b"tndebug.checkpoint/" in z.read(pkl[0])
    except (OSError, zipfile.BadZipFile, ValueError, RuntimeError):
        return False


def _listed_figures(p: Path) -> set[str]:
    try:
        figures = json.loads(p.read_text()).get("run", {}).get("figures", [])
        return {f["file"] for f in figures if isinstance(f, dict) and isinstance(f.get("file"), str)}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def legacy(d: Path) -> set[str]:
    """The files of `d` that are recognisably tndebug's without a manifest (see the docstring);
    an event file that holds no data (a run that failed at its start) counts: it loses nothing."""
    d = Path(d)
    have = candidates(d)
    ours = {n for n in have if n.startswith("report.json") and _report_json(d / n)}
    ours |= {n for n in have if n.startswith("checkpoint.pt") and _checkpoint(d / n)}
    events = [n for n in have if n.startswith("tb/")]
    ours |= {n for n in events if _size(d / n) <= EMPTY_EVENTS}
    if ours & set(KEEPS):
        ours |= set(events)
        if "report.md" in have and _starts(d / "report.md", b"# tndebug report"):
            ours.add("report.md")
        if "report.json" in ours:
            ours |= _listed_figures(d / "report.json") & set(have)
    return ours


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 1 << 62


def _starts(p: Path, head: bytes) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(len(head)) == head
    except OSError:
        return False


def ours(d: Path) -> set[str]:
    """What of `d` tndebug wrote and may remove: the manifest's files still there, and the
    recognisably tndebug files of a directory from before the manifest."""
    d = Path(d)
    if not d.is_dir():
        return set()
    return {e for e in read(d) if (d / e).is_file()} | legacy(d)


def foreign(d: Path, names: tuple[str, ...]) -> list[str]:
    """Files in `d` with a name tndebug would write (`names`) that tndebug did not write."""
    mine = ours(d)
    return [n for n in candidates(d) if n not in mine and tndebug_name(n, names)]


def remove(d: Path, entries) -> list[str]:
    """Delete `entries` (files only, inside `d`), then figures/ and tb/ when left empty; the
    manifest forgets them. Returns what was removed."""
    d = Path(d)
    removed = []
    for rel in sorted(entries):
        p = d / rel
        if tndebug_name(rel) and _inside(d, rel) and (p.is_file() or p.is_symlink()):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(rel)
    for sub in ("figures", "tb"):
        with contextlib.suppress(OSError):
            if any(r.startswith(sub + "/") for r in entries):
                (d / sub).rmdir()                 # only when empty
    with _lock:
        left = {e for e in read(d) if e not in entries and (d / e).is_file()}
        write(d, left)
        if d.resolve() in _tracked:
            _tracked[d.resolve()] = set(left)
    return removed


def add(d: Path, entries) -> None:
    """List `entries` in `d`'s manifest (with what it lists already)."""
    d = Path(d)
    with _lock:
        have = read(d) | _tracked.get(d.resolve(), set())
        new = have | {e for e in entries if tndebug_name(e)}
        if new != have or not (d / MANIFEST).exists() and new:
            write(d, new)
        if d.resolve() in _tracked:
            _tracked[d.resolve()] = new


def record(path: str | Path) -> None:
    """A file tndebug has just written: listed in the manifest of the tracked output directory
    it lies in (none: nothing to do)."""
    p = Path(path).resolve()
    for d in list(_tracked):
        if p.is_relative_to(d):
            add(d, [p.relative_to(d).as_posix()])
            return


@contextlib.contextmanager
def tracking(d: str | Path):
    """Inside, `record` lists files written under `d` in its manifest (nested: no-op)."""
    key = Path(d).resolve()
    if key in _tracked:
        yield
        return
    with _lock:
        _tracked[key] = read(key)
    try:
        yield
    finally:
        with _lock:
            _tracked.pop(key, None)
