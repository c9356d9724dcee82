"""Coverage (tndebug/probes/base.py, engine.py): "pass" only where something was checked."""
from contextlib import contextmanager

import pytest
from torch import nn

from _misc_helpers import HandSeq2Seq, hand_subject, probed_loop, setup_only
from tndebug.config import ModelConfig
from tndebug.findings import Finding
from tndebug.inject import make_model
from tndebug.probes.base import NO_STEP, Probe, ProbeError, RunContext, StepInfo
from tndebug.probes.engine import ProbeEngine
from tndebug.probes.gradient_flow import GradientFlowProbe
from tndebug.probes.loss_health import LossHealthProbe
from tndebug.probes.schedule import every, never
from tndebug.subject import tndebug_subject

SITES = ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.cross_attn")


class Planned(Probe):
    """Covers what it is told at setup: (where, "skip" | a coverage status)."""
    name = "stand-in-coverage"
    reads = ()

    def __init__(self, plan, schedule=None) -> None:
        super().__init__(schedule or never())
        self.plan = plan

    def setup(self, run):
        for where, how in self.plan:
            if how == "skip":
                self.skip(f"no scores captured in {where}", where=where)
            else:
                self.cover(where, how, f"{how} at {where}" if how != "checked" else "")


class NothingCapture:
    """A capture that recognises nothing in the model (no FFN, no attention)."""

    @contextmanager
    def recording(self, reads, trace):
        yield trace


def _tiny_run(mode="train") -> RunContext:
    return RunContext(subject=tndebug_subject(make_model(ModelConfig.tiny())), mode=mode)


def _statuses(probes, mode="train", steps=0):
    with ProbeEngine(probes, _tiny_run(mode)) as engine:
        engine.setup()
        for step in range(steps):
            engine.begin_step(step)
            engine.end_step(StepInfo(step))
        engine.finish()
        return engine.statuses()


def test_a_probe_that_skips_every_module_has_no_verdict():
    st = _statuses([Planned([(s, "skip") for s in SITES])])["stand-in-coverage"]
    assert st["status"] == "no verdict"
    assert st["reason"] == f"no scores captured in {SITES[0]}"
    assert set(st["coverage"]) == set(SITES)
    assert all(c["status"] == "no verdict" and c["reason"] for c in st["coverage"].values())


def test_partial_coverage_passes_and_lists_the_undecided_module():
    probe = Planned([(SITES[0], "checked"), (SITES[1], "skip"), (SITES[2], "checked")])
    st = _statuses([probe])["stand-in-coverage"]
    assert st["status"] == "pass" and "reason" not in st
    assert st["coverage"][SITES[1]] == {"status": "no verdict",
                                        "reason": f"no scores captured in {SITES[1]}"}
    assert st["coverage"][SITES[0]] == {"status": "checked"}
    assert probe.checked                      # the legacy flag follows the coverage


def test_a_later_cover_only_upgrades():
    probe = Planned([])
    probe.cover("m", "not applicable", "no mask here")
    probe.cover("m", "no verdict", "could not tell")
    probe.cover("m", "not applicable", "ignored")
    assert probe.coverage["m"] == {"status": "no verdict", "reason": "could not tell"}
    probe.cover("m", "checked")
    probe.skip("too late", where="m")
    assert probe.coverage["m"] == {"status": "checked"} and probe.status() == "pass"
    with pytest.raises(ProbeError, match="'done'"):
        probe.cover("m", "done")


def test_not_applicable_everywhere_or_never_run_is_skipped():
    st = _statuses([Planned([(s, "not applicable") for s in SITES]), Planned([])])
    assert st["stand-in-coverage"]["status"] == "skipped"       # both share the name: the last wins
    one = Planned([(s, "not applicable") for s in SITES])
    one.setup(None)
    assert one.status() == "skipped" and one.reason() == f"not applicable at {SITES[0]}"
    assert Planned([]).status() == "skipped"


def test_an_observed_step_is_not_a_check():
    """The engine counts observed steps; only the probe says what it examined."""
    probe = Planned([], schedule=every(1))
    st = _statuses([probe], steps=3)["stand-in-coverage"]
    assert probe.observed_steps == 3 and not probe.checked
    assert st["status"] == "no verdict" and "reported nothing it checked" in st["reason"]


def test_a_training_probe_that_observed_no_step_has_no_verdict():
    probe = LossHealthProbe()
    st = _statuses([probe], mode="train", steps=0)["loss-health"]
    assert st == {"status": "no verdict", "reason": NO_STEP, "steps_observed": 0}
    # a probe whose setup checked something is still no verdict when it needed steps
    grad = GradientFlowProbe()
    st = _statuses([grad], mode="train", steps=0)["gradient-flow"]
    assert grad.checked and st["status"] == "no verdict" and st["steps_observed"] == 0
    assert any(c["status"] == "checked" for c in st["coverage"].values())     # the FFNs at init
    # outside training the rule does not apply (triage observes one step of its own)
    assert "steps_observed" not in _statuses([LossHealthProbe()], mode="triage")["loss-health"]


def test_statuses_follow_the_findings_given_under_ddp():
    """Rank 0's probe saw nothing; another rank's finding, gathered, decides the status."""
    probe = Planned([(SITES[0], "checked")])
    with ProbeEngine([probe], _tiny_run()) as engine:
        engine.setup()
        engine.finish()
        theirs = [Finding("stand-in-coverage", "warning", "seen on rank 1", where=SITES[0], rank=1)]
        assert engine.statuses()["stand-in-coverage"]["status"] == "pass"
        assert engine.statuses(theirs)["stand-in-coverage"]["status"] == "warn"


def test_a_crashing_probe_has_no_verdict_with_the_exception():
    class Crash(Planned):
        def setup(self, run):
            raise RuntimeError("boom")
    st = _statuses([Crash([])])["stand-in-coverage"]
    assert st["status"] == "no verdict" and "RuntimeError: boom" in st["reason"]


def test_gradient_flow_says_no_verdict_for_an_ffn_it_cannot_find():
    """No capture of FFN activations (issue 10: T5's FFN was not found): the gradients are
    checked per layer group, the dead-unit test has no verdict, with the reason."""
    model = HandSeq2Seq(lambda v, d: nn.Embedding(v, d))
    probe = GradientFlowProbe(every(1))
    probed_loop(hand_subject(model, NothingCapture()), [probe], steps=3)
    assert probe.status() == "pass"
    run = probe.coverage[""]
    assert run["status"] == "no verdict" and "FFN" in run["reason"], run
    assert probe.coverage["encoder.layers.0"] == {"status": "checked"}


def test_setup_only_probes_report_what_they_examined():
    subject = tndebug_subject(make_model(ModelConfig.tiny()))
    from tndebug.probes import make_probes
    probes = make_probes(["mask-broadcast", "head-collapse", "variance-drift", "ln-placement",
                          "positional-encoding", "nan-scores"])
    setup_only(subject, probes, mode="triage")
    by = {p.name: p for p in probes}
    attn = {"encoder.layers.0.self_attn", "decoder.layers.1.cross_attn"}
    assert attn <= {w for w, c in by["mask-broadcast"].coverage.items() if c["status"] == "checked"}
    assert attn <= {w for w, c in by["head-collapse"].coverage.items() if c["status"] == "checked"}
    assert by["variance-drift"].coverage == {"encoder": {"status": "checked"},
                                             "decoder": {"status": "checked"}}
    assert by["positional-encoding"].coverage["src_embed"] == {"status": "checked"}
    assert by["nan-scores"].coverage == {"": {"status": "checked"}}
    assert all(p.status() == "pass" for p in probes), {p.name: p.status() for p in probes}
