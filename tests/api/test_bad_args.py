"""Every bad argument of tndebug.watch and tndebug.check is one UsageError line, raised on entry,
that names the argument and the bad value; the good call next to it still works (issue 18)."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch

import models as M
import tndebug
from tndebug.errors import UsageError
from tndebug.padding import mid_sequence_pads
from tndebug.triage.userdata import to_batch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def model():
    return M.FusedSDPA()


def watch(model, opt=None, **kw):
    kw = {"forward": M.fused_forward, "quiet": True, **kw}
    return tndebug.watch(model, opt, **kw)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# -- arguments refused when the watch is made --------------------------------------------------
def test_criterion_not_callable(model):
    with pytest.raises(UsageError) as e:
        watch(model, criterion="cross_entropy")
    assert one_line(e).startswith("watch: criterion='cross_entropy' is a str, not a callable; pass")
    watch(model, criterion=torch.nn.CrossEntropyLoss())             # a callable is taken


@pytest.mark.parametrize("spec", ["", " , ", []])
def test_empty_probe_selection(model, spec):
    with pytest.raises(UsageError, match="selects no probe"):
        watch(model, probes=spec)
    with pytest.raises(UsageError, match="^check: probes=.* selects no probe"):
        tndebug.check(model, M.fused_forward, probes=spec)


def test_none_on_purpose_and_names_still_work(model):
    assert watch(model, probes="none") is not None
    report = tndebug.check(model, M.fused_forward, probes="nan-scores")
    assert report.run["probes_run"] == ["nan-scores"]


@pytest.mark.parametrize("kw, text", [(dict(start_step=-1), "start_step=-1; expected an integer >= 0"),
                                      (dict(total_steps=0), "total_steps=0; expected an integer >= 1"),
                                      (dict(probes=5), "probes=5; expected")])
def test_numbers_and_types(model, kw, text):
    with pytest.raises(UsageError, match=text.replace("(", r"\(")):
        watch(model, **kw)


# -- ids and the vocabulary --------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    (dict(pad_id=-1), "pad_id=-1 is not a token id (ids are >= 0)"),
    (dict(pad_id=99), f"pad_id=99 is outside the model's vocabulary (ids 0..{M.V - 1})"),
    (dict(bos_id=99), f"bos_id=99 is outside the model's vocabulary (ids 0..{M.V - 1})"),
    (dict(pad_id=1.5), "pad_id=1.5: expected an integer token id")])
def test_ids_outside_the_vocabulary(model, kw, text):
    """Before: pad_id=-1 made nan-scores, missing-scale and mask-broadcast raise at setup and
    the verdict was CLEAN."""
    with pytest.raises(UsageError) as e:
        watch(model, **kw).__enter__()
    assert one_line(e).startswith(text)
    with pytest.raises(UsageError, match=text.replace("(", r"\(").replace(")", r"\)")):
        tndebug.check(model, M.fused_forward, **kw)


def test_a_forward_with_another_vocabulary_size(model):
    with pytest.raises(UsageError) as e:
        tndebug.check(model, lambda m, s, t, p: m(s, t, p)[..., :-1])
    assert one_line(e) == (f"forward=<lambda> returns logits over {M.V - 1} ids, but the model's "
                           f"token embeddings have {M.V} rows; return the model's full logits "
                           f"[B, T, V], or pass tgt_vocab={M.V - 1} if {M.V - 1} is right")
    with pytest.raises(UsageError, match=f"returns logits over {M.V} ids, but tgt_vocab=12"):
        watch(model, tgt_vocab=12).__enter__()
    # the model's own logits, or the forward computing them from the model's sizes, are fine
    assert tndebug.check(model, lambda m, s, t, p: m(s, t, p).log_softmax(-1)).run["tgt_vocab"] == M.V


# -- check(): probes and data --------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["lr-schedule", "nan-scores,label-smoothing", ["loss-health"]])
def test_check_refuses_probes_that_need_a_training_run(model, spec):
    """Before: check(..., probes="lr-schedule") was clean with nothing checked."""
    with pytest.raises(UsageError) as e:
        tndebug.check(model, M.fused_forward, probes=spec)
    assert "judge a training run" in one_line(e) and "tndebug.watch" in str(e.value)


def test_check_all_means_the_probes_check_can_run(model):
    from tndebug.probes import TRIAGE_PROBES
    report = tndebug.check(model, M.fused_forward, probes="all")
    assert report.run["probes_run"] == list(TRIAGE_PROBES)


def test_check_data_that_is_not_ids(model):
    src, tgt = M.copy_batch(torch.Generator().manual_seed(0))
    with pytest.raises(UsageError, match=r"^check: data= src is a float32 tensor of shape \(16, 8\)"):
        tndebug.check(model, M.fused_forward, data=(src.float(), tgt))
    with pytest.raises(UsageError, match="tgt holds token id 99, outside the model's vocabulary"):
        tndebug.check(model, M.fused_forward, data=(src, tgt.masked_fill(tgt == 3, 99)))
    with pytest.raises(UsageError, match="got 1 items"):
        tndebug.check(model, M.fused_forward, data=(src,))
    assert tndebug.check(model, M.fused_forward, data=(src, tgt)).run["held_out_sequences"] == 16


# -- a pad id that is a real token -------------------------------------------------------------
def test_mid_sequence_pads_found_only_between_real_tokens():
    t = torch.tensor([[5, 3, 4, 0, 0],       # right padding: no
                      [0, 0, 3, 4, 2],       # left padding: no
                      [1, 3, 0, 4, 0]])      # a pad between two tokens: row 2, position 2
    assert mid_sequence_pads({"src": t}, 0) == {"src": {"rows": 1, "of": 3, "at": [(2, 2)]}}
    assert mid_sequence_pads({"src": t[:2]}, 0) == {}


def test_check_data_with_the_pad_id_mid_sequence(model):
    src, tgt = M.copy_batch(torch.Generator().manual_seed(0))
    with pytest.raises(UsageError) as e:
        tndebug.check(model, M.fused_forward, data=(src, tgt), pad_id=5)
    line = one_line(e)
    assert line.startswith("check: data= pad id 5 occurs mid-sequence (a real token on both "
                           "sides) in 7 of 16 rows of src (row 0 position 1")
    assert line.endswith("so 5 is likely a real token and the pad id given is wrong; pass the "
                         "id your rows are padded with (pad_id=), or pad_id=None if your data "
                         "have no padding")
    assert tndebug.check(model, M.fused_forward, data=(src, tgt), pad_id=0).verdict != "errors"


def test_triage_data_with_the_pad_id_mid_sequence():
    src, tgt = M.copy_batch(torch.Generator().manual_seed(0))
    with pytest.raises(UsageError) as e:
        to_batch({"src": src, "tgt": tgt}, 5, 1, "held.pt")
    assert one_line(e).startswith("--data held.pt: pad id 5 occurs mid-sequence")
    assert str(e.value).endswith("pass the model's pad id (--pad-id)")
    assert to_batch({"src": src, "tgt": tgt}, 0, 1, "held.pt").src.shape == (16, 8)


def test_watch_reports_the_pad_id_once_as_a_finding(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, pad_id=5, probes="loss-health") as dbg:
        M.train("sdpa", model, opt, 3)
    (f,) = dbg._data_findings
    assert (f.probe, f.severity, f.where, f.step) == ("pad-id", "warning", "", 0)
    assert f.evidence["src_rows"] == "7 of 16" and f.evidence["src_positions"][0] == (0, 1)
    assert "pad_id=ID" in f.fix and "pad_id=None" in f.fix and "batch=" in f.fix
    assert f.evidence["pads_at_row_ends_if_sequence_first"] is False
    model2 = M.FusedSDPA()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    with watch(model2, opt2, probes="loss-health") as good:
        M.train("sdpa", model2, opt2, 3)
    assert good._data_findings == []


def test_the_pad_id_finding_reaches_the_report(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, pad_id=5, probes="loss-health") as dbg:
        M.train("sdpa", model, opt, 3)
    assert [f.probe for f in dbg.report.findings if f.probe == "pad-id"] == ["pad-id"]


# -- during the block: the loss and batch= --------------------------------------------------------
def test_a_loss_that_is_not_a_scalar(model):
    with watch(model, probes="gradient-flow") as dbg:
        with pytest.raises(UsageError) as e:
            dbg.step(loss=torch.ones(4))
        assert one_line(e) == ("dbg.step(loss=...): got a tensor of shape (4,); expected the step's "
                               "scalar loss (a 0-d tensor or a number): pass the reduced loss, "
                               "e.g. loss.mean()")
        with pytest.raises(UsageError, match=r"got 'low' \(str\)"):
            dbg.step(loss="low")
        dbg.step(loss=torch.tensor(1.5))
        dbg.step(loss=2.0)
    assert dbg.report.run["steps"] == 2


@pytest.mark.parametrize("fn, text", [
    (lambda a, k: None, "watch: batch= returned None for the model's call; it must return (src"),
    (lambda a, k: (a[0],), "watch: batch= returned a tuple of 1 item; it must return"),
    (lambda a, k: (a[0], a[1].float()), "watch: batch= returned a float32 tensor of shape"),
    (lambda a, k: (a[0], a[1][:3]), "watch: batch= returned tgt_in with 3 rows, src has 16"),
    (lambda a, k: k["nope"], "watch: batch= raised KeyError: 'nope'")])
def test_a_batch_function_that_returns_no_batch(model, fn, text):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(UsageError) as e:
        with watch(model, opt, batch=fn, probes="loss-health"):
            M.train("sdpa", model, opt, 2)
    assert one_line(e).startswith(text)


def test_a_good_batch_function(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, batch=lambda a, k: (a[0], a[1]), probes="loss-health") as dbg:
        M.train("sdpa", model, opt, 3)
    assert dbg.report.run["steps"] == 3 and dbg.report.probes["loss-health"]["steps_observed"] > 0


# -- out=: the CLI's output rules ----------------------------------------------------------------
def test_out_a_file_or_under_one(model, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError) as e:
        watch(model, out=tmp_path / "afile")
    assert one_line(e) == f"watch: out='{tmp_path / 'afile'}': is a file, not a directory; pass a directory path"
    with pytest.raises(UsageError, match="is a file, so no directory can be made under it"):
        watch(model, out=tmp_path / "afile" / "run")
    with pytest.raises(UsageError, match="expected a directory path"):
        watch(model, out=3)


def _short_run(model, out, **kw):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, out=out, probes="loss-health", **kw) as dbg:
        M.train("sdpa", model, opt, 2)
    return dbg


def test_out_that_holds_a_run_needs_overwrite(model, tmp_path):
    d = tmp_path / "run"
    _short_run(model, d)
    assert (d / "report.json").is_file() and not (d / ".tndebug.lock").exists()
    with pytest.raises(UsageError) as e:
        watch(model, out=d)
    assert one_line(e) == (f"watch: out='{d}' already holds tndebug output (report.json, "
                           f"report.md, tb/); pass overwrite=True to replace it, or another out=")
    _short_run(model, d, overwrite=True)
    assert len(list((d / "tb").glob("events.out.tfevents.*"))) == 1      # never two runs in tb/
    assert json.loads((d / "report.json").read_text())["run"]["steps"] == 2


def test_a_resumed_watch_continues_in_its_directory(model, tmp_path):
    d = tmp_path / "run"
    _short_run(model, d)
    dbg = _short_run(model, d, start_step=2)          # as `tndebug run --resume`: no overwrite
    assert dbg.report.run["start_step"] == 2


def test_out_in_use_is_refused(model, tmp_path):
    d = tmp_path / "busy"
    d.mkdir()
    (d / ".tndebug.lock").write_text(f"pid=1\nhost={socket.gethostname()}\n")   # pid 1 is alive
    with pytest.raises(UsageError, match=r"is in use by another tndebug \(pid 1\); wait for it, "
                                         r"or pass another out="):
        watch(model, out=d).__enter__()
    os.remove(d / ".tndebug.lock")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with watch(model, opt, out=d, probes="loss-health", tensorboard=False):   # nothing in d yet
        with pytest.raises(UsageError, match="in use by another tndebug.watch in this process"):
            watch(model, out=d).__enter__()
        M.train("sdpa", model, opt, 1)



def test_an_entry_that_fails_after_the_claim_leaves_no_lock_and_no_directory(model, tmp_path,
                                                                             monkeypatch):
    from tndebug.reporters import session

    def broken(self, *a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(session.ReportSession, "__init__", broken)
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="disk full"):
        watch(model, out=fresh).__enter__()
    assert not fresh.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        watch(model, out=kept).__enter__()
    assert kept.is_dir() and not (kept / ".tndebug.lock").exists()


@pytest.mark.parametrize("kw", [dict(src_vocab=0), dict(tgt_vocab=1), dict(src_vocab=2.5),
                                dict(tgt_vocab=True)])
def test_a_vocabulary_size_that_is_none_is_refused(model, kw):
    """Issue 47's bench: check(src_vocab=0) was accepted."""
    name, value = next(iter(kw.items()))
    with pytest.raises(UsageError, match=f"{name}={value!r}: expected the vocabulary size"):
        tndebug.check(model, M.fused_forward, **kw)
