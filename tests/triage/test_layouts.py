"""Layouts: recognised from keys, converted exactly into tndebug's model, named back."""
from __future__ import annotations

import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.data import eval_set, get_task
from tndebug.errors import UsageError
from tndebug.inject import make_model
from tndebug.triage import layouts
from tndebug.capture.adapters import annotated_forward
from tndebug.triage.run import _config

from conftest import TINY, zoo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BATCH = eval_set(get_task("copy"), n=6)


def converted(model, layout, **choices):
    conv = layouts.convert(model.state_dict(), layout)
    return conv, layouts.build_model(conv, _config(conv, {**conv.sizes, **choices}))


def test_detect():
    assert layouts.detect_layout(make_model(ModelConfig.tiny()).state_dict()) == "tndebug"
    assert layouts.detect_layout(zoo("annotated").make_model(11, 11, **TINY).state_dict()) == "annotated"
    assert layouts.detect_layout(zoo("torch_seq2seq").build().state_dict()) == "torch"
    assert layouts.detect_layout(zoo("sdpa_model").build().state_dict()) is None


def test_annotated_converts_exactly():
    m = zoo("annotated").make_model(11, 11, **TINY).eval()
    conv, tm = converted(m, "annotated", n_heads=4)
    assert conv.sizes == dict(d_model=32, src_vocab=11, tgt_vocab=11, n_layers=2, d_ff=64,
                              ln_eps=1e-6, norm="pre", max_len=64)
    with torch.no_grad():
        want = annotated_forward(m, BATCH.src, BATCH.tgt_in, 0)
        got = tm(BATCH.src, BATCH.tgt_in).log_softmax(-1)
    assert (want - got).abs().max() < 1e-5
    assert conv.user_path("decoder.layers.1.cross_attn") == "decoder.layers.1.src_attn"
    assert conv.user_path("encoder.layers.0.ffn") == "encoder.layers.0.feed_forward"
    assert conv.user_path("encoder.layers.0.self_attn.w_k") == "encoder.layers.0.self_attn.linears.1"


def test_annotated_without_final_norm_is_pre_ln_without_it():
    m = zoo("annotated").make_model(11, 11, **TINY, final_norm=False).eval()
    conv, tm = converted(m, "annotated", n_heads=4)
    assert not conv.final_norm and "pre_ln_no_final_norm" in tm.cfg.faults
    with torch.no_grad():
        assert (annotated_forward(m, BATCH.src, BATCH.tgt_in, 0)
                - tm(BATCH.src, BATCH.tgt_in).log_softmax(-1)).abs().max() < 1e-5


@pytest.mark.parametrize("norm_first", [False, True])
def test_nn_transformer_converts_exactly(norm_first):
    mod = zoo("torch_seq2seq")
    m = mod.build(dropout=0.0, norm_first=norm_first).eval()
    conv, tm = converted(m, "torch", n_heads=4, norm="pre" if norm_first else "post")
    assert set(conv.unknown) == {"n_heads", "norm", "emb_scale"}
    with torch.no_grad():
        want = mod.forward(m, BATCH.src, BATCH.tgt_in, 0)
        got = tm(BATCH.src, BATCH.tgt_in)
        wrong = converted(m, "torch", n_heads=4, norm="post" if norm_first else "pre")[1](BATCH.src, BATCH.tgt_in)
    assert (want - got).abs().max() < 1e-5 and (want - wrong).abs().max() > 0.1
    assert conv.user_path("decoder.layers.0.cross_attn") == "transformer.decoder.layers.0.multihead_attn"
    assert conv.user_path("encoder.layers.1.sublayer.1.norm") == "transformer.encoder.layers.1.norm2"
    assert conv.user_path("src_embed") == "src_tok_emb.embedding"


def test_nn_transformer_without_embedding_scale():
    mod = zoo("torch_seq2seq")
    m = mod.build(dropout=0.0, emb_scale=False).eval()
    _, tm = converted(m, "torch", n_heads=4, norm="post", emb_scale=False)
    with torch.no_grad():
        assert (mod.forward(m, BATCH.src, BATCH.tgt_in, 0) - tm(BATCH.src, BATCH.tgt_in)).abs().max() < 1e-5


def test_tndebug_round_trip_shares_the_checkpoints_tensors():
    m = make_model(ModelConfig.tiny(dropout=0.0, norm="post")).eval()
    conv = layouts.convert(m.state_dict(), "tndebug")
    assert conv.unknown["norm"] == ("post", "pre")
    tm = layouts.build_model(conv, _config(conv, {**conv.sizes, "n_heads": 4, "norm": "post"}))
    assert tm.encoder.layers[0].self_attn.w_q.weight.data_ptr() == \
        conv.state_dict["encoder.layers.0.self_attn.w_q.weight"].data_ptr()          # no copy
    assert tm.encoder.layers[0].self_attn.w_q.weight.requires_grad
    with torch.no_grad():
        assert torch.allclose(tm(BATCH.src, BATCH.tgt_in), m(BATCH.src, BATCH.tgt_in), atol=1e-5)


def test_normalise_config_aliases():
    assert layouts.normalise_config({"h": 8, "N": 6, "d_model": 512, "dim_feedforward": 2048,
                                     "norm_first": True, "dropout": 0.1, "name": "x"}) == \
        {"n_heads": 8, "n_layers": 6, "d_model": 512, "d_ff": 2048, "norm": "pre"}


def test_learned_positions_in_torch_layout_ask_for_the_code():
    sd = zoo("torch_seq2seq").build().state_dict()
    sd["positional_encoding.pos_embedding"] = torch.randn_like(sd["positional_encoding.pos_embedding"])
    with pytest.raises(UsageError, match="learned or non-sinusoidal positional encoding.*--model"):
        layouts.convert(sd, "torch")


def test_unrecognised_outside_keys_ask_for_an_adapter():
    sd = zoo("torch_seq2seq").build().state_dict()
    sd["extra_head.weight"] = torch.zeros(5, 32)
    with pytest.raises(UsageError, match="could not be told apart"):
        layouts.convert(sd, "torch")


def test_mismatched_shapes_are_a_usage_error():
    m = zoo("annotated").make_model(11, 11, **TINY)
    sd = m.state_dict()
    sd["encoder.layers.1.feed_forward.w_1.weight"] = torch.zeros(48, 32)
    conv = layouts.convert(sd, "annotated")
    with pytest.raises(UsageError, match="shapes do not fit"):
        layouts.build_model(conv, _config(conv, {**conv.sizes, "n_heads": 4}))


def test_half_precision_checkpoint_is_examined_in_fp32():
    m = zoo("annotated").make_model(11, 11, **TINY).eval()
    conv, tm = converted(m.half(), "annotated", n_heads=4)
    assert all(p.dtype == torch.float32 for p in tm.parameters())
    assert torch.isfinite(tm(BATCH.src, BATCH.tgt_in)).all()
