"""Integrity before diagnosis (issue 47): a zip checkpoint whose records fail their CRC (bits
flipped after the save) is refused in one line, exit 2, before any probe; torch.load itself
would load the flipped weights and the probes would judge them (a flipped file was CLEAN)."""
from __future__ import annotations

import zipfile

import torch

from tndebug.cli import main
from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.safeload import damaged


def _flip(src, dst) -> str:
    """`dst`: `src` with 64 bytes inside its largest tensor record XOR-ed; returns the record."""
    data = bytearray(open(src, "rb").read())
    with zipfile.ZipFile(src) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 128
    for i in range(start, start + 64):
        data[i] ^= 0x40
    open(dst, "wb").write(bytes(data))
    return info.filename


def test_a_bit_flipped_checkpoint_is_refused_before_any_probe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": make_model(ModelConfig.tiny()).state_dict()}, "model.pt")
    record = _flip("model.pt", "flipped.pt")
    torch.load("flipped.pt", weights_only=True)            # torch reads it without a word
    assert damaged(tmp_path / "model.pt") is None
    assert main(["triage", "flipped.pt", "--heads", "4", "--out", "t"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"tndebug: error: flipped.pt is damaged: its record {record} fails the zip "
                      f"CRC check (bits changed after the save, e.g. a bad disk or copy); nothing "
                      f"was diagnosed: copy or save it again"), err
    assert not (tmp_path / "t").exists()


def test_resume_from_a_bit_flipped_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--preset", "tiny", "--probe", "none", "--steps", "1", "--batch-size", "8",
                 "--out", str(run)]) == 0
    _flip(run / "checkpoint.pt", tmp_path / "flipped.pt")
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "flipped.pt"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "flipped.pt is damaged: its record" in err and len(err.splitlines()) == 1, err
