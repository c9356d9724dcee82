"""label-shift's test of an encoder-only (masked-LM) loop: is the loss taken where the input
hides the answer?

A masked LM learns by predicting tokens it cannot see: the recipe (Devlin et al. 2019, kept by
RoBERTa, ELECTRA's generator, DistilBert) labels ~15% of the positions, replaces most of those
inputs by the mask id, and ignores the rest (-100). The classic bug takes the loss at every
position (`labels = input_ids`, or a collator whose -100 was lost): most labelled positions then
show their own label in the input, the model learns to copy it, and the loss falls to ~0 while
nothing is learnt. Decided from the loop's own batches, exactly: the share of real positions
that carry a label, and the share of those whose input token is the label itself.
"""
from __future__ import annotations

import torch

# A loss at every position labels all real positions and leaves ~85% of them unchanged (the
# recipe changes only the 15% it picks); the recipe labels 15% and leaves 10% of those unchanged.
# Both cuts sit at 0.5, far from either side for any masking rate up to 50%: a property of the
# objective, set on no run.
LABELLED_SHARE = 0.5
UNCHANGED_SHARE = 0.5


def counts(src: torch.Tensor, labels: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """src [B, S] the model's input ids, labels [B, S] its targets (pad where none) ->
    {"real", "labelled", "unchanged"} counts (0-d tensors; summed over steps by the caller)."""
    real = src != pad_id
    labelled = real & (labels != pad_id)
    return {"real": real.sum(), "labelled": labelled.sum(),
            "unchanged": (labelled & (src == labels)).sum()}


def verdict(real: int, labelled: int, unchanged: int) -> tuple[bool, dict]:
    """(loss taken where the input shows the answer, evidence)."""
    lab = labelled / real if real else 0.0
    same = unchanged / labelled if labelled else 0.0
    ev = {"real_positions": real, "labelled": labelled, "labelled_unchanged": unchanged,
          "labelled_share": lab, "unchanged_share": same,
          "thresholds": {"labelled_share": LABELLED_SHARE, "unchanged_share": UNCHANGED_SHARE}}
    return lab > LABELLED_SHARE and same > UNCHANGED_SHARE, ev
