import math

import pytest
import torch
from torch import nn

from tndebug.data import EOS, get_task, eval_set
from tndebug.train import TrainConfig, model_config, run_training
from tndebug.train.evaluate import evaluate, greedy_decode

from _train_helpers import Spy, tiny_run


def test_probe_moments_in_order():
    spy = Spy()
    result = tiny_run(steps=3, probes=[spy])
    assert spy.calls == ["setup"] + ["observe", "update"] * 3 + ["finish"]
    assert spy.steps == [(0, 0), (1, 1), (2, 2)]                 # begin_step and end_step agree
    run = spy.run
    assert run.optimizer is result.optimizer and run.total_steps == 3
    assert run.lr_schedule(2) == pytest.approx(spy.lrs[2])
    assert run.compute_dtype == torch.float32 and run.device == "cpu"
    assert result.report.probes["spy"]["status"] == "pass"


def test_report_fields():
    r = tiny_run(steps=2).report.run
    for key in ("task", "preset", "norm", "faults", "seed", "steps", "device", "final_loss",
                "exact_match", "token_accuracy", "wall_s", "status", "stopped_at_step", "dtype",
                "tokens_per_s", "peak_gpu_mem_bytes"):
        assert key in r, key
    assert r["status"] == "completed" and r["stopped_at_step"] == 2 and r["preset"] == "tiny"
    assert r["peak_gpu_mem_bytes"] is None and r["tokens_per_s"] > 0
    assert 0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0


def test_nan_loss_stops_as_diverged_with_first_sign():
    def poison(run):
        with torch.no_grad():
            run.subject.model.generator.proj.bias.fill_(float("nan"))
    spy = Spy(on_setup=poison)
    report = tiny_run(steps=5, probes=[spy]).report
    assert report.run["status"] == "diverged" and report.run["stopped_at_step"] == 0
    assert math.isnan(report.history["loss"][0]) and len(report.history["loss"]) == 1
    assert report.first_sign is not None and report.first_sign.probe == "spy"
    assert spy.calls[-1] == "finish"


def test_ctrl_c_gives_interrupted_and_keeps_the_checkpoint(tmp_path):
    def interrupt(trace, info):
        if info.step == 2:
            raise KeyboardInterrupt
    report = tiny_run(steps=5, probes=[Spy(on_observe=interrupt)], out_dir=tmp_path).report
    assert report.run["status"] == "interrupted" and report.run["stopped_at_step"] == 2
    assert (tmp_path / "checkpoint.pt").is_file()


def test_a_run_interrupted_before_its_first_step_is_unchecked():
    """Issue 12: nothing trained, so the probes that need training have no verdict."""
    def interrupt(trace, info):
        raise KeyboardInterrupt
    from tndebug.probes.loss_health import LossHealthProbe
    report = tiny_run(steps=5, probes=[Spy(on_observe=interrupt), LossHealthProbe()],
                      evaluate_at_end=False).report
    assert report.run["status"] == "interrupted" and report.run["stopped_at_step"] == 0
    assert report.probes["loss-health"]["status"] == "no verdict"
    assert report.probes["loss-health"]["steps_observed"] == 0
    assert report.verdict == "unchecked"


def test_no_dropout_fault_sets_dropout_zero():
    assert model_config("copy", "tiny", faults=("no_dropout",)).dropout == 0.0
    assert model_config("copy", "tiny").dropout == 0.1


def test_vocab_mismatch_is_refused():
    with pytest.raises(ValueError, match="vocabularies"):
        run_training(model_config("copy", "tiny"), TrainConfig(task="translate", steps=1))


class _Oracle(nn.Module):
    """Encodes nothing; its decoder predicts the source token at the next position (a copier)."""

    def __init__(self, V, broken_at=None):
        super().__init__()
        self.V, self.broken_at = V, broken_at
        self.w = nn.Parameter(torch.zeros(1))

    def encode(self, src):
        return src

    def decode(self, memory, src, ys):
        t = ys.shape[1] - 1
        nxt = memory[:, t] if t < memory.shape[1] else torch.full_like(memory[:, 0], EOS)
        if self.broken_at is not None and t == self.broken_at:
            nxt = torch.where(nxt > 3, nxt - 1, nxt)
        return nn.functional.one_hot(nxt, self.V).float()[:, None].expand(-1, ys.shape[1], -1)


def test_greedy_decode_and_metrics():
    data = eval_set(get_task("copy"), 64, seed=1)
    pred = greedy_decode(_Oracle(11), data.src, data.tgt_out.shape[1])
    assert torch.equal(pred, data.tgt_out)                       # stops at EOS, pads after
    assert evaluate(_Oracle(11), data)["exact_match"] == 1.0
    scores = evaluate(_Oracle(11, broken_at=0), data)            # first token wrong when > 3
    wrong = (data.tgt_out[:, 0] > 3).float().mean().item()
    assert scores["exact_match"] == pytest.approx(1 - wrong)
    assert scores["token_accuracy"] < 1.0


@pytest.mark.slow
def test_default_run_learns_copy():
    """The default recipe (small preset, 400 steps) reaches >= 99% exact match (~15 s CPU)."""
    report = run_training(model_config("copy", "small"), TrainConfig(device="cpu")).report
    assert report.run["exact_match"] >= 0.99
