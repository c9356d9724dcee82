"""Checkpoint hygiene checks, each with a clean case and a faulty one."""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes.missing_scale_sweep import sweep_findings
from tndebug.judge.status import sweep_not_run
from tndebug.probes.head_collapse_weights import duplicate_heads
from tndebug.report import Report
from tndebug.triage import hygiene
from tndebug.triage.loading import Checkpoint


def test_non_finite_weights_name_the_tensor():
    sd = {"a.weight": torch.ones(3, 3), "b.weight": torch.tensor([1.0, float("nan"), float("inf")]),
          "steps": torch.tensor(3)}
    (f,) = hygiene.non_finite(sd)
    assert (f.probe, f.severity, f.where) == ("checkpoint", "error", "b.weight")
    assert f.evidence == {"non_finite": 2, "nan": 1, "numel": 3,
                          "tensors": {"b.weight": {"non_finite": 2, "nan": 1, "numel": 3}}}
    (f,) = hygiene.non_finite({**sd, "c.weight": torch.full((2,), float("nan"))})   # one line
    assert f.where == "b.weight" and f.message.endswith("(+1 more tensors)")
    assert set(f.evidence["tensors"]) == {"b.weight", "c.weight"}
    assert hygiene.non_finite({"a": torch.ones(2)}) == []


@pytest.mark.parametrize("opt_state, step, missing", [
    ({"state": {0: {"step": 1}}, "param_groups": []}, 10, None),
    (None, 10, "optimizer state"),
    ({"state": {}, "param_groups": []}, 10, "optimizer moments"),
    ({"state": {0: {}}, "param_groups": []}, None, "step counter"),
])
def test_resume_state(opt_state, step, missing):
    ck = Checkpoint(Path("x.pt"), {}, "model", optimizer=opt_state, step=step)
    found = hygiene.resume_state(ck)
    if missing is None:
        assert found == []
    else:
        (f,) = found
        assert f.probe == "lr-schedule" and f.severity == "info" and missing in f.message
        assert "only matters if you resume training from this file" in f.message


def test_config_that_disagrees_with_the_weights():
    (f,) = hygiene.config_vs_weights({"d_model": 512, "n_layers": 2}, {"d_model": 32, "n_layers": 2},
                                     "config")
    assert f.where == "config.d_model" and f.evidence == {"config": 512, "weights": 32}
    assert hygiene.config_vs_weights({"d_model": 32}, {"d_model": 32}, "config") == []


def attn_weights(cfg):
    m = make_model(cfg)
    a = m.encoder.layers[0].self_attn
    return ("encoder.layers.0.self_attn", a.w_q.weight.detach(), a.w_k.weight.detach(),
            a.w_v.weight.detach(), cfg.n_heads)


def test_duplicate_heads_in_weights():
    assert duplicate_heads([attn_weights(ModelConfig.tiny())]) == []
    (f,) = duplicate_heads([attn_weights(ModelConfig.tiny().with_faults("identical_head_init"))])
    assert f.probe == "head-collapse" and f.severity == "error" and f.evidence["duplicated"] == 4
    (f,) = duplicate_heads([attn_weights(ModelConfig.tiny().with_faults("shared_qkv"))])
    assert f.evidence == {"shared": "qkv"}


def test_zero_query_and_key_weights_are_not_shared_or_duplicated():
    """W_Q = W_K = 0 (an attention that ended up attending uniformly): torch.equal holds and the
    heads agree, but from a zero weight, not from one projection or one draw (issue 19)."""
    where, wq, wk, wv, h = attn_weights(ModelConfig.tiny())
    assert duplicate_heads([(where, torch.zeros_like(wq), torch.zeros_like(wk), wv, h)]) == []
    (f,) = duplicate_heads([(where, wq, wq.clone(), wv, h)])     # the pair: equal, non-zero
    assert f.evidence == {"shared": "qk"}


def test_stored_pe_table():
    from tndebug.model.embedding import sinusoid_table
    assert hygiene.stored_pe(sinusoid_table(16, 8)[None], "src_embed.1.pe", 8) == []
    (f,) = hygiene.stored_pe(torch.zeros(1, 16, 8), "src_embed.1.pe", 8)
    assert f.probe == "positional-encoding" and f.evidence["all_zero"] and f.where == "src_embed.1"


class FakeModel:
    """Loss as a function of the score scale: lowest at alpha = `best` (a toy checkpoint)."""

    def __init__(self, best, solved=True):
        self.best, self.alpha, self.solved = best, 1.0, solved

    @contextmanager
    def scaled(self, alpha):
        self.alpha = alpha
        yield
        self.alpha = 1.0

    def forward(self, src, tgt):
        sharp = 6.0 * math.exp(-math.log(self.alpha / self.best) ** 2) if self.solved else 0.0
        return torch.nn.functional.one_hot(src, 11).float() * sharp     # [B, T, V]


class SplitModel(FakeModel):
    """7 of 16 sequences get much better with a larger alpha, 9 a little worse: the mean loss
    is lowest at alpha = 4, by 0.067 nats, but most sequences do not agree."""

    def forward(self, src, tgt):
        slope = torch.tensor([0.8] * 7 + [-0.3] * 9)[:, None, None]          # [B, 1, 1]
        sharp = 2.0 + slope * math.log(self.alpha)
        return torch.nn.functional.one_hot(src, 11).float() * sharp


def sweep(model, n=16, **kw):
    src = torch.randint(3, 11, (n, 6), generator=torch.Generator().manual_seed(1))
    ev = hygiene.temperature_sweep(model.forward, model.scaled, (src, src, src), 0, 11, **kw)
    return sweep_findings(ev), ev             # missing-scale names the sweep's outcome (its sweep file)


def test_temperature_sweep_matched_checkpoint():
    found, ev = sweep(FakeModel(1.0))
    assert found == [] and ev["verdict"] == "matched" and ev["best_alpha"] == 1.0


def test_temperature_sweep_checkpoint_trained_without_scale():
    (f,), ev = sweep(FakeModel(2 ** 1.5))          # sqrt(d_k) for d_k = 8
    assert (f.probe, f.severity) == ("missing-scale", "error")
    assert ev["best_alpha"] == pytest.approx(2 ** 1.5) and "without the 1/sqrt(d_k)" in f.message
    assert ev["significant"] and ev["paired"]["share_better"] == 1.0 and ev["paired"]["n"] == 16


def test_temperature_sweep_tiny_gap_is_never_an_error():
    # issue 10: a loss gap of 3e-6 at an argmin outside [0.71, 1.41] gave an error
    class Flat(FakeModel):
        def forward(self, src, tgt):
            sharp = 4.0 + 1e-5 * math.log(self.alpha)         # lowest at the largest alpha, by 3e-6 nats
            return torch.nn.functional.one_hot(src, 11).float() * sharp
    found, ev = sweep(Flat(1.0))
    assert ev["best_alpha"] == 8.0 and 0 < ev["gain_nats"] < 1e-4
    assert found == [] and ev["verdict"] == "not significant"


def test_temperature_sweep_noise_is_not_significant():
    found, ev = sweep(SplitModel(1.0))
    assert ev["best_alpha"] == 4.0 and ev["gain_nats"] > hygiene.MIN_GAIN_NATS
    assert ev["paired"]["share_better"] == 7 / 16
    assert found == [] and ev["verdict"] == "not significant"


def test_temperature_sweep_needs_enough_sequences():
    found, ev = sweep(FakeModel(2 ** 1.5), n=4)
    assert found == [] and ev["verdict"] == "not significant" and ev["paired"]["n"] == 4


def test_temperature_sweep_is_inconclusive_on_an_unsolved_task():
    """No finding: a part not run, recorded in missing-scale's status, and the verdict is not
    clean (issue 19)."""
    found, ev = sweep(FakeModel(1.0, solved=False))
    assert found == [] and ev["verdict"] == "inconclusive" and "--data" in ev["reason"]
    statuses = {"missing-scale": {"status": "pass"}}
    sweep_not_run(statuses, ev)
    assert statuses["missing-scale"]["not_run"] == {"temperature sweep": ev["reason"]}
    report = Report(run={}, probes=statuses)
    assert report.verdict == "incomplete" and report.exit_code() == 4
    sweep_not_run(only := {"nan-scores": {"status": "pass"}}, ev)   # missing-scale not run
    assert only == {"nan-scores": {"status": "pass"}}


def test_temperature_sweep_on_the_users_own_code_is_not_applicable():
    found, ev = sweep(FakeModel(1.0), own_code=True)
    assert found == [] and ev["verdict"] == "not applicable" and "by construction" in ev["reason"]
    (f,), ev = sweep(FakeModel(2 ** 1.5), own_code=True)     # strongly different: info only
    assert f.severity == "info" and ev["verdict"] == "not applicable"
    assert "not that a scale is missing" in f.message
    found, ev = sweep(FakeModel(1.0, solved=False), own_code=True)
    assert found == [] and ev["verdict"] == "not applicable"


def test_embedding_scale_from_the_weights():
    assert hygiene.embedding_scale(torch.randn(11, 64) / 8, 8.0, "src_embed") == []       # rho ~ 1.4
    (f,) = hygiene.embedding_scale(torch.randn(37000, 512) * 0.003, 1.0, "src_embed")    # no sqrt(d)
    assert f.probe == "positional-encoding" and f.evidence["rho"] < 0.05
    (f,) = hygiene.embedding_scale(torch.randn(11, 512), math.sqrt(512), "tgt_embed")     # N(0,1) x sqrt(d)
    assert f.evidence["rho"] > 20
