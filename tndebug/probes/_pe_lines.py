"""Where a position mechanism that is never applied should have been applied, in the user's code
(positional-encoding/positions-not-applied; issue 48).

The finding names the mechanism the model declares (`tables[0]`: a parameter, buffer or
module). Its line is told from the table's shape, against what the first attention reads:

* a table of rows as wide as the stream ([L, d_model] or [1, L, d_model]: a learned or
  sinusoidal absolute table) is added to the embeddings: the line that made what enters the first block (`x = self.tok(ids)`,
  where `+ self.pos[:T]` belongs), from the probe's own forward (op_lines.input_line);
* a module of another width (a relative-bias nn.Embedding, one column per head) or a tensor
  whose last dim is neither d_model nor the head's (an ALiBi bias [h, L, L]) is added to the
  scores: the line of the first attention's score product (or its SDPA call), the op its
  values never reached;
* a rotary table (a tensor whose last dim is head_dim or head_dim / 2, or complex) is applied to
  q and k, at a
  line between their making and the score product that no op shows: no line (an honest none
  beats a wrong one: on the user-style corpus the score line missed the deleted rotation in 2 of
  4 rotary styles).

A module table as wide as the stream (an nn.Embedding of positions that is called and its
output dropped) keeps the engine's place: the line that calls it, where the unused table is
built.
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.capture.op_lines import input_line
from tndebug.capture.source import pick
from tndebug.subject import Subject


def not_applied_line(subject: Subject, table: str) -> dict | None:
    """The user's line for `table` never applied (see the module docstring); None: none found,
    or the engine places it."""
    model = subject.model
    modules = dict(model.named_modules())
    t = dict(model.named_parameters()).get(table)
    if t is None:
        t = dict(model.named_buffers()).get(table)
    is_module = t is None
    if is_module:
        mod = modules.get(table)
        t = getattr(mod, "weight", None) if isinstance(mod, nn.Module) else None
    cap = subject.capture
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or cap is None:
        return None
    stack = "encoder" if subject.kind == "encoder" else "decoder"
    firsts = sorted((i, p) for p, (s, i) in cap.layers.items() if s == stack) or \
        sorted((i, p) for p, (s, i) in cap.layers.items())
    if not firsts or firsts[0][1] not in modules:
        return None
    g = torch.Generator().manual_seed(3)
    src, tgt = subject.random_batch(batch=2, src_len=8, tgt_len=8, generator=g)
    if subject.kind != "encoder":
        src = tgt[:, :0]
    try:
        with subject.evaluating(), torch.no_grad():
            trace = subject.trace(src, tgt, reads=("attn.scores", "attn.q"))
    except Exception:  # noqa: BLE001 - the line is a help, the finding stands without it
        return None
    recs = sorted((r for r in trace.records() if r.kind in ("enc_self", "dec_self")),
                  key=lambda r: r.layer if r.layer is not None else 1 << 30)
    if not recs:
        return None
    rec = recs[0]
    hd = rec.q.shape[-1] if rec.q is not None else None

    def run():
        with subject.evaluating(), torch.no_grad():
            subject.logits(src, tgt)
    made, shape = input_line(modules[firsts[0][1]], run)
    if not shape:
        return None
    d = shape[-1]                                           # the stream's width
    if t.dim() >= 2 and t.shape[-1] == d and t[..., 0].numel() == t.shape[-2]:   # [L, d], [1, L, d]
        return None if is_module else made                  # a module: the engine (its call)
    if not is_module and (t.is_complex() or hd is None or t.shape[-1] in (hd, hd // 2)):
        return None                                         # rotary (or not told): no line
    loc = pick(rec.sources, "scores", "sdpa")
    return loc if loc and not loc.get("def") else None
