"""A user's model in the T5 manner (issue 19 tests): no 1/sqrt(d_k) in the attention, the scale
folded into W_Q at initialisation instead (W_Q and its bias sqrt(d_k) smaller), on the
Annotated Transformer's code (tests/zoo/annotated.py, scale=False).

    tndebug triage ckpt.pt --model t5style_user.py:make_model
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from tndebug.capture.adapters import import_file

annotated = import_file(Path(__file__).resolve().parents[1] / "zoo" / "annotated.py")


def make_model(src_vocab=11, tgt_vocab=11, N=2, d_model=32, d_ff=64, h=4, dropout=0.0, fold=True):
    model = annotated.make_model(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout, scale=False)
    if fold:                                  # T5: q starts sqrt(d_k) smaller than k
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, annotated.MultiHeadedAttention):
                    m.linears[0].weight /= math.sqrt(m.d_k)
                    m.linears[0].bias /= math.sqrt(m.d_k)
    return model
