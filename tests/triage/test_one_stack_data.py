"""`triage --data` for one-stack models of the user's own code: a decoder-only or encoder-only
model reads {'ids': LongTensor[N, T]} (or the bare tensor, an optional attention mask, and for a
decoder the empty-src form {'src': [N, 0], 'tgt': ids}), as Hugging Face directories already do;
every test that asks for data runs on it (label-shift's two places). Character-level data with
no pad token is `--pad-id none`. An encoder-decoder given one sequence per row is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tndebug.capture.adapters import import_file
from tndebug.cli import main
from tndebug.data import as_lm, eval_set, get_task
from tndebug.triage import TriageOptions, triage

from conftest import assert_bad_input

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TESTS = Path(__file__).resolve().parents[1]
CHARGPT = TESTS / "api" / "chargpt.py"


@pytest.fixture(scope="module")
def chargpt(tmp_path_factory):
    """A character-level nanoGPT-style model (id 0 is '\\n', no pad) trained 300 steps, saved
    as nanoGPT saves it, and held-out windows of its text as {'ids'} and as an empty src."""
    folder = tmp_path_factory.mktemp("chargpt")
    mod = import_file(CHARGPT)
    torch.manual_seed(0)
    model = mod.build()
    mod.train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), 300)
    torch.save({"model": model.state_dict(), "model_args": {}, "iter_num": 300},
               folder / "ckpt.pt")
    stream = mod.text(seed=1)                                    # held out: another draw
    ids = torch.stack([stream[i:i + 32] for i in range(0, 32 * 24, 32)])     # [24, 32]
    torch.save({"ids": ids}, folder / "ids.pt")
    torch.save(ids, folder / "bare.pt")
    torch.save({"src": ids[:, :0], "tgt": ids}, folder / "empty_src.pt")
    return folder


def _triage_json(argv, tmp_path):
    out = tmp_path / "t"
    rc = main(["triage", *map(str, argv), "--no-figures", "--out", str(out)])
    return rc, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("data", ["ids.pt", "bare.pt", "empty_src.pt"])
def test_decoder_only_user_code_triages_on_the_users_own_ids(chargpt, tmp_path, data):
    rc, rep = _triage_json([chargpt / "ckpt.pt", "--model", f"{CHARGPT}:build",
                            "--data", chargpt / data, "--pad-id", "none"], tmp_path)
    assert rep["run"]["arch"] == "decoder" and rep["run"]["data"] == f"--data {chargpt / data}"
    assert rep["run"]["held_out_sequences"] == 24 and rep["run"]["pad_id"] is None
    assert rc == 0 and rep["verdict"] == "clean", [f["code"] for f in rep["findings"]]
    cov = rep["probes"]["label-shift"]["coverage"]               # both places judged on the data
    assert {k: v["status"] for k, v in cov.items()} == {"unshifted": "checked",
                                                        "shifted-twice": "checked"}
    assert rep["run"]["temperature_sweep"]["data"] == "--data"


def test_character_data_without_pad_id_none_says_how(chargpt, tmp_path, capsys):
    assert_bad_input([chargpt / "ckpt.pt", "--model", f"{CHARGPT}:build", "--data",
                      chargpt / "ids.pt"], capsys, tmp_path, "or --pad-id none if your data have no padding")


def test_padded_ids_with_an_attention_mask(tmp_path):
    """Right-padded rows given as ids + attention_mask: the ids under a 0 of the mask become
    --pad-id (whatever they held), so the probes' batch is the padded one."""
    from tndebug.triage.userdata import for_kind, load_data
    ids = as_lm(eval_set(get_task("copy"), n=8, seed=0)).tgt_in   # BOS source EOS target, pads
    assert (ids[:, -1] == 0).any() and (ids[:, -1] != 0).any()       # ragged rows
    mask = (ids != 0).long()
    torch.save({"ids": ids.masked_fill(ids == 0, 7), "attention_mask": mask}, tmp_path / "m.pt")
    got = for_kind(load_data(str(tmp_path / "m.pt"), 0, 1), 0, "decoder")
    assert torch.equal(got.tgt_out, ids[:, 1:]) and got.src.shape == (8, 0)
    assert torch.equal(got.tgt_in, ids[:, :-1].masked_fill(ids[:, 1:] == 0, 0))
    enc = for_kind(load_data(str(tmp_path / "m.pt"), 0, 1), 0, "encoder")
    assert torch.equal(enc.src, ids) and torch.equal(enc.tgt_out, ids)


@pytest.mark.parametrize("mask, words", [
    ([[1, 0, 1, 1], [1, 1, 0, 0]], "a 0 between real tokens in row 0"),
    ([[1, 1, 1]], "expected [N, T] like 'ids'"),
])
def test_a_bad_attention_mask_is_one_line(tmp_path, mask, words):
    from tndebug.errors import UsageError
    from tndebug.triage.userdata import for_kind, load_data
    torch.save({"ids": torch.full((2, 4), 5), "attention_mask": torch.tensor(mask)}, tmp_path / "m.pt")
    with pytest.raises(UsageError) as e:
        for_kind(load_data(str(tmp_path / "m.pt"), 0, 1), 0, "decoder")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_encoder_only_user_code_triages_on_the_users_own_ids(tmp_path):
    corpus = import_file(TESTS / "foreign" / "minibert_corpus.py")
    ckpt = corpus.make_checkpoint("manual", None, 0, tmp_path, steps=150)
    ids = as_lm(eval_set(get_task("copy"), n=20, seed=5)).tgt_in            # right-padded with 0
    torch.save({"ids": ids}, tmp_path / "ids.pt")
    report = triage(TriageOptions(str(ckpt), model=f"{corpus.FILE}:build",
                                  data=str(tmp_path / "ids.pt")))
    assert report.run["arch"] == "encoder" and report.run["held_out_sequences"] == 20
    assert report.run["data"] == f"--data {tmp_path / 'ids.pt'}"
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert not [f for f in report.findings if f.severity in ("warning", "error")], \
        [(f.code, f.message) for f in report.findings]


def test_an_encoder_decoder_given_ids_is_one_line(annotated_ckpt, tmp_path, capsys):
    from conftest import zoo_spec
    path, _ = annotated_ckpt()
    torch.save({"ids": torch.randint(3, 11, (4, 6))}, tmp_path / "ids.pt")
    words = "holds {'ids': ...}, one sequence per row, but the model is an encoder-decoder: it needs {'src'"
    assert_bad_input([path, "--data", tmp_path / "ids.pt"], capsys, tmp_path, words)   # a layout
    assert_bad_input([path, "--model", zoo_spec("annotated", "make_model"), "--adapter", "annotated",
                      "--data", tmp_path / "ids.pt"], capsys, tmp_path, words)      # its own code
    assert_bad_input([path, "--pad-id", "none"], capsys, tmp_path,
                     "--pad-id none (data with no padding) applies to a decoder- or encoder-only")
