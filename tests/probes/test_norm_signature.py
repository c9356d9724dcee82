"""The LayerNorm identity on streams that sit at its edges: a low-variance input (eps matters)
and a stream that is only centred (a null vector, but no normalised variance)."""
import torch
from torch import nn

from tndebug.probes import _depth_stats as ds


def signature(x):
    return ds.norm_signature(x, torch.ones(x.shape[:2], dtype=torch.bool))


def test_a_layernorm_of_a_low_variance_stream_is_normalised():
    torch.manual_seed(0)
    x = torch.randn(8, 20, 32) * 0.03 * (1 + torch.rand(8, 20, 1))     # var ~1e-3, eps 1e-5 matters
    norm = nn.LayerNorm(32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.1, 0.1)
        assert ds.is_normalised(signature(norm(x))) is True


def test_a_stream_that_is_only_centred_is_not_normalised():
    torch.manual_seed(0)
    x = torch.randn(8, 20, 32) * (1 + 2 * torch.rand(8, 20, 1))        # token norms spread widely
    assert ds.is_normalised(signature(x - x.mean(-1, keepdim=True))) is False
