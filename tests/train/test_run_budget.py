"""`tndebug run`'s probe budget (TrainConfig.probe_budget, --probe-budget): the scheduled looks
it defers, what it never defers, and what the report says about it."""
from __future__ import annotations

import pytest

from tndebug.cli import main
from tndebug.train import TrainConfig, model_config, run_training


def _run(budget, faults=(), steps=40):
    cfg = model_config("copy", "tiny", "pre", faults=faults)
    res = run_training(cfg, TrainConfig(steps=steps, probe_budget=budget), probes="all",
                       evaluate_at_end=False)
    res.report.observed = {p.name: p.observed_steps for p in res.engine.probes}
    return res.report


def _codes(report):
    return sorted({(f.probe, f.code, f.severity) for f in report.findings})


def test_a_zero_budget_defers_every_costly_look_but_the_guaranteed_ones():
    """Budget 0: once the step time is known every look that captures is over it, so only the
    first look of each probe, the capture-less probes and nan-scores (budget_exempt) remain."""
    full, thin = _run(None), _run(0.0)
    assert full.run["probe_budget"] is None
    budget = thin.run["probe_budget"]
    assert budget["fraction"] == 0.0 and budget["thinned"] and "deferred" in budget["note"]
    assert "nan-scores" not in budget["thinned"]                   # its first sight of a NaN
    assert "loss-health" not in budget["thinned"] and "lr-schedule" not in budget["thinned"]
    for name, skipped in budget["thinned"].items():
        seen_full, seen_thin = full.observed[name], thin.observed[name]
        assert seen_thin >= 1 and seen_thin + skipped == seen_full, (name, seen_thin, seen_full)
    assert thin.observed["nan-scores"] == full.observed["nan-scores"] > 1


def test_a_probe_that_applies_nowhere_is_not_counted_as_deferred():
    """lm-decoding is not applicable to an encoder-decoder: the budget deferred none of its
    looks (by 120 steps a zero budget defers every costly look that applies)."""
    thinned = _run(0.0, steps=120).run["probe_budget"]["thinned"]
    assert "gradient-flow" in thinned and "lm-decoding" not in thinned


@pytest.mark.parametrize("fault", ["no_scale", "mask_after_softmax"])
def test_the_budget_loses_no_finding(fault):
    assert _codes(_run(0.0, (fault,))) == _codes(_run(None, (fault,)))


def test_the_budget_is_a_share_or_none():
    assert TrainConfig().probe_budget is None                    # tndebug run passes 0.03
    for bad in (-0.1, 1.5, "3%"):
        with pytest.raises(ValueError, match="probe_budget"):
            TrainConfig(probe_budget=bad)


@pytest.mark.parametrize("flag, message", [("-1", "between 0 and 1"), ("lots", "invalid float")])
def test_a_bad_probe_budget_flag_is_one_line(flag, message, tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "x"), "--probe-budget", flag]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_flag_reaches_the_run(tmp_path, capsys):
    import json
    out = tmp_path / "r"
    main(["run", "--preset", "tiny", "--steps", "3", "--probe-budget", "5%", "--out", str(out)])
    assert json.loads((out / "report.json").read_text())["run"]["probe_budget"]["fraction"] == 0.05
    out3 = tmp_path / "r3"                                        # no flag: 3%, as watch's
    main(["run", "--preset", "tiny", "--steps", "3", "--out", str(out3)])
    assert json.loads((out3 / "report.json").read_text())["run"]["probe_budget"]["fraction"] == 0.03
    out2 = tmp_path / "r2"
    main(["run", "--preset", "tiny", "--steps", "3", "--probe-budget", "none", "--out", str(out2)])
    assert json.loads((out2 / "report.json").read_text())["run"].get("probe_budget") is None
