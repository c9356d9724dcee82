"""Encoder-only Hugging Face models (Bert, Roberta, DistilBert, Electra): any `model_type` that
`AutoModelForMaskedLM` builds and whose saved architectures name no causal head. Used by
`tndebug triage DIR` (triage/hf_dir.py) and by `check`/`watch` on such a model (library/live.py).

    forward = make_mlm_adapter()
    Subject(model, forward, kind="encoder", ...)

The model is called as a user of transformers calls a masked LM: `input_ids` and
`attention_mask` (1 = keep); token types and positions are the model's own defaults (zeros;
arange, or Roberta's count from `padding_idx`, which is why the pad must be the config's). Its
per-token logits are both what the probes compare and the encoding (`Subject.encode`): the MLM
head is a function of each position alone, so a change anywhere in the stack shows in them.
The pad and the content ids are chosen as for a decoder-only model (`hf/decoder_only.choose_lm_ids`:
pad = config.pad_token_id, else the largest id that is no special id); no start id is fed.
"""
from __future__ import annotations

import torch


MLM_CALLS = ("model(input_ids, attention_mask=ids != pad).logits; token_type_ids and "
             "position_ids left to the model's defaults")


def make_mlm_adapter():
    """forward(model, ids, pad_id) -> MLM logits [B, S, V]."""
    def forward(model, ids, pad_id):
        mask = (ids != pad_id).long()                                         # 1 = keep
        return model(input_ids=ids, attention_mask=mask).logits                # [B, S, V]
    return forward


# The one loss of triage's recorded forward and backward (gradient-flow): cross-entropy of the
# logits against the input ids at every real position. No position is masked: the gradients
# take the same path through the stack, and no random choice of masked positions enters.
MLM_LOSS = "cross-entropy of the logits against the input ids at every real position (pads ignored)"


def mlm_ids_note(ids: dict) -> str:
    return (f"pad {ids['pad']} ({ids['pad_from']}); the probes' rows are ordinary ids "
            f"{ids['content'][0]}..{ids['content'][1] - 1}, right-padded, with no [CLS]/[SEP] "
            f"(an encoder needs no start id); --pad-id/--bos-id are not used")


# The temperature sweep of an encoder-only model scores the masked-LM objective it was trained
# on: a share of each row's ordinary tokens replaced by the mask id and predicted. Scored on
# unmasked input the loss is that of copying the input, which a trained MLM does at any
# temperature (the sweep would judge nothing). 15% is BERT's rate (Devlin et al. 2019), and the
# rate of RoBERTa, ELECTRA's generator and DistilBert; at least one position a row.
MASK_SHARE = 0.15


def masked_lm_batch(batch, mask_id: int, pad_id: int, specials) -> tuple:
    """(src with MASK_SHARE of each row's ordinary tokens (no pad, no special id) set to
    `mask_id`, the same as tgt_in, tgt_out = the original ids there and pad elsewhere); the
    positions are drawn with a fixed seed, so a rerun scores the same ones."""
    src = batch.src.clone()
    ordinary = src != pad_id
    for s in set(specials) | {mask_id}:
        ordinary &= src != s
    g = torch.Generator().manual_seed(0)
    pick = (torch.rand(src.shape, generator=g) < MASK_SHARE) & ordinary          # [N, T]
    first = ordinary.float().argmax(1)                                           # a row's first
    none = ~pick.any(1) & ordinary.any(1)
    pick[none.nonzero().flatten(), first[none]] = True
    tgt_out = torch.where(pick, src, torch.full_like(src, pad_id))
    src[pick] = mask_id
    return src, src.clone(), tgt_out
