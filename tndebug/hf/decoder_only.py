"""Decoder-only Hugging Face models for `tndebug triage DIR`: GPT2, Llama, Qwen2, Mistral,
GPTNeoX, any `model_type` that `AutoModelForCausalLM` knows.

    forward, incremental = make_lm_adapter()
    Subject(model, forward, kind="decoder", incremental=incremental, ...)

The model is called the way `generate()` calls it: `input_ids`, `attention_mask` (1 = keep) and
`position_ids` counted from the row's first real token; `incremental` decodes through the
model's KV cache (`past_key_values`), one token at a time, as generation does.
"""
from __future__ import annotations

import torch

from tndebug.errors import UsageError


def positions(mask: torch.Tensor) -> torch.Tensor:
    """position_ids as `generate()` derives them from the attention mask: the cumulative count
    of real tokens - 1, pads set to 1 (GenerationMixin.prepare_inputs_for_generation). This is
    what the model sees when it generates, so a left-padded row gets the positions of the same
    row unpadded; passing them explicitly keeps the probes' call and generation's the same.
    mask [B, T] (1 = keep) -> [B, T]"""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def make_lm_adapter():
    """forward(model, ids, pad_id) -> logits [B, T, V] and incremental(model, ids, pad_id, split)
    -> logits [B, T - split, V] through the KV cache."""
    def forward(model, ids, pad_id):
        mask = (ids != pad_id).long()                                         # 1 = keep
        return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                     use_cache=False).logits                                   # [B, T, V]

    def shift_positions(model, ids, pad_id, offset):
        """forward with every position + offset (lm-decoding's rotary test: relative positions
        leave the logits unchanged)."""
        mask = (ids != pad_id).long()
        return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask) + offset,
                     use_cache=False).logits                                   # [B, T, V]

    forward.shift_positions = shift_positions

    def incremental(model, ids, pad_id, split):
        """The prefix ids[:, :split] once with use_cache=True, then each later token alone with
        past_key_values, the attention mask grown by one column and position_ids continuing:
        the logits of positions split.. as generation computes them."""
        mask = (ids != pad_id).long()
        pos = positions(mask)
        past, out = None, []
        if split > 0:
            past = model(input_ids=ids[:, :split], attention_mask=mask[:, :split],
                         position_ids=pos[:, :split], use_cache=True).past_key_values
        for t in range(split, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                         position_ids=pos[:, t:t + 1], past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(step.logits[:, -1])                                     # [B, V]
        if not out:
            return ids.new_zeros((ids.shape[0], 0, 0), dtype=torch.float32)
        return torch.stack(out, 1)                                             # [B, T - split, V]
    return forward, incremental


LM_CALLS = ("model(input_ids, attention_mask=ids != pad, position_ids=cumsum(mask) - 1 (pads 1), "
            "use_cache=False).logits; the KV cache: the prefix with use_cache=True, then one token "
            "at a time with past_key_values")


def lm_ids_note(ids: dict) -> str:
    return (f"pad {ids['pad']} ({ids['pad_from']}) and BOS {ids['start']} ({ids['start_from']}); "
            f"--pad-id/--bos-id are not used")


def choose_lm_ids(config, vocab: int, limit: int | None = None) -> dict:
    """pad, BOS and the content range [lo, hi) of a decoder-only model's vocabulary; pad and the
    content below `limit` (the ids whose logits the probes see) when it is given.

    pad: config.pad_token_id when the config has one. Else (GPT2 has none: its pad is a
    convention of the user's, often eos) the largest id below `vocab` that is no special id:
    with attention_mask = ids != pad a pad is masked out whatever token it is, but it must not be
    BOS or EOS, which the probes and generation read as themselves, and at the top of the range
    it leaves the content ids one contiguous block. BOS: config.bos_token_id, else (no BOS in
    the config) the first ordinary id, which is then left out of the content."""
    spec = {k: v for k, v in sorted(vars(config).items())
            if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool)
            and 0 <= v < vocab}
    specials = set(spec.values())
    pad_from = "pad_token_id" if "pad_token_id" in spec else None
    pad = spec.get("pad_token_id")
    top = min(vocab, limit or vocab)
    if pad is None:
        pad = next(i for i in range(top - 1, -1, -1) if i not in specials)
        pad_from = "largest id that is no special id (config.json has no pad_token_id)"
    bos_from = "bos_token_id" if "bos_token_id" in spec else None
    bos = spec.get("bos_token_id")
    taken = specials | {pad}
    if bos is None:
        bos = next(i for i in range(vocab) if i not in taken)
        bos_from = "first ordinary id (config.json has no bos_token_id)"
        taken.add(bos)
    low = [s for s in taken if s < top // 2]
    high = [s for s in taken if s >= top // 2]
    lo, hi = (max(low) + 1 if low else 0), min(high + [top])
    if hi - lo < 4:
        raise UsageError(f"config.json leaves fewer than 4 ordinary token ids ({lo}..{hi - 1}) "
                         f"in a vocabulary of {vocab}")
    return {"pad": pad, "pad_from": pad_from, "start": bos, "start_from": bos_from,
            "marker": bos, "content": (lo, hi), "specials": spec}
