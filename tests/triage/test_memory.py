"""What triage does to hold its peak memory down (issue 21: <= 3x the fp32 weights) changes no
figure: the wide batch traced in blocks, the vocabulary matrices' row-sparse gradients, the
finiteness test in blocks. The peak itself is measured by bench/hf_triage.py, not here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tndebug.capture.trace import Trace
from tndebug.config import ModelConfig
from tndebug.driver import norms_as_freed
from tndebug.model.transformer import build as build_model
from tndebug.probes import _depth_setup as DS
from tndebug.subject import tndebug_subject
from tndebug.hf.load import _RowsLinear, sliced_output
from tndebug.triage.hygiene import FINITE_BLOCK, all_finite


def test_rows_linear_matches_a_sliced_weight():
    torch.manual_seed(0)
    w = torch.randn(50, 8, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    x = torch.randn(3, 4, 8, requires_grad=True)
    g = torch.randn(3, 4, 20)
    y = _RowsLinear.apply(x, w, b, 20)
    (y * g).sum().backward()
    sparse = w.grad, b.grad.clone(), x.grad.clone()
    assert sparse[0].is_sparse
    w.grad = b.grad = x.grad = None
    ref = F.linear(x, w[:20], b[:20])
    assert torch.equal(y, ref)
    (ref * g).sum().backward()
    torch.testing.assert_close(sparse[0].to_dense(), w.grad)
    torch.testing.assert_close(sparse[1], b.grad)
    torch.testing.assert_close(sparse[2], x.grad)


class TiedLM(nn.Module):
    """A tied embedding and head over a 300-id vocabulary: the shape sliced_output cuts."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 300, bias=False)
        self.head.weight = self.emb.weight

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_sliced_pass_gives_the_dense_gradient_norms():
    """The norms a triage pass keeps (norms_as_freed) are those of the dense gradients of the
    same sliced loss: the tied matrix's included, its head and embedding parts summed."""
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 300, (4, 7))

    def loss_of(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), (ids % 40).reshape(-1))

    with sliced_output(model, 40) as keep:
        assert keep == 40 and model.emb.sparse
        logits = model(ids)
        assert logits.shape[-1] == 40
        norms = {}
        with norms_as_freed(model, norms):
            loss_of(logits).backward()
    assert not model.emb.sparse and "forward" not in vars(model.head)     # all undone
    w = model.emb.weight
    logits = F.linear(torch.tanh(model.mid(model.emb(ids))), w[:40])
    dense = torch.autograd.grad(loss_of(logits), list(model.parameters()))
    for p, g in zip(model.parameters(), dense):
        torch.testing.assert_close(norms[id(p)], torch.linalg.vector_norm(g))


def test_wide_batch_in_blocks_is_the_whole_batch(monkeypatch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0)).eval()
    subject = tndebug_subject(model)
    batch = subject.random_batch(10, 6, 6, pad_share=0.3)
    whole = DS.in_blocks(subject, batch, ("grad.stream",), None)
    monkeypatch.setattr(DS, "BLOCK_TOKENS", 36)                  # 3 sequences a block
    blocks = DS.in_blocks(subject, batch, ("grad.stream",), None)
    assert whole.streams and [s.name for s in whole.streams] == [s.name for s in blocks.streams]
    for a, b in zip(whole.streams, blocks.streams):
        assert a.x.shape == b.x.shape and a.x.shape[0] == 10
        torch.testing.assert_close(a.x, b.x, rtol=1e-5, atol=1e-6)
    for site, parts in whole.embed.items():
        for k, x in parts.items():
            torch.testing.assert_close(x, blocks.embed[site][k], rtol=1e-5, atol=1e-6)


def test_traces_that_cannot_be_joined_say_so():
    a, b = Trace(), Trace()
    b.grads["x"] = torch.zeros(1)
    assert Trace.joined([a, b], torch.zeros(2, 1), torch.zeros(2, 1)) is None


@pytest.mark.parametrize("where", [0, FINITE_BLOCK - 1, FINITE_BLOCK, 2 * FINITE_BLOCK + 5])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_sees_every_block(where, bad):
    t = torch.zeros(3 * FINITE_BLOCK)
    assert all_finite(t) and all_finite(torch.zeros(0))
    t[where] = bad
    assert not all_finite(t)
    assert not all_finite(t.reshape(-1, 4).t())            # a view that is not contiguous
