"""The generic capture fills the same Trace as TapCapture, from models it has never seen."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.model.embedding import sinusoid_table
from tndebug.subject import Subject, tndebug_subject
from tndebug.capture.trace import ATTN_FIELDS, Trace
from tndebug.capture.adapters import annotated_forward
from tndebug.capture import GenericCapture

from conftest import TINY, zoo

B, S, T = 3, 7, 5


def batch(pad_last=True):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 11, (B, S), generator=g)
    tgt = torch.randint(3, 11, (B, T), generator=g)
    tgt[:, 0] = 1
    if pad_last:
        src[0, 4:] = 0
        tgt[0, 3:] = 0
    return src, tgt


def record(model, forward, reads=("all",), grad=False):
    src, tgt = batch()
    trace = Trace(src=src, tgt=tgt)
    cap = GenericCapture(model)
    with torch.set_grad_enabled(grad), cap.recording(reads, trace):
        out = forward(model, src, tgt, 0)
    if grad:
        out.float().logsumexp(-1).sum().backward()
    return trace, out


def test_matches_tapcapture_on_tndebugs_model():
    model = make_model(ModelConfig.tiny(dropout=0.0)).eval()
    src, tgt = batch()
    ref = tndebug_subject(model).trace(src, tgt)
    got, _ = record(model, lambda m, s, t, p: m(s, t))
    assert list(got.attention) == list(ref.attention)
    for site, r in ref.attention.items():
        g = got.attention[site]
        assert (g.kind, g.layer) == (r.kind, r.layer)
        for f in ATTN_FIELDS:
            assert torch.allclose(getattr(g, f), getattr(r, f), atol=1e-5), (site, f)
    assert [(s.stack, s.layer, s.kind) for s in got.streams] == \
           [(s.stack, s.layer, s.kind) for s in ref.streams]
    for a, b in zip(got.streams, ref.streams):
        assert torch.allclose(a.x, b.x, atol=1e-5)
    assert list(got.ffn_hidden) == list(ref.ffn_hidden)


def test_annotated_style_model():
    model = zoo("annotated").make_model(11, 11, **TINY).eval()
    trace, _ = record(model, annotated_forward)
    kinds = {s: (r.kind, r.layer) for s, r in trace.attention.items()}
    assert kinds == {"encoder.layers.0.self_attn": ("enc_self", 0), "encoder.layers.1.self_attn": ("enc_self", 1),
                     "decoder.layers.0.self_attn": ("dec_self", 0), "decoder.layers.0.src_attn": ("cross", 0),
                     "decoder.layers.1.self_attn": ("dec_self", 1), "decoder.layers.1.src_attn": ("cross", 1)}
    for site, rec in trace.attention.items():
        attn = model.get_submodule(site)
        assert rec.q.shape[:2] == (B, 4) and rec.q.shape[-1] == 8                     # [B, h, T, d_k]
        assert torch.allclose(rec.probs, attn.attn, atol=1e-6)                        # the module's own copy
        assert torch.allclose(rec.scores, rec.q @ rec.k.transpose(-2, -1) / math.sqrt(8), atol=1e-5)
        assert rec.out.shape == (B, rec.q.shape[2], 32)
    enc = trace.attention["encoder.layers.0.self_attn"]
    assert (enc.masked_scores[0, :, :, 4:] == -1e9).all() and (enc.key_keep()[1]).all()
    dec = trace.attention["decoder.layers.0.self_attn"]
    assert (dec.probs[1].triu(1) == 0).all()                                           # causal
    assert [s.kind for s in trace.streams].count("sublayer") == 2 * 2 + 2 * 3
    assert [s.kind for s in trace.streams][0] == "embed"
    emb = trace.embed["src_embed.0"]
    assert torch.allclose(emb["pe"][1], sinusoid_table(S, 32), atol=1e-5)
    assert torch.allclose(emb["tok"], model.src_embed[0].lut(batch()[0]) * math.sqrt(32))
    assert set(trace.ffn_hidden) == {f"{s}.layers.{i}.feed_forward" for s in ("encoder", "decoder") for i in (0, 1)}


def test_sequence_first_nn_transformer_model():
    mod = zoo("torch_seq2seq")
    model = mod.build(dropout=0.0).eval()
    trace, logits = record(model, mod.forward)
    sites = list(trace.attention)
    assert "transformer.decoder.layers.1.multihead_attn" in sites and len(sites) == 6
    cross = trace.attention["transformer.decoder.layers.0.multihead_attn"]
    dec = trace.attention["transformer.decoder.layers.0.self_attn"]
    assert (cross.kind, dec.kind) == ("cross", "dec_self")
    assert cross.q.shape == (B, 4, T, 8) and cross.k.shape == (B, 4, S, 8)         # batch first
    assert torch.allclose(cross.probs.sum(-1), torch.ones(B, 4, T))
    assert cross.probs[0, :, :, 4:].abs().max() == 0                                # memory pad mask
    assert (dec.probs[1].triu(1) == 0).all()
    for s in trace.streams:
        assert s.x.shape[0] == B, s.name                                             # [T, B, d] -> [B, T, d]
    emb = trace.embed["src_tok_emb"]
    assert emb["tok"].shape == (B, S, 32)
    assert torch.allclose(emb["pe"][2], sinusoid_table(S, 32), atol=1e-5)
    # the record's output feeds the rest of the model unchanged: z @ W_O + b == out
    w = model.transformer.decoder.layers[0].multihead_attn.out_proj
    z = cross.z.transpose(1, 2).reshape(B, T, 32)
    assert torch.allclose(w(z), cross.out, atol=1e-5)


class MHABlock(nn.Module):
    """nn.MultiheadAttention called the default way (need_weights=True: the bmm path)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 11)

    def forward(self, src, tgt, pad):
        x = self.emb(src)
        y, _ = self.attn(x, x, x, key_padding_mask=src == pad)
        return self.out(y[:, : tgt.shape[1]])


def test_multihead_attention_weights_path_gives_per_head_records():
    model = MHABlock().eval()
    trace, _ = record(model, lambda m, s, t, p: m(s, t, p))
    rec = trace.attention["attn"]
    assert rec.probs.shape == (B, 2, S, S) and not rec.head_averaged
    assert torch.allclose(rec.scores, rec.q @ rec.k.transpose(-2, -1) / math.sqrt(8), atol=1e-5)
    x = model.emb(batch()[0])
    _, w = model.attn(x, x, x, key_padding_mask=batch()[0] == 0, average_attn_weights=False)
    assert torch.allclose(rec.probs, w, atol=1e-6)


def test_sdpa_model_scores_are_recomputed_and_scale_follows_the_code():
    mod = zoo("sdpa_model")
    for scale in (True, False):
        torch.manual_seed(0)
        model = mod.build(scale=scale).eval()
        trace, _ = record(model, mod.forward)
        kinds = {s: r.kind for s, r in trace.attention.items()}
        assert kinds["enc.0.attn"] == "enc_self" and kinds["dec.1.attn"] == "dec_self"
        assert kinds["dec.0.cross"] == "cross"
        rec = trace.attention["dec.0.attn"]
        c = 1 / math.sqrt(8) if scale else 1.0
        assert torch.allclose(rec.scores, c * rec.q @ rec.k.transpose(-2, -1), atol=1e-5)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert torch.isinf(rec.masked_scores[1][:, future]).all()                      # causal
        assert torch.allclose(rec.probs.sum(-1), torch.ones_like(rec.probs.sum(-1)))
    assert set(trace.embed) == {"wte:src", "wte:tgt"}                                 # shared table
    assert torch.allclose(trace.embed["wte:src"]["pe"][0], model.wpe.weight[:S], atol=1e-6)
    assert torch.allclose(trace.embed["wte:tgt"]["pe"][0], model.wpe.weight[:T], atol=1e-6)


def test_scaling_multiplies_the_scores():
    mod = zoo("annotated")
    torch.manual_seed(0)
    unscaled = mod.make_model(11, 11, **TINY, scale=False).eval()
    scaled = mod.make_model(11, 11, **TINY).eval()
    scaled.load_state_dict(unscaled.state_dict())
    src, tgt = batch()
    with torch.no_grad():
        want = annotated_forward(scaled, src, tgt, 0)
        with GenericCapture(unscaled).scaling(1 / math.sqrt(8)):
            got = annotated_forward(unscaled, src, tgt, 0)
        plain = annotated_forward(unscaled, src, tgt, 0)
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(plain, want, atol=1e-3)


def test_gradients_at_stream_points():
    model = zoo("annotated").make_model(11, 11, **TINY).eval()
    trace, _ = record(model, annotated_forward, reads=("stream", "grad.stream"), grad=True)
    assert "encoder.layers.1" in trace.grads and trace.grads["encoder.layers.1"].shape == (B, S, 32)


def test_nothing_is_left_behind():
    model = zoo("torch_seq2seq").build(dropout=0.0).eval()
    originals = (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.softmax, F.softmax,
                 F.scaled_dot_product_attention, torch.Tensor.masked_fill)
    fast = torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(RuntimeError, match="boom"):
        with GenericCapture(model).recording(("all",), Trace(src=batch()[0], tgt=batch()[1])):
            raise RuntimeError("boom")
    assert (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.softmax, F.softmax,
            F.scaled_dot_product_attention, torch.Tensor.masked_fill) == originals
    assert torch.backends.mha.get_fastpath_enabled() == fast
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_subject_trace_with_a_user_adapter():
    mod = zoo("torch_seq2seq")
    model = mod.build(dropout=0.0).eval()
    subject = Subject(model, mod.forward, src_vocab=11, tgt_vocab=11, encode=mod.encode,
                      capture=GenericCapture(model))
    src, tgt = batch()
    with subject.evaluating():
        trace = subject.trace(src, tgt)
        memory = subject.encode(src)
    assert trace.logits.shape == (B, T, 11) and memory.shape == (B, S, 32)
    assert any(s.stack == "encoder" and s.kind == "stack" for s in trace.streams)


def test_a_recording_holds_nothing_alive_after_it_ends():
    """The stream gradient hooks live in the autograd graph; if the recording kept graph tensors
    (q, k, scores) the graph and the hooks would hold each other, out of the collector's sight,
    and every triage of a user's model leaked the model (1.5 GB per run at the base size)."""
    import gc
    import weakref

    model = zoo("annotated").make_model(11, 11, **TINY).eval()
    alive = weakref.ref(model.encoder.layers[0].self_attn.linears[0].weight)
    src, tgt = batch()
    trace = Trace(src=src, tgt=tgt)
    with torch.enable_grad(), GenericCapture(model).recording(("all", "grad.stream"), trace):
        out = annotated_forward(model, src, tgt, 0)
    torch.autograd.grad(out.float().logsumexp(-1).sum(), list(model.parameters()))
    assert trace.streams and trace.attention and trace.grads     # it did record
    del model, out, trace
    gc.collect()
    assert alive() is None


def test_only_the_fields_asked_for_are_kept():
    model = zoo("annotated").make_model(11, 11, **TINY).eval()
    trace, _ = record(model, annotated_forward, reads=("attn.probs",))
    recs = list(trace.attention.values())
    assert recs and all(r.probs is not None for r in recs)
    assert all(r.q is None and r.scores is None and r.out is None for r in recs)
    assert trace.order == []            # module outputs are kept for stream readers only
