"""Data with no padding (pad_id=None) in `watch` and `check`, on a character-level nanoGPT-style
model and loop (tests/api/chargpt.py: id 0 is '\\n', a real character in every window): no pad
warning, label-smoothing says "no padding in this data", the run records pad_id None. A pad id
given that the data use as a token is still warned, and its fix names the argument to change;
a sequence-first call (model(src.T, tgt.T)) read batch-first is named, with the `batch=` that
reads it. `check(data=)` of a one-stack model takes ids [N, T] or {'ids': ...}."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tndebug
from tndebug.errors import UsageError

import chargpt
import models as M

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS = 150


def watched(steps=STEPS, **kw):
    torch.manual_seed(0)
    model = chargpt.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with tndebug.watch(model, opt, forward=chargpt.forward, quiet=True, total_steps=steps,
                       **kw) as dbg:
        loss = chargpt.train(model, opt, steps)
    return dbg, loss


@pytest.fixture(scope="module")
def no_pad():
    return watched(pad_id=None)


def test_a_healthy_character_level_run_with_no_pad_has_no_pad_warning(no_pad):
    dbg, loss = no_pad
    assert loss < 1.5                                         # it learnt (ln 17 = 2.8 at start)
    assert not [f for f in dbg.report.findings if f.severity in ("warning", "error")], \
        [(f.code, f.message) for f in dbg.report.findings]
    assert not [f for f in dbg.report.findings if "pad" in (f.code or "")
                and f.code != "lm-decoding/no-pad-mask"]
    assert dbg.report.verdict == "clean" and dbg.report.run["pad_id"] is None


def test_the_pad_dependent_tests_say_no_padding(no_pad):
    dbg, _ = no_pad
    st = dbg.report.probes["label-smoothing"]
    assert st["status"] in ("not applicable", "skipped")
    assert "no padding in this data" in str(st)
    for name in ("loss-health", "label-shift", "mask-broadcast", "lm-decoding"):
        assert dbg.report.probes[name]["status"] == "pass", (name, dbg.report.probes[name])


def test_a_pad_id_the_data_use_as_a_token_is_still_warned():
    dbg, _ = watched(pad_id=0, probes="loss-health")           # 0 is '\n', mid-row in every window
    (f,) = [f for f in dbg.report.findings if f.code == "pad-id/mid-sequence"]
    assert f.severity == "warning" and f.evidence["pad_id"] == 0
    assert f.evidence["tgt_in_rows"] == "16 of 16" and f.evidence["tgt_in_positions"]
    assert "pad_id=None" in f.fix and "pad_id=ID" in f.fix    # the argument to change, both ways
    assert f.evidence["pads_at_row_ends_if_sequence_first"] is False


# -- a sequence-first model --------------------------------------------------------------------------
class SeqFirst(nn.Module):
    """nn.Transformer as the PyTorch tutorials call it: [S, B] ids in, [T, B, V] logits out."""

    def __init__(self, d=32):
        super().__init__()
        self.emb, self.pos = nn.Embedding(M.V, d), nn.Embedding(32, d)
        self.transformer = nn.Transformer(d, 4, 1, 1, 64, dropout=0.0, norm_first=True)
        self.out = nn.Linear(d, M.V)

    def embed(self, ids):                                                 # [L, B] -> [L, B, d]
        return self.emb(ids) * 32 ** 0.5 + self.pos(torch.arange(ids.shape[0]))[:, None]

    def forward(self, src, tgt):                                          # [S, B], [T, B]
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[0])
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal,
                             src_key_padding_mask=(src == M.PAD).T,
                             memory_key_padding_mask=(src == M.PAD).T,
                             tgt_key_padding_mask=(tgt == M.PAD).T)
        return self.out(h)                                                # [T, B, V]


def seq_first_forward(model, src, tgt, pad_id):                           # batch-first for the probes
    return model(src.T, tgt.T).transpose(0, 1)


def seq_first_run(**kw):
    torch.manual_seed(0)
    model = SeqFirst()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, opt, forward=seq_first_forward, quiet=True,
                       probes="loss-health", **kw) as dbg:
        for _ in range(3):
            src, tgt = M.copy_batch(g)                                    # [B, S], [B, S + 1]
            logits = model(src.T, tgt[:, :-1].T)                          # [T, B, V]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].T.flatten(),
                                               ignore_index=M.PAD)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return dbg


def test_a_sequence_first_call_read_batch_first_names_batch():
    dbg = seq_first_run(pad_id=M.PAD)
    (f,) = [f for f in dbg.report.findings if f.code == "pad-id/mid-sequence"]
    assert f.evidence["pads_at_row_ends_if_sequence_first"] is True
    assert "sequence-first" in f.message
    assert "batch=lambda args, kwargs: (args[0].T, args[1].T)" in f.fix
    told = seq_first_run(pad_id=M.PAD, batch=lambda args, kwargs: (args[0].T, args[1].T))
    assert not [f for f in told.report.findings if f.code == "pad-id/mid-sequence"]


# -- check(data=) of a one-stack model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = chargpt.build()
    chargpt.train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), 200)
    stream = chargpt.text(seed=1)
    ids = torch.stack([stream[i:i + 32] for i in range(0, 32 * 12, 32)])  # [12, 32]
    return model.eval(), ids


@pytest.mark.parametrize("form", ["tensor", "dict"])
def test_check_takes_ids_of_a_one_stack_model(trained, form):
    model, ids = trained
    data = ids if form == "tensor" else {"ids": ids}
    report = tndebug.check(model, chargpt.forward, data=data, pad_id=None)
    assert report.run["data"] == "data=" and report.run["held_out_sequences"] == 12
    assert report.run["pad_id"] is None and report.run["arch"] == "decoder"
    assert report.verdict == "clean", [(f.code, f.message) for f in report.findings]


def test_check_with_a_pad_id_the_ids_use_says_pad_id_none(trained):
    model, ids = trained
    with pytest.raises(UsageError) as e:
        tndebug.check(model, chargpt.forward, data={"ids": ids}, pad_id=0)
    assert "pad_id=None if your data have no padding" in str(e.value) and "\n" not in str(e.value)


def test_check_of_an_encoder_decoder_given_ids_is_one_line():
    model = M.TorchTransformer()
    with pytest.raises(UsageError) as e:
        tndebug.check(model, M.torch_forward, data=torch.randint(2, M.V, (4, 6)))
    assert str(e.value).startswith("check: data= holds one sequence per row (ids), but the model "
                                   "is an encoder-decoder")


# -- a model with no padding mask, on data with no padding -------------------------------------------
def test_no_pad_mask_is_no_alarm_when_the_data_have_no_padding():
    """An encoder-only model that builds no padding mask (minibert's pad_leak) is a pad-leak only
    where pads exist: with pad_id=None the pad tests say "no padding in this data", and the
    tests that need no padding still run (a causal mask in the encoder is still named)."""
    from pathlib import Path
    from tndebug.capture.adapters import import_file
    mb = import_file(Path(__file__).resolve().parents[1] / "foreign" / "minibert.py")
    torch.manual_seed(0)
    leaky = mb.build(variant="manual", bug="pad_leak").eval()
    assert tndebug.check(leaky, pad_id=0, arch="encoder").verdict == "errors"     # pads exist
    report = tndebug.check(leaky, pad_id=None, arch="encoder")
    assert report.verdict == "clean", [(f.code, f.message) for f in report.findings]
    cov = report.probes["mask-broadcast"]["coverage"]["padding"]
    assert cov["status"] == "not applicable" and "no padding in this data" in cov["reason"]
    causal = tndebug.check(mb.build(variant="manual", bug="causal").eval(), pad_id=None, arch="encoder")
    assert "mask-broadcast/encoder-causal" in {f.code for f in causal.findings}


class _RaisesAlways(nn.Module):
    """A decoder-only model whose own code raises on every call (transformers' StableLM with
    more key/value heads than heads does), as a user's broken config would."""
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (32)")


def test_a_decoder_only_model_that_raises_is_a_usage_error_not_a_crash():
    # the retry with rows ending in a pad wrote into the decoder-only model's empty src:
    # IndexError (tndebug's internal error, exit 3) instead of the model's own error (exit 2)
    with pytest.raises(UsageError, match="must match the size"):
        tndebug.check(_RaisesAlways(), forward=lambda m, ids, pad_id: m(ids), arch="decoder",
                      pad_id=None)
