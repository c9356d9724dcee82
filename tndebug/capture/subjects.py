"""A foreign model's vocabularies: one rule for every front-end (`tndebug triage --model`,
`tndebug triage DIR`, `check`, `watch`), which then build their Subject with `Subject.of_kind`.

    with fed_tables(model, src, tgt) as fed:      # around one call of the user's forward
        logits = forward(model, src, tgt, pad_id)
    src_v, tgt_v = vocab_rule(model, logits.shape[-1], fed, kind)
    subject = Subject.of_kind(model, forward, second, kind=kind, capture=capture, pad_id=..., ...)

The vocabulary rule, decided by behaviour: a side's vocabulary is the number of rows of the
embedding table its ids were looked up in during that call, and the target's is bounded by the
logits' width (a head narrower than the table predicts only its own ids). Where no table was
seen to receive the ids (a one-hot input, a functional lookup), the names are a hint (a table
named src/enc/source for the source), then the first token table, then the logits' width.
A Hugging Face model states the same in its API (`get_input_embeddings()` is the table its
ids are looked up in, `get_output_embeddings()` the head), which triage/hf_dir.py reads directly.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


# name hints of tables that are never the vocabulary: positions, token types / segments (BERT's
# token_type_embeddings has 2 rows: as the "smallest table" it would leave no ordinary id)
NOT_VOCAB = ("pos", "wpe", "type", "segment")


def token_tables(model: nn.Module) -> list[tuple[str, int]]:
    """(path, rows) of the model's nn.Embedding tables not named as positions or token types."""
    return [(n, m.num_embeddings) for n, m in model.named_modules() if isinstance(m, nn.Embedding)
            and not any(w in n.lower() for w in NOT_VOCAB)]


@contextmanager
def fed_tables(model: nn.Module, src: torch.Tensor, tgt: torch.Tensor):
    """{"src": rows, "tgt": rows}: the embedding tables the call inside looked `src` and `tgt` up
    in (batch first or transposed); a side no table received is absent."""
    fed: dict[str, int] = {}

    def saw(module, args):
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            return
        for role, ref in (("src", src), ("tgt", tgt)):
            if role not in fed and ref.numel() and ids.dim() == 2 and (
                    (ids.shape == ref.shape and torch.equal(ids, ref))
                    or (ids.shape == ref.T.shape and torch.equal(ids, ref.T))):
                fed[role] = module.num_embeddings
    handles = [m.register_forward_pre_hook(saw) for m in model.modules() if isinstance(m, nn.Embedding)]
    try:
        yield fed
    finally:
        for h in handles:
            h.remove()


def vocab_rule(model: nn.Module, width: int, fed: dict[str, int], kind: str = "seq2seq",
               src_vocab: int | None = None, tgt_vocab: int | None = None) -> tuple[int, int]:
    """(src_vocab, tgt_vocab) by the rule above; a size the user gave wins. `width`: the
    logits' last dimension. One sequence (decoder- or encoder-only): both are that sequence's."""
    if kind in ("decoder", "encoder"):
        side = "tgt" if kind == "decoder" else "src"
        v = tgt_vocab or src_vocab or min(width, fed.get(side, width))
        return v, v
    tgt_v = tgt_vocab or min(width, fed.get("tgt", width))
    if src_vocab:
        return src_vocab, tgt_v
    if "src" in fed:
        return fed["src"], tgt_v
    tables = token_tables(model)
    named = next((v for n, v in tables if any(w in n.lower() for w in ("src", "enc", "source"))), None)
    return named or (tables[0][1] if tables else tgt_v), tgt_v
