"""Refusals say what is true (issue 47): pickled code in a Hugging Face folder, `--probe all,none`,
a --model name that is not a function, `tndebug` alone, a config.json that is a directory."""
from __future__ import annotations

import json

import pytest
import torch

from tndebug.cli import main

BART = {"model_type": "bart", "vocab_size": 96, "d_model": 32, "encoder_layers": 1,
        "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64}


def _first(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_tndebug_alone_prints_a_short_usage(capsys):
    assert main([]) == 2
    err = _first(capsys)
    assert err[0].startswith("usage: tndebug COMMAND") and len(err) <= 6, err
    assert [line.split()[0] for line in err[1:]] == ["run", "triage", "check", "probes", "faults"]


@pytest.mark.parametrize("spec,word", [("all,none", "all"), ("nan-scores,none", "none"),
                                       ("all,nan-scores", "all")])
def test_all_or_none_in_a_list_says_it_stands_alone(spec, word, capsys):
    assert main(["run", "--probe", spec]) == 2
    assert _first(capsys) == [f"tndebug: error: '{spec}': '{word}' is a selection by itself, not a "
                              f"probe name; pass {word} alone, or a list of probe names without it"]


def test_a_model_name_that_is_not_a_function_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("make_model = 3\n")
    torch.save({"w": torch.ones(1)}, "model.pt")
    assert main(["triage", "model.pt", "--model", "mine.py:make_model"]) == 2
    assert _first(capsys)[0] == ("tndebug: error: --model: mine.py defines make_model = 3 (type "
                                 "int), not a function; pass FILE.py:NAME of a function")


def test_pickled_code_in_a_hugging_face_folder_is_named_not_loaded(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(BART))
    torch.save({"w": torch.ones(1), "cfg": print}, tmp_path / "hf" / "pytorch_model.bin")
    assert main(["triage", "hf", "--out", "t"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "tndebug: error: hf/pytorch_model.bin holds pickled code (builtins.print); it was not "
        "loaded. Re-save the model with model.save_pretrained(DIR) (model.safetensors holds "
        "tensors only)")
    assert "\x1b" not in err and "weights_only" not in err and "corrupt" not in err
    assert not (tmp_path / "t").exists()


def test_a_config_json_that_is_a_directory_says_so(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf" / "config.json").mkdir(parents=True)
    torch.save({"w": torch.ones(1)}, tmp_path / "hf" / "pytorch_model.bin")
    assert main(["triage", "hf"]) == 2
    assert _first(capsys)[0] == ("tndebug: error: hf/config.json is a directory, not a file; a "
                                 "save_pretrained directory holds its configuration in the JSON "
                                 "file config.json")
