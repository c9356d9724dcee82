"""Greedy decoding and held-out evaluation: exact-sequence match and token accuracy."""
from __future__ import annotations

import torch

from tndebug.data import BOS, EOS, PAD, Batch


@torch.no_grad()
def greedy_decode(model, src: torch.Tensor, max_len: int, *, bos: int = BOS, eos: int = EOS,
                  pad: int = PAD) -> torch.Tensor:
    """Decode `max_len` tokens greedily (encoder once, decoder re-run on the growing prefix).

    Returns the predicted target `[B, max_len]`; positions after a row's first EOS are `pad`.
    """
    memory = model.encode(src)                                            # [B, S, d_model]
    ys = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)   # [B, 1]
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logits = model.decode(memory, src, ys)                            # [B, t, V]
        nxt = logits[:, -1].argmax(-1)                                    # [B]
        nxt = nxt.masked_fill(done, pad)
        done |= nxt == eos
        ys = torch.cat([ys, nxt[:, None]], dim=1)                         # [B, t+1]
        if bool(done.all()):
            break
    out = ys[:, 1:]
    if out.shape[1] < max_len:
        out = torch.nn.functional.pad(out, (0, max_len - out.shape[1]), value=pad)
    return out                                                            # [B, max_len]


@torch.no_grad()
def evaluate(model, data: Batch, *, batch_size: int = 500, autocast=None) -> dict[str, float]:
    """Greedy-decode `data.src` and compare with `data.tgt_out` (target + EOS).

    exact_match: share of sequences whose every real target position (EOS included) is right.
    token_accuracy: share of real target positions that are right.
    """
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    exact = correct = total = 0
    try:
        for i in range(0, data.src.shape[0], batch_size):
            src = data.src[i:i + batch_size].to(device)
            gold = data.tgt_out[i:i + batch_size].to(device)                 # [b, T]
            ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                pred = greedy_decode(model, src, gold.shape[1])              # [b, T]
            real = gold != PAD
            hit = (pred == gold) & real
            correct += int(hit.sum())
            total += int(real.sum())
            exact += int((hit | ~real).all(dim=1).sum())
    finally:
        model.train(was)
    n = data.src.shape[0]
    return {"exact_match": exact / max(n, 1), "token_accuracy": correct / max(total, 1), "n": n}
