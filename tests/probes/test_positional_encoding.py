import math

import pytest
import torch
from torch import nn

from _misc_helpers import EmbedCapture, HandSeq2Seq, hand_subject, kinds, setup_only, sinusoids
from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.model import make_model
from tndebug.probes.positional_encoding import PERM_TOL, RHO_LOW, PositionalEncodingProbe
from tndebug.probes.schedule import every
from tndebug.subject import tndebug_subject

NAME = "positional-encoding"


def _ours(cfg):
    return setup_only(tndebug_subject(make_model(cfg)), [PositionalEncodingProbe()])


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_model_is_silent(norm):
    probe = PositionalEncodingProbe(every(3))
    engine, findings, _ = train_with_probes(ModelConfig.tiny(norm=norm), [probe], steps=6)
    assert kinds(findings, NAME) == set()
    assert probe.status() == "pass" and probe.skipped is None


@pytest.mark.parametrize("fault, expected", [
    ("no_pos_encoding", {("error", "src_embed")}),
    ("no_emb_scale", {("warning", "src_embed"), ("warning", "tgt_embed")}),
    ("pos_max_len_small", {("error", "src_embed"), ("error", "tgt_embed")}),
])
def test_fault_gives_exactly_its_finding(fault, expected):
    findings = _ours(ModelConfig.tiny().with_faults(fault))
    assert kinds(findings, NAME) == expected


def test_missing_pe_evidence_names_both_embeddings():
    [f] = _ours(ModelConfig.tiny(norm="post").with_faults("no_pos_encoding"))
    assert f.evidence["rel_diff"] < f.evidence["threshold"] == PERM_TOL
    assert f.evidence["sites_without_pe"] == ["src_embed", "tgt_embed"]


def test_clamped_table_names_the_first_reused_position():
    f = _ours(ModelConfig.tiny().with_faults("pos_max_len_small"))[0]
    assert (f.evidence["first_duplicate_position"], f.evidence["same_row_as"]) == (8, 7)


# -- the same bugs written by hand in a user's model ------------------------------------------

class ForgetfulPE(nn.Module):
    """pytorch-lightning #19138: the PE is computed, and the sum is never assigned."""

    def __init__(self, vocab, d):
        super().__init__()
        self.lut, self.d = nn.Embedding(vocab, d), d
        nn.init.normal_(self.lut.weight, std=d ** -0.5)
        self.register_buffer("pe", sinusoids(64, d))

    def token_part(self, x):
        return self.lut(x) * math.sqrt(self.d)

    def forward(self, x):
        x = self.token_part(x)
        x + self.pe[: x.shape[1]]   # noqa: B018 - the bug
        return x


class UnscaledPE(ForgetfulPE):
    """Annotated-style Xavier embeddings, the * sqrt(d_model) forgotten."""

    def __init__(self, vocab, d):
        super().__init__(vocab, d)
        self.lut = nn.Embedding(1000, d)             # a 1000-word vocabulary
        nn.init.xavier_uniform_(self.lut.weight)

    def token_part(self, x):
        return self.lut(x)

    def forward(self, x):
        return self.token_part(x) + self.pe[: x.shape[1]]


class WrappedPE(ForgetfulPE):
    """Learned positions, 8 rows, indexed with `arange(T) % 8`: position 8 reuses row 0."""

    def __init__(self, vocab, d):
        super().__init__(vocab, d)
        self.pos = nn.Embedding(8, d)

    def forward(self, x):
        return self.token_part(x) + self.pos(torch.arange(x.shape[1]) % 8)


class GoodPE(ForgetfulPE):
    def forward(self, x):
        return self.token_part(x) + self.pe[: x.shape[1]]   # T > 64 raises: healthy


def _hand(embed_cls, **kw):
    model = HandSeq2Seq(embed_cls)
    return setup_only(hand_subject(model, EmbedCapture(model), **kw), [PositionalEncodingProbe()])


def test_hand_model_healthy_is_silent_and_survives_refusing_long_inputs():
    probe = PositionalEncodingProbe()
    model = HandSeq2Seq(GoodPE)
    assert setup_only(hand_subject(model, EmbedCapture(model)), [probe]) == []
    assert probe.status() == "pass"


def test_hand_forgotten_pe_is_the_same_error():
    assert kinds(_hand(ForgetfulPE), NAME) == {("error", "src_embed")}


def test_hand_forgotten_pe_without_taps_or_encoder_still_caught():
    model = HandSeq2Seq(ForgetfulPE)
    probe = PositionalEncodingProbe()
    findings = setup_only(hand_subject(model, capture=None), [probe])
    assert kinds(findings, NAME) == {("error", "encoder")}
    assert findings[0].evidence["compared"] == "encoder output"
    assert "no embedding taps" in probe.skipped   # the capture-based tests say why they skipped
    findings = setup_only(hand_subject(model, capture=None, encode=False), [PositionalEncodingProbe()])
    assert kinds(findings, NAME) == {("error", "encoder")}
    assert findings[0].evidence["compared"] == "decoder logits"


def test_hand_unscaled_embeddings_warn():
    findings = _hand(UnscaledPE)
    assert kinds(findings, NAME) == {("warning", "src_embed"), ("warning", "tgt_embed")}
    assert all(f.evidence["rho"] < RHO_LOW for f in findings)


def test_hand_wrapped_positions_are_the_same_error():
    findings = _hand(WrappedPE, max_len=40)
    assert kinds(findings, NAME) == {("error", "src_embed"), ("error", "tgt_embed")}
    ev = findings[0].evidence
    assert (ev["first_duplicate_position"], ev["same_row_as"]) == (8, 0)
