"""The engine's first_sign is the earliest warning or error by step, even when a probe that saw
an earlier step reports later; and the final training step is snapshotted for the reporters."""
from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.probes.base import Probe
from tndebug.probes.schedule import every


class Early(Probe):
    """A warning about step 6, reported at step 6 (like ln-placement's horizon check)."""
    name = "early-reporter"
    summary = "test"
    reads = ()

    def __init__(self):
        super().__init__(every(1))

    def update(self, stats, info):
        if info.step == 6:
            self.report("warning", "seen at step 6", step=6)


class Late(Probe):
    """An error about step 2, decided only at step 8 (like a loss that exploded earlier)."""
    name = "late-reporter"
    summary = "test"
    reads = ()

    def __init__(self):
        super().__init__(every(1))

    def update(self, stats, info):
        if info.step == 8:
            self.report("error", "it began at step 2", step=2)


def test_first_sign_is_revisited_when_an_earlier_step_arrives_later():
    engine, findings, _ = train_with_probes(ModelConfig.tiny(), [Early(), Late()], steps=10, batch=4)
    assert {f.step for f in findings} == {2, 6}
    assert engine.first_sign.probe == "late-reporter" and engine.first_sign.step == 2


class TraceSink:
    def __init__(self):
        self.steps = []

    def on_trace(self, step, trace):
        self.steps.append((step, bool(trace.records()), bool(trace.streams)))


def test_final_step_is_snapshotted_for_sinks_without_probes_observing_it():
    sink, probe = TraceSink(), Early()
    probe.schedule = every(4)
    train_with_probes(ModelConfig.tiny(), [probe], steps=10, batch=4, sinks=[sink])
    assert [s for s, *_ in sink.steps] == [0, 4, 8, 9]
    assert sink.steps[-1][1:] == (True, True)          # attention and the stream at step 9
    assert probe.observed_steps == 3                    # the snapshot is the reporters' only
