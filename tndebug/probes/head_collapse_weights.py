"""head-collapse's check of the weights alone: two heads of one attention drawn as copies, or Q
and K (and V) given one projection. Needs no forward: triage (checkpoint, Hugging Face
directory) and `check` run it on the attention weights the capture matched
(capture.projection_weights, or a Hugging Face model's q/k/v projections)."""
from __future__ import annotations

from typing import Iterable

import torch

from tndebug.findings import Finding
from tndebug.probes.head_collapse import DUP_COS


def duplicate_heads(sites: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> list[Finding]:
    """sites: (module path, W_Q, W_K, W_V [d, d] each, heads). Shared W_Q = W_K, or two heads
    whose Q/K/V slices have cosine > 0.99."""
    out = []
    for where, wq, wk, wv, h in sites:
        if not (wq.any() and wk.any()):
            # a zero W_Q or W_K: every score is the same, the heads attend uniformly whatever
            # their draw, so neither sharing nor duplicated heads can be told from these weights
            continue
        if wq.shape == wk.shape and torch.equal(wq, wk):
            same_v = wv.shape == wq.shape and torch.equal(wq, wv)
            out.append(Finding("head-collapse", "error",
                               f"{where}: W_Q and W_K{' and W_V' if same_v else ''} are the same weights "
                               f"(torch.equal): on one input (self-attention) every head's scores are "
                               f"symmetric", where=where, step=0,
                               evidence={"shared": "qkv" if same_v else "qk"},
                               fix="give Q, K and V their own projections (nn.Linear each)",
                               code="head-collapse/shared-projection"))
            continue
        if h < 2 or wq.shape[0] % h:
            continue
        per_head = torch.cat([w.reshape(h, -1) for w in (wq, wk, wv)], dim=1).double()  # [h, 3 d_k d]
        unit = per_head / per_head.norm(dim=1, keepdim=True).clamp_min(1e-30)
        cos = unit @ unit.T                                                             # [h, h]
        cos.fill_diagonal_(-1.0)
        worst = float(cos.max())
        if worst > DUP_COS:
            i, j = divmod(int(cos.argmax()), h)
            n_dup = int((cos > DUP_COS).any(1).sum())
            out.append(Finding("head-collapse", "error",
                               f"{where}: {n_dup} of {h} heads are copies of each other in the weights "
                               f"(heads {i} and {j}: cosine {worst:.4f})", where=where, step=0,
                               evidence={"max_cosine": worst, "heads": [i, j], "duplicated": n_dup,
                                         "threshold": DUP_COS},
                               fix="initialise each head independently (no deepcopy of one head)",
                               code="head-collapse/duplicated-heads"))
    return out
