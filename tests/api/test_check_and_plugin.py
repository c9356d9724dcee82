"""tndebug.check on live model objects, and the pytest plugin run inside pytest (pytester)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import models as M
import tndebug
from tndebug.library.check import CheckResult

MODELS_PY = Path(__file__).with_name("models.py")


@pytest.mark.parametrize("kind", ["annotated", "sdpa", "bart"])
def test_check_healthy_models(kind):
    build, forward = M.MODELS[kind]
    report = tndebug.check(build(), forward)
    assert [f for f in report.findings if f.severity != "info"] == []
    assert report.verdict == "clean" and report.run["mode"] == "check"
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert "loss-health" not in report.probes          # needs training: watch's job


def test_check_names_the_missing_scale_and_leaves_the_model_as_it_was():
    model = M.FusedSDPA(scale=False).train()
    report = tndebug.check(model, M.fused_forward)
    errors = {(f.probe, f.where) for f in report.findings if f.severity == "error"}
    assert ("missing-scale", "enc.0.attn") in errors, report.findings
    assert report.exit_code("error") == 1
    assert model.training and all(p.grad is None for p in model.parameters())


def test_check_result_assertion_lists_probe_module_evidence_fix():
    result = CheckResult(tndebug.check(M.FusedSDPA(scale=False), M.fused_forward))
    with pytest.raises(AssertionError) as e:
        result.assert_clean("error")
    text = str(e.value)
    assert "ERROR   missing-scale in enc.0.attn" in text
    assert "evidence: " in text and "fix: " in text
    result.assert_finding("missing-scale", "error", where="enc.0.attn")
    CheckResult(tndebug.check(M.FusedSDPA(), M.fused_forward)).assert_clean()


def _write_test(pytester):
    pytester.makepyfile(models=MODELS_PY.read_text())
    pytester.makepyfile(test_user=textwrap.dedent('''
        import pytest
        import torch
        import models as M

        torch.set_num_threads(1)

        def test_healthy(tndebug_check):
            tndebug_check(M.FusedSDPA(), M.fused_forward).assert_clean()

        def test_buggy(tndebug_check):
            tndebug_check(M.FusedSDPA(scale=False), M.fused_forward).assert_clean()

        @pytest.mark.tndebug(probes="mask-broadcast")
        def test_buggy_but_only_masks_checked(tndebug_check):
            tndebug_check(M.FusedSDPA(scale=False), M.fused_forward).assert_clean()
    '''))


def test_plugin_healthy_passes_buggy_fails_with_the_finding(pytester):
    _write_test(pytester)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_buggy*",
                                 "*AssertionError: tndebug: * finding(s) at or above warning in FusedSDPA*",
                                 "*ERROR   missing-scale in enc.0.attn*", "*evidence: *", "*fix: *"])
    assert "test_buggy_but_only_masks_checked FAILED" not in result.stdout.str()


def test_plugin_fail_on_option(pytester):
    pytester.makepyfile(models=MODELS_PY.read_text())
    pytester.makepyfile(test_info=textwrap.dedent('''
        import models as M

        def test_annotated_fill(tndebug_check):
            # a -1e9 mask fill is an info finding in an fp32 model: fails only at --tndebug-fail-on=info
            tndebug_check(M.annotated(), M.annotated_forward).assert_clean()
    '''))
    pytester.runpytest("-q", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "--tndebug-fail-on=info",
                                "--tndebug-probes=nan-scores")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*INFO    nan-scores in encoder.layers.0.self_attn*"])


def test_plugin_on_a_decoder_only_and_an_encoder_only_model(pytester):
    """Issue 21: the fixture on the other shapes: a Hugging Face GPT-2 and BERT, healthy and with
    the causal mask removed (GPT-2: a bidirectional decoder) or added (BERT: is_decoder), each
    judged with its shape's tests."""
    pytest.importorskip("transformers")
    pytester.makepyfile(test_shapes=textwrap.dedent('''
        import pytest
        import torch
        import transformers as tf

        torch.set_num_threads(1)

        def gpt2(causal=True):
            torch.manual_seed(0)
            m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=2,
                                                 n_positions=64, pad_token_id=0))
            if not causal:
                for block in m.transformer.h:
                    block.attn.is_causal = False
                m.config.is_causal = False
            return m.eval()

        def bert(is_decoder=False):
            torch.manual_seed(0)
            return tf.BertForMaskedLM(tf.BertConfig(vocab_size=60, hidden_size=32,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=64, pad_token_id=0,
                                                    is_decoder=is_decoder)).eval()

        def test_gpt2_healthy(tndebug_check):
            tndebug_check(gpt2()).assert_clean()

        def test_bert_healthy(tndebug_check):
            tndebug_check(bert()).assert_clean()

        def test_bert_with_a_causal_mask(tndebug_check):
            tndebug_check(bert(is_decoder=True)).assert_clean()
    '''))
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_bert_with_a_causal_mask*", "*ERROR   mask-broadcast*"])


def _t5_q_off_band(transformers, torch):
    """A tiny T5 whose q is 3x its initialisation (off the fold's band, as training moves it)."""
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, feed_forward_proj="relu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0))
    with torch.no_grad():
        for m in t5.modules():
            if type(m).__name__ == "T5Attention":
                m.q.weight.mul_(3.0)
    return t5


def test_check_judges_a_hugging_face_models_scale_where_its_design_is():
    """tndebug.check on a transformers object re-judges a missing-scale error on a fresh
    `_from_config` model of its class, as `tndebug triage DIR` does (issue 19): T5 folds the
    scale into its initialisation, and a T5 whose q has moved off that band (x3 here, as
    training moves it) is its design, an info; GPT-2 with scale_attn_weights=False (a config
    switch away from the default) stays an error."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    t5 = _t5_q_off_band(transformers, torch).eval()
    report = tndebug.check(t5)
    scale = [f for f in report.findings if f.probe == "missing-scale"]
    assert scale and all(f.severity == "info" for f in scale), scale
    assert any(f.evidence.get("judged_on") == "fresh init" for f in scale), scale
    assert report.verdict == "clean"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=96, bos_token_id=1,
        eos_token_id=2, scale_attn_weights=False)).eval()
    errors = [f for f in tndebug.check(gpt2).findings if f.severity == "error"]
    assert [f.probe for f in errors] == ["missing-scale"], errors
    assert "scale_attn_weights" in errors[0].fix


def test_watch_judges_a_hugging_face_models_scale_where_its_design_is():
    """The same re-judgement when the watched loop closes: a T5 whose q left its
    initialisation band (x3) trains under watch with no missing-scale error, the info judged on
    a fresh initialisation."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    t5 = _t5_q_off_band(transformers, torch)
    opt = torch.optim.Adam(t5.parameters(), 1e-4)
    g = torch.Generator().manual_seed(1)
    with tndebug.watch(t5, opt, probes="missing-scale") as dbg:
        for _ in range(4):
            x = torch.randint(2, 96, (8, 10), generator=g)
            loss = t5(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    scale = [f for f in dbg.report.findings if f.probe == "missing-scale"]
    assert scale and all(f.severity == "info" for f in scale), scale
    assert any(f.evidence.get("judged_on") == "fresh init" for f in scale), scale
