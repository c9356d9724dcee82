"""tndebug: an instrumented debugger for encoder-decoder Transformers."""
__version__ = "0.1.0"

# The library face (docs/library.md), imported on first use so that `import tndebug` (the CLI)
# does not import torch.
_LIBRARY = ("watch", "Watch", "check", "CheckResult", "format_findings")


def __getattr__(name):
    if name == "load_report":                 # report.json -> Report (frames: tndebug/frames.py)
        from tndebug.report import load_report
        return load_report
    if name in _LIBRARY:
        from tndebug import library
        return getattr(library, name)
    raise AttributeError(f"module 'tndebug' has no attribute {name!r}")


__all__ = ["__version__", *_LIBRARY, "load_report"]
