"""A `Subject`: what probes may do with a model — call it, encode, and capture a trace.

Probes are written against this, never against tndebug's classes, so that triage can wrap a
user's model (through an adapter) and run the same probes on their code.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from tndebug.capture.taps import TapCapture
from tndebug.capture.trace import StopForward, Trace

# Below MIN_PROBE_LEN positions (3 real tokens and a pad) no exact test can run, so a shorter
# length limit is not searched for.
MIN_PROBE_LEN = 4
# The pad id of data with no padding (`pad_id=None`: character-level text, where id 0 is a real
# character): no id equals it, so every position of the user's batches is real and no loss is
# ignored. The exact tests still pad their own copies, with `Subject.pad_id` (an internal id).
NO_PAD = -1

ForwardFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]
# A decoder-only model's call: forward(model, ids [B, T], pad_id) -> logits [B, T, V]; an
# encoder-only model's is the same, with its outputs per token (MLM logits or hidden states)
LMForwardFn = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
KINDS = ("seq2seq", "decoder", "encoder")


class Subject:
    """A model plus how to call it.

    Args:
        model: the module (for parameters, named_modules, train/eval).
        forward: `forward(model, src, tgt, pad_id) -> logits [B, T, V]`; for `kind="decoder"`
            `forward(model, ids, pad_id) -> logits [B, T, V]`.
        encode: optional `encode(model, src, pad_id) -> memory [B, S, d]` (seq2seq only).
        capture: an object with `recording(reads, trace)` (TapCapture or a generic capture).
        kind: "seq2seq" (an encoder and a decoder), "decoder" (one causal stack, GPT-style) or
            "encoder" (one bidirectional stack, BERT-style: ids only, outputs per token).
        incremental: optional, decoder-only: `incremental(model, ids, pad_id, split) -> logits
            [B, T - split, V]`, the logits of positions split.. of `ids` [B, T] computed the way
            the model generates: the prefix ids[:, :split] once, filling its KV cache, then one
            token at a time through that cache. Offered where the model has a cache (Hugging
            Face `past_key_values`, a user's adapter); None: no cache to test.
        padded: False when the user's data hold no padding (`pad_id=None`): their batches are
            read with `data_pad_id` (NO_PAD), and `pad_id` only pads the probes' own copies.

    A decoder-only model is driven through the same calls: `tgt` (BOS-led, right-padded) is its
    sequence, `src` is empty ([B, 0]) and ignored, so every test of the decoder (causality,
    target padding, the trace of its attention) runs unchanged; the tests of a source side say
    they do not apply (`has_source`).

    An encoder-only model is the mirror image: `src` (right-padded, no BOS) is its sequence and
    `tgt` is ignored; `logits(src, _)` and `encode(src)` are both its per-token outputs
    [B, S, V], so every test of an encoder (source pad length, batch independence, its trace,
    the permutation test) runs unchanged, and the tests of a target side say they do not apply
    (`has_target`).
    """

    def __init__(self, model: nn.Module, forward: ForwardFn | LMForwardFn, *, pad_id: int = 0,
                 bos_id: int = 1, src_vocab: int, tgt_vocab: int, encode=None, capture=None,
                 max_len: int | None = None, kind: str = "seq2seq", incremental=None,
                 first_content: int | None = None, padded: bool = True) -> None:
        if kind not in KINDS:
            raise ValueError(f"Subject kind {kind!r}; expected one of {KINDS}")
        if kind in ("decoder", "encoder") and encode is not None:
            raise ValueError(f"a {kind}-only Subject is called through forward alone: pass no encode")
        self.model = model
        self.kind = kind
        self._incremental = incremental
        self._forward = forward
        self._encode = encode
        self.capture = capture
        self.pad_id, self.bos_id = pad_id, bos_id
        self.padded = padded                # False: the user's data hold no padding (pad_id=None)
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.max_len = max_len              # the longest sequence the model takes (None: unknown)
        self._first = first_content         # None: the ids after pad and BOS
        self._limit: int | None = None      # the longest length that runs, when one raised (`fit`)
        self._runs_at = 0                   # the longest length seen to run

    @classmethod
    def of_kind(cls, model: nn.Module, forward, second=None, *, kind: str = "seq2seq",
                capture=None, **kw) -> "Subject":
        """The Subject of every front-end (triage --model, triage DIR, check, watch). `second` is
        the model's other call: `encode(model, src, pad_id)` of an encoder-decoder,
        `incremental(model, ids, pad_id, split)` of a decoder-only model (None: no KV cache to
        test); an encoder-only model has none. `kw`: pad_id, bos_id, src_vocab, tgt_vocab,
        max_len, first_content, padded."""
        if kind == "decoder":
            return cls(model, forward, kind="decoder", incremental=second, capture=capture, **kw)
        if kind == "encoder":
            return cls(model, forward, kind="encoder", capture=capture, **kw)
        return cls(model, forward, encode=second, capture=capture, **kw)

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def data_pad_id(self) -> int:
        """The pad id of the user's own batches: `pad_id`, or NO_PAD when they hold no padding
        (then `pad_id` is only the id the exact tests pad their own copies with)."""
        return self.pad_id if self.padded else NO_PAD

    @property
    def first_content(self) -> int:
        """The smallest id of the probes' random content: neither pad nor BOS, and above every
        special id a model's config declares when it was given (`first_content`, Hugging Face)."""
        return self._first if self._first is not None else max(self.pad_id, self.bos_id) + 1

    def fit(self, n: int) -> int:
        """`n`, or less when the model takes no sequence that long: `max_len` when it is known
        (the model's position table, a config limit, or the user's `max_len`), else found by
        calling the model (eval, no grad) on a plain batch of two rows, one right-padded: when
        length n raises and a short one runs, the longest length that runs (bisection). A model
        that raises at every length has no limit found here; the probes' own calls then show
        what it raises on. What was found is kept: a model is tried at few lengths."""
        if self.max_len:
            return max(1, min(n, self.max_len))
        if self._limit is not None:
            return min(n, self._limit)
        if n <= self._runs_at or n < MIN_PROBE_LEN:
            return n
        if self._runs(n):
            self._runs_at = n
            return n
        if not self._runs(MIN_PROBE_LEN):
            return n
        lo, hi = max(MIN_PROBE_LEN, self._runs_at), n      # runs at lo, raises at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._runs(mid) else (lo, mid)
        self._limit = lo
        return lo

    def inputs(self) -> dict:
        """What the probes' own batches were fitted to, for the report's `run.probe_inputs`:
        the ids they draw from, the pad and start ids, and the length limit with its source."""
        limit = self.max_len or self._limit
        source = ("max_len (the model's config, or the user's max_len)" if self.max_len else
                  "found by calling the model (longer sequences raised)" if self._limit else
                  "none found (every length tried ran)")
        return {"content_ids": [self.first_content, min(self.src_vocab, self.tgt_vocab) - 1],
                "pad_id": self.pad_id, "bos_id": self.bos_id, "max_len": limit,
                "max_len_source": source, "longest_tried": max(self._runs_at, limit or 0) or None}

    def _runs(self, n: int) -> bool:
        src = torch.full((2, n), self.first_content, dtype=torch.long, device=self.device)
        src[0, max(2, n // 2):] = self.pad_id
        tgt = src.clone()
        tgt[:, 0] = self.bos_id
        try:
            with self.evaluating():
                self.logits(src, tgt)
            return True
        except Exception:  # noqa: BLE001 - the model refusing a length is what is measured
            return False

    @property
    def has_source(self) -> bool:
        """False for a decoder-only model: there is no source sequence to pad or perturb."""
        return self.kind != "decoder"

    @property
    def has_target(self) -> bool:
        """False for an encoder-only model: no target sequence (nothing causal to test)."""
        return self.kind != "encoder"

    def logits(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        if self.kind == "decoder":
            return self._forward(self.model, tgt, self.pad_id)
        if self.kind == "encoder":
            return self._forward(self.model, src, self.pad_id)
        return self._forward(self.model, src, tgt, self.pad_id)

    @property
    def position_shift(self):
        """`shift(model, ids, pad_id, offset) -> logits` with every position moved by `offset`,
        where the model's call offers one (a Hugging Face decoder's `position_ids`; the
        adapter's `forward.shift_positions`), else None: lm-decoding's rotary shift test."""
        return getattr(self._forward, "shift_positions", None)

    @property
    def has_cache(self) -> bool:
        return self._incremental is not None

    def incremental(self, ids: torch.Tensor, split: int) -> torch.Tensor | None:
        """Logits of positions split.. decoded through the model's KV cache  # [B, T - split, V]
        (None when the subject offers no cache)."""
        if self._incremental is None:
            return None
        return self._incremental(self.model, ids, self.pad_id, split)

    def encode(self, src: torch.Tensor) -> torch.Tensor | None:
        if self.kind == "encoder":                  # its output per token is its encoding
            return self._forward(self.model, src, self.pad_id)
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

    def trace(self, src: torch.Tensor, tgt: torch.Tensor, reads=("all",), *,
              until_stacks: bool = False, stop_before: str | None = None) -> Trace:
        """One forward pass (caller chooses the mode) recorded into a Trace. A capture that can
        stops the forward early (the rest never runs; `trace.logits` stays None): with
        `until_stacks`, once what enters the stacks is recorded (reads "embed"); with
        `stop_before` (a module path: the output head), as that module is called."""
        if self.capture is None:
            raise RuntimeError("this subject cannot capture internals")
        trace = Trace(src=src, tgt=tgt, pad_id=self.pad_id)
        stop = {}
        if until_stacks and _takes(self.capture.recording, "until_stacks"):
            stop["until_stacks"] = True
        if stop_before is not None and _takes(self.capture.recording, "stop_before"):
            stop["stop_before"] = stop_before
        with self.capture.recording(reads, trace, **stop):
            try:
                trace.logits = self.logits(src, tgt).detach()
            except StopForward:
                pass
        return trace

    def random_batch(self, batch: int = 8, src_len: int = 10, tgt_len: int = 10, *,
                     pad_share: float = 0.5, generator: torch.Generator | None = None):
        """Random content with BOS-led targets; about `pad_share` of rows right-padded.

        Returns (src [B, S], tgt [B, T]); every row keeps at least 2 real tokens. An
        encoder-only subject's tgt is src itself (its per-token targets: the ids, pads ignored).
        """
        g = generator or torch.Generator().manual_seed(1234)
        if not self.has_source:
            src_len = 0
        if not self.has_target:
            tgt_len = src_len
        src_len, tgt_len = self.fit(src_len) if src_len else 0, self.fit(tgt_len)
        lo = self.first_content
        src = torch.randint(lo, self.src_vocab, (batch, src_len), generator=g)
        tgt = torch.randint(lo, self.tgt_vocab, (batch, tgt_len), generator=g)
        tgt[:, 0] = self.bos_id
        for b in range(batch):
            if torch.rand((), generator=g).item() < pad_share:
                s = int(torch.randint(2, src_len, (), generator=g)) if src_len > 2 else src_len
                t = int(torch.randint(2, tgt_len, (), generator=g))
                src[b, s:] = self.pad_id
                tgt[b, t:] = self.pad_id
        if not self.has_target:
            tgt = src.clone()
        return src.to(self.device), tgt.to(self.device)


def _takes(fn, name: str) -> bool:
    """Whether `fn` accepts the keyword `name` (a capture of the user's own may not)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def tndebug_subject(model) -> Subject:
    """Wrap tndebug's own Transformer (or its decoder-only model)."""
    cfg = model.cfg
    if cfg.arch == "decoder":
        return Subject(model, lambda m, ids, pad: m(ids), pad_id=cfg.pad_id, bos_id=1,
                       src_vocab=cfg.src_vocab, tgt_vocab=cfg.tgt_vocab,
                       capture=TapCapture(model), max_len=cfg.max_len, kind="decoder",
                       incremental=lambda m, ids, pad, split: m.incremental(ids, split))
    return Subject(
        model, lambda m, src, tgt, pad: m(src, tgt), pad_id=cfg.pad_id, bos_id=1,
        src_vocab=cfg.src_vocab, tgt_vocab=cfg.tgt_vocab,
        encode=lambda m, src, pad: m.encode(src), capture=TapCapture(model),
        max_len=cfg.max_len)
