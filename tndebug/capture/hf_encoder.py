"""How tndebug calls an encoder-only Hugging Face model (Bert, Roberta, DistilBert, Electra, a
masked LM): `input_ids` and `attention_mask` (1 = keep); token types and positions are the
model's own defaults. Used by `tndebug triage DIR` (triage/hf_encoder.py) and by `check`/`watch`
on such a model (library/live.py)."""
from __future__ import annotations


MLM_CALLS = ("model(input_ids, attention_mask=ids != pad).logits; token_type_ids and "
             "position_ids left to the model's defaults")


def make_mlm_adapter():
    """forward(model, ids, pad_id) -> MLM logits [B, S, V]."""
    def forward(model, ids, pad_id):
        mask = (ids != pad_id).long()                                         # 1 = keep
        return model(input_ids=ids, attention_mask=mask).logits                # [B, S, V]
    return forward
