"""x-transformers' TransformerWrapper(Decoder), trained on copy as a language model and triaged as
a user would (tests/foreign/xgpt_corpus.py): healthy variants clean with every probe that applies
checked, every bug named by its probe with no error from another. Held out: no threshold was set
on this package's decoder-only models."""
from __future__ import annotations

import pytest

pytest.importorskip("x_transformers")

from nanogpt_corpus import describe, flagged            # noqa: E402
from xgpt_corpus import BUG_CASES, EXPECTED_PROBE, make_checkpoint, run_triage   # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
_cache: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("xgpt")


def checkpoint(folder, variant, bug, seed=0):
    key = (variant, bug, seed)
    if key not in _cache:
        _cache[key] = make_checkpoint(variant, bug, seed, folder)
    return _cache[key]


def _no_verdict(report) -> dict:
    return {n: st.get("reason") for n, st in report.probes.items() if st.get("status") == "no verdict"}


@pytest.mark.parametrize("variant", ["abs", "rotary", "flash"])
def test_healthy_transformer_wrapper_triages_clean(folder, variant):
    report = run_triage(checkpoint(folder, variant, None))
    bad = flagged(report)
    assert not bad, f"{variant}: false alarms\n{describe(bad)}"
    assert report.verdict == "clean", (report.verdict, _no_verdict(report))
    assert report.run["arch"] == "decoder"
    for probe in ("mask-broadcast", "missing-scale", "label-shift", "head-collapse"):
        assert report.probes[probe]["status"] == "pass", (probe, report.probes[probe])


@pytest.mark.parametrize("variant, bug", [pytest.param(v, b, id=f"{v}-{b}") for v, b in BUG_CASES])
def test_bug_is_named_by_its_probe(folder, variant, bug):
    report = run_triage(checkpoint(folder, variant, bug))
    probe = EXPECTED_PROBE[bug]
    bad = flagged(report)
    assert any(f.probe == probe for f in bad), \
        f"{variant} {bug}: {probe} reports nothing at warning or error\n{describe(report.findings)}"
    collateral = [f for f in bad if f.severity == "error" and f.probe != probe]
    assert not collateral, f"{variant} {bug}: errors from other probes\n{describe(collateral)}"
