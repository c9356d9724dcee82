"""Cheap checks of the user's paths, torch-free, so that a bad path is refused (one line, exit 2)
before torch is imported or a model is built: a checkpoint that is missing, empty or no regular
file (a FIFO would block the read, a device never ends), and a --text file that is not UTF-8.
triage's loaders call the same checks, so the library and the CLI say the same line."""
from __future__ import annotations

import importlib.util
import json
import stat
from pathlib import Path

from tndebug.errors import UsageError
from tndebug.safeload import foreign_head, not_a_checkpoint

CHECKPOINT_NAMES = ("checkpoint.pt", "model.safetensors", "model.pt", "pytorch_model.bin")


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def regular_file(p: Path, what: str) -> None:
    """`p` exists (checked by the caller) and is a regular file with bytes in it."""
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UsageError(f"{p} is {_kind(mode)}, not a regular file; pass {what}")
    if p.stat().st_size == 0:
        raise UsageError(f"{p} is empty (0 bytes); the save was probably interrupted")


def checkpoint_file(path: str | Path) -> Path | None:
    """The checkpoint file `path` names (a directory's checkpoint.pt, model.pt, ...), checked to
    exist, be a regular file and hold bytes; None for a directory holding none of those (a
    Hugging Face folder, or one that triage's loader refuses with its own line)."""
    p = Path(path)
    try:
        p.stat()
    except FileNotFoundError:
        pass                                 # said below, with the advice
    except OSError as e:                     # a name too long, a symlink loop, no permission
        raise UsageError(f"{path}: {e.strerror.lower() if e.strerror else e}; pass the path of a "
                         f"checkpoint written by torch.save or safetensors") from None
    if p.is_dir():
        for name in CHECKPOINT_NAMES:
            if (p / name).is_file():
                p = p / name
                break
        else:
            return None
    if not p.exists():
        raise UsageError(f"no such file: {path}; pass the path of a checkpoint written by "
                         f"torch.save or safetensors")
    regular_file(p, "the checkpoint file written by torch.save or safetensors")
    if p.suffix != ".safetensors" and (foreign := not_a_checkpoint(p)):
        raise UsageError(foreign)            # a PNG, a CSV: said from its first bytes, no torch
    return p


def text_file(spec: str, flag: str = "--text") -> str:
    """The UTF-8 text of `spec`; a missing, special or binary file is one line."""
    p = Path(spec)
    if not p.exists():
        raise UsageError(f"{flag}: no such file {spec}")
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UsageError(f"{flag} {spec}: is {_kind(mode)}, not a regular file; pass a UTF-8 text file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {spec}: not UTF-8 text (byte {e.start}: {data[e.start]:#04x}); "
                         f"pass a text file, one sequence (or source<TAB>target) per line") from None
    if "\x00" in text:
        raise UsageError(f"{flag} {spec}: a binary file (it holds NUL bytes); pass a text file, "
                         f"one sequence (or source<TAB>target) per line")
    return text


RUN_CHECKPOINT = "checkpoint.pt"


def run_checkpoint(path: str | Path) -> Path:
    """`run --resume PATH`: a run directory or its checkpoint.pt -> the file (train/checkpoint.py's
    `resolve`, here so that the CLI refuses a bad path before torch)."""
    p = Path(path)
    if p.is_dir():
        p = p / RUN_CHECKPOINT
    if not p.is_file():
        raise UsageError(f"no checkpoint at {path} (expected a run directory or a {RUN_CHECKPOINT})")
    if p.stat().st_size and (foreign := not_a_checkpoint(p)):
        raise UsageError(foreign)
    return p


def data_file(spec: str) -> None:
    """`--data FILE.pt` exists and is a regular file with bytes in it (FILE.py:FUNCTION: the
    file exists); the contents are read later, with torch."""
    path_s, sep, name = spec.rpartition(":")
    p = Path(path_s if sep and path_s.endswith(".py") and name else spec)
    if not p.exists():
        raise UsageError(f"--data: no such file {p}")
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UsageError(f"--data {p}: is {_kind(mode)}, not a regular file; pass a torch.save file "
                         f"{{'src', 'tgt'}} or {{'ids'}}, or FILE.py:FUNCTION")
    if p.stat().st_size == 0:
        raise UsageError(f"--data {p} is empty (0 bytes); the save was probably interrupted")
    if p.suffix != ".py" and (head := foreign_head(p)):
        raise UsageError(f"--data {p}: not a torch.save file: neither a zip archive nor a pickle; "
                         f"it begins with {head}; pass a torch.save file {{'src', 'tgt'}} or "
                         f"{{'ids'}}, or FILE.py:FUNCTION")


def config_json(text: str | None) -> dict | None:
    """--config: inline JSON or a JSON file -> the dict (capture/user_model.parse_config)."""
    if text is None:
        return None
    p = Path(text)
    if not text.lstrip().startswith("{") and p.suffix == ".json":
        if not p.is_file():
            raise UsageError(f"--config: no such file {text}")
        text = p.read_text()
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--config is not valid JSON ({e}); pass '{{\"d_model\": 512}}' or a .json "
                         f"file") from None
    if not isinstance(cfg, dict):
        raise UsageError("--config must be a JSON object of keyword arguments")
    return cfg


def hf_only(checkpoint: str, attn: str | None, text: str | None) -> None:
    """--attn and --text apply to a Hugging Face directory only (triage/hf_dir.py's is_hf_dir says
    which directories are; a file never is)."""
    if (attn or text) and not Path(checkpoint).is_dir():
        raise UsageError("--attn and --text apply to a Hugging Face directory (config.json + weights)")


def code_spec(spec: str, flag: str) -> Path:
    """`FILE.py:NAME` (--model, --adapter): the form, and a file there; its code runs later."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name:
        raise UsageError(f"{flag} {spec!r}: expected FILE.py:NAME")
    if not Path(path_s).is_file():
        raise UsageError(f"{flag}: no such file {path_s}")
    if importlib.util.spec_from_file_location("tndebug_user_check", path_s) is None:
        # import_file's own test (a CSV, a .txt: no loader for the suffix), before torch
        raise UsageError(f"{flag}: cannot import {path_s} (not a Python file?)")
    return Path(path_s)
