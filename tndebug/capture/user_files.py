"""The user's own .py files (--model, --adapter FILE.py:NAME): imported once each, their
directory on sys.path while importing; every error one line.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tndebug.errors import UsageError
from tndebug.paths import code_spec


def load_callable(spec: str, flag: str):
    """'path/to/file.py:name' -> (the function, its module). Errors are one line."""
    path = code_spec(spec, flag)             # the form and the file (the CLI checks them first)
    path_s, _, name = spec.rpartition(":")
    module = import_file(path, flag)
    fn = getattr(module, name, None)
    if fn is not None and not callable(fn):
        raise UsageError(f"{flag}: {path_s} defines {name} = {_shown(fn)} (type "
                         f"{type(fn).__name__}), not a function; pass FILE.py:NAME of a function")
    if fn is None:
        have = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                and getattr(v, "__module__", None) == module.__name__]
        raise UsageError(f"{flag}: {path_s} defines no function {name!r} "
                         f"(it has: {', '.join(have[:8]) or 'none'})")
    return fn, module


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_imported: dict[str, object] = {}


def import_file(path: Path, flag: str = "--model"):
    """Import a user's .py file as a module (its directory goes on sys.path while importing)."""
    key = str(path.resolve())
    if key in _imported:
        return _imported[key]
    mod_name = f"tndebug_user_{abs(hash(key)) % 10**8}_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{flag}: cannot import {path} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        sys.modules.pop(mod_name, None)
        raise UsageError(f"{flag}: importing {path} raised {type(e).__name__}: {line(e)}") from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    _imported[key] = module
    return module


def line(e: Exception) -> str:
    """The first line of an exception's message (200 characters at most), or its type."""
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else type(e).__name__
