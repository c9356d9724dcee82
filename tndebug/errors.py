"""Errors that the CLI turns into one clear line and exit code 2."""


class UsageError(Exception):
    """Bad input or usage: a missing file, a bad flag, an unsafe or corrupt checkpoint."""


class ProbeError(ValueError):
    """A probe is misdeclared (unknown tap, bad schedule), or an unknown probe name was asked for.
    Defined here, torch-free, so that the CLI refuses a bad --probe before importing torch
    (`tndebug.probes.base.ProbeError` is this class)."""


class SigTerm(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt, so that a run stops the same way
    (checkpoint, report, flushed events); the command then exits 143 (128 + SIGTERM)."""

    exit_code = 143
