"""tndebug's pytest plugin (entry point `pytest11: tndebug`): triage's exact checks in your tests.

    def test_my_transformer(tndebug_check):
        tndebug_check(make_model(), forward).assert_clean()

    @pytest.mark.tndebug(probes="mask-broadcast,missing-scale", fail_on="error")
    def test_masks(tndebug_check):
        tndebug_check(make_model(), forward).assert_clean()

`tndebug_check(model, forward=None, data=None, **kw)` runs `tndebug.check` and returns a
`CheckResult`: `.report`, `.findings`, `.assert_clean(severity=None, probes=None)` (an
AssertionError listing each finding at or above the severity: probe, module, message,
evidence, fix) and `.assert_finding(probe, severity)`.

Options: `--tndebug-fail-on=info|warning|error` (default warning: what `assert_clean` fails
on) and `--tndebug-probes=a,b` (default: every probe that needs no training run). The mark's
`probes=` and `fail_on=` win over the options. Importing this module imports no torch.
"""
from __future__ import annotations

import pytest

SEVERITIES = ("info", "warning", "error")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("tndebug", "tndebug: checks for encoder-decoder Transformers")
    group.addoption("--tndebug-fail-on", default=None, choices=SEVERITIES,
                    help="severity at which CheckResult.assert_clean() fails (default: warning)")
    group.addoption("--tndebug-probes", default=None,
                    help="probes tndebug_check runs, 'a,b' (default: every triage probe)")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "tndebug(probes=None, fail_on=None): the probes tndebug_check runs in this "
                   "test and the severity assert_clean() fails on")


@pytest.fixture
def tndebug_check(request):
    """A callable `(model, forward=None, data=None, **check_kwargs) -> CheckResult`."""
    from tndebug.library.check import CheckResult, check
    mark = request.node.get_closest_marker("tndebug")
    opts = dict(mark.kwargs) if mark is not None else {}
    unknown = set(opts) - {"probes", "fail_on"}
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.tndebug: unknown argument(s) {sorted(unknown)}; "
                                f"use probes= and fail_on=")
    fail_on = opts.get("fail_on") or request.config.getoption("--tndebug-fail-on") or "warning"
    if fail_on not in SEVERITIES:
        raise pytest.UsageError(f"@pytest.mark.tndebug(fail_on={fail_on!r}): one of {', '.join(SEVERITIES)}")
    probes = opts.get("probes") or request.config.getoption("--tndebug-probes")

    def run(model, forward=None, data=None, **kwargs) -> CheckResult:
        kwargs.setdefault("probes", probes)
        return CheckResult(check(model, forward, data, **kwargs), fail_on=fail_on)
    return run
