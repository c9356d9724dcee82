"""tndebug.watch and tndebug.check on decoder-only models in the user's own loop: tndebug's own
GPT-style model, a user forward(model, ids, pad_id), and the labels-not-shifted bug, named from
what the model learns."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tndebug
from tndebug.config import ModelConfig
from tndebug.data import as_lm, data_generator, get_task, misshift
from tndebug.inject import make_model


def decoder(seed=0):
    torch.manual_seed(seed)
    return make_model(ModelConfig.tiny(arch="decoder", dropout=0.0))


def loop(model, opt, steps, *, shift=1):
    """A user's loop: ids in, logits out, loss on the continuation (labels from data.as_lm)."""
    task, g = get_task("copy"), data_generator(0, "train")
    for _ in range(steps):
        b = as_lm(task.batch(g, 32))
        if shift != 1:
            b = misshift(b, shift)
        logits = model(b.tgt_in)                                            # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.tgt_out.reshape(-1),
                               ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def watched(shift=1, steps=150, forward=None, **kw):
    model = decoder()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with tndebug.watch(model, opt, forward=forward, quiet=True, total_steps=steps, **kw) as dbg:
        loop(model, opt, steps, shift=shift)
    return dbg.report


def serious(report):
    return [(f.code, f.severity) for f in report.findings if f.severity in ("warning", "error")]


def test_a_healthy_decoder_only_loop_is_clean_and_every_probe_ran():
    report = watched()
    assert serious(report) == [], report.findings
    assert report.verdict == "clean", report.probes
    assert report.probes["label-shift"]["status"] == "pass"
    assert report.probes["mask-broadcast"]["status"] == "pass"
    assert report.probes["lm-decoding"]["coverage"]["kv cache"]["status"] == "checked"


def test_labels_not_shifted_in_the_users_loop_are_named():
    report = watched(shift=0)
    assert ("label-shift/unshifted", "error") in serious(report)


def test_a_user_forward_with_ids_only_makes_a_decoder_only_subject():
    def forward(model, ids, pad_id):
        return model(ids)
    report = tndebug.check(decoder(), forward)
    assert report.verdict == "clean", report.probes
    assert "src_pad_length" not in str(report.probes["mask-broadcast"])


def test_a_decoder_that_sees_the_future_fails_check():
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny(arch="decoder", dropout=0.0).with_faults("no_causal_mask"))
    report = tndebug.check(model)
    assert ("mask-broadcast/causal-leak", "error") in serious(report), report.findings
    assert report.verdict == "errors" and report.exit_code() == 1


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_is_checked_without_a_forward(arch):
    tf = pytest.importorskip("transformers")
    cfg = {"gpt2": lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                          n_positions=64),
           "llama": lambda: tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                           num_key_value_heads=2, intermediate_size=64,
                                           vocab_size=300, max_position_embeddings=64)}[arch]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    report = tndebug.check(model)
    assert serious(report) == [], report.findings
    assert report.probes["mask-broadcast"]["status"] == "pass"


def test_targets_equal_to_inputs_are_label_shifts_alone():
    """Issue 44: past loss-health's plateau horizon (200 steps) the CE against the next token
    is far above ln V while the loop's own loss is near 0: label-shift names the bug, and
    loss-health gives no "stuck at the uniform level" error."""
    report = watched(shift=0, steps=220, probes="loss-health,label-shift")
    assert serious(report) == [("label-shift/unshifted", "error")], report.findings
    assert report.probes["loss-health"]["status"] == "pass"
