"""Values no training produces are a damaged file, named before any model bug (issue 47): a bias
whose exponent bits flipped (6e37), or negative values in Adam's exp_avg_sq."""
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.triage import TriageOptions, triage
from tndebug.triage.hygiene import implausible


def _saved(tmp_path, edit=None, optimizer=None):
    torch.manual_seed(0)
    sd = make_model(ModelConfig.tiny()).state_dict()
    if edit:
        edit(sd)
    obj = {"model": sd, **({"optimizer": optimizer} if optimizer else {})}
    torch.save(obj, tmp_path / "model.pt")
    return triage(TriageOptions(str(tmp_path / "model.pt"), heads=4))


def test_an_astronomical_bias_is_a_checkpoint_finding_first(tmp_path):
    key = "encoder.layers.0.self_attn.q_proj.bias"

    def flip(sd):
        name = key if key in sd else next(k for k in sd if k.endswith("bias"))
        sd[name][3] = 6e37
    report = _saved(tmp_path, flip)
    first = report.first_sign
    assert first.code == "checkpoint/implausible-values", (first.code, first.message)
    assert first.where.endswith("bias") and "6e+37" in first.message and "damaged" in first.message


def test_negative_second_moments_are_named_with_their_tensor(tmp_path):
    sd = make_model(ModelConfig.tiny()).state_dict()
    first = next(iter(sd.values()))
    state = {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros_like(first),
                 "exp_avg_sq": -torch.rand_like(first) * 4.3e8}}
    opt = {"state": state, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    found = implausible(sd, opt)
    assert len(found) == 1 and found[0].where == "optimizer state[0].exp_avg_sq"
    assert "negative values" in found[0].message and found[0].severity == "error"
    report = _saved(tmp_path, optimizer=opt)
    assert report.first_sign.code == "checkpoint/implausible-values"


def test_a_healthy_checkpoint_has_no_such_finding(tmp_path):
    sd = make_model(ModelConfig.tiny()).state_dict()
    assert implausible(sd, {"state": {0: {"exp_avg_sq": torch.rand(3), "exp_avg": -torch.rand(3)}}}) == []
