"""Synthetic sequence-to-sequence tasks, generated from a seed (nothing is downloaded).

Token ids, shared by every task:

    0 pad    1 BOS (start of the decoder input)    2 EOS (end of every target)    3.. content

A batch is `src [B, S]` = source + EOS, `tgt_in [B, T]` = BOS + target and `tgt_out [B, T]` =
target + EOS, all right-padded: the decoder learns where to stop, so greedy decoding needs no
length oracle. The source EOS marks the end as in NMT; without it the decoder must find the
end by content, and copies that end in a repeated token ("5 5") stop one token early. About `pad_share` of the rows are shorter than the longest
allowed, so nearly every batch carries padding and padding bugs change the numbers.

Tasks (`TASKS`):

* copy      target = source. Vocabulary 11 and length 10 as in The Annotated Transformer
            (there content is 1..10; here 1 is BOS and 2 EOS, so content is 3..10).
* reverse   target = source reversed.
* sort      target = source sorted ascending.
* translate a toy translation that cross-attention must reorder. The source language has
            function words F (3..8), adjectives A (9..16) and nouns N (17..24); a sentence is
            a string of phrases "F", "N" or "A N". Each word maps to one target word through a
            fixed bijection (a permutation of the content ids, the same for every seed), and
            every "A N" becomes "N' A'" (adjective after the noun, as English -> French), so the
            alignment is not monotone.

The held-out evaluation set comes from its own seed stream (`stream_seed(seed, "eval")`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from tndebug.task_names import SUMMARIES, VOCAB

PAD, BOS, EOS, FIRST_CONTENT = 0, 1, 2, 3


class Batch(NamedTuple):
    src: torch.Tensor       # [B, S] content + EOS, right-padded with PAD
    tgt_in: torch.Tensor    # [B, T] BOS + target, right-padded
    tgt_out: torch.Tensor   # [B, T] target + EOS, right-padded

    @property
    def ntokens(self) -> int:
        """Non-pad target tokens (what the loss is averaged over)."""
        return int((self.tgt_out != PAD).sum())

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in self))


# content [B, L] with PAD beyond each row's length -> target content [B, L], same padding
TargetFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (generator, lengths [B], width) -> source content [B, width]
SourceFn = Callable[[torch.Generator, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Task:
    """A synthetic task: vocabulary sizes, lengths, and how to make a source and its target.

    `max_len` is the longest source content; targets have the same length here, so every
    tensor of a batch is `max_len + 1` wide (the +1 for BOS/EOS).
    """
    name: str
    src_vocab: int
    tgt_vocab: int
    max_len: int
    min_len: int
    summary: str
    source: SourceFn
    target: TargetFn

    @property
    def tgt_len(self) -> int:
        """Width of tgt_in / tgt_out: target content + BOS (or EOS)."""
        return self.max_len + 1

    def batch(self, g: torch.Generator, batch_size: int, pad_share: float = 0.5) -> Batch:
        """One random batch; about `pad_share` of the rows are shorter than `max_len`."""
        L = self.max_len
        lengths = torch.full((batch_size,), L, dtype=torch.long)
        short = torch.rand(batch_size, generator=g) < pad_share
        if L > self.min_len:
            drawn = torch.randint(self.min_len, L, (batch_size,), generator=g)   # [B] in [min, L)
            lengths = torch.where(short, drawn, lengths)
        keep = torch.arange(L)[None, :] < lengths[:, None]                         # [B, L]
        src = self.source(g, lengths, L).masked_fill(~keep, PAD)                  # [B, L]
        tgt = self.target(src, lengths).masked_fill(~keep, PAD)                   # [B, L]
        B, rows = batch_size, torch.arange(batch_size)
        src = torch.cat([src, torch.zeros(B, 1, dtype=torch.long)], dim=1)        # [B, L+1]
        src[rows, lengths] = EOS
        tgt_in = torch.cat([torch.full((B, 1), BOS), tgt], dim=1)                 # [B, L+1]
        tgt_out = torch.cat([tgt, torch.zeros(B, 1, dtype=torch.long)], dim=1)    # [B, L+1]
        tgt_out[rows, lengths] = EOS
        return Batch(src, tgt_in, tgt_out)


def as_lm(batch: Batch) -> Batch:
    """The same examples for a decoder-only model: one sequence BOS + source + EOS + target +
    EOS per row, right-padded; `tgt_in` is it without its last column, `tgt_out` the next token
    at each position with the prompt's positions set to PAD, so the loss (which ignores PAD)
    falls on the continuation only. `src` is empty ([B, 0]).

        src     5 6 EOS            tgt_out  5 6 EOS
        tgt_in  BOS 5 6 EOS 5 6          -> tgt_out  . . . 5 6 EOS   (. = PAD)
    """
    B = batch.src.shape[0]
    n_src = (batch.src != PAD).sum(1)                        # content + EOS   [B]
    n_tgt = (batch.tgt_out != PAD).sum(1)                    # content + EOS   [B]
    width = 1 + batch.src.shape[1] + batch.tgt_out.shape[1]
    seq = torch.full((B, width), PAD, dtype=torch.long, device=batch.src.device)
    labels = torch.full_like(seq, PAD)
    for b in range(B):
        s, t = int(n_src[b]), int(n_tgt[b])
        seq[b, 0] = BOS
        seq[b, 1:1 + s] = batch.src[b, :s]
        seq[b, 1 + s:1 + s + t] = batch.tgt_out[b, :t]
        labels[b, s:s + t] = batch.tgt_out[b, :t]            # position s (the source EOS) predicts t1
    return Batch(seq[:, :0], seq[:, :-1], labels[:, :-1])


def misshift(batch: Batch, shift: int) -> Batch:
    """An `as_lm` batch whose labels are the tokens `shift` positions on (1 = `as_lm`'s own):
    0 puts each position's own input token as its label (labels not shifted), 2 the label of
    the next position (shifted twice). For the training faults lm_labels_unshifted/_twice."""
    if shift == 0:
        return batch._replace(tgt_out=batch.tgt_in.where(batch.tgt_out != PAD, PAD))
    if shift == 2:
        pad = torch.full_like(batch.tgt_out[:, :1], PAD)
        return batch._replace(tgt_out=torch.cat([batch.tgt_out[:, 1:], pad], dim=1))
    raise ValueError(f"shift={shift}: 0 or 2 (1 is as_lm itself)")


def content_lengths(seqs: torch.Tensor) -> torch.Tensor:
    """Content tokens per row (not pad, BOS or EOS).  [B, L] -> [B]"""
    return (seqs >= FIRST_CONTENT).sum(dim=1)


# -- copy, reverse, sort -------------------------------------------------------------------
def _uniform_source(vocab: int) -> SourceFn:
    return lambda g, lengths, L: torch.randint(FIRST_CONTENT, vocab, (len(lengths), L), generator=g)


def _copy(src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return src.clone()


def _reverse(src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    L = src.shape[1]
    idx = (lengths[:, None] - 1 - torch.arange(L)[None, :]).clamp(min=0)   # [B, L]
    return src.gather(1, idx)


def _sort(src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    big = torch.iinfo(src.dtype).max
    return src.masked_fill(src == PAD, big).sort(dim=1).values.masked_fill_(
        torch.arange(src.shape[1])[None, :] >= lengths[:, None], PAD)


# -- translate -----------------------------------------------------------------------------
FUNCTION_WORDS = range(3, 9)     # F
ADJECTIVES = range(9, 17)        # A
NOUNS = range(17, 25)            # N
TRANSLATE_VOCAB = VOCAB["translate"]
assert TRANSLATE_VOCAB == NOUNS.stop


def _word_map() -> torch.Tensor:
    """The fixed source -> target bijection on content ids (same for every seed).  [V]"""
    perm = torch.randperm(TRANSLATE_VOCAB - FIRST_CONTENT,
                          generator=torch.Generator().manual_seed(20170612)) + FIRST_CONTENT
    return torch.cat([torch.arange(FIRST_CONTENT), perm])


WORD_MAP = _word_map()


def _translate_source(g: torch.Generator, lengths: torch.Tensor, L: int) -> torch.Tensor:
    """Sentences of phrases F | N | A N (probabilities 0.35, 0.25, 0.4), cut to each length."""
    B = len(lengths)
    kind = torch.rand(B, L, generator=g)                                         # [B, L]
    f = torch.randint(FUNCTION_WORDS.start, FUNCTION_WORDS.stop, (B, L), generator=g)
    a = torch.randint(ADJECTIVES.start, ADJECTIVES.stop, (B, L), generator=g)
    n = torch.randint(NOUNS.start, NOUNS.stop, (B, L), generator=g)
    out = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        i, n_b = 0, int(lengths[b])
        while i < n_b:
            u = float(kind[b, i])
            if u < 0.4 and i + 1 < n_b:            # "A N"
                out[b, i], out[b, i + 1] = a[b, i], n[b, i + 1]
                i += 2
            else:
                out[b, i] = n[b, i] if u < 0.65 else f[b, i]
                i += 1
    return out


def _translate(src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Map every word, then swap each adjective-noun pair."""
    is_adj = (src >= ADJECTIVES.start) & (src < ADJECTIVES.stop)                 # [B, L]
    mapped = WORD_MAP[src]                                                       # [B, L]
    out = mapped.clone()
    # an adjective at i is always followed by its noun at i+1 (see _translate_source)
    swap_first = is_adj                                                          # noun goes here
    swap_second = torch.zeros_like(is_adj)
    swap_second[:, 1:] = is_adj[:, :-1]                                          # adjective goes here
    out[:, :-1][swap_first[:, :-1]] = mapped[:, 1:][swap_first[:, :-1]]
    out[:, 1:][swap_second[:, 1:]] = mapped[:, :-1][swap_second[:, 1:]]
    return out


def monotone_translation(src: torch.Tensor) -> torch.Tensor:
    """Word-by-word mapping with no reordering (what a model without alignment would emit)."""
    return WORD_MAP[src]


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("copy", VOCAB["copy"], VOCAB["copy"], 10, 1, SUMMARIES["copy"], _uniform_source(11), _copy),
    Task("reverse", VOCAB["reverse"], VOCAB["reverse"], 10, 1, SUMMARIES["reverse"], _uniform_source(11),
         _reverse),
    Task("sort", VOCAB["sort"], VOCAB["sort"], 10, 1, SUMMARIES["sort"], _uniform_source(11), _sort),
    Task("translate", TRANSLATE_VOCAB, TRANSLATE_VOCAB, 10, 2, SUMMARIES["translate"],
         _translate_source, _translate),
)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return TASKS[name]


# -- seed streams ---------------------------------------------------------------------------
_STREAMS = {"train": 1, "eval": 2}


def stream_seed(seed: int, split: str) -> int:
    """A seed for one split; train and eval never share a stream."""
    return (seed * 0x9E3779B1 + _STREAMS[split] * 0x85EBCA77) % (2 ** 63)


def data_generator(seed: int, split: str = "train") -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(seed, split))


def batches(task: Task, batch_size: int, g: torch.Generator, pad_share: float = 0.5) -> Iterator[Batch]:
    """Endless training batches drawn from `g` (save `g.get_state()` to resume the stream)."""
    while True:
        yield task.batch(g, batch_size, pad_share)


def eval_set(task: Task, n: int = 1000, seed: int = 0, pad_share: float = 0.5) -> Batch:
    """`n` held-out sequences from the eval stream of `seed`."""
    return task.batch(data_generator(seed, "eval"), n, pad_share)


__all__ = ["PAD", "BOS", "EOS", "FIRST_CONTENT", "Batch", "Task", "TASKS", "get_task",
           "batches", "eval_set", "data_generator", "stream_seed", "content_lengths",
           "monotone_translation"]
