"""A Hugging Face model whose scale comes from a config field left at its class default
(Gemma-2's query_pre_attn_scalar = 256 on heads 16 wide: scores scaled by 1/16, not 1/4): the
missing-scale error's fix names the field and the value to set (it spoke of `self.scaling` =
head_dim**-0.5, which Gemma-2 does not use). A field set away from its default keeps its own
wording (test_hf_init.py)."""
from __future__ import annotations

import pytest
import torch

import tndebug

transformers = pytest.importorskip("transformers")


def test_a_scale_field_at_its_default_is_named_in_the_fix():
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    assert cfg.query_pre_attn_scalar == 256                  # the class default
    torch.manual_seed(0)
    report = tndebug.check(transformers.Gemma2ForCausalLM(cfg), probes="missing-scale")
    (f,) = [f for f in report.findings if f.probe == "missing-scale" and f.severity == "error"]
    assert f.fix.startswith("config.query_pre_attn_scalar = 256 sets this scale "
                            "(query_pre_attn_scalar**-0.5 = 0.0625); set it to 16."), f.fix
    assert f.evidence["config_scale_field"] == {"query_pre_attn_scalar": 256.0}
