"""A paper-tutorial encoder-decoder (tests/foreign/two_input_seq2seq.py: `forward(src, trg)`
returning flattened logits, blocks in ModuleLists named `layer_stack` returning tuples) is
checked with no adapter and no --arch, as a new user runs it: the call is guessed from the
model's shape, the blocks are found from what the list items hold, and its one-line bugs are
named. Before: refused ("do not know how to call"), and with an adapter INCOMPLETE (no blocks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tndebug.cli import main

HERE = Path(__file__).parent
SPEC = f"{HERE / 'two_input_seq2seq.py'}:make"


def _concise(capsys, *extra):
    code = main(["check", SPEC, "--format", "concise", *extra])
    return code, capsys.readouterr().out.splitlines()


def test_healthy_model_is_called_by_guess_and_checked_clean(capsys):
    code, out = _concise(capsys)
    assert out[-1].startswith("tndebug check: CLEAN"), out
    assert code == 0


def test_blocks_in_an_unnamed_list_reach_the_depth_probes(capsys):
    code = main(["check", SPEC, "--format", "json", "--probe", "variance-drift,ln-placement"])
    report = json.loads(capsys.readouterr().out)
    status = {name: p["status"] for name, p in report["probes"].items()}
    assert status["variance-drift"] == "pass" and status["ln-placement"] == "pass", status
    assert code == 0


def _line(text: str) -> int:
    return next(i for i, line in enumerate((HERE / "two_input_seq2seq.py").read_text().splitlines(), 1)
                if text in line)


@pytest.mark.parametrize("bug,code_name,at", [
    ("no_scale", "missing-scale/absent", "torch.matmul(q / self.temperature"),   # where it applies
    ("no_causal", "mask-broadcast/causal-leak", None)])
def test_one_line_bugs_are_named(capsys, bug, code_name, at):
    code, out = _concise(capsys, "--config", json.dumps({"bug": bug}))
    errors = [line for line in out if " error: " in line]
    assert code == 1 and len(errors) == 1, out
    assert f"{code_name} error" in errors[0] and "two_input_seq2seq.py:" in errors[0]
    if at is not None:
        assert f"two_input_seq2seq.py:{_line(at)}: " in errors[0]


def test_a_built_in_adapter_named_on_the_command_line_is_used(capsys):
    # `--adapter annotated` was dropped by `check` (the model was called by guess and passed)
    code = main(["check", SPEC, "--adapter", "annotated", "--format", "concise"])
    err = capsys.readouterr().err
    assert code == 2 and "annotated raised AttributeError" in err, err


def test_concise_output_says_what_could_not_be_checked(tmp_path, monkeypatch, capsys):
    """Exit 4 in CI with --format concise: the lines say which probe could not check and why
    (they gave only "tndebug check: INCOMPLETE (...)"). Here the projections sit in a module
    whose class name says nothing of attention, so missing-scale cannot trace q and k."""
    (tmp_path / "renamed.py").write_text(
        "import two_input_seq2seq as m\n"
        "class MultiHead(m.MultiHeadAttention):\n    pass\n"
        "m.MultiHeadAttention = MultiHead\n"
        "def make():\n    return m.make()\n")
    monkeypatch.syspath_prepend(str(HERE))
    code = main(["check", f"{tmp_path / 'renamed.py'}:make", "--format", "concise",
                 "--probe", "missing-scale"])
    out = capsys.readouterr().out.splitlines()
    assert code == 4 and out[-1].startswith("tndebug check: INCOMPLETE"), out
    assert out[-2].startswith("tndebug check: not checked: missing-scale: q and k"), out
