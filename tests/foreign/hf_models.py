"""Hugging Face encoder-decoders built from small configs (nothing is downloaded): BART, Marian
and T5, with the eager or the SDPA attention implementation, called the way a user of
`transformers` calls them.

    tndebug triage ckpt.pt --model hf_models.py:build --adapter hf_models.py:forward \
        --config '{"arch": "bart", "attn_implementation": "sdpa"}'

`build(bug=...)` injects one bug into the instance, the way a user's patch or subclass would:

    no_scale           every attention's `scaling` = 1.0 (BART, Marian; T5 has none by design).
                       Both implementations read it: eager multiplies q k^T by it, SDPA passes
                       it as `scale=`.
    no_causal          the decoder's self-attention sees the future: its config says
                       `is_causal = False` (create_causal_mask then builds a bidirectional mask)
                       and its attention modules' `is_causal` is off (SDPA's `is_causal=` path)
    inverted_pad_mask  the caller passes attention_mask = (src == pad) (read by `forward` below)
    zero_positions     the position table is zero and frozen (BART's learned, Marian's
                       sinusoidal; T5's relative position bias)
    no_emb_scale       Marian without its sqrt(d_model) embedding scale
    shared_qkv         one Linear serves as W_Q, W_K and W_V in every attention
"""
from __future__ import annotations

import torch
from torch import nn

from transformers import (BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel,
                          T5Config, T5ForConditionalGeneration)

ARCHS = ("bart", "marian", "t5")
IMPLEMENTATIONS = ("eager", "sdpa")
BUGS = {
    "bart": ("no_scale", "no_causal", "inverted_pad_mask", "zero_positions", "shared_qkv"),
    "marian": ("no_scale", "no_causal", "inverted_pad_mask", "zero_positions", "no_emb_scale",
               "shared_qkv"),
    "t5": ("no_causal", "inverted_pad_mask", "zero_positions", "shared_qkv"),
}


def _config(arch: str, vocab: int, d_model: int, layers: int, heads: int, d_ff: int):
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    if arch == "t5":
        return T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff,
                        num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16,
                        dropout_rate=0.0, feed_forward_proj="relu", **ids)
    sizes = dict(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                 encoder_attention_heads=heads, decoder_attention_heads=heads,
                 encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids)
    if arch == "bart":
        return BartConfig(**sizes, forced_eos_token_id=None)
    if arch == "marian":
        return MarianConfig(**sizes, decoder_vocab_size=vocab, scale_embedding=True)   # as opus-mt
    raise ValueError(f"arch {arch!r}: one of {', '.join(ARCHS)}")


_CLASSES = {"bart": BartForConditionalGeneration, "marian": MarianMTModel,
            "t5": T5ForConditionalGeneration}


def build(arch: str = "bart", attn_implementation: str = "eager", bug: str | None = None,
          vocab: int = 16, d_model: int = 32, layers: int = 2, heads: int = 4, d_ff: int = 64):
    config = _config(arch, vocab, d_model, layers, heads, d_ff)
    config._attn_implementation = attn_implementation
    model = _CLASSES[arch](config)
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(f"{arch}: asked for {attn_implementation}, "
                           f"got {model.config._attn_implementation}")
    if bug is not None:
        if bug not in BUGS[arch]:
            raise ValueError(f"{arch} has no bug {bug!r}; one of {', '.join(BUGS[arch])}")
        _inject(model, arch, bug)
    model.foreign_bug = bug                 # read by the adapter (the caller's own bug)
    return model


def _attentions(model: nn.Module):
    """The modules that hold the projections (BartAttention, MarianAttention, T5Attention)."""
    return [m for m in model.modules() if isinstance(getattr(m, "q_proj", getattr(m, "q", None)), nn.Linear)]


def _inject(model: nn.Module, arch: str, bug: str) -> None:
    core = model if arch == "t5" else model.model
    if bug == "no_scale":
        for attn in _attentions(model):
            attn.scaling = 1.0
    elif bug == "no_causal":
        core.decoder.config.is_causal = False
        layers = core.decoder.block if arch == "t5" else core.decoder.layers
        for layer in layers:
            self_attn = layer.layer[0].SelfAttention if arch == "t5" else layer.self_attn
            self_attn.is_causal = False
    elif bug == "zero_positions":
        tables = ([m.relative_attention_bias for m in _attentions(model)
                   if getattr(m, "has_relative_attention_bias", False)] if arch == "t5"
                  else [core.encoder.embed_positions, core.decoder.embed_positions])
        for table in tables:
            with torch.no_grad():
                table.weight.zero_()
            table.weight.requires_grad_(False)
    elif bug == "no_emb_scale":
        core.encoder.embed_scale = core.decoder.embed_scale = 1.0
    elif bug == "shared_qkv":
        for attn in _attentions(model):
            if arch == "t5":
                attn.k = attn.v = attn.q
            else:
                attn.k_proj = attn.v_proj = attn.q_proj


# -- the adapter tndebug calls -------------------------------------------------------------
def _source_mask(model, src, pad_id):
    if getattr(model, "foreign_bug", None) == "inverted_pad_mask":
        return (src == pad_id).long()       # the bug: 1 at padding
    return (src != pad_id).long()


def forward(model, src, tgt, pad_id):
    out = model(input_ids=src, attention_mask=_source_mask(model, src, pad_id),
                decoder_input_ids=tgt, decoder_attention_mask=(tgt != pad_id).long(),
                use_cache=False)
    return out.logits                                      # [B, T, V]


def encode(model, src, pad_id):
    return model.get_encoder()(input_ids=src, attention_mask=_source_mask(model, src, pad_id)
                               ).last_hidden_state          # [B, S, d]
