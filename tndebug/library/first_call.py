"""The first call of the user's model (`live.live_subject`): a small batch of ordinary ids, one
forward in eval mode without gradients, and what came back: the logits, the module whose output
they are, and the embedding tables the ids were looked up in (the vocabulary rule's evidence).
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.capture.adapters import Adapter, first_tensor
from tndebug.capture.subjects import fed_tables, token_tables
from tndebug.errors import UsageError
from tndebug.library.args import ids_in_vocabulary


def embedding_vocab(model: nn.Module) -> int | None:
    """The ids every token table can look up (before the first call: its ids must fit)."""
    sizes = [v for _, v in token_tables(model)]
    return min(sizes) if sizes else None


def vocab_sizes(model: nn.Module, heads: bool = True) -> set[int]:
    """The sizes a model's logits can have: its token embeddings' rows (and, with `heads`, its
    Linear layers' outputs)."""
    sizes = {v for _, v in token_tables(model)}
    if heads:
        sizes |= {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    return sizes


def first_batch(model: nn.Module, c, pad_id: int, bos_id: int):
    """(src [2, 7], tgt [2, 6]) of ordinary ids that every token table can look up, tgt BOS-led;
    one stack: its sequence alone. Refuses ids outside the vocabulary before the call (which
    would index out of range), and a model whose vocabulary cannot be told."""
    lo = c.first_content if c.first_content is not None else max(pad_id, bos_id) + 1
    vocab = embedding_vocab(model)
    given = (c.src_vocab, c.tgt_vocab, vocab)
    n_ids = min(v for v in given if v) if any(given) else None
    if n_ids is not None and c.first_content is None:    # the user's ids (not HF's config's)
        largest = max([n_ids, *(v for v in (c.src_vocab, c.tgt_vocab) if v),
                       *vocab_sizes(model, heads=False)])
        ids_in_vocabulary(pad_id, bos_id, n_ids, largest)
    if n_ids is None or n_ids <= lo + 1:
        raise UsageError(f"cannot tell the vocabulary of {type(model).__name__} (no nn.Embedding "
                         f"with more than {lo + 1} rows): pass src_vocab= and tgt_vocab=")
    g = torch.Generator().manual_seed(0)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    src = torch.randint(lo, n_ids, (2, 7), generator=g).to(device)
    tgt = torch.randint(lo, n_ids, (2, 6), generator=g).to(device)
    tgt[:, 0] = bos_id
    if c.kind == "decoder":
        src = src[:, :0]                          # one sequence: tgt
    elif c.kind == "encoder":
        tgt = src.clone()                         # one sequence: src (tgt is ignored)
    return src, tgt


def first_call(model: nn.Module, adapter: Adapter, src, tgt, pad_id: int, info: dict):
    """(`_call_once`'s dict, src, tgt) of the first call. A model may raise on rows without
    padding (an inverted key padding mask masks every key of such a row): then it is called with
    a pad ending every row (info["first_call"] says so), and the probes' own calls show what it
    raises on. Raising on both batches is a usage error (the first one's)."""
    try:
        return _call_once(model, adapter, src, tgt, pad_id), src, tgt
    except UsageError as first:
        src, tgt = src.clone(), tgt.clone()
        for ids in (src, tgt):
            if ids.shape[1]:                      # a decoder-only model's src has no column
                ids[:, -1] = pad_id
        try:
            out = _call_once(model, adapter, src, tgt, pad_id)
        except UsageError:
            raise first from None
        info["first_call"] = "rows ending in a pad (the model raised on rows without padding)"
        return out, src, tgt


def _call_once(model: nn.Module, adapter: Adapter, src, tgt, pad_id: int) -> dict:
    """One forward in eval mode, no grad: the logits, and the path of the module whose output
    they are (the root for most models; `generator` for The Annotated Transformer's)."""
    outputs: list[tuple[str, torch.Tensor]] = []    # held for the call: ids are not reused

    def hook(name):
        def record(mod, args, out):
            t = first_tensor(out)
            if t is not None:
                outputs.append((name, t))                         # returns None: output unchanged
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    was = model.training
    model.eval()
    try:
        with fed_tables(model, src, tgt) as fed, torch.no_grad():
            logits = adapter.forward(model, src, tgt, pad_id)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UsageError(f"{adapter.name} raised {type(e).__name__}: {text} (it is called as "
                         f"forward(model, src [B, S], tgt [B, T], pad_id), or decoder-only forward(model, "
                         f"ids [B, T], pad_id), batch first)") from None
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    path = next((n for n, t in outputs if t is logits), None)
    outputs.clear()
    return {"logits": logits, "path": path, "fed": fed}
