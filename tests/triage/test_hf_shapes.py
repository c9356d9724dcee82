"""A Hugging Face directory of none of the three shapes (encoder-decoder, decoder-only,
encoder-only) is refused in one line that says what it holds (issue 18). A BERT is told as an
encoder-only model, not "a decoder-only" one, and triaged (tests/triage/test_hf_encoder.py);
decoder-only directories: tests/triage/test_hf_decoder.py."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tndebug.cli import main  # noqa: E402


def _save(cls, cfg, path):
    cls(cfg).save_pretrained(path)
    return str(path)


def test_a_directory_of_no_triaged_shape_says_what_it_holds(tmp_path, capsys):
    from transformers import ViTConfig, ViTModel
    d = _save(ViTModel, ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32), tmp_path / "m")
    assert main(["triage", d, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds a vit model (ViTModel) with no language-model head" in err
    assert err.count("tndebug: error:") == 1


def test_a_bert_is_told_as_encoder_only():
    from tndebug.hf.build import model_shape
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked)
    assert model_shape("bert", {"architectures": ["BertForMaskedLM"]}, causal, masked) == "an encoder-only"
    assert model_shape("bert", {"architectures": ["BertLMHeadModel"], "is_decoder": True},
                  causal, masked) == "a decoder-only"
