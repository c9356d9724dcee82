"""Stream growth judged apart from weights (issue 19): trained causal LMs grow their residual
stream past the envelope set at initialisation (bench/hf_unseen.py: 67-243x after 1000 steps,
healthy); triage re-runs variance-drift on a fresh initialisation of the code, and only growth
the code shows there stays a warning."""
from __future__ import annotations

from tndebug.driver import ProbeResult
from tndebug.findings import Finding
from tndebug.judge.fresh import growth_at_init


def growth(g: float, where: str = "model") -> Finding:
    return Finding("variance-drift", "warning",
                   f"residual stream RMS grows {g:.1f}x across the decoder (healthy pre-LN runs "
                   f"stay within 18x)", where=where, step=0, evidence={"growth": g},
                   code="variance-drift/stream-growth")


def fresh(found):
    calls = []

    def probe_fresh(names):
        calls.append(names)
        return ProbeResult(found, {}, {})
    return probe_fresh, calls


def test_growth_of_trained_weights_only_is_info():
    probe_fresh, calls = fresh([])
    statuses = {"variance-drift": {"status": "warn"}}
    (f,), st = growth_at_init([growth(212.8)], statuses, probe_fresh, "from_config")
    assert calls == [["variance-drift"]]
    assert f.severity == "info" and f.evidence["judged_on"] == "fresh init"
    assert f.message.startswith("in the trained weights") and "training grew it" in f.message
    assert st["variance-drift"]["status"] == "pass"


def test_growth_the_code_shows_at_init_stays_a_warning():
    probe_fresh, _ = fresh([growth(60.0)])
    statuses = {"variance-drift": {"status": "warn"}}
    (f,), st = growth_at_init([growth(212.8)], statuses, probe_fresh)
    assert f.severity == "warning" and f.evidence["init_growth"] == 60.0
    assert "the code grows it" in f.message and st["variance-drift"]["status"] == "warn"


def test_growth_elsewhere_at_init_does_not_count_and_no_growth_builds_nothing():
    probe_fresh, _ = fresh([growth(60.0, where="encoder")])
    (f,), _ = growth_at_init([growth(212.8, where="decoder")],
                             {"variance-drift": {"status": "warn"}}, probe_fresh)
    assert f.severity == "info"
    probe_fresh, calls = fresh([])
    other = Finding("nan-scores", "error", "x", step=0, code="nan-scores/nonfinite-forward")
    assert growth_at_init([other], {}, probe_fresh)[0] == [other] and calls == []
