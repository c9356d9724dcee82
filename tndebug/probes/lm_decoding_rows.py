"""The rows every lm-decoding test feeds the model, and the rule it compares logits by."""
from __future__ import annotations

import torch

from tndebug.subject import Subject

# Both tests compare the same model on the same real tokens: healthy, only float rounding of
# other shapes (another kernel, another reduction order) separates them, ~1e-7 of the logit scale
# in fp32 (measured 0.95-1.3e-6 absolute on logits up to ~3.6, tndebug's tiny decoder-only). A pad that
# moves a position, or a cached step that misses a key, changes logits by 1e-2..1 of their scale.
# REL_TOL sits two orders of magnitude above rounding and far below either: max|change| >
# REL_TOL * (1 + max|reference logit|) (the same rule as mask-broadcast's).
REL_TOL = 1e-5
THRESHOLD = f"max|change| > {REL_TOL:g}*(1+max|logit|)"


def content_rows(s: Subject, batch: int, length: int, seed: int) -> torch.Tensor:
    """BOS-led rows of content tokens, no pads.  # [B, T]"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(s.first_content, s.tgt_vocab, (batch, length), generator=g)
    ids[:, 0] = s.bos_id
    return ids.to(s.device)


def pad_columns(s: Subject, batch: int, n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((batch, n), s.pad_id, dtype=like.dtype, device=like.device)
