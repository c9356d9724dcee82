"""Findings in Hugging Face terms, for every front-end that probes a transformers model (`tndebug
triage DIR`, `check`/`watch` on a transformers model): fixes that speak of config fields,
`attention_mask` and `decoder_input_ids` instead of Annotated-Transformer code, and a whole
stack named by its module path. Chosen by the finding's probe and code, never its wording."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from tndebug.findings import Finding

HF_FIXES = {
    "missing-scale": "transformers' attention multiplies q k^T by `self.scaling` = head_dim**-0.5 "
                     "(eager) or passes `scale=self.scaling` to SDPA; a subclass or patch that sets "
                     "`scaling = 1.0` or drops `scale=` removes it (T5 has none by design: its "
                     "initialisation folds it into q). An architecture published without it "
                     "(GPT-Neo) was trained that way: do not add it to a trained checkpoint's "
                     "code; retrain with the scale, or keep the learning rate and d_k it was "
                     "trained with",
    "mask-broadcast:causal": "the decoder's self-attention must be causal: keep the decoder "
                             "config's `is_decoder=True` / `is_causal=True` and its attention modules' "
                             "`is_causal`; pass decoder_input_ids = labels shifted right with "
                             "decoder_start_token_id (model.prepare_decoder_input_ids_from_labels), "
                             "and a decoder_attention_mask of 1 = keep, 0 = padding (never a full "
                             "4-D mask without the causal part)",
    "mask-broadcast:padding": "pass attention_mask with 1 = keep, 0 = padding, as the tokenizer "
                              "returns it: attention_mask = (input_ids != config.pad_token_id).long() "
                              "(not inverted, not True at padding); the same mask reaches the "
                              "cross-attention, so pass it to generate() and forward() alike",
    "nan-scores": "masks in transformers add torch.finfo(dtype).min, not -inf; a patched mask or "
                  "an all-padding row (attention_mask all 0) gives NaN: keep at least one 1 per row",
    "positional-encoding": "check the positions: learned `embed_positions` (BART, mBART; "
                           "config.max_position_embeddings) must be loaded and trained, not zero or "
                           "frozen; Marian/Pegasus build sinusoidal tables from the config; T5 needs "
                           "`relative_attention_bias` in layer 0 of each stack; "
                           "config.scale_embedding multiplies embeddings by sqrt(d_model)",
    "head-collapse": "each attention needs its own q_proj / k_proj / v_proj (T5: q, k, v): check that "
                     "a patch, a tie or a custom init does not share or copy them across heads",
    "variance-drift": "each layer must add its sublayer's output to its input "
                      "(hidden_states = residual + hidden_states): check a subclassed or patched layer",
    "ln-placement": "the norm placement is fixed by the architecture (BART/Marian post-LN; mBART, "
                    "Pegasus, T5 pre-LN with a final layer_norm): check a patched layer or a config "
                    "field such as normalize_before / add_final_layer_norm",
    "ln-placement:norm-collapsed": "the norm's weight is 0 in the file: a key that did not load "
                                   "(from_pretrained's missing-keys warning), a conversion or a "
                                   "patch that zeroed it; reload the trained weights (Gemma-style "
                                   "norms that scale by 1 + weight keep zeros and are not this)",
    "gradient-flow": "a part gets no gradient: check requires_grad (frozen parameters), detach() in "
                     "a patched forward, and tie_word_embeddings",
}


# mask-broadcast's kinds whose HF fix is the causal one, or the padding one; the others (a softmax
# axis, a head split, positions mixed outside the softmax, ...) keep their own fix
MASK_CAUSAL = {"causal-leak", "causal-transposed"}
MASK_PADDING = {"pad-leak", "memory-leak", "tgt-pad-leak", "src-pad-leak", "mask-inverted",
                "mask-after-softmax", "row-sums"}


def hf_fix(f: Finding) -> Finding:
    """The finding with a fix written for transformers code (the generic one in evidence)."""
    key = f.probe
    if f.code == "ln-placement/norm-collapsed":
        key = "ln-placement:norm-collapsed"
    if f.probe == "mask-broadcast":          # by the finding's kind, never its wording
        kind = f.code.partition("/")[2]
        key += (":causal" if kind in MASK_CAUSAL else ":padding" if kind in MASK_PADDING else ":other")
    if key not in HF_FIXES or f.severity == "info" or "best_alpha" in f.evidence:
        return f
    return replace(f, fix=HF_FIXES[key], evidence={**f.evidence, "generic_fix": f.fix})


def hf_where(f: Finding, model: nn.Module) -> Finding:
    """'encoder' / 'decoder' (a probe's word for a whole stack) -> the stack's HF path, and for
    positional-encoding its position table (`model.encoder.embed_positions`) where it has one."""
    if f.where not in ("encoder", "decoder"):
        return f
    try:
        stack = model.get_encoder() if f.where == "encoder" else model.get_decoder()
    except (AttributeError, NotImplementedError):     # a decoder-only model may have neither
        return f
    path = next((n for n, m in model.named_modules() if m is stack), None)
    if not path:
        return f
    if f.probe == "positional-encoding" and hasattr(stack, "embed_positions"):
        path += ".embed_positions"
    return replace(f, where=path, evidence={**f.evidence, "tndebug_where": f.where})
