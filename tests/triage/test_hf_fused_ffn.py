"""gradient-flow finds a gated FFN whose gate and up maps are fused into one Linear d -> 2f
(GLM's and Phi-3's gate_up_proj, ModernBERT's Wi), read in two halves before the contraction
f -> d: the contraction's input is the hidden, and the dead-unit test runs on every layer.
Before 2026-12-07 such a model said "no FFN found ... dead-unit test not run" and was still
called clean (a development scan of architectures outside bench/hf_unseen.py)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V, D, L = 256, 32, 2


def config(arch):
    T = transformers
    if arch == "glm":
        return T.GlmConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2), T.AutoModelForCausalLM
    return T.ModernBertConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D,
                              num_hidden_layers=L, num_attention_heads=4, max_position_embeddings=64,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2, global_attn_every_n_layers=1,
                              local_attention=8), T.AutoModelForMaskedLM


@pytest.mark.parametrize("arch", ("glm", "modernbert"))
def test_fused_gate_up_ffn_is_found_and_checked_in_every_layer(arch, tmp_path):
    cfg, auto = config(arch)
    torch.manual_seed(0)
    model = auto.from_config(cfg)
    fused = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and m.out_features == 2 * cfg.intermediate_size]
    assert len(fused) == L                                  # one d -> 2f map per layer
    model.save_pretrained(tmp_path)
    report = triage_hf(TriageOptions(str(tmp_path), probes="gradient-flow"))
    cov = report.probes["gradient-flow"]["coverage"]
    assert "" not in cov, cov                               # not "no FFN found"
    mlps = {f.rpartition(".")[0] for f in fused}
    assert all(cov.get(m, {}).get("status") == "checked" for m in mlps), (mlps, cov)
    assert report.probes["gradient-flow"]["status"] == "pass"
