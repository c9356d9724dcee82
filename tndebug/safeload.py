"""What is wrong with a file torch.load refused, told without running it: the globals a pickle
would import (read statically, never executed) and one line for a truncated, corrupt or foreign
file. Used by every reader of a checkpoint (triage/loading.py, train/checkpoint.py's --resume)."""
from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path


def unsafe_globals(p: Path) -> list[str]:
    """Globals the pickle would import, read statically; nothing is executed."""
    import torch                     # here: the CLI's cheap checks read this module before torch
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(p)))
    except Exception:  # noqa: BLE001 - legacy (non-zip) format: scan the pickle opcodes
        return _scan_legacy_globals(p)


def _scan_legacy_globals(p: Path) -> list[str]:
    found: list[str] = []
    strings: list[str] = []
    try:
        with open(p, "rb") as f:
            for _ in range(4):   # magic, protocol, sys_info, then the object
                for op, arg, _pos in pickletools.genops(f):
                    if op.name == "GLOBAL":
                        found.append(str(arg).replace(" ", "."))
                    elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                        strings.append(str(arg))
                    elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.append(f"{strings[-2]}.{strings[-1]}")
                    if op.name == "STOP":
                        break
    except Exception:  # noqa: BLE001 - best effort
        pass
    safe_prefixes = ("torch.", "collections.OrderedDict", "builtins.set", "_codecs.encode",
                     "numpy.core.multiarray._reconstruct")
    return sorted({g for g in found if not g.startswith(safe_prefixes)})


def damaged(p: Path) -> str | None:
    """One line when a zip checkpoint (torch.save's format) fails its CRC check: bit flips or a
    bad copy, which torch.load does not check and the probes would diagnose as a model bug (a
    checkpoint with 4 KB flipped was CLEAN). testzip reads every record once (about a second a
    GB); None when the file is no zip or its records all check out."""
    if not zipfile.is_zipfile(p):
        return None
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except Exception:  # noqa: BLE001 - a broken archive: torch.load says what is wrong with it
        return None
    if bad is None:
        return None
    return (f"{p} is damaged: its record {bad} fails the zip CRC check (bits changed after the "
            f"save, e.g. a bad disk or copy); nothing was diagnosed: copy or save it again")


def describe_load_error(p: Path, e: Exception) -> str:
    """One line saying what is wrong with a file torch.load refused (not an unsafe global)."""
    msg = _first_sentence(e)
    if isinstance(e, EOFError) and not str(e):
        msg = "the file ends before the pickle does"
    if "TorchScript" in msg:
        return (f"{p} is a TorchScript archive (torch.jit.save), which holds code; save the "
                f"weights with torch.save(model.state_dict(), ...) and triage that")
    if zipfile.is_zipfile(p) or "zip archive" in msg or "central directory" in msg:
        return (f"{p} is truncated or corrupt ({msg}); copy or save it again "
                f"(torch.save writes the whole file at the end)")
    return not_a_checkpoint(p) or f"{p} is truncated or corrupt ({msg}); copy or save it again"


def foreign_head(p: Path) -> str | None:
    """What `p` begins with ("the text 'a,b'", "the bytes 89 50 4e 47 ..."), when it is neither
    a zip archive (torch.save's format; TorchScript's too) nor a pickle (the legacy format: it
    begins with the PROTO opcode 0x80); None when it is one of them. Unpickling such bytes fails
    with whatever opcode they happen to spell (KeyError: 544502645, pop from empty list), which
    says nothing to the user; what the bytes are does. Reads 64 bytes, no torch."""
    with open(p, "rb") as f:
        head = f.read(64)
    if head[:1] == b"\x80" or head[:2] == b"PK":
        return None
    return _describe_head(head)


def not_a_checkpoint(p: Path) -> str | None:
    """The line for a file that is no torch.save file at all (foreign_head), else None."""
    head = foreign_head(p)
    if head is None:
        return None
    return (f"{p} is not a PyTorch checkpoint: neither a zip archive (torch.save) nor a pickle; "
            f"it begins with {head}; pass a file written by torch.save or a .safetensors file")


def _describe_head(head: bytes) -> str:
    text = head.split(b"\n", 1)[0][:40]
    try:
        shown = text.decode("utf-8")
    except UnicodeDecodeError:
        shown = ""
    if shown and shown.isprintable():
        return f"the text {shown!r}"
    return f"the bytes {head[:8].hex(' ')}"


def _first_sentence(e: Exception, limit: int = 160) -> str:
    """The first sentence of an exception's first line, cut at a word, never mid-word."""
    s = first_line(e)
    for stop in (". ", "; "):
        if stop in s:
            s = s.split(stop, 1)[0]
    s = s.rstrip(".")
    if len(s) > limit:
        s = s[:limit].rsplit(" ", 1)[0] + " ..."
    return s


def first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
