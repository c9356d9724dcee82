import math

import pytest
import torch
from torch import nn

from _misc_helpers import EmbedCapture, HandSeq2Seq, hand_subject, kinds, setup_only, sinusoids
from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.inject import make_model
from tndebug.probes.positional_encoding import RHO_LOW, PositionalEncodingProbe
from tndebug.probes.positional_encoding_order import PERM_TOL
from tndebug.probes.schedule import every
from tndebug.subject import tndebug_subject

NAME = "positional-encoding"


def all_kinds(findings):
    """{(severity, where)} of every finding of the probe, info included."""
    return {(f.severity, f.where) for f in findings if f.probe == NAME}


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
    ("no_emb_scale", {("info", "src_embed"), ("info", "tgt_embed")}),    # uses positions: info
    ("pos_max_len_small", {("error", "src_embed"), ("error", "tgt_embed")}),
])
def test_fault_gives_exactly_its_finding(fault, expected):
    findings = _ours(ModelConfig.tiny().with_faults(fault))
    assert all_kinds(findings) == expected


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


def test_hand_unscaled_embeddings_that_use_positions_are_info_naming_the_deviation():
    """No sqrt(d_model) (2 of 7 healthy public implementations): the order test shows the
    positions used, so the deviation is info, named, never a warning."""
    findings = _hand(UnscaledPE)
    assert all_kinds(findings) == {("info", "src_embed"), ("info", "tgt_embed")}
    for f in findings:
        assert f.evidence["rho"] < RHO_LOW and f.evidence["order_test"] == "uses positions"
        assert "no sqrt(d_model)" in f.message and "no harm shown" in f.message


class BatchIndexedPE(UnscaledPE):
    """`x + pe[:x.size(0)]` on batch-first input: each sequence gets one PE row at every
    position (no position information), over unscaled embeddings it drowns."""

    def forward(self, x):
        return self.token_part(x) + self.pe[: x.shape[0]][:, None, :]      # [B, T, d]


def test_hand_unscaled_embeddings_whose_positions_are_lost_warn():
    findings = _hand(BatchIndexedPE)
    assert ("error", "encoder") in kinds(findings, NAME)                    # the order test
    (w,) = [f for f in findings if f.severity == "warning" and f.where == "src_embed"]
    assert "PE drowns the token embeddings" in w.message and "ignores token order" in w.message
    assert w.evidence["order_test"] == "ignores order"


def test_unscaled_embeddings_in_a_run_that_trains_warn_while_rho_stays_low():
    """Issue 45: a falling loss does not show the deviation harmless (no_emb_scale reached token
    accuracy 0.27 against 0.64 with the scale, its loss falling 2.64 -> 1.44): a warning while the
    token part has not regained its share by the last probed step."""
    probe = PositionalEncodingProbe(every(50))
    _, findings, _ = train_with_probes(ModelConfig.tiny().with_faults("no_emb_scale"), [probe],
                                       steps=101, warmup=20)
    assert all_kinds(findings) == {("warning", "src_embed"), ("warning", "tgt_embed")}
    for f in findings:
        (s0, l0), (s1, l1) = f.evidence["loss_trend"][0], f.evidence["loss_trend"][-1]
        assert (s0, s1) == (0, 100) and l1 < 0.95 * l0
        assert f.evidence["rho_last"] < 0.25 and f.evidence["rho_last_step"] == 100
        assert "rho is still" in f.message and "does not show the deviation harmless" in f.message


def test_unscaled_embeddings_whose_token_part_recovers_are_info():
    """The harm did not last: rho back inside its band at the last probed step (set here as the
    probe's observe would have recorded it) and the loss falling: info that says so."""
    probe = PositionalEncodingProbe(every(50))
    train_with_probes(ModelConfig.tiny().with_faults("no_emb_scale"), [probe], steps=1)
    probe._scale_off = [{"site": "src_embed", "evidence": {"rho": 0.17},
                         "what": "PE drowns", "deviation": "the token part at src_embed is 0.17"}]
    probe._rho_last, probe._losses, probe._training = {"src_embed": (100, 1.1)}, [(0, 2.6), (100, 1.4)], True
    probe.findings = []
    probe.finish(None)
    (f,) = probe.findings
    assert f.severity == "info" and "regained its share" in f.message and f.evidence["rho_last"] == 1.1


def test_unscaled_embeddings_in_a_run_that_does_not_learn_warn():
    """lr 0: the loss stays where it starts, so the deviation's harm cannot be ruled out."""
    probe = PositionalEncodingProbe(every(10))
    _, findings, _ = train_with_probes(ModelConfig.tiny().with_faults("no_emb_scale"), [probe],
                                       steps=21, lr_factor=1e-12)
    assert kinds(findings, NAME) == {("warning", "src_embed"), ("warning", "tgt_embed")}
    assert all("the loss does not fall" in f.message for f in findings)


def test_hand_wrapped_positions_are_the_same_error():
    findings = _hand(WrappedPE, max_len=40)
    assert kinds(findings, NAME) == {("error", "src_embed"), ("error", "tgt_embed")}
    ev = findings[0].evidence
    assert (ev["first_duplicate_position"], ev["same_row_as"]) == (8, 0)


# -- the overflow test stops at the stacks where the model declares its length ---------------

def _gpt2_clamped(clamp):
    """A small Hugging Face GPT-2 (max_len 64); with `clamp`, positions from it on reuse row
    clamp - 1 (a table too short for the length the config declares)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=64, bos_token_id=1,
        eos_token_id=1)).eval()
    if clamp:
        wpe = model.transformer.wpe
        wpe.forward = lambda pos, f=wpe.forward: f(pos.clamp(max=clamp - 1))
    return model


@pytest.mark.parametrize("clamp", [None, 24])
def test_the_overflow_test_runs_no_layer_within_the_declared_length(clamp):
    from tndebug.capture.generic import GenericCapture
    from tndebug.subject import Subject
    model = _gpt2_clamped(clamp)
    lengths = []
    model.transformer.h[0].ln_1.register_forward_hook(lambda m, a, out: lengths.append(out.shape[1]))
    fwd = lambda m, ids, pad: m(input_ids=ids, attention_mask=(ids != pad).long()).logits  # noqa: E731
    subject = Subject(model, fwd, pad_id=0, bos_id=1, src_vocab=40, tgt_vocab=40, first_content=2,
                      kind="decoder", capture=GenericCapture(model, kind="decoder"), max_len=64)
    probe = PositionalEncodingProbe()
    probe.run = None
    probe.overflow_test(subject)
    assert 64 not in lengths                               # the layers never saw the long row
    reused = [f for f in probe.findings if f.code.endswith("pe-rows-reused")]
    if clamp is None:
        assert reused == [] and probe.coverage            # checked, and nothing reused
    else:
        (f,) = reused
        assert (f.evidence["first_duplicate_position"], f.evidence["same_row_as"]) == (24, 23)
        assert f.evidence["probe_length"] == 64
