import pytest
import torch

from tndebug.data import (BOS, EOS, FIRST_CONTENT, PAD, TASKS, content_lengths, data_generator,
                          eval_set, get_task, monotone_translation, stream_seed)


@pytest.mark.parametrize("name", list(TASKS))
def test_shapes_ids_and_framing(name):
    task = get_task(name)
    b = task.batch(data_generator(0), 64)
    W = task.max_len + 1
    assert b.src.shape == b.tgt_in.shape == b.tgt_out.shape == (64, W)
    assert int(b.src.max()) < task.src_vocab and int(b.tgt_out.max()) < task.tgt_vocab
    assert (b.tgt_in[:, 0] == BOS).all()
    n = content_lengths(b.src)
    rows = torch.arange(64)
    # source and target both end with one EOS at the content length, then pads
    for seq in (b.src, b.tgt_out):
        assert ((seq == EOS).sum(1) == 1).all()
        assert (seq[rows, n] == EOS).all()
        assert ((seq == PAD) == (torch.arange(W)[None] > n[:, None])).all()
    # teacher forcing: the decoder input is the output shifted right by one
    assert torch.equal(b.tgt_in[:, 1:].masked_fill(b.tgt_in[:, 1:] == EOS, PAD),
                       b.tgt_out[:, :-1].masked_fill(b.tgt_out[:, :-1] == EOS, PAD))
    assert (n >= task.min_len).all() and (n <= task.max_len).all()


def test_padding_share():
    task = get_task("copy")
    g = data_generator(3)
    short_rows, padded_batches = [], 0
    for _ in range(40):
        b = task.batch(g, 32)
        short = content_lengths(b.src) < task.max_len
        short_rows.append(short.float().mean())
        padded_batches += bool(short.any())
    assert 0.4 < float(torch.stack(short_rows).mean()) < 0.6
    assert padded_batches >= 20
    full = task.batch(g, 32, pad_share=0.0)
    assert (content_lengths(full.src) == task.max_len).all()


def test_determinism_and_streams():
    task = get_task("reverse")
    a = task.batch(data_generator(7), 16)
    b = task.batch(data_generator(7), 16)
    c = task.batch(data_generator(8), 16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.src, c.src)
    assert stream_seed(7, "train") != stream_seed(7, "eval")
    ev = eval_set(task, 16, seed=7)
    assert not torch.equal(ev.src, a.src)
    assert torch.equal(ev.src, eval_set(task, 16, seed=7).src)


def _content(seq):
    return [t for t in seq.tolist() if t >= FIRST_CONTENT]


def test_copy_reverse_sort_targets():
    g = data_generator(1)
    for name, fn in (("copy", lambda s: s), ("reverse", lambda s: s[::-1]), ("sort", sorted)):
        b = get_task(name).batch(g, 32)
        for src, out in zip(b.src, b.tgt_out):
            assert _content(out) == list(fn(_content(src)))


def test_translate_needs_reordering():
    task = get_task("translate")
    b = task.batch(data_generator(0), 256)
    mapped = monotone_translation(b.src)
    reordered = 0
    for src, m, out in zip(b.src, mapped, b.tgt_out):
        tgt, mono = _content(out), _content(m)
        assert sorted(tgt) == sorted(mono)          # same words, translated
        reordered += tgt != mono
    assert reordered / 256 > 0.7                  # most sentences need a non-monotone alignment
    content = torch.arange(FIRST_CONTENT, task.src_vocab)
    assert sorted(monotone_translation(content).tolist()) == content.tolist()   # a bijection


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        get_task("parse")
