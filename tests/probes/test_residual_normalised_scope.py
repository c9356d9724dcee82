"""ln-placement's inline residual-normalised test counts only a norm in the module that holds
the attention: ModernBERT's `embeddings.norm` starts the stream and its first layer reads it
through an Identity (`attn_norm` of layer 0), so the first residual is that norm's output by
design; checked with no finding (it was an error). The bug in a block's own lines is still
named (tests/realbugs/test_realbug_misses.py)."""
from __future__ import annotations

import pytest
import torch

import tndebug

transformers = pytest.importorskip("transformers")


def test_modernbert_embedding_norm_is_not_a_normalised_residual():
    cfg = transformers.ModernBertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    report = tndebug.check(transformers.ModernBertForMaskedLM(cfg), probes="ln-placement")
    assert not [f for f in report.findings if f.code == "ln-placement/residual-normalised"], \
        report.findings
    assert report.probes["ln-placement"]["status"] == "pass"
