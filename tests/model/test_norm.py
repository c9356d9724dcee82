"""RMSNorm (tndebug/model/norm.py) computes Zhang & Sennrich's formula, and the config's
`norm_kind` puts it (or LayerNorm) at every norm of the model, pre and post."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.model.norm import RMSNorm


def hand_rmsnorm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """y_i = x_i / sqrt(mean_j x_j^2 + eps) * g_i, written out per token in float64."""
    x64 = x.double()
    out = torch.empty_like(x64)
    for idx in range(x64.shape[0]):
        row = x64[idx]
        ms = sum(float(v) ** 2 for v in row) / row.numel()
        out[idx] = row / (ms + eps) ** 0.5 * g.double()
    return out


def test_rmsnorm_matches_the_formula():
    x = torch.randn(6, 16) * 3 + 1.5                      # off-centre: LayerNorm would differ
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    got = norm(x).double()
    want = hand_rmsnorm(x, norm.weight.detach(), 1e-5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, nn.functional.layer_norm(x, (16,)).double(), atol=1e-2)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]      # no bias


def test_rmsnorm_eps_counts_on_a_small_row():
    x = torch.full((1, 4), 1e-3)
    with torch.no_grad():
        small, big = RMSNorm(4, eps=1e-12)(x), RMSNorm(4, eps=1e-2)(x)
    assert torch.allclose(small, torch.ones(1, 4), atol=1e-4)       # x / rms(x) = 1
    assert float(big.max()) < 0.02                                   # eps dominates: ~x / 0.1


def test_rmsnorm_of_a_half_input_does_not_overflow():
    x = torch.full((2, 8), 300.0, dtype=torch.float16)              # x^2 = 9e4 > fp16's 65504
    assert not bool(torch.isfinite(x.pow(2)).all())
    y = RMSNorm(8)(x)
    assert bool(torch.isfinite(y).all()) and torch.allclose(y.float(), torch.ones(2, 8), atol=1e-2)


@pytest.mark.parametrize("norm", ("pre", "post"))
@pytest.mark.parametrize("arch", ("seq2seq", "decoder"))
def test_norm_kind_sets_every_norm(norm, arch):
    for kind, cls in (("layernorm", nn.LayerNorm), ("rmsnorm", RMSNorm)):
        m = make_model(ModelConfig.tiny(norm=norm, arch=arch, norm_kind=kind))
        kinds = {type(x) for x in m.modules() if isinstance(x, (nn.LayerNorm, RMSNorm))}
        assert kinds == {cls}


def test_config_refuses_an_unknown_norm_kind_and_round_trips():
    with pytest.raises(ValueError, match="norm_kind='batchnorm'"):
        ModelConfig.tiny(norm_kind="batchnorm")
    cfg = ModelConfig.tiny(arch="decoder", norm_kind="rmsnorm", pos="rotary")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in ModelConfig.tiny().to_dict().items() if k not in ("norm_kind", "pos")}
    restored = ModelConfig.from_dict(old)                            # a checkpoint from before
    assert (restored.norm_kind, restored.pos) == ("layernorm", "sinusoidal")
