"""The judge stage (issue 46): one tail, its passes in their declared order, each doing nothing
when the front-end's Context lacks its input."""
from __future__ import annotations

from tndebug import judge
from tndebug.findings import Finding


def _f(probe, severity, where="", code="", step=0, **ev):
    return Finding(probe, severity, f"{probe} at {where or 'run'}", where=where, step=step,
                   evidence=ev, code=code or f"{probe}/x")


def test_the_passes_are_declared_once_in_order():
    names = [n for n, _ in judge.PASSES]
    assert len(names) == len(set(names))
    assert names.index("scale-at-init") < names.index("gather") < names.index("wording") \
        < names.index("dedupe") < names.index("statuses") < names.index("nan-story") \
        < names.index("select")


def test_one_pass_dedupes_and_lists_the_checks_a_training_run_keeps_every_step():
    found = [_f("head-collapse", "warning", "a", step=0), _f("head-collapse", "warning", "a", step=3)]
    one = judge.conclude({}, found, {"head-collapse": {"status": "warn"}}, judge.Context(one_pass=True))
    assert len(one.findings) == 1 and one.probes["checkpoint"]["status"] == "pass"
    run = judge.conclude({}, found, {"head-collapse": {"status": "warn"}})
    assert len(run.findings) == 2 and "checkpoint" not in run.probes


def test_the_front_ends_checks_join_around_the_probes_and_notes_after_dedupe():
    probe = _f("mask-broadcast", "info", "", code="mask-broadcast/at-embedding")
    note = _f("mask-broadcast", "info", "", code="mask-broadcast/tndebug-masks")
    first, check = _f("checkpoint", "error", "w"), _f("head-collapse", "error", "h")
    r = judge.conclude({}, [probe], {}, judge.Context(one_pass=True, first=[first], checks=[check],
                                                      notes=[note]))
    assert [f.code for f in r.findings] == [first.code, probe.code, check.code, note.code]
    assert r.probes["checkpoint"]["status"] == "fail" and r.probes["head-collapse"]["status"] == "fail"


def test_a_part_not_run_and_a_sweep_that_decided_nothing_keep_the_verdict_from_clean():
    r = judge.conclude({}, [], {"missing-scale": {"status": "pass"}}, judge.Context(
        one_pass=True, sweep={"verdict": "skipped", "reason": "no data"},
        not_run=[("checkpoint", "grouped-query head order", "undecided")]))
    assert r.status("missing-scale") == "not run" and r.status("checkpoint") == "not run"
    assert r.verdict == "incomplete" and set(r.incomplete()) == {"missing-scale", "checkpoint"}


def test_a_probe_switched_off_is_no_verdict_and_a_tndebug_bug_stays_an_internal_error():
    statuses = {"a": {"status": "pass"}, "b": {"status": "internal error", "reason": "tndebug's own code"}}
    r = judge.conclude({}, [], statuses, judge.Context(failed={"a": "observe raised X", "b": "setup raised Y"},
                                                       skipped={"c": "not available"}))
    assert r.probes["a"] == {"status": "no verdict", "reason": "failed: observe raised X"}
    assert r.probes["b"]["status"] == "internal error" and r.probes["c"]["status"] == "skipped"


def test_the_sweep_is_named_by_the_judge_under_missing_scales_name():
    ev = {"verdict": "mismatch", "best_alpha": 2.83, "best_loss": 0.4, "loss_at_1": 1.2,
          "paired": {"share_better": 0.9, "n": 16}, "interval": [0.71, 1.41], "ln_V": 2.4,
          "significant": True}
    r = judge.conclude({}, [], {"missing-scale": {"status": "pass"}}, judge.Context(one_pass=True, sweep=ev))
    assert [f.code for f in r.findings] == ["missing-scale/sweep-mismatch"]
    assert r.status("missing-scale") == "fail" and r.verdict == "errors"
    quiet = judge.conclude({}, [], {}, judge.Context(sweep={**ev, "verdict": "matched"}))
    assert quiet.findings == []


def test_select_runs_last_and_the_first_sign_follows_it():
    found = [_f("nan-scores", "error", "x", code="nan-scores/nonfinite-forward", step=2),
             _f("loss-health", "warning", "", code="loss-health/loss-spike", step=1)]
    r = judge.conclude({}, found, {"nan-scores": {"status": "fail"}, "loss-health": {"status": "warn"}},
                       judge.Context(ignore=["loss-health"]))
    assert r.first_sign.code == "nan-scores/nonfinite-forward" and r.run["codes"]["dropped"] == 1
    assert r.probes["loss-health"]["status"] == "pass"
