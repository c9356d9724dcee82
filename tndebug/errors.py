"""Errors that the CLI turns into one clear line and exit code 2."""


class UsageError(Exception):
    """Bad input or usage: a missing file, a bad flag, an unsafe or corrupt checkpoint."""
