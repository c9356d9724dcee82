"""tndebug's decoder-only model: causal, padding-invariant on either side, and driven by the
seq2seq greedy decoder through encode/decode; the LM batches put the loss on the continuation."""
from __future__ import annotations

import torch

from tndebug.config import ModelConfig
from tndebug.data import BOS, EOS, PAD, as_lm, data_generator, get_task
from tndebug.model import DecoderOnly
from tndebug.inject import make_model
from tndebug.subject import tndebug_subject
from tndebug.train.evaluate import greedy_decode


def build(*faults, **kw) -> DecoderOnly:
    torch.manual_seed(0)
    return make_model(ModelConfig.tiny(arch="decoder", dropout=0.0, **kw).with_faults(*faults)).eval()


def ids(B=4, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 11, (B, T), generator=g)
    x[:, 0] = BOS
    return x


def test_make_model_builds_the_decoder_only_model_with_one_stack():
    m = build()
    assert isinstance(m, DecoderOnly)
    assert not hasattr(m, "encoder") and len(m.decoder.layers) == 2
    assert m(ids()).shape == (4, 9, 11)


@torch.no_grad()
def test_causal_and_the_causal_faults_leak():
    x = ids()
    other = x.clone()
    other[:, 5:] = (x[:, 5:] - 2) % 8 + 3
    healthy = (build()(x)[:, :5] - build()(other)[:, :5]).abs().max()
    assert healthy < 1e-5
    for fault in ("no_causal_mask", "causal_transposed"):
        m = build(fault)
        assert (m(x)[:, :5] - m(other)[:, :5]).abs().max() > 1e-3, fault


@torch.no_grad()
def test_right_and_left_padding_leave_real_logits_unchanged():
    m, x = build(), ids()
    right = torch.cat([x, torch.zeros(4, 3, dtype=x.dtype)], 1)
    left = torch.cat([torch.zeros(4, 3, dtype=x.dtype), x], 1)
    assert (m(x) - m(right)[:, :9]).abs().max() < 1e-5
    assert (m(x) - m(left)[:, 3:]).abs().max() < 1e-5


def test_as_lm_puts_the_loss_on_the_continuation_only():
    task = get_task("reverse")
    b = task.batch(data_generator(0, "train"), 6)
    lm = as_lm(b)
    assert lm.src.shape == (6, 0) and lm.tgt_in.shape == lm.tgt_out.shape
    for r in range(6):
        n_src, n_tgt = int((b.src[r] != PAD).sum()), int((b.tgt_out[r] != PAD).sum())
        seq = lm.tgt_in[r]
        assert int(seq[0]) == BOS and int(seq[n_src]) == EOS          # BOS + source (with its EOS)
        assert torch.equal(lm.tgt_out[r, n_src:n_src + n_tgt], b.tgt_out[r, :n_tgt])
        assert (lm.tgt_out[r, :n_src] == PAD).all() and (lm.tgt_out[r, n_src + n_tgt:] == PAD).all()
        # the label at i is the token at i + 1 of the same sequence
        assert torch.equal(lm.tgt_out[r, n_src:n_src + n_tgt - 1], seq[n_src + 1:n_src + n_tgt])


@torch.no_grad()
def test_greedy_decoding_through_encode_decode_matches_the_full_forward():
    m = build()
    task = get_task("copy")
    b = task.batch(data_generator(3, "eval"), 5)
    pred = greedy_decode(m, b.src, b.tgt_out.shape[1])                  # [5, T], left-padded prompts
    for r in range(5):                                                   # one row alone, no padding
        n = int((b.src[r] != PAD).sum())
        seq = torch.cat([torch.tensor([BOS]), b.src[r, :n]])             # BOS + source + EOS
        for t in range(pred.shape[1]):
            nxt = int(m(seq[None])[0, -1].argmax())
            assert nxt == int(pred[r, t])
            if nxt == EOS:
                break
            seq = torch.cat([seq, torch.tensor([nxt])])


def test_its_subject_is_decoder_only_and_ignores_the_source():
    m = build()
    s = tndebug_subject(m)
    assert s.kind == "decoder" and not s.has_source and s.encode(torch.zeros(2, 3)) is None
    src, tgt = s.random_batch(4, 7, 8)
    assert src.shape == (4, 0) and tgt.shape == (4, 8) and (tgt[:, 0] == BOS).all()
    with s.evaluating():
        assert torch.equal(s.logits(src, tgt), m(tgt))


@torch.no_grad()
def test_the_kv_cache_gives_the_full_forwards_logits():
    """incremental(ids, split): the prefix once, then one token at a time through the cache;
    exact (float rounding) at every real position, for any split, with left pads, Pre and Post-LN."""
    for norm in ("pre", "post"):
        m = build(norm=norm)
        x = torch.cat([torch.zeros(4, 2, dtype=torch.long), ids()], 1)      # rows 1.. left-padded
        x[0, :2] = torch.tensor([BOS, 5])
        x[0, 2] = 6
        full, real = m(x), x != PAD
        for split in range(0, x.shape[1] + 1):
            got = m.incremental(x, split)                                   # [B, T - split, V]
            assert got.shape == (4, x.shape[1] - split, 11)
            gap = (got - full[:, split:])[real[:, split:]].abs()
            assert gap.numel() == 0 or gap.max() < 1e-5, (norm, split)


def test_its_subject_offers_the_cache():
    m = build()
    s = tndebug_subject(m)
    assert s.has_cache
    with s.evaluating():
        x = ids()
        assert (s.incremental(x, 3) - m(x)[:, 3:]).abs().max() < 1e-5
