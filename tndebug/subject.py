"""A `Subject`: what probes may do with a model — call it, encode, and capture a trace.

Probes are written against this, never against tndebug's classes, so that triage can wrap a
user's model (through an adapter) and run the same probes on their code.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from tndebug.trace import TapCapture, Trace

ForwardFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]


class Subject:
    """A model plus how to call it.

    Args:
        model: the module (for parameters, named_modules, train/eval).
        forward: `forward(model, src, tgt, pad_id) -> logits [B, T, V]`.
        encode: optional `encode(model, src, pad_id) -> memory [B, S, d]`.
        capture: an object with `recording(reads, trace)` (TapCapture or a generic capture).
    """

    def __init__(self, model: nn.Module, forward: ForwardFn, *, pad_id: int = 0, bos_id: int = 1,
                 src_vocab: int, tgt_vocab: int, encode=None, capture=None,
                 max_len: int | None = None) -> None:
        self.model = model
        self._forward = forward
        self._encode = encode
        self.capture = capture
        self.pad_id, self.bos_id = pad_id, bos_id
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.max_len = max_len

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def first_content(self) -> int:
        """The smallest token id that is neither pad nor BOS."""
        return max(self.pad_id, self.bos_id) + 1

    def logits(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self._forward(self.model, src, tgt, self.pad_id)

    def encode(self, src: torch.Tensor) -> torch.Tensor | None:
        return None if self._encode is None else self._encode(self.model, src, self.pad_id)

    @contextmanager
    def evaluating(self):
        """Eval mode (dropout off), no grad; restores the previous mode."""
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield self
        finally:
            self.model.train(was)

    def trace(self, src: torch.Tensor, tgt: torch.Tensor, reads=("all",)) -> Trace:
        """One forward pass (caller chooses the mode) recorded into a Trace."""
        if self.capture is None:
            raise RuntimeError("this subject cannot capture internals")
        trace = Trace(src=src, tgt=tgt, pad_id=self.pad_id)
        with self.capture.recording(reads, trace):
            trace.logits = self.logits(src, tgt).detach()
        return trace

    def random_batch(self, batch: int = 8, src_len: int = 10, tgt_len: int = 10, *,
                     pad_share: float = 0.5, generator: torch.Generator | None = None):
        """Random content with BOS-led targets; about `pad_share` of rows right-padded.

        Returns (src [B, S], tgt [B, T]); every row keeps at least 2 real tokens.
        """
        g = generator or torch.Generator().manual_seed(1234)
        lo = self.first_content
        src = torch.randint(lo, self.src_vocab, (batch, src_len), generator=g)
        tgt = torch.randint(lo, self.tgt_vocab, (batch, tgt_len), generator=g)
        tgt[:, 0] = self.bos_id
        for b in range(batch):
            if torch.rand((), generator=g).item() < pad_share:
                s = int(torch.randint(2, src_len, (), generator=g))
                t = int(torch.randint(2, tgt_len, (), generator=g))
                src[b, s:] = self.pad_id
                tgt[b, t:] = self.pad_id
        return src.to(self.device), tgt.to(self.device)


def tndebug_subject(model) -> Subject:
    """Wrap tndebug's own Transformer."""
    cfg = model.cfg
    return Subject(
        model, lambda m, src, tgt, pad: m(src, tgt), pad_id=cfg.pad_id, bos_id=1,
        src_vocab=cfg.src_vocab, tgt_vocab=cfg.tgt_vocab,
        encode=lambda m, src, pad: m.encode(src), capture=TapCapture(model),
        max_len=cfg.max_len)
