"""missing-scale on a Hugging Face directory whose architecture leaves the scale out by design
(issue 19): GPT-Neo's attention applies no 1/sqrt(d_k) in transformers' own code, at
initialisation too, with nothing folded into the weights. The checkpoint's author wrote none of
that code, so it is the architecture's published design (info), at init and trained. A config
that switches the scale off (GPT-2's scale_attn_weights=False) keeps the error, its fix naming
the field; so does code changed by the caller (tests/triage/test_hf_init.py, patched BART)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.hf.wording import scale_switches                        # noqa: E402
from tndebug.triage.hf_dir import triage_hf                                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V, D, H, L = 100, 64, 4, 2


def _neo():
    return transformers.GPTNeoConfig(vocab_size=V, hidden_size=D, num_layers=L, num_heads=H,
                                     max_position_embeddings=64, window_size=8,
                                     attention_types=[[["global", "local"], 1]],
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gpt2_unscaled():
    return transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=64,
                                   scale_attn_weights=False, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)


def _save(config, folder, steps=0):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if steps:                                   # a next-token task, trained: weights drift
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            ids = torch.randint(3, V, (16, 12), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(folder)
    return folder


def _scale(report):
    return [f for f in report.findings if f.probe == "missing-scale"]


@pytest.mark.parametrize("steps", [0, 30])
def test_gpt_neo_unscaled_by_design_is_info(tmp_path, steps):
    folder = _save(_neo(), tmp_path / "neo", steps)
    report = triage_hf(TriageOptions(str(folder), probes="missing-scale"))
    found = _scale(report)
    assert found and all(f.severity == "info" for f in found), [(f.severity, f.message) for f in found]
    f = found[0]
    assert f.code == "missing-scale/absent" and f.evidence["judged_on"] == "fresh init"
    assert "GPTNeoForCausalLM" in f.evidence["design_of"] and "published design" in f.message
    assert len(f.evidence["modules"]) == L                        # every layer, one finding
    status = report.probes["missing-scale"]
    assert status["status"] == "pass", status
    assert "GPTNeoForCausalLM" in status["fresh_init"]["package_code"]


def test_config_that_switches_the_scale_off_stays_an_error(tmp_path):
    folder = _save(_gpt2_unscaled(), tmp_path / "gpt2")
    report = triage_hf(TriageOptions(str(folder), probes="missing-scale"))
    errors = [f for f in _scale(report) if f.severity == "error"]
    assert errors, [(f.severity, f.message) for f in report.findings]
    assert errors[0].fix.startswith("config.json sets scale_attn_weights=False (the default is True)")
    assert errors[0].evidence["config_scale_fields"] == {"scale_attn_weights": False}
    assert report.probes["missing-scale"]["status"] == "fail"
    assert "package_code" not in report.probes["missing-scale"]["fresh_init"]


def test_scale_switches_are_fields_away_from_their_defaults():
    assert scale_switches(_neo()) == {}
    assert scale_switches(transformers.GPT2Config()) == {}
    assert scale_switches(_gpt2_unscaled()) == {"scale_attn_weights": (False, True)}
    gemma = transformers.Gemma2Config(query_pre_attn_scalar=16)
    assert scale_switches(gemma) == {"query_pre_attn_scalar": (16, 256)}
