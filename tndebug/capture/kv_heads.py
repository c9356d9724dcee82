"""Grouped-query attention's repeated key/value heads, put in the other order: what a recording
feeds the scores when a probe asks whether the model repeats its kv heads in the order its
queries read them (`kv_swap`; triage's kv-order test).
"""
from __future__ import annotations

import torch


def kv_swapped(x) -> tuple[torch.Tensor, str]:
    """(x with its key/value heads in the other grouped-query order, the order they were in)
    when x [B, h, ., .] holds g kv heads repeated to h (1 < g < h): "interleaved" (HF's
    repeat_kv, `repeat_interleave`: q head i reads kv head i // (h/g)) becomes tiled
    (`repeat(1, h/g, 1, 1)`: q head i reads kv head i % g), and tiled becomes interleaved;
    else (x, ""). Exact equality: repeated heads are copies."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] < 4:
        return x, ""
    h = x.shape[1]
    if torch.equal(x, x[:, :1].expand_as(x)):          # one head broadcast: no order to swap
        return x, ""
    for g in range(2, h):
        r = h // g
        if h % g:
            continue
        if torch.equal(x, x[:, ::r].repeat_interleave(r, dim=1)):
            return x[:, [(i % g) * r for i in range(h)]], "interleaved"
        if torch.equal(x, x[:, :g].repeat(1, r, 1, 1)):
            return x[:, [i // r for i in range(h)]], "tiled"
    return x, ""
