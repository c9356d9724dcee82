"""Cheap checks before torch (issue 47): the CLI's parser builds without importing torch, so a bad
flag, a bad --out or a missing, empty or special checkpoint path is refused in a fraction of a
second; a FIFO is called a FIFO, a binary --text is refused before the model is built."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def refuse_without_torch(tmp_path, argv: list[str]) -> str:
    """Run tndebug.cli.main(argv) in a fresh interpreter; assert exit 2 and torch never imported;
    return stderr."""
    code = ("import sys\nfrom tndebug.cli import main\n"
            f"rc = main({argv!r})\n"
            "assert rc == 2, rc\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NO-TORCH", (argv, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tndebug: error: "), out.stderr
    return lines[0]


def test_a_bad_flag_is_refused_before_torch_is_imported(tmp_path):
    code = ("import sys\nfrom tndebug.cli import main\n"
            "try:\n    main(['run', '--steps', '-1'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.strip() == "NO-TORCH", out.stderr
    assert "--steps: -1: must be an integer >= 0" in out.stderr


@pytest.mark.parametrize("argv", [
    ["run", "--steps", "-1"], ["run", "--batch-size", "0"], ["run", "--lr-factor", "nan"],
    ["run", "--prob", "all"], ["run", "--probe", "bogus"], ["run", "--probe", "all,none"],
    ["run", "--fault", "nope"], ["run", "--out", ""], ["run", "--out", "afile"],
    ["triage", "nope.pt"], ["triage", "empty.pt"], ["triage", "model.pt", "--heads", "0"],
    ["triage", "model.pt", "--out", "afile"], ["nosuchcommand"], ["--no-such-flag"],
    ["run", "--pos", "rotary"], ["run", "--arch", "decoder", "--fault", "rotary_q_only"],
    ["triage", "x" * 300 + ".pt"], ["triage", "loop.pt"], ["triage", "emptyd"],
    ["triage", "model.pt", "--data", "missing.pt"], ["triage", "model.pt", "--data", "empty.pt"],
    ["triage", "model.pt", "--model", "missing.py:make"], ["triage", "model.pt", "--model", "mymodel.py"],
    ["triage", "model.pt", "--adapter", "missing.py:forward"], ["triage", "model.pt", "--text", "x.txt"],
    ["triage", "model.pt", "--attn", "eager"], ["run", "--resume", "nowhere"], ["run", "--resume", "emptyd"],
])
def test_cheap_refusals_do_not_import_torch(tmp_path, argv):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "model.pt").write_bytes(b"PK not really")
    os.symlink("loop.pt", tmp_path / "loop.pt")
    (tmp_path / "emptyd").mkdir()
    line = refuse_without_torch(tmp_path, argv)
    if argv[-1].startswith("xxx"):
        assert "file name too long" in line


def test_a_batch_that_does_not_split_leaves_no_directory(tmp_path, monkeypatch, capsys):
    from tndebug.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--preset", "tiny", "--nproc", "3"]) == 2
    assert "does not split over 3 processes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                  # no runs/ left behind


def test_the_torch_free_task_table_agrees_with_the_tasks():
    from tndebug.data import TASKS
    from tndebug.task_names import SUMMARIES, VOCAB
    assert list(TASKS) == list(SUMMARIES) == list(VOCAB)
    assert all(t.src_vocab == t.tgt_vocab == VOCAB[n] and t.summary == SUMMARIES[n] for n, t in TASKS.items())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_not_called_empty(tmp_path):
    os.mkfifo(tmp_path / "pipe.pt")
    line = refuse_without_torch(tmp_path, ["triage", "pipe.pt"])
    assert "pipe.pt is a FIFO (named pipe), not a regular file" in line and "empty" not in line
    from tndebug.errors import UsageError
    from tndebug.triage.loading import load_checkpoint
    with pytest.raises(UsageError, match="FIFO"):           # the library's loader says the same
        load_checkpoint(tmp_path / "pipe.pt")


def test_a_binary_text_file_is_refused_before_the_model_is_built(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bart"}')
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x" * 16)
    (tmp_path / "pairs.tsv").write_bytes(bytes(range(256)) * 8)
    line = refuse_without_torch(tmp_path, ["triage", "hf", "--text", "pairs.tsv"])
    assert line.startswith("tndebug: error: --text pairs.tsv: not UTF-8 text (byte 128: 0x80)")
    from tndebug.errors import UsageError
    from tndebug.triage.hf_data import load_text
    with pytest.raises(UsageError, match="not UTF-8 text"):  # the loader itself refuses it too
        load_text(str(tmp_path / "pairs.tsv"), tmp_path / "hf", {})


# -- names, codes, JSON and foreign files, before torch (issue 47: 11 refusals took 2-7 s) ---------
@pytest.mark.parametrize("argv, says", [
    (["triage", "model.pt", "--probe", "bogus"], "unknown probe 'bogus'; valid: nan-scores"),
    (["triage", "model.pt", "--probe", "all,nan-scores"], "'all' is a selection by itself"),
    (["triage", "model.pt", "--select", "nope/code"], "--select 'nope/code': no such finding code"),
    (["triage", "model.pt", "--ignore", "bogus"], "--ignore 'bogus': no such finding code"),
    (["run", "--select", "nope/code", "--preset", "tiny"], "--select 'nope/code': no such"),
    (["run", "--ignore", "bogus"], "--ignore 'bogus': no such finding code"),
    (["check", "m.py:build", "--select", "nope"], "--select 'nope': no such finding code"),
    (["triage", "model.pt", "--adapter", "fairseq"], "--adapter 'fairseq': not a built-in adapter"),
    (["check", "m.py:build", "--adapter", "fairseq"], "--adapter 'fairseq': not a built-in adapter"),
    (["triage", "model.pt", "--config", "{d_model: 3"], "--config is not valid JSON (Expecting"),
    (["triage", "model.pt", "--config", "missing.json"], "--config: no such file missing.json"),
    (["check", "m.py:build", "--config", "[1]"], "--config must be a JSON object"),
    (["triage", "mine.png"], "mine.png is not a PyTorch checkpoint: neither a zip archive "
                             "(torch.save) nor a pickle; it begins with the bytes 89 50 4e 47"),
    (["triage", "data.csv"], "it begins with the text 'a,b'"),
    (["run", "--resume", "data.csv"], "data.csv is not a PyTorch checkpoint"),
    (["triage", "model.pt", "--data", "data.csv"], "--data data.csv: not a torch.save file: "
                                                   "neither a zip archive nor a pickle"),
    (["triage", "model.pt", "--model", "data.csv:make"], "--model: cannot import data.csv "
                                                         "(not a Python file?)"),
])
def test_names_codes_json_and_foreign_files_are_refused_before_torch(tmp_path, argv, says):
    (tmp_path / "model.pt").write_bytes(b"PK not really")
    (tmp_path / "m.py").write_text("def build():\n    pass\n")
    (tmp_path / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    line = refuse_without_torch(tmp_path, argv)
    assert says in line, line


def test_the_torch_free_code_list_is_the_probes_own():
    from tndebug.commands.cheap import declared_codes
    from tndebug.probes.codes import all_codes
    assert list(declared_codes()) == [c for c, _ in all_codes()]


def test_the_torch_free_adapter_names_are_the_built_in_adapters():
    import inspect
    import re
    from tndebug.capture import adapters
    from tndebug.task_names import ADAPTER_NAMES
    dispatched = re.findall(r'name == "(\w+)"', inspect.getsource(adapters.builtin_adapter))
    assert ADAPTER_NAMES == adapters.BUILTIN and sorted(dispatched) == sorted(ADAPTER_NAMES)


@pytest.mark.parametrize("command", [["run"], ["triage", "ckpt.pt"], ["check", "m.py:make"]])
def test_an_out_that_cannot_be_made_is_refused_before_torch(tmp_path, command):
    import zipfile
    with zipfile.ZipFile(tmp_path / "ckpt.pt", "w") as z:     # looks like torch.save's zip
        z.writestr("ckpt/data.pkl", b"\x80\x02}q\x00.")
    (tmp_path / "m.py").write_text("def make():\n    pass\n")
    (tmp_path / "a_file").write_text("mine\n")
    line = refuse_without_torch(tmp_path, command + ["--out", "a_file/sub/dir"])
    assert "a_file is a file, so no directory can be made under it" in line
    assert (tmp_path / "a_file").read_text() == "mine\n"


def test_the_out_try_leaves_no_directory_behind(tmp_path):
    from tndebug.commands.cheap import out_place
    (tmp_path / "kept").mkdir()
    out_place(str(tmp_path / "kept" / "new" / "deeper"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    out_place(str(tmp_path / "kept"))                 # exists: left to the later rules
    assert (tmp_path / "kept").is_dir()


def test_an_out_the_file_system_refuses_is_refused_before_torch(tmp_path):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    line = refuse_without_torch(tmp_path, ["run", "--out", "/proc/tndebug-out/x"])
    assert "--out /proc/tndebug-out/x: cannot create it" in line
