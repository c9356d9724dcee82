"""tndebug as a library: `watch` (probes on your own training loop), `check` (triage's exact
checks on a live model), the framework callbacks (`tndebug.integrations`) and the pytest
plugin (`tndebug.pytest_plugin`). docs/library.md lists what is stable."""
from tndebug.library.check import CheckResult, check, format_findings
from tndebug.library.live import live_subject
from tndebug.library.watch import Watch, watch

__all__ = ["watch", "Watch", "check", "CheckResult", "format_findings", "live_subject"]
