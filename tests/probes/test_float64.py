"""probes/_float64.in_float64: the model in float64 for a `with` block, its own casts included.
Code that computes its scores in float32 on purpose (GPT-J's `query.float()`, Llama's softmax
with dtype=torch.float32) rounded there again before, so positional-encoding's float64 rerun of
a swap that is float32 rounding kept a float32-sized effect (issue 45's user-style corpus, GPT-J
with rotary never applied, missed after training: bench/results/foreign_styles at 103777c)."""
from __future__ import annotations

import torch
from torch import nn

from tndebug.probes._float64 import in_float64


class CastsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))  # complex64

    def forward(self, x):                                          # [B, T, 8]
        q = self.q(x)
        s = q.float() @ q.to(torch.float32).transpose(-1, -2)      # [B, T, T], "in float32"
        p = s.softmax(-1, dtype=torch.float32).half().to(q.dtype)
        z = torch.view_as_complex(q.reshape(*q.shape[:-1], 4, 2).contiguous()) * self.freqs
        return p, torch.arange(3, dtype=torch.float), z


def test_the_models_own_casts_give_float64_inside_and_nothing_changes_after():
    m = CastsInside()
    before = {k: (v.dtype, v.clone()) for k, v in m.state_dict().items()}
    x = torch.randn(2, 5, 8)
    with in_float64(m):
        p, r, z = m(x.double())
        assert p.dtype == torch.float64 and r.dtype == torch.float64   # float32 before the fix
        assert z.dtype == torch.complex128 and m.freqs.dtype == torch.complex128
        assert torch.ones(2).view(torch.int32).dtype == torch.int32    # a byte view is not a cast
    assert p.float().dtype == torch.float32                             # the mode ends with the block
    for k, v in m.state_dict().items():
        assert v.dtype == before[k][0] and torch.equal(v, before[k][1]), k


def test_a_float32_cast_no_longer_rounds_the_float64_result():
    """The same sum in float64 with and without the cast agree to float64 rounding, not float32."""
    m = CastsInside()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with in_float64(m):
        p, _, _ = m(x)
        q = m.q(x)
        ref = (q @ q.transpose(-1, -2)).softmax(-1)
    assert float((p - ref).abs().max()) < 1e-12
