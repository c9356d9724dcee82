"""Encoder-only Hugging Face models for `tndebug triage DIR`: Bert, Roberta, DistilBert, Electra,
any `model_type` that `AutoModelForMaskedLM` builds and whose saved architectures name no causal
head.

    forward = make_mlm_adapter()
    Subject(model, forward, kind="encoder", ...)

The model is called as a user of transformers calls a masked LM: `input_ids` and
`attention_mask` (1 = keep); token types and positions are the model's own defaults (zeros;
arange, or Roberta's count from `padding_idx`, which is why the pad must be the config's). Its
per-token logits are both what the probes compare and the encoding (`Subject.encode`): the MLM
head is a function of each position alone, so a change anywhere in the stack shows in them.
The pad and the content ids are chosen as for a decoder-only model (`hf_decoder.choose_lm_ids`:
pad = config.pad_token_id, else the largest id that is no special id); no start id is fed.
"""
from __future__ import annotations

MLM_CALLS = ("model(input_ids, attention_mask=ids != pad).logits; token_type_ids and "
             "position_ids left to the model's defaults")
# The one loss of triage's recorded forward and backward (gradient-flow): cross-entropy of the
# logits against the input ids at every real position. No position is masked: the gradients
# take the same path through the stack, and no random choice of masked positions enters.
MLM_LOSS = "cross-entropy of the logits against the input ids at every real position (pads ignored)"


def make_mlm_adapter():
    """forward(model, ids, pad_id) -> MLM logits [B, S, V]."""
    def forward(model, ids, pad_id):
        mask = (ids != pad_id).long()                                         # 1 = keep
        return model(input_ids=ids, attention_mask=mask).logits                # [B, S, V]
    return forward


def mlm_ids_note(ids: dict) -> str:
    return (f"pad {ids['pad']} ({ids['pad_from']}); the probes' rows are ordinary ids "
            f"{ids['content'][0]}..{ids['content'][1] - 1}, right-padded, with no [CLS]/[SEP] "
            f"(an encoder needs no start id); --pad-id/--bos-id are not used")
