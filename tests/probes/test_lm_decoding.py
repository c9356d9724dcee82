"""lm-decoding: on a decoder-only model, left padding and the KV cache leave the logits of real
tokens exact. A healthy model passes both tests; each decoder fault is named by its code (with
what the behaviour tells of its cause); a cache that is dropped or not updated is told apart;
an encoder-decoder, a model with no cache, a forward that is not causal or pads that leak on the
right say why they have no verdict here."""
from __future__ import annotations

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes import PROBE_NAMES
from tndebug.probes.base import RunContext
from tndebug.probes.lm_decoding import LMDecoding
from tndebug.subject import Subject, tndebug_subject


def model(*faults, arch="decoder", norm="pre"):
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny(arch=arch, norm=norm, dropout=0.0).with_faults(*faults))


def probe(subject) -> LMDecoding:
    p = LMDecoding()
    p.setup(RunContext(subject=subject))
    return p


def plain_subject(m, incremental=None) -> Subject:
    """A user's decoder-only subject: forward(model, ids, pad) and, optionally, their cache."""
    cfg = m.cfg
    return Subject(m, lambda mm, ids, pad: mm(ids), pad_id=cfg.pad_id, src_vocab=cfg.src_vocab,
                   tgt_vocab=cfg.tgt_vocab, max_len=cfg.max_len, kind="decoder",
                   incremental=incremental)


def test_it_is_registered_with_its_codes():
    assert "lm-decoding" in PROBE_NAMES
    assert set(LMDecoding.codes) == {"left-pad", "kv-cache", "no-pad-mask", "rotary-shift",
                                     "rotary-values"}


@pytest.mark.parametrize("norm", ("pre", "post"))
def test_a_healthy_decoder_passes_both_tests(norm):
    p = probe(tndebug_subject(model(norm=norm)))
    assert p.findings == []
    assert p.status() == "pass"
    assert {k: v for k, v in p.coverage.items() if k != "rotary"} == {
        "": {"status": "checked"}, "kv cache": {"status": "checked"}}
    assert p.coverage["rotary"]["status"] == "not applicable"      # sinusoidal: absolute positions


@pytest.mark.parametrize("norm", ("pre", "post"))
def test_positions_from_column_0_are_named_at_the_embedding(norm):
    p = probe(tndebug_subject(model("positions_ignore_left_pad", norm=norm)))
    (f,) = p.findings
    assert (f.code, f.severity, f.where) == ("lm-decoding/left-pad", "error", "tgt_embed")
    ev = f.evidence
    assert ev["left_pad"]["delta"] > 100 * ev["left_pad"]["tol"]
    assert ev["right_pad"]["delta"] <= ev["right_pad"]["tol"]          # the control holds
    assert "cumsum" in f.fix


def test_a_model_without_any_padding_mask_gets_an_info_not_an_error():
    # nanoGPT-style: no padding mask at all, only the causal one (tndebug's decoder, its pad-key
    # mask dropped): left padding is unsupported, a hazard of batched generation, not a defect
    m = model()
    orig = m.masks

    def causal_only(ids):
        keep, lead = orig(torch.ones_like(ids))              # every id a real token
        return keep, torch.zeros_like(lead)
    m.masks = causal_only
    p = probe(tndebug_subject(m))
    (f,) = p.findings
    assert (f.code, f.severity) == ("lm-decoding/no-pad-mask", "info")
    assert f.where == "decoder.layers.0.self_attn" and "left-pad" in f.message


def test_a_mask_from_lengths_that_assumes_right_padding_is_an_error():
    # keep = arange(T) < n_real: a left-padded row shows its pads and hides its last real keys
    m = model()
    orig = m.masks

    def from_lengths(ids):
        keep, lead = orig(ids)
        n = (ids != m.cfg.pad_id).sum(1)
        by_length = torch.arange(ids.shape[1], device=ids.device)[None] < n[:, None]   # [B, T]
        causal = keep.new_ones(ids.shape[1], ids.shape[1]).tril()
        return by_length[:, None, None, :] & causal, torch.zeros_like(lead)
    m.masks = from_lengths
    p = probe(tndebug_subject(m))
    (f,) = p.findings
    assert (f.code, f.severity) == ("lm-decoding/left-pad", "error")
    assert "assumes right padding" in f.message and "ids != pad_id" in f.fix


def test_a_saturated_softmax_without_a_padding_mask_stays_an_info():
    # no pad mask and scores so large that softmax underflows to exact zeros on real keys (as in
    # a nanoGPT trained 1000 steps without 1/sqrt(d_k)): single zeros are not a mask hiding keys
    m = model()
    orig = m.masks

    def causal_only(ids):
        keep, lead = orig(torch.ones_like(ids))
        return keep, torch.zeros_like(lead)
    m.masks = causal_only
    with torch.no_grad():
        for layer in m.decoder.layers:
            for lin in (layer.self_attn.w_q, layer.self_attn.w_k):
                lin.weight.mul_(12.0)
    s = tndebug_subject(m)
    ids = torch.randint(s.first_content, s.tgt_vocab, (5, 13), generator=torch.Generator().manual_seed(1))
    probs = s.trace(ids[:, :0], ids, reads=LMDecoding.reads).records()[0].probs
    assert bool((probs == 0).any())                                  # the softmax saturates
    p = probe(s)
    (f,) = p.findings
    assert (f.code, f.severity) == ("lm-decoding/no-pad-mask", "info")


def test_a_padding_mask_that_shows_left_pads_is_named_at_the_attention():
    # pad_mask_query_axis: the mask hides pad queries, not pad keys; a causal model never sees its
    # right pads, so only left pads are attended
    p = probe(tndebug_subject(model("pad_mask_query_axis")))
    (f,) = p.findings
    assert f.code == "lm-decoding/left-pad" and f.where == "decoder.layers.0.self_attn"
    assert "ids != pad_id" in f.fix


@pytest.mark.parametrize("norm", ("pre", "post"))
def test_a_top_left_causal_mask_in_the_cache_is_named(norm):
    p = probe(tndebug_subject(model("kv_cache_causal_top_left", norm=norm)))
    (f,) = p.findings
    assert (f.code, f.severity) == ("lm-decoding/kv-cache", "error")
    assert f.evidence["sees"] == {"first key": True, "prefix keys after the first": False,
                                  "tokens decoded before": False}
    assert "is_causal" in f.message and "bottom-right" in f.fix
    assert p.coverage[""] == {"status": "checked"}                    # left padding is fine


@pytest.mark.parametrize("norm", ("pre", "post"))
def test_a_cache_position_one_off_is_named(norm):
    p = probe(tndebug_subject(model("kv_cache_position_off_by_one", norm=norm)))
    (f,) = p.findings
    assert f.code == "lm-decoding/kv-cache"
    assert all(f.evidence["sees"].values())                          # it sees every key
    assert "position" in f.message
    cases = f.evidence["cases"]
    assert len(cases) == 3 and all(c["delta"] > 100 * c["tol"] for c in cases.values())


def _dropped(m, ids, pad, split):
    """Each step alone: the cache is never read."""
    return torch.stack([m(ids[:, t:t + 1])[:, -1] for t in range(split, ids.shape[1])], 1)


def _not_updated(m, ids, pad, split):
    """Each step sees the prefix's cache, never the tokens decoded after it."""
    return torch.stack([m(torch.cat([ids[:, :split], ids[:, t:t + 1]], 1))[:, -1]
                        for t in range(split, ids.shape[1])], 1)


@pytest.mark.parametrize("inc,words", [(_dropped, "not read"), (_not_updated, "not updated")])
def test_a_users_broken_cache_is_told_apart(inc, words):
    p = probe(plain_subject(model(), incremental=inc))
    (f,) = p.findings
    assert f.code == "lm-decoding/kv-cache" and words in f.message


def test_a_users_exact_cache_passes():
    p = probe(plain_subject(model(), incremental=lambda m, ids, pad, split: m(ids)[:, split:]))
    assert p.findings == [] and p.coverage["kv cache"] == {"status": "checked"}


def test_no_cache_is_not_applicable_and_left_padding_still_checked():
    p = probe(plain_subject(model()))
    assert p.findings == [] and p.status() == "pass"
    assert p.coverage["kv cache"]["status"] == "not applicable"
    assert "no KV cache" in p.coverage["kv cache"]["reason"]


def test_a_forward_that_reads_the_future_leaves_the_cache_without_verdict():
    p = probe(tndebug_subject(model("no_causal_mask")))
    assert p.findings == []
    assert p.coverage["kv cache"]["status"] == "no verdict"
    assert "not causal" in p.coverage["kv cache"]["reason"]


def test_pads_that_leak_on_the_right_are_left_to_mask_broadcast():
    p = probe(tndebug_subject(model("view_without_transpose")))
    assert p.findings == []
    assert p.coverage[""]["status"] == "no verdict"
    assert "tgt-pad-leak" in p.coverage[""]["reason"]


def test_an_encoder_decoder_is_not_applicable():
    p = probe(tndebug_subject(model(arch="seq2seq")))
    assert p.findings == [] and p.status() == "skipped"
    assert p.coverage == {"": {"status": "not applicable", "reason": p.coverage[""]["reason"]}}
    assert "encoder-decoder" in p.reason()  # DECODER_ONLY


# -- rotary positions in tndebug's own model (pos="rotary") -------------------------------------
ROTARY_CODES = {"rotary_q_only": "rotary-shift", "rotary_halves": "rotary-shift",
                "rotary_on_v": "rotary-values"}
FIRST = "decoder.layers.0.self_attn"


def rotary_model(*faults, norm="pre", norm_kind="layernorm"):
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny(arch="decoder", norm=norm, norm_kind=norm_kind, pos="rotary",
                                       dropout=0.0).with_faults(*faults))


@pytest.mark.parametrize("norm_kind", ("layernorm", "rmsnorm"))
@pytest.mark.parametrize("norm", ("pre", "post"))
def test_a_healthy_rotary_decoder_is_checked_and_passes(norm, norm_kind):
    p = probe(tndebug_subject(rotary_model(norm=norm, norm_kind=norm_kind)))
    assert p.findings == []
    # relative positions: the rotary test applies (not "absolute by design") and passes
    assert p.coverage == {FIRST: {"status": "checked"}, "": {"status": "checked"},
                          "kv cache": {"status": "checked"}}


@pytest.mark.parametrize("norm_kind", ("layernorm", "rmsnorm"))
@pytest.mark.parametrize("norm", ("pre", "post"))
@pytest.mark.parametrize("fault", ROTARY_CODES)
def test_each_rotary_fault_is_named_at_the_first_attention(fault, norm, norm_kind):
    from tndebug.faults import FAULTS
    assert FAULTS[fault].probe == "lm-decoding"
    p = probe(tndebug_subject(rotary_model(fault, norm=norm, norm_kind=norm_kind)))
    assert [(f.code, f.severity, f.where) for f in p.findings] == [
        (f"lm-decoding/{ROTARY_CODES[fault]}", "error", FIRST)]
    ev = p.findings[0].evidence
    moved = ev["values_move"] if fault == "rotary_on_v" else ev["relative"]
    assert moved["delta"] > 100 * moved["tol"]
    assert p.coverage["kv cache"] == {"status": "checked"}     # the cache rotates as the forward


def _tiny_rotary_run(*faults, norm="pre", norm_kind="rmsnorm"):
    from tndebug.train.config import DECODER_RUN, TrainConfig, model_config
    from tndebug.train.loop import run_training
    torch.manual_seed(0)
    mc = model_config("copy", "tiny", norm, faults, arch="decoder", dropout=0.0, pos="rotary",
                      norm_kind=norm_kind)
    tc = TrainConfig(task="copy", steps=30, batch_size=16, eval_size=20, device="cpu",
                     warmup=DECODER_RUN["warmup"], lr_factor=DECODER_RUN["lr_factor"])
    return run_training(mc, tc, probes="all", evaluate_at_end=False).report


@pytest.mark.parametrize("norm", ("pre", "post"))
def test_a_tiny_rotary_rmsnorm_run_has_no_warning_and_its_bug_is_named(norm):
    alarms = lambda r: [(f.code, f.where) for f in r.findings                       # noqa: E731
                        if f.severity in ("warning", "error")]
    healthy = _tiny_rotary_run(norm=norm)
    assert alarms(healthy) == []
    assert not [n for n, s in healthy.probes.items() if s["status"] in ("fail", "warn")]
    assert alarms(_tiny_rotary_run("rotary_q_only", norm=norm)) == [
        ("lm-decoding/rotary-shift", FIRST)]
