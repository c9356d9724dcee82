"""Errors that the CLI turns into one clear line and exit code 2."""


class UsageError(Exception):
    """Bad input or usage: a missing file, a bad flag, an unsafe or corrupt checkpoint."""


class SigTerm(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt, so that a run stops the same way
    (checkpoint, report, flushed events); the command then exits 143 (128 + SIGTERM)."""

    exit_code = 143
