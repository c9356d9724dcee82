"""Triage of users' own decoder-only code: nanoGPT-style models (tests/foreign/nanogpt.py, fused
c_attn, a tril `bias` buffer or SDPA is_causal, tied wte/lm_head, learned wpe), trained briefly on
copy as a language model and saved as nanoGPT saves them. Healthy over three seeds and both
attention paths: clean (no warning, no error); each injected bug named by the probe that owns
it, with no error from another probe; q, k, v split in another order is the same model and
triages clean. The adapter is guessed (`gpt`) unless a test passes one."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from tndebug.capture.adapters import adapter_kind, import_file, resolve_adapter
from tndebug.errors import UsageError

from foreign_corpus import ROOT, probe_failures
from nanogpt_corpus import (BUG_CASES, EXPECTED_PROBE, FILE, describe, flagged, make_checkpoint,
                            run_triage)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
_cache: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("nanogpt")


def checkpoint(folder, variant, bug, seed):
    key = (variant, bug, seed)
    if key not in _cache:
        _cache[key] = make_checkpoint(variant, bug, seed, folder)
    return _cache[key]


@pytest.mark.parametrize("variant", ["manual", "sdpa"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_nanogpt_triages_clean(folder, variant, seed):
    report = run_triage(checkpoint(folder, variant, None, seed))
    bad = flagged(report)
    assert not bad, f"{variant} seed {seed}: false alarms\n{describe(bad)}"
    broke = probe_failures(report)
    assert not broke, f"{variant} seed {seed}: clean only because probes broke: {broke}"
    assert report.run["arch"] == "decoder" and report.run["adapter"] == "gpt"
    assert report.run["attention_modules"] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert report.probes["missing-scale"]["status"] == "pass"
    assert report.probes["label-shift"]["status"] == "pass"      # both places checked


@pytest.mark.parametrize("variant, bug", [pytest.param(v, b, id=f"{v}-{b}") for v, b in BUG_CASES])
def test_bug_is_named_by_its_probe(folder, variant, bug):
    report = run_triage(checkpoint(folder, variant, bug, 0))
    probe = EXPECTED_PROBE[bug]
    bad = flagged(report)
    if probe is None:                        # benign: a relabelling of learnt weights
        assert not bad, f"{variant} {bug} is benign, yet\n{describe(bad)}"
        return
    assert any(f.probe == probe for f in bad), \
        f"{variant} {bug}: {probe} reports nothing at warning or error\n{describe(report.findings)}"
    collateral = [f for f in bad if f.severity == "error" and f.probe != probe]
    assert not collateral, f"{variant} {bug}: errors from other probes\n{describe(collateral)}"
    assert not probe_failures(report)
    if bug == "pad_mask":
        # it masks the pad keys and counts positions from column 0, so left pads move its logits;
        # but it reads the future (the causal mask is gone), so generation is broken whatever
        # the padding: lm-decoding leaves left padding to the causal leak mask-broadcast names
        place = report.probes["lm-decoding"]["coverage"][""]
        assert place["status"] == "no verdict" and "not causal" in place["reason"], place


def test_unshifted_labels_on_a_tied_head_get_no_verdict_saying_why(folder):
    # nanoGPT ties lm_head to wte: at initialisation it already repeats its input, so a
    # checkpoint that repeats its input (the loss was computed against idx) cannot be told from
    # an untrained one; the test says so instead of an error or a silent pass
    report = run_triage(checkpoint(folder, "manual", "labels_unshifted", 0))
    assert not [f for f in report.findings if f.probe == "label-shift"]
    st = report.probes["label-shift"]
    assert st["status"] == "no verdict" and st["fresh_init"]["repeats_input_at_init"] is True
    assert "tied" in st["coverage"]["unshifted"]["reason"] and report.verdict == "incomplete"


# -- adapters -------------------------------------------------------------------------------
def test_a_three_parameter_user_adapter_makes_a_decoder_only_subject(folder):
    spec = f"{FILE}:forward"
    report = run_triage(checkpoint(folder, "manual", None, 0), adapter=spec)
    assert report.run["arch"] == "decoder" and report.run["adapter"] == spec
    assert not flagged(report), describe(flagged(report))
    assert "as_lm" in report.run["data"] and "forward(model, ids, pad_id)" in report.run["calls"]


def test_gpt_adapter_says_it_passes_targets_to_get_every_position():
    model = import_file(FILE).build().eval()
    adapter = resolve_adapter(None, model)
    ids = torch.randint(2, 11, (2, 7))
    assert adapter.name == "gpt" and adapter.kind == "decoder" and "model(idx, idx)" in adapter.note
    assert adapter.forward(model, ids, 0).shape == (2, 7, 11)
    assert model(ids)[0].shape == (2, 1, 11)          # nanoGPT without targets: the last only


class _LastOnly(nn.Module):
    """GPT-shaped, but returns the last position whatever it is given."""
    def __init__(self):
        super().__init__()
        self.wte, self.blocks = nn.Embedding(11, 8), nn.ModuleList([nn.MultiheadAttention(8, 2)])
        self.head = nn.Linear(8, 11)

    def forward(self, idx, targets=None):
        return self.head(self.wte(idx)[:, -1:])


def test_a_model_that_only_gives_the_last_position_is_one_line():
    with pytest.raises(UsageError, match=r"only the last position's logits \(1, 1, 11\).*"
                                         r"def forward\(model, ids, pad_id\)"):
        resolve_adapter(None, _LastOnly())


def test_a_model_whose_shape_cannot_be_told_names_what_was_found():
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    with pytest.raises(UsageError, match=r"found embeddings 0 \(11\); head 1; no numbered blocks"
                                         r".*--adapter gpt.*forward\(model, ids, pad_id\)") as e:
        resolve_adapter(None, model)
    assert "\n" not in str(e.value)


def test_adapter_kind_is_read_from_its_parameters():
    assert adapter_kind(lambda model, ids, pad_id: None, "a.py:f") == "decoder"
    assert adapter_kind(lambda model, src, tgt, pad_id: None, "a.py:f") == "seq2seq"
    assert adapter_kind(lambda model, src, tgt, pad_id=0: None, "a.py:f") == "seq2seq"
    with pytest.raises(UsageError, match="expected forward\\(model, ids, pad_id\\)"):
        adapter_kind(lambda model, ids: None, "a.py:f")


def test_cli_unknown_shape_exits_2(tmp_path):
    user = tmp_path / "user.py"
    user.write_text("from torch import nn\n"
                    "def build():\n    return nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))\n")
    torch.save({"model": import_file(user).build().state_dict()}, tmp_path / "u.pt")
    out = subprocess.run([sys.executable, "-m", "tndebug", "triage", str(tmp_path / "u.pt"),
                          "--model", f"{user}:build"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "do not know how to call Sequential" in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if ln.strip()]) == 1, out.stderr
