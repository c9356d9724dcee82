"""Hugging Face consistency checks (issue 19, tndebug/hf/checks.py): a head in the file
that differs from the embedding it is tied to, config ids against the saved tokenizer and
against --data, two weight files that differ. Each healthy -> no checkpoint finding; each
broken -> the error (warning for the two files) with its numbers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

from test_hf import _word_tokenizer, config, describe                 # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("checks") / "bart"
    transformers.AutoModelForSeq2SeqLM.from_config(config("bart")).save_pretrained(folder)
    return folder


def _copy(bart, tmp_path, name="m", **cfg) -> Path:
    folder = tmp_path / name
    shutil.copytree(bart, folder)
    if cfg:
        raw = json.loads((folder / "config.json").read_text())
        raw.update(cfg)
        (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _checks(report):
    return [f for f in report.findings if f.probe == "checkpoint" and f.severity != "info"]


def _with_head(folder: Path, head) -> None:
    from safetensors.torch import load_file, save_file
    sd = load_file(str(folder / "model.safetensors"))
    sd["lm_head.weight"] = head(sd["model.shared.weight"])
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_saved_head_that_differs_from_its_tied_embedding(bart, tmp_path):
    same = _copy(bart, tmp_path, "same")
    _with_head(same, lambda e: e.clone())                            # saved, equal: healthy
    assert not _checks(triage_hf(TriageOptions(str(same)))), "equal head flagged"
    stray = _copy(bart, tmp_path, "stray")
    torch.manual_seed(1)
    _with_head(stray, lambda e: torch.randn_like(e) * 0.02)
    seen = {}

    def look(model, adapter):                                        # the model triage examines
        seen["untied"] = model.lm_head.weight.data_ptr() != model.model.shared.weight.data_ptr()
    report = triage_hf(TriageOptions(str(stray)), patch=look)
    errs = [f for f in _checks(report) if f.where == "lm_head.weight"]
    assert errs and errs[0].severity == "error", describe(report.findings)
    ev = errs[0].evidence
    assert ev["embedding"] == "model.shared.weight" and ev["max_abs_difference"] > 0
    assert ev["head_norm"] != ev["embedding_norm"] and seen["untied"]   # as transformers runs it


def _tokenized(bart, tmp_path, name, **cfg) -> Path:
    folder = _copy(bart, tmp_path, name, **cfg)
    _word_tokenizer(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>",
                                         pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    return folder


def test_config_ids_against_the_tokenizer(bart, tmp_path):
    assert not _checks(triage_hf(TriageOptions(str(_tokenized(bart, tmp_path, "ok")))))
    bad = _tokenized(bart, tmp_path, "bad", pad_token_id=5, decoder_start_token_id=7)
    report = triage_hf(TriageOptions(str(bad)))
    got = {f.where: f for f in _checks(report)}
    assert got["pad_token_id"].severity == "error", describe(report.findings)
    assert got["pad_token_id"].evidence["tokenizer"] == [1]
    assert got["decoder_start_token_id"].severity == "error"
    assert "bos_token_id" not in got                                  # BART: bos 0 in both


def test_weights_that_do_not_fit_name_a_config_id_the_tokenizer_disagrees_with(bart, tmp_path):
    """A table sized by an id (FSMT sizes its positions by pad_token_id) does not load when
    config.json's id is wrong: the one-line refusal names the id beside the shapes. (Here the
    table's size is changed through max_position_embeddings: BART's does not follow the pad.)"""
    from tndebug.errors import UsageError
    bad = _tokenized(bart, tmp_path, "sized", pad_token_id=5, max_position_embeddings=40)
    with pytest.raises(UsageError) as e:
        triage_hf(TriageOptions(str(bad)))
    msg = str(e.value)
    assert "shape mismatch" in msg and "pad_token_id = 5, the tokenizer's 1" in msg, msg
    assert "\n" not in msg
    ok_ids = _tokenized(bart, tmp_path, "sized_ok", max_position_embeddings=40)
    with pytest.raises(UsageError) as e:                  # the ids agree: the shapes alone
        triage_hf(TriageOptions(str(ok_ids)))
    assert "shape mismatch" in str(e.value) and "tokenizer" not in str(e.value)


def test_config_bos_against_the_tokenizer(bart, tmp_path):
    """bos is read by generate() without a prompt only: a mismatch is a warning, said why."""
    bad = _tokenized(bart, tmp_path, "bos", bos_token_id=9)
    report = triage_hf(TriageOptions(str(bad)))
    got = {f.where: f for f in _checks(report)}
    assert set(got) == {"bos_token_id"}, describe(report.findings)
    assert got["bos_token_id"].severity == "warning" and "generate()" in got["bos_token_id"].message
    assert got["bos_token_id"].evidence["tokenizer"] == [0] and got["bos_token_id"].evidence["config"] == [9]


def _data(tmp_path, start: int, pad: int) -> Path:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 90, (10, 7), generator=g)
    tgt = torch.cat([torch.full((10, 1), start), torch.randint(4, 90, (10, 6), generator=g),
                     torch.full((10, 1), 2)], 1)                                # start, words, eos
    for i in range(0, 10, 2):                                                   # short rows padded
        n = 2 + i % 4
        src[i, -n:] = pad
        tgt[i, -n:] = pad
        tgt[i, -n - 1] = 2
    path = tmp_path / f"data_{start}_{pad}.pt"
    torch.save({"src": src, "tgt": tgt}, path)
    return path


def test_config_ids_against_the_data(bart, tmp_path):
    report = triage_hf(TriageOptions(str(bart), data=str(_data(tmp_path, 2, 1))))
    assert not _checks(report), describe(report.findings)                      # BART: start 2, pad 1
    wrong = _copy(bart, tmp_path, "wrong", decoder_start_token_id=0)
    report = triage_hf(TriageOptions(str(wrong), data=str(_data(tmp_path, 2, 1))))
    got = {f.where: f for f in _checks(report)}
    assert got["decoder_start_token_id"].evidence["data"] == 2, describe(report.findings)
    report = triage_hf(TriageOptions(str(bart), data=str(_data(tmp_path, 2, 3))))
    got = {f.where: f for f in _checks(report)}
    assert got["pad_token_id"].evidence["data"] == 3, describe(report.findings)


def test_safetensors_and_a_different_bin(bart, tmp_path):
    from safetensors.torch import load_file
    same = _copy(bart, tmp_path, "same_bin")
    sd = load_file(str(same / "model.safetensors"))
    torch.save(sd, same / "pytorch_model.bin")
    report = triage_hf(TriageOptions(str(same)))
    assert not _checks(report) and "same tensors" in report.run["weight_files_note"]
    other = _copy(bart, tmp_path, "other_bin")
    torch.save({k: v + 0.01 if "fc1" in k else v for k, v in sd.items()}, other / "pytorch_model.bin")
    report = triage_hf(TriageOptions(str(other)))
    warn = [f for f in _checks(report) if f.where == "pytorch_model.bin"]
    assert warn and warn[0].severity == "warning", describe(report.findings)
    assert warn[0].evidence["triaged"] == ["model.safetensors"] and warn[0].evidence["differing_tensors"] == 8          # fc1 weight and bias, 4 layers


# -- an untied head that does not fit the trained body (tndebug/hf/head.py) -----------------
def _untied_copy_bart(steps: int):
    """A tiny untied BART (tie_word_embeddings false) trained `steps` Adam steps on copying, and
    a held-out batch of the same task (src, tgt_in led by decoder start 2, tgt_out)."""
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=20, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False))
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    g = torch.Generator().manual_seed(1)

    def batch(n):
        src = torch.randint(3, 20, (n, 8), generator=g)
        tgt = torch.cat([torch.full((n, 1), 2), src, torch.full((n, 1), 2)], 1)
        return src, tgt[:, :-1], tgt[:, 1:]
    for _ in range(steps):
        src, tgt_in, tgt_out = batch(32)
        loss = model(input_ids=src, decoder_input_ids=tgt_in, labels=tgt_out.contiguous()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), batch(24)


def test_untied_head_that_does_not_fit_the_trained_body():
    from tndebug.hf.head import head_unfit_on_data
    model, (src, tgt_in, tgt_out) = _untied_copy_bart(150)
    pad = model.config.pad_token_id
    assert head_unfit_on_data(model, src, tgt_in, tgt_out, pad) == []      # healthy trained
    torch.manual_seed(3)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)                              # re-initialised head
    got = head_unfit_on_data(model, src, tgt_in, tgt_out, pad)
    assert [(f.code, f.severity, f.where) for f in got] == [("checkpoint/head-unfit", "error", "lm_head.weight")]
    ev = got[0].evidence
    assert ev["body_alignment_median"] >= 2 and ev["head_z"] < 10, ev
    assert ev["refit_head_accuracy"] - ev["saved_head_accuracy"] >= 0.25, ev
    untrained, (src, tgt_in, tgt_out) = _untied_copy_bart(0)               # both at initialisation
    assert head_unfit_on_data(untrained, src, tgt_in, tgt_out, pad) == []


def test_t5_v1_1_head_declared_untied_is_not_a_tie_error(tmp_path):
    """config.json "tie_word_embeddings": false with its own lm_head (T5 v1.1, mT5, Flan-T5):
    transformers 5's T5Config forces the tie in the class and unties on load; the head is the
    design, not a stray copy, and triage runs it as transformers does."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    folder = tmp_path / "t5v11"
    transformers.AutoModelForSeq2SeqLM.from_config(config("t5")).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(raw))
    sd = load_file(str(folder / "model.safetensors"))
    torch.manual_seed(1)
    sd["lm_head.weight"] = torch.randn_like(sd["shared.weight"])
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    seen = {}

    def look(model, adapter):
        seen["head"] = torch.equal(model.lm_head.weight.detach(), sd["lm_head.weight"])
    report = triage_hf(TriageOptions(str(folder), probes="missing-scale"), patch=look)
    assert not _checks(report), describe(report.findings)
    assert seen["head"]                                     # the saved head, as transformers runs it


def test_triage_with_data_names_an_untied_head_that_does_not_fit(tmp_path):
    """The same check through `tndebug triage DIR --data`: the directory as save_pretrained
    writes it, the user's held-out pairs as {"src", "tgt"} (tgt led by the decoder start)."""
    model, (src, tgt_in, tgt_out) = _untied_copy_bart(150)
    data = tmp_path / "held_out.pt"
    torch.save({"src": src, "tgt": torch.cat([tgt_in, tgt_out[:, -1:]], 1)}, data)
    healthy = tmp_path / "healthy"
    model.save_pretrained(healthy)
    report = triage_hf(TriageOptions(str(healthy), data=str(data)))
    assert not [f for f in report.findings if f.code == "checkpoint/head-unfit"], describe(report.findings)
    torch.manual_seed(3)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)
    broken = tmp_path / "broken"
    model.save_pretrained(broken)
    report = triage_hf(TriageOptions(str(broken), data=str(data)))
    got = [f for f in report.findings if f.code == "checkpoint/head-unfit"]
    assert [(f.severity, f.where) for f in got] == [("error", "lm_head.weight")], describe(report.findings)


def test_t5_with_norm_gains_zeroed_names_the_norms_not_a_shared_projection(tmp_path):
    """Issue 19: a T5 whose RMSNorm weights are 0 (every token leaves each norm as 0) got six
    'Q, K and V come from one projection' errors and dead-unit warnings with an init fix; the
    norm is what breaks it. The healthy T5 gets no norm finding."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config("t5"))
    model.save_pretrained(tmp_path / "healthy")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("layer_norm"):
                module.weight.zero_()
    model.save_pretrained(tmp_path / "zeroed")
    healthy = triage_hf(TriageOptions(str(tmp_path / "healthy")))
    assert not [f for f in healthy.findings if f.code == "ln-placement/norm-collapsed"]
    report = triage_hf(TriageOptions(str(tmp_path / "zeroed")))
    bad = [f for f in report.findings if f.severity != "info"]
    assert [f.code for f in bad] == ["ln-placement/norm-collapsed"], describe(bad)
    assert "more norms" in bad[0].message and "did not load" in bad[0].fix   # the HF fix
    assert report.probes["head-collapse"]["status"] != "fail"


@pytest.mark.parametrize("tie", [True, False])
def test_an_untied_head_without_data_makes_the_verdict_incomplete(tmp_path, tie):
    """Issue 19: an untrained head in an untied model was CLEAN with nothing said; without the
    user's data the head cannot be judged, so the untied-head test is a part not run, named
    with its head and what to pass, and the verdict cannot be clean (the temperature sweep,
    skipped without data, is not run either, tied or not)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                  tie_word_embeddings=tie)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "m")
    report = triage_hf(TriageOptions(str(tmp_path / "m")))
    assert report.verdict == "incomplete" and report.exit_code() == 4
    assert "temperature sweep" in report.probes["missing-scale"]["not_run"]
    unrun = report.probes["checkpoint"].get("not_run", {})
    assert not [f for f in report.findings if "unchecked" in f.code or "skipped" in f.code]
    if tie:
        assert not unrun
        return
    (why,) = unrun.values()
    assert "lm_head.weight" in why and "--text" in why
    assert "checkpoint" in report.incomplete() and "untied-head" in report.incomplete()["checkpoint"]


def test_a_config_pad_that_is_a_word_of_the_text_is_an_error_not_bad_input(tmp_path, capsys):
    """Issue 19 (pad against the data): config.json's pad_token_id set to an ordinary word id
    while the tokenizer pads with its own; --text, tokenised with that tokenizer, holds the id
    mid-row. That is the config's defect: an error on pad_token_id (was: exit 2 as bad input),
    the data not used, and what needs it recorded as not run. Raw --data ids stay bad input."""
    import json
    from tndebug.cli import main
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "m"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=5,
        bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    text = tmp_path / "held_out.txt"
    text.write_text("w7 w5 w9 w11\nw8 w6 w5 w12 w4\nw9 w9 w10\n")
    capsys.readouterr()
    assert main(["triage", str(folder), "--text", str(text), "--out", str(tmp_path / "o"),
                 "--no-figures"]) == 1
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    pad = [f for f in report["findings"] if f["where"] == "pad_token_id" and f["severity"] == "error"]
    assert pad, report["findings"]
    assert report["run"]["temperature_sweep"]["verdict"] == "skipped"
    assert "not used" in report["probes"]["missing-scale"]["not_run"]["temperature sweep"]
    ids = torch.tensor([[1, 7, 5, 9], [1, 8, 5, 12]])
    torch.save({"ids": ids}, tmp_path / "ids.pt")
    assert main(["triage", str(folder), "--data", str(tmp_path / "ids.pt"), "--out",
                 str(tmp_path / "o2"), "--no-figures"]) == 2
    assert "pad id 5" in capsys.readouterr().err


def test_a_generic_tokenizer_is_read_as_saved_whatever_the_model_type(tmp_path):
    """transformers 5 saves a tokenizers-library tokenizer as tokenizer_class TokenizersBackend;
    AutoTokenizer then builds Qwen2Tokenizer for a qwen2 directory, which reads a WordLevel
    vocabulary as no tokens (every --text line refused as 'only special ids'). tndebug loads the
    generic class there, and the model's own class where the config names one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tndebug.hf.load import load_saved_tokenizer, transformers_offline
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "q"
    transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                         unk_token="<unk>").save_pretrained(folder)
    assert load_saved_tokenizer(transformers_offline(), folder)("w5 w9 w10")["input_ids"] == [5, 9, 10]
