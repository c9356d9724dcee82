"""`tndebug triage` on bad input: one line naming the problem and what to do, exit 2, nothing
written; on good input: a report in --out."""
from __future__ import annotations

import json

import pytest
import torch

from tndebug.cli import main

from conftest import TINY, ZOO, assert_bad_input, run_triage_cli, zoo, zoo_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


run, bad = run_triage_cli, assert_bad_input


def test_missing_file(capsys, tmp_path):
    bad([tmp_path / "nope.pt"], capsys, tmp_path, "no such file")


def test_truncated_file(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    path.write_bytes(path.read_bytes()[:1000])
    bad([path], capsys, tmp_path, "truncated or corrupt")


def test_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "notes.pt").write_text("just text\n")
    bad([tmp_path / "notes.pt"], capsys, tmp_path, "not a PyTorch checkpoint")


def test_unknown_layout(capsys, tmp_path):
    torch.save(zoo("sdpa_model").build().state_dict(), tmp_path / "s.pt")
    bad([tmp_path / "s.pt"], capsys, tmp_path, "unknown layout")


def test_model_file_that_does_not_exist(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--model", tmp_path / "missing.py:make_model"], capsys, tmp_path, "no such file")


def test_model_spec_without_factory(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--model", ZOO / "annotated.py"], capsys, tmp_path, "expected FILE.py:NAME")


def test_factory_that_raises(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--model", zoo_spec("annotated", "make_model"), "--config",
         json.dumps({"src_vocab": 11, "tgt_vocab": 11, "d_model": 32, "h": 5})],
        capsys, tmp_path, "raised AssertionError")


def test_shapes_that_do_not_match_the_model(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--model", zoo_spec("annotated", "make_model"), "--config",
         json.dumps({"src_vocab": 11, "tgt_vocab": 11, **TINY, "d_ff": 128})],
        capsys, tmp_path, "shapes do not match")


def test_unknown_adapter_function(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--model", zoo_spec("annotated", "make_model"), "--adapter",
         zoo_spec("annotated", "no_such_fn")], capsys, tmp_path, "defines no function 'no_such_fn'")


def test_bad_config_json(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--config", "{d_model: 3"], capsys, tmp_path, "not valid JSON")


def test_unsafe_pickle_is_refused_with_its_globals_listed(capsys, tmp_path):
    torch.save({"model": {"w": torch.ones(1)}, "cfg": print}, tmp_path / "u.pt")
    code, out, err = run([tmp_path / "u.pt", "--out", tmp_path / "o", "--format", "json"], capsys)
    assert code == 2 and "builtins.print" in err and "--trust-checkpoint" in err
    assert len(err.strip().splitlines()) == 1 and not out.strip()
    assert not (tmp_path / "o").exists()          # a refused input leaves nothing behind


def test_unsafe_pickle_with_overwrite_keeps_the_earlier_report(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    code, _, err = run([path, "--out", tmp_path / "o", "--probe", "none", "--fail-on", "never"], capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir() if p.is_file()}
    torch.save({"model": {"w": torch.ones(1)}, "cfg": print}, tmp_path / "u.pt")
    code, _, err = run([tmp_path / "u.pt", "--out", tmp_path / "o", "--overwrite"], capsys)
    assert code == 2 and "holds pickled code" in err
    after = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir() if p.is_file()}
    assert after == before and "report.json" in after


def test_good_run_writes_a_report(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    code, _, err = run([path, "--out", tmp_path / "o", "--probe", "none", "--fail-on", "never"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    run_ = report["run"]
    assert run_["mode"] == "triage" and run_["layout"] == "annotated"
    assert run_["inferred_config"]["n_heads"] == 4 and run_["inferred_config"]["norm"] == "pre"
    assert "checkpoint" in report["probes"]


def test_task_whose_ids_do_not_fit_the_vocabulary(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--task", "translate"], capsys, tmp_path, "uses token ids up to 24")


def test_adapter_that_returns_sequence_first_logits(capsys, tmp_path):
    (tmp_path / "adapter.py").write_text(
        "from seq import forward as f\n"
        "def forward(model, src, tgt, pad_id):\n"
        "    return f(model, src, tgt, pad_id).transpose(0, 1)\n")
    (tmp_path / "seq.py").write_text((ZOO / "torch_seq2seq.py").read_text())
    torch.save({"model": zoo("torch_seq2seq").build().state_dict()}, tmp_path / "t.pt")
    bad([tmp_path / "t.pt", "--model", zoo_spec("torch_seq2seq", "build"),
         "--adapter", f"{tmp_path}/adapter.py:forward"], capsys, tmp_path, "expected logits [B, T, V]")


# -- issue 12: messages, output places ---------------------------------------------------------
@pytest.mark.parametrize("content, words", [
    (b"just text\n", "neither a zip archive (torch.save) nor a pickle; it begins with the text 'just text'"),
    (b"hello world this is a text file\n" * 4, "it begins with the text 'hello world"),
    (b"\x00\x01\x02binary", "it begins with the bytes 00 01 02"),
])
def test_text_and_binary_junk_say_what_the_bytes_are(content, words, capsys, tmp_path):
    (tmp_path / "x.pt").write_bytes(content)
    bad([tmp_path / "x.pt"], capsys, tmp_path, words)


def test_truncated_message_is_not_cut_mid_word(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    path.write_bytes(path.read_bytes()[:1000])
    code, _, err = run([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "(PytorchStreamReader failed reading zip archive: failed finding central " \
                          "directory); copy or save it again" in err, err


def test_an_empty_dict_says_so(capsys, tmp_path):
    torch.save({}, tmp_path / "e.pt")
    bad([tmp_path / "e.pt"], capsys, tmp_path, "holds an empty dict: no weights to triage")


def test_an_unknown_adapter_name_lists_the_built_in_ones(capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, "--adapter", "fairseq"], capsys, tmp_path,
        "--adapter 'fairseq': not a built-in adapter (built-in: annotated, tndebug, gpt, bert)")


@pytest.mark.parametrize("flags, words", [
    (["--heads", "0"], "argument --heads: 0: must be an integer >= 1"),
    (["--pad-id", "-1"], "argument --pad-id: -1: must be an integer >= 0"),
])
def test_numbers_that_make_no_sense(flags, words, capsys, tmp_path, annotated_ckpt):
    path, _ = annotated_ckpt()
    bad([path, *flags], capsys, tmp_path, words)


def test_out_that_is_a_file_is_refused_before_any_work(capsys, tmp_path, annotated_ckpt, monkeypatch):
    path, _ = annotated_ckpt()
    (tmp_path / "f").write_text("x")
    import tndebug.triage.run as triage_run
    monkeypatch.setattr(triage_run, "triage", lambda opts: pytest.fail("triage ran"))
    code, _, err = run([path, "--out", tmp_path / "f"], capsys)
    assert code == 2 and "is a file, not a directory" in err
    code, _, err = run([path, "--out", tmp_path / "f" / "sub"], capsys)
    assert code == 2 and "is a file, so no directory can be made under it" in err


def test_triage_into_a_training_run_keeps_its_report(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--preset", "tiny", "--probe", "none", "--steps", "1", "--batch-size", "8",
                 "--out", str(out)]) == 0
    before = (out / "report.json").read_text()
    capsys.readouterr()
    code, _, err = run([out / "checkpoint.pt", "--out", out, "--probe", "none"], capsys)
    assert code == 2 and "already holds tndebug output" in err and "--overwrite" in err
    assert (out / "report.json").read_text() == before


def test_default_out_is_named_after_the_checkpoint_and_numbered(capsys, tmp_path, monkeypatch,
                                                                annotated_ckpt):
    path, _ = annotated_ckpt()
    (tmp_path / "a").mkdir()
    ckpt = tmp_path / "a" / "checkpoint.pt"
    ckpt.write_bytes(path.read_bytes())
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        code, _, err = run([ckpt, "--probe", "none", "--fail-on", "never"], capsys)
        assert code == 0, err
    assert (tmp_path / "triage-a-checkpoint" / "report.json").is_file()
    assert (tmp_path / "triage-a-checkpoint-2" / "report.json").is_file()



def test_json_stdout_is_the_report_when_the_users_code_prints(capsys, tmp_path, annotated_ckpt):
    """Issue 44: nanoGPT's and minGPT's constructors print "number of parameters: ...": with
    --format json what the user's code prints (import, factory, forward) goes to stderr."""
    path, _ = annotated_ckpt()
    (tmp_path / "chatty.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('zoo_annotated', {str(ZOO / 'annotated.py')!r})\n"
        "zoo = importlib.util.module_from_spec(spec); spec.loader.exec_module(zoo)\n"
        "print('importing chatty')\n"
        "def make_model(*args, **kw):\n"
        "    model = zoo.make_model(*args, **kw)\n"
        "    print('number of parameters: %.2fM' % (sum(p.numel() for p in model.parameters()) / 1e6))\n"
        "    forward = model.forward\n"
        "    def chatty_forward(*a, **k):\n"
        "        print('forward called')\n"
        "        return forward(*a, **k)\n"
        "    model.forward = chatty_forward\n"
        "    return model\n")
    code, out, err = run([path, "--model", f"{tmp_path / 'chatty.py'}:make_model", "--out",
                          tmp_path / "o", "--probe", "missing-scale", "--format", "json",
                          "--fail-on", "never"], capsys)
    assert code == 0, err
    assert json.loads(out)["run"]["mode"] == "triage"
    assert "number of parameters" in err and "importing chatty" in err
