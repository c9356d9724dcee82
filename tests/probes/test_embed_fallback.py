"""Issue 45: no fallback invents evidence. When no embedding output is captured, the padded-shape
test reads the stream's entry point only where it is token-local (a function of each position's
own token); one that mixes tokens comes after an attention, and the test then has no verdict
instead of blaming the PE for what the attention did (a false collateral error on public code)."""
from __future__ import annotations

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes import _embed_moves
from tndebug.subject import tndebug_subject


def _fake_outs(mixing: bool):
    def outs(trace):
        ids = (trace.tgt if trace.tgt is not None else trace.src).float()        # [B, T]
        x = ids.cumsum(1) if mixing else ids                                     # [B, T]
        return {"decoder.entry": x[..., None].expand(*x.shape, 4).clone()}, True
    return outs


@pytest.fixture
def subject():
    torch.manual_seed(0)
    return tndebug_subject(make_model(ModelConfig.tiny()))


def test_a_stream_entry_that_mixes_tokens_is_no_embedding(subject, monkeypatch):
    monkeypatch.setattr(_embed_moves, "_outs", _fake_outs(mixing=True))
    with pytest.raises(_embed_moves.NotAnEmbedding):
        _embed_moves.embedding_moves(subject)


def test_a_token_local_stream_entry_is_read(subject, monkeypatch):
    monkeypatch.setattr(_embed_moves, "_outs", _fake_outs(mixing=False))
    assert _embed_moves.embedding_moves(subject) == {}          # per-position ids: nothing moves
