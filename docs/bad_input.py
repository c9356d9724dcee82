"""Regenerate docs/bad_input.md: run every kind of bad input and record what the user gets.

    python docs/bad_input.py            # rewrites docs/bad_input.md (about a minute on CPU)

Each case runs `tndebug ...` in process, in a scratch directory, so the messages show the
relative paths a user would type; each library case (`LIBRARY_CASES`) runs its line of Python
there against a small model and records the UsageError's line. tests/test_bad_input_doc.py
reruns the quick cases and checks the document still says what they print.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

DOC = Path(__file__).with_name("bad_input.md")
TINY = ["--preset", "tiny", "--probe", "none", "--batch-size", "8"]


def _setup(d: Path) -> None:
    """The files the cases read: made once, in the scratch directory `d`."""
    import torch

    from tndebug.cli import main
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        main(["run", *TINY, "--steps", "1", "--out", "run"])
    state = torch.load(d / "run" / "checkpoint.pt", weights_only=True)
    (d / "mismatch").mkdir()
    key = next(iter(state["model"]))
    state["model"][key] = torch.zeros(3, 3)
    torch.save(state, d / "mismatch" / "checkpoint.pt")
    sd = make_model(ModelConfig.tiny()).state_dict()
    torch.save({"model": sd}, d / "model.pt")
    good = (d / "model.pt").read_bytes()
    (d / "truncated.pt").write_bytes(good[:1000])
    torch.save({"model": sd}, d / "legacy.pt", _use_new_zipfile_serialization=False)
    (d / "truncated_legacy.pt").write_bytes((d / "legacy.pt").read_bytes()[:5000])
    (d / "empty.pt").write_bytes(b"")
    (d / "notes.pt").write_text("just text\n")
    (d / "junk.pt").write_bytes(b"\x00\x01\x02\x03binary")
    torch.save({}, d / "empty_dict.pt")
    torch.save({"epoch": 3, "loss": 1.5}, d / "no_weights.pt")
    torch.save({"model": {"w": torch.ones(1)}, "cfg": print}, d / "unsafe.pt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), d / "script.pt")
    (d / "emptydir").mkdir()
    torch.save({"a.weight": torch.ones(3, 3)}, d / "odd_layout.pt")
    (d / "afile").write_text("x")
    (d / "mymodel.py").write_text("def make_model(**kw):\n    raise RuntimeError('nope')\n")
    src, tgt = _ids()
    torch.save({"src": src, "tgt": tgt}, d / "mid_pad.pt")
    torch.save({"ids": src}, d / "ids.pt")
    (d / "mine" / "figures").mkdir(parents=True)           # a folder of the user's own files
    for name, text in (("report.md", "# my notes\n"), ("data.csv", "a,b\n"), ("figures/mine.png", "png")):
        (d / "mine" / name).write_text(text)
    (d / "exits.py").write_text("import sys\ndef make_model(**kw):\n    sys.exit(0)\n")
    (d / "notfn.py").write_text("make_model = 3\n")
    _flipped(d / "model.pt", d / "flipped.pt")
    (d / "hf_code").mkdir()
    (d / "hf_code" / "config.json").write_text('{"model_type": "bart", "vocab_size": 96}')
    torch.save({"w": torch.ones(1), "cfg": print}, d / "hf_code" / "pytorch_model.bin")
    (d / "hf_cfgdir" / "config.json").mkdir(parents=True)
    torch.save({"w": torch.ones(1)}, d / "hf_cfgdir" / "pytorch_model.bin")
    if hasattr(os, "mkfifo"):
        os.mkfifo(d / "pipe.pt")
    (d / "pairs.bin").write_bytes(bytes(range(256)) * 4)
    zoo = Path(__file__).resolve().parents[1] / "tests" / "zoo" / "torch_seq2seq.py"
    (d / "seq.py").write_text(zoo.read_text())
    sys.path.insert(0, str(d))
    import importlib
    seq = importlib.import_module("seq")
    torch.save({"model": seq.build().state_dict()}, d / "seq.pt")
    sys.path.remove(str(d))
    for name, body in (("int_logits", "y.long()"), ("fewer_ids", "y[..., :-3]")):
        (d / f"{name}.py").write_text("from seq import forward as f\n"
                                      "def forward(model, src, tgt, pad_id):\n"
                                      f"    y = f(model, src, tgt, pad_id)\n    return {body}\n")
    (d / "meta.py").write_text("import torch\nimport seq\n"
                               "def build(**kw):\n    with torch.device('meta'):\n        return seq.build(**kw)\n")


def _flipped(src: Path, dst: Path) -> None:
    """`src` with 64 bytes of its largest tensor record XOR-ed (the zip CRC then fails)."""
    import zipfile
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 128
    for i in range(start, start + 64):
        data[i] ^= 0x40
    dst.write_bytes(bytes(data))


def _ids():
    """16 rows of ids 2..10 (tgt BOS-led, 1): id 5 occurs mid-sequence, as a real token does."""
    import torch
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, 11, (16, 8), generator=g)
    return src, torch.cat([torch.ones(16, 1, dtype=torch.long), src], 1)


# (what, argv, quick): the quick cases are rerun by the test (each takes well under a second)
CASES = [
    ("an unknown fault", ["run", "--fault", "nope"], True),
    ("an unknown probe", ["run", "--probe", "nan-scores,bogus"], True),
    ("a negative step count", ["run", "--steps", "-1"], True),
    ("a step count that is not a number", ["run", "--steps", "many"], True),
    ("a non-finite lr factor", ["run", "--lr-factor", "nan"], True),
    ("a zero lr factor", ["run", "--lr-factor", "0"], True),
    ("a warmup below 1", ["run", "--warmup", "0"], True),
    ("a batch size of 0", ["run", "--batch-size", "0"], True),
    ("0 processes", ["run", "--nproc", "0"], True),
    ("a negative --save-every", ["run", "--save-every", "-1"], True),
    ("an empty probe selection", ["run", "--probe", ""], True),
    ("an abbreviated flag (no prefix matching)", ["run", "--prob", "all"], True),
    ("a batch that does not split over the processes", ["run", "--nproc", "3"], True),
    ("fp16 without CUDA", ["run", "--amp", "fp16", "--device", "cpu"], True),
    ("rotary positions on the encoder-decoder", ["run", "--pos", "rotary"], True),
    ("a rotary fault without rotary positions", ["run", "--arch", "decoder", "--fault", "rotary_q_only"], True),
    ("--out that is a file", ["run", *TINY, "--out", "afile"], True),
    ("--out under a file", ["run", *TINY, "--out", "afile/run"], True),
    ("--out that already holds a run", ["run", *TINY, "--out", "run"], True),
    ("an empty --out (it would write into the current directory)", ["run", *TINY, "--out", ""], True),
    ("--out holding the user's own report.md (data.csv, figures/mine.png beside it)",
     ["run", *TINY, "--out", "mine"], True),
    ("... and with --overwrite (only what tndebug wrote is ever removed)",
     ["run", *TINY, "--out", "mine", "--overwrite"], True),
    ("a batch size no memory holds", ["run", "--batch-size", "1000000000000"], True),
    ("a seed over 64 bits", ["run", "--seed", str(2**70)], True),
    ("an lr factor far beyond training", ["run", "--lr-factor", "1e300"], True),
    ("a step count beyond any run", ["run", "--steps", "10000000000"], True),
    ("more processes than one machine runs", ["run", "--nproc", "100"], True),
    ("all or none inside a list of probes", ["run", "--probe", "all,none"], True),
    ("a missing --resume", ["run", "--resume", "nowhere"], True),
    ("--resume on a text file", ["run", "--resume", "notes.pt"], True),
    ("--resume on an unsafe pickle", ["run", "--resume", "unsafe.pt"], True),
    ("--resume on a checkpoint not written by tndebug run", ["run", "--resume", "model.pt"], True),
    ("--resume on a truncated file", ["run", "--resume", "truncated.pt"], True),
    ("--resume with a flag that contradicts the checkpoint", ["run", "--resume", "run", "--task", "sort"], True),
    ("--resume whose weights do not fit the model", ["run", "--resume", "mismatch", "--probe", "none"], False),
    ("--resume adding a fault that changes the parameters", ["run", "--resume", "run", "--fault", "shared_qkv"], False),
    ("a missing checkpoint", ["triage", "nope.pt"], True),
    ("an empty file", ["triage", "empty.pt"], True),
    ("a truncated checkpoint", ["triage", "truncated.pt"], True),
    ("a truncated legacy (non-zip) checkpoint", ["triage", "truncated_legacy.pt"], True),
    ("a text file", ["triage", "notes.pt"], True),
    ("binary junk", ["triage", "junk.pt"], True),
    ("an empty dict", ["triage", "empty_dict.pt"], True),
    ("a dict with no weights", ["triage", "no_weights.pt"], True),
    ("an unsafe pickle (code in the file)", ["triage", "unsafe.pt", "--out", "refused"], True),
    ("a TorchScript archive", ["triage", "script.pt"], True),
    ("a directory without a checkpoint", ["triage", "emptydir"], True),
    ("weights of no layout tndebug knows", ["triage", "odd_layout.pt"], False),
    ("0 heads", ["triage", "model.pt", "--heads", "0"], True),
    ("a negative pad id", ["triage", "model.pt", "--pad-id", "-1"], True),
    ("triage with an empty probe selection", ["triage", "model.pt", "--probe", ""], True),
    ("--data whose pad id occurs mid-sequence (a real token)",
     ["triage", "model.pt", "--data", "mid_pad.pt", "--pad-id", "5"], True),
    ("--data of one sequence per row ({'ids': ...}) for an encoder-decoder",
     ["triage", "model.pt", "--data", "ids.pt"], True),
    ("--pad-id none (no padding) for an encoder-decoder", ["triage", "model.pt", "--pad-id", "none"], True),
    ("an adapter name that is not built in", ["triage", "model.pt", "--adapter", "fairseq"], True),
    ("--arch without --model (the layout says the shape)", ["triage", "model.pt", "--arch", "encoder"], True),
    ("--model without :FACTORY", ["triage", "model.pt", "--model", "mymodel.py"], False),
    ("--model file that does not exist", ["triage", "model.pt", "--model", "missing.py:make"], False),
    ("--model factory that raises", ["triage", "model.pt", "--model", "mymodel.py:make_model"], False),
    ("--config that is not JSON", ["triage", "model.pt", "--config", "{d_model: 3"], False),
    ("--model factory that calls sys.exit", ["triage", "model.pt", "--model", "exits.py:make_model"], False),
    ("--model name that is not a function", ["triage", "model.pt", "--model", "notfn.py:make_model"], False),
    ("a pad id outside the model's vocabulary", ["triage", "model.pt", "--heads", "4", "--pad-id", "999999"],
     False),
    ("a checkpoint whose bits changed after the save (zip CRC)", ["triage", "flipped.pt"], True),
    ("a Hugging Face folder whose pytorch_model.bin holds pickled code", ["triage", "hf_code"], False),
    ("a Hugging Face folder whose config.json is a directory", ["triage", "hf_cfgdir"], False),
    ("a FIFO (named pipe) given as the checkpoint", ["triage", "pipe.pt"], True),
    ("--text that is a binary file (refused before the model is built)",
     ["triage", "hf_code", "--text", "pairs.bin"], True),
    ("--adapter without --model on one of tndebug's layouts (it would be ignored)",
     ["triage", "model.pt", "--adapter", "seq.py:forward"], True),
    ("an adapter returning integer \"logits\"",
     ["triage", "seq.pt", "--model", "seq.py:build", "--adapter", "int_logits.py:forward"], False),
    ("an adapter returning logits over 3 ids fewer than the vocabulary",
     ["triage", "seq.pt", "--model", "seq.py:build", "--adapter", "fewer_ids.py:forward"], False),
    ("a --model factory that builds on the meta device (no weights)",
     ["triage", "seq.pt", "--model", "meta.py:build", "--adapter", "seq.py:forward"], False),
    ("triage --out that is a file", ["triage", "model.pt", "--out", "afile"], True),
    ("triage --out into a training run", ["triage", "run/checkpoint.pt", "--out", "run"], True),
]


# (what, the call, quick): one line of Python, run with `model` (tndebug's tiny Transformer: 11
# ids, 0 the pad, 1 the start), `opt` (its Adam), `src`/`tgt` (ids 2..10, tgt BOS-led) and
# `train_step(model, opt)` (one forward, backward and optimizer step of the user's loop)
LIBRARY_CASES = [
    ("a criterion that is not callable", 'tndebug.watch(model, opt, criterion="cross_entropy")', True),
    ("an empty probe selection", 'tndebug.watch(model, opt, probes="")', True),
    ("a budget that is no fraction", 'tndebug.watch(model, opt, budget=3)', True),
    ("an empty probe list", "tndebug.check(model, probes=[])", True),
    ("a probe that needs a training run, in check", 'tndebug.check(model, probes="lr-schedule")', True),
    ("a negative pad id", "tndebug.watch(model, opt, pad_id=-1).__enter__()", True),
    ("a pad id outside the vocabulary", "tndebug.check(model, pad_id=99)", True),
    ("a start id outside the vocabulary", "tndebug.check(model, bos_id=99)", True),
    ("a forward with another vocabulary size", "tndebug.check(model, lambda m, s, t, p: m(s, t)[..., :-1])", True),
    ("a forward that contradicts tgt_vocab=", "tndebug.check(model, lambda m, s, t, p: m(s, t), tgt_vocab=12)", True),
    ("data= that are not token ids", "tndebug.check(model, data=(src.float(), tgt))", True),
    ("data= whose pad id occurs mid-sequence (a real token)", "tndebug.check(model, data=(src, tgt), pad_id=5)", True),
    ("data= ids of one sequence per row for an encoder-decoder", "tndebug.check(model, data=src)", True),
    ("a loss that is not a scalar",
     "with tndebug.watch(model) as dbg: dbg.step(loss=torch.ones(4))", True),
    ("a batch= that returns None (at its first call)",
     "with tndebug.watch(model, opt, batch=lambda args, kwargs: None): train_step(model, opt)", True),
    ("a batch= that returns one tensor",
     "with tndebug.watch(model, opt, batch=lambda args, kwargs: args[0]): train_step(model, opt)", True),
    ("a model on the meta device (no weights)",
     'tndebug.check(torch.nn.Transformer(16, 2, 1, 1, 32).to("meta"))', True),
    ("a model without attention (embedding and linear layers only)",
     "tndebug.check(torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)), "
     "lambda m, s, t, p: m(t))", True),
    ("a forward returning integer \"logits\"",
     "tndebug.check(model, lambda m, s, t, p: m(s, t).argmax(-1, keepdim=True).expand(-1, -1, 11))", True),
    ("the optimizer of another model", "tndebug.watch(model, torch.optim.Adam(torch.nn.Linear(2, 2).parameters()))",
     True),
    ("ignore= that is no code or list of codes", "tndebug.check(model, ignore=3)", True),
    ("load_report of a file that is no report.json", 'tndebug.load_report("afile")', True),
    ("out= an empty path", 'tndebug.watch(model, opt, out="")', True),
    ("out= a file", 'tndebug.watch(model, opt, out="afile")', True),
    ("out= under a file", 'tndebug.watch(model, opt, out="afile/run")', True),
    ("out= a directory that holds a run", 'tndebug.watch(model, opt, out="run")', True),
]


def _library_namespace() -> dict:
    import torch

    import tndebug
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    src, tgt = _ids()

    def train_step(model, opt):
        model.train()
        logits = model(src, tgt[:, :-1])                                     # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"tndebug": tndebug, "torch": torch, "model": model, "opt": opt, "src": src,
            "tgt": tgt, "train_step": train_step}


def run_library_case(call: str) -> str:
    """The UsageError's line, or what else happened (then the document shows the defect)."""
    from tndebug.errors import UsageError
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            exec(call, _library_namespace())
        except UsageError as e:
            return f"UsageError: {e}"
        except Exception as e:  # noqa: BLE001 - recorded, so the test fails on it
            return f"not refused: {type(e).__name__}: {e}"
    return "not refused: no error"


def library_row(what: str, call: str, line: str) -> str:
    bar = chr(92) + "|"
    return f"| {what} | `{call.replace('|', bar)}` | {line.replace('|', bar)} |"


def run_case(argv: list[str]) -> tuple[int, str]:
    """(exit code, tndebug's first line on stderr)."""
    from tndebug.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("tndebug:")]
    return code, lines[0] if lines else ""


@contextlib.contextmanager
def scratch():
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="tndebug-bad-input-") as tmp:
        os.chdir(tmp)
        try:
            _setup(Path(tmp))
            yield Path(tmp)
        finally:
            os.chdir(old)


def row(what: str, argv: list[str], code: int, line: str) -> str:
    cmd = "tndebug " + " ".join(a if a and " " not in a and "{" not in a else f"'{a}'" for a in argv)
    return f"| {what} | `{cmd}` | {code} | {line.replace('|', chr(92) + '|')} |"


HEAD = """# Bad input: each kind, and exactly what you get

Every bad input is refused with **one line** on stderr that starts `tndebug: error:`, names what
is wrong and what to do, and **exit code 2**; no traceback, nothing trained or written (an output
directory made for the command is removed again). Warnings from torch or from your own model
code come *after* that line. Output places (`--out`) are checked before any work. The one bad
input that also writes a report is an unsafe pickle: triage lists its globals, never runs them,
and writes a report that says so (see [triage.md](triage.md)). The rule for output directories is
in the README ("Outputs are never lost or mixed").

Not shown, because it depends on the machine: `--device cuda` without CUDA (`--device cuda: CUDA
is not available here (use --device cpu or auto)`), and an `--out` you may not write (`--out DIR:
PARENT is not writable; pass a directory you can write`), and a directory in use by another
tndebug (`DIR is in use by another tndebug (pid N); wait for it, or pass another --out (if
no tndebug runs there, remove DIR/.tndebug.lock)`), and more `--threads` than the machine has
cores (`argument --threads: 100000: must be at most N (the cores of this machine: more threads
only slow torch down)`). `tndebug` with no command prints its five-line usage (exit 2). The user's
code exiting (`sys.exit` in a `--model` factory, an adapter, or at the import of their file) is
one line naming the file and the line, exit 2.

Regenerated by `python docs/bad_input.py`; `tests/test_bad_input_doc.py` checks the quick cases.
Paths are relative to the directory the command runs in.

| bad input | command | exit | what you get (tndebug's first line) |
|---|---|---|---|
"""

LIBRARY_HEAD = """
## The library: `tndebug.watch` and `tndebug.check`

Every bad argument is refused with one `tndebug.errors.UsageError` whose message is one line: the
argument, the bad value, what to pass. It is raised on entry: when `watch(...)` or `check(...)`
is called, or when the `with` block is entered (the model is called once then, so the ids, the
vocabulary and the forward are checked there). Two arguments show only in the loop and are
refused at their first call: what `batch=` returns for the model's call, and
`dbg.step(loss=...)`. `watch(out=)` follows the output rule of `tndebug run` (tndebug/outputs.py):
a directory that holds a run is refused unless `overwrite=True`, which clears its reports,
figures and TensorBoard events first; a directory in use (`.tndebug.lock`, by another process
or another watch of this one) is refused; a resumed watch (`start_step > 0`) continues in its
own directory. `probes="none"` is a choice and is taken; an empty selection is refused. In
`watch`, where batches come from the training loop, a pad id that occurs mid-sequence is not
refused but reported once, from the first batch, as a warning finding of `pad-id`.

Each call below runs against `model` (tndebug's tiny Transformer: 11 ids, 0 the pad), `opt`
(its Adam), `src`/`tgt` (ids 2..10, `tgt` BOS-led) and `train_step(model, opt)` (one step of
the user's loop).

| bad argument | call | what you get |
|---|---|---|
"""


def main() -> int:
    rows, lib_rows = [], []
    with scratch():
        for what, argv, _quick in CASES:
            code, line = run_case(argv)
            rows.append(row(what, argv, code, line))
            print(rows[-1], file=sys.stderr)
        for what, call, _quick in LIBRARY_CASES:
            lib_rows.append(library_row(what, call, run_library_case(call)))
            print(lib_rows[-1], file=sys.stderr)
    DOC.write_text(HEAD + "\n".join(rows) + "\n" + LIBRARY_HEAD + "\n".join(lib_rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
