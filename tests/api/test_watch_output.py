"""tndebug.watch's console output (issue 44): the training script's stdout stays its own; a few
lines on stderr (verdict, counts, the findings' codes, the files); the whole summary on stdout
only with print_report=True; nothing with quiet=True."""
from __future__ import annotations

import pytest
import torch

import models as M
import tndebug


def run(tmp_path, *, zero=True, **kw):
    build, forward = M.MODELS["sdpa"]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, forward=forward, out=tmp_path / "run", probes="zero-grad",
                       tensorboard=False, **kw) as dbg:
        for _ in range(4):
            src, tgt = M.copy_batch(g)
            loss = M.train_step("sdpa", model, src, tgt)
            if zero:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            print("my loss", loss.item())           # the script's own output
    return dbg


def test_stdout_is_the_scripts_and_a_short_summary_goes_to_stderr(tmp_path, capsys):
    dbg = run(tmp_path, zero=False)
    out, err = capsys.readouterr()
    assert [ln.split()[:2] for ln in out.splitlines()] == [["my", "loss"]] * 4
    lines = err.strip().splitlines()
    assert lines[0] == "tndebug: verdict ERRORS (1 error, 0 warnings, 0 info)", err
    assert any(ln.startswith("  ERROR zero-grad/grads-accumulate at step 1: ") for ln in lines), err
    assert f"  report: {tmp_path / 'run' / 'report.json'}" in lines
    assert len(lines) <= 6 and dbg.exit_code == 1


def test_print_report_puts_the_whole_summary_on_stdout(tmp_path, capsys):
    run(tmp_path, print_report=True)
    out, err = capsys.readouterr()
    assert "verdict: CLEAN" in out and "probes passed (1): zero-grad" in out
    assert "tndebug: verdict" not in err


@pytest.mark.parametrize("kw", [{"quiet": True}, {"quiet": True, "print_report": True}])
def test_quiet_prints_nothing(tmp_path, capsys, kw):
    run(tmp_path, **kw)
    out, err = capsys.readouterr()
    assert "verdict" not in out + err and (tmp_path / "run" / "report.json").is_file()


def test_a_long_message_on_stderr_is_cut_at_a_word():
    # a positions-never-applied message (160 characters) stopped mid-word: "... at pos"
    from tndebug.reporters.common import clipped
    text = ("positions never applied: the model declares position_embedding_table, but swapping "
            "the tokens at positions 1 and 6 leaves the first attention unchanged")
    out = clipped(text, 100)
    assert len(out) <= 100 and out.endswith("…")
    assert text.startswith(out[:-1]) and text[len(out) - 1] == " "      # cut before a space
    assert clipped("short", 100) == "short"
