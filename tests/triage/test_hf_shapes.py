"""A Hugging Face directory that is neither an encoder-decoder nor decoder-only is refused in one
line that says what it holds: a BERT is an encoder-only model, not "a decoder-only" one (issue 18).
(Decoder-only directories are triaged: tests/triage/test_hf_decoder.py.)"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tndebug.cli import main  # noqa: E402


def _save(cls, cfg, path):
    cls(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["bert"])
def test_a_directory_that_is_no_encoder_decoder_says_what_it_holds(kind, tmp_path, capsys):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
    if kind == "bert":
        d = _save(BertForMaskedLM, BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32),
                  tmp_path / "m")
        said = "holds an encoder-only model (bert, BertForMaskedLM)"
    else:
        d = _save(GPT2LMHeadModel, GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                              bos_token_id=0, eos_token_id=0), tmp_path / "m")
        said = "holds a decoder-only model (gpt2, GPT2LMHeadModel)"
    assert main(["triage", d, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("tndebug: error:") == 1
