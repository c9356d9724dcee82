"""How tndebug calls a Hugging Face model that no user code wraps: the ids it can draw (its
config's special ids left out), the adapter that calls it as a transformers user does, and its
attention projections. Used by `tndebug triage DIR` (triage/hf_dir.py) and by `check`/`watch` on a
transformers model (library/live.py). transformers itself is never imported here: these read
the model's config and call the model.
"""
from __future__ import annotations

import torch
from torch import nn

from tndebug.errors import UsageError


def special_ids(config) -> dict[str, int]:
    return {k: v for k, v in sorted(vars(config).items())
            if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def choose_ids(config, vocab: int) -> dict:
    """pad, the decoder-start id, the id the probes put in column 0, the content range."""
    spec = special_ids(config)
    pad = spec.get("pad_token_id", 0)
    start_from = next((k for k in ("decoder_start_token_id", "bos_token_id", "pad_token_id",
                                   "eos_token_id") if k in spec), None)
    start = spec[start_from] if start_from else 0
    specials = sorted({v for v in spec.values() if v < vocab})
    low = [s for s in specials if s < vocab // 2]
    high = [s for s in specials if s >= vocab // 2]
    lo, hi = (max(low) + 1 if low else 0), (min(high) if high else vocab)
    # probes tell padding by id: when decoder start == pad (T5, Marian, Pegasus) they get another
    # special id in column 0, which the adapter turns back into decoder_start_token_id
    marker = start
    if start == pad:
        marker = next((s for s in specials if s != pad), lo)
        lo = max(lo, marker + 1) if marker < vocab // 2 else lo
    if hi - lo < 4:
        raise UsageError(f"config.json leaves fewer than 4 ordinary token ids ({lo}..{hi - 1}) "
                         f"in a vocabulary of {vocab}")
    return {"pad": pad, "start": start, "start_from": start_from, "marker": marker,
            "content": (lo, hi), "specials": spec}


def make_adapter(start: int, marker: int):
    """forward(model, src, tgt, pad_id) and encode(model, src, pad_id) as transformers users call
    the model; column 0 holding `marker` becomes decoder_start_token_id."""
    def decoder_ids(tgt):
        if marker == start:
            return tgt
        dec = tgt.clone()
        dec[:, 0] = torch.where(tgt[:, 0] == marker, torch.full_like(tgt[:, 0], start), tgt[:, 0])
        return dec

    def forward(model, src, tgt, pad_id):
        out = model(input_ids=src, attention_mask=(src != pad_id).long(),          # 1 = keep
                    decoder_input_ids=decoder_ids(tgt),
                    decoder_attention_mask=(tgt != pad_id).long(), use_cache=False)
        return out.logits                                                            # [B, T, V]

    def encode(model, src, pad_id):
        return model.get_encoder()(input_ids=src, attention_mask=(src != pad_id).long()
                                   ).last_hidden_state                               # [B, S, d]
    forward.decoder_ids = decoder_ids               # for callers that wrap it (tests)
    return forward, encode


def attention_weights(model: nn.Module) -> list:
    """(path, W_Q, W_K, W_V, heads) for BART-family (q_proj/k_proj/v_proj), T5 (q/k/v), the BERT
    family (query/key/value) and DistilBert (q_lin/k_lin/v_lin)."""
    out = []
    for name, m in model.named_modules():
        names = next((t for t in (("q_proj", "k_proj", "v_proj"), ("q", "k", "v"),
                                  ("query", "key", "value"), ("q_lin", "k_lin", "v_lin"))
                      if all(isinstance(getattr(m, a, None), nn.Linear) for a in t)), None)
        h = next((getattr(m, a) for a in ("num_heads", "n_heads", "num_attention_heads")
                  if isinstance(getattr(m, a, None), int)),
                 None) or getattr(getattr(m, "config", None), "num_attention_heads", None)
        if names and isinstance(h, int):
            out.append((name, *(getattr(m, a).weight.detach() for a in names), h))
    return out
