"""lucidrains' x-transformers (pip install x-transformers, the `xt` extra): its encoder-decoder
`XTransformer`, configured by keyword flags the way its README does, with the attention variants
it offers by flag. Nothing of the package is edited: the bugs are put into the built instance
from outside, the way a user's patch would.

    tndebug triage ckpt.pt --model xtransformers.py:build --adapter xtransformers.py:forward \
        --config '{"variant": "rotary"}'

Variants (`build(variant=...)`; each sets the flag on both the encoder and the decoder):
    abs         learned absolute positions (x-transformers' default), LayerNorm, einsum attention
    flash       the same with attn_flash=True (F.scaled_dot_product_attention)
    rotary      rotary_pos_emb=True (the absolute table is then off)
    relpos      rel_pos_bias=True (T5's bucketed bias, absolute table off) with use_rmsnorm=True
                (x-transformers refuses attn_flash with it)
    rotary-flash  rotary with attn_flash=True

build(bug=...):
    no_scale           every attention's `attend.scale` = 1.0 (its einsum path multiplies q k^T
                       by it; its flash path rescales q by scale / default_scale before SDPA)
    no_causal          the decoder's self-attentions' `causal` (Attention and its Attend) off
    inverted_pad_mask  the caller passes mask = context_mask = (src == pad) (read by `forward`)
    shared_qkv         one Linear serves as to_q, to_k and to_v in every attention
    zero_positions     the positions carry nothing: the absolute tables are zero and frozen;
                       rotary: its inv_freq buffer is zero (every rotation is the identity);
                       relpos: the relative bias tables are zero and frozen

XTransformer.forward returns the decoder's loss (its AutoregressiveWrapper shifts `tgt` itself),
so the adapter below calls its two halves as that forward does and returns the logits.
"""
from __future__ import annotations

import torch
from torch import nn

from x_transformers import XTransformer
from x_transformers.x_transformers import Attention

VARIANTS = {
    "abs": {},
    "flash": {"attn_flash": True},
    "rotary": {"rotary_pos_emb": True},
    "relpos": {"rel_pos_bias": True, "use_rmsnorm": True},
    "rotary-flash": {"rotary_pos_emb": True, "attn_flash": True},
}
BUGS = ("no_scale", "no_causal", "inverted_pad_mask", "shared_qkv", "zero_positions")


def build(variant: str = "abs", bug: str | None = None, vocab: int = 16, dim: int = 32,
          depth: int = 2, heads: int = 4, max_seq_len: int = 64):
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    flags = {f"{side}_{k}": v for side in ("enc", "dec") for k, v in VARIANTS[variant].items()}
    model = XTransformer(
        dim=dim, tie_token_emb=True,
        enc_num_tokens=vocab, enc_depth=depth, enc_heads=heads, enc_max_seq_len=max_seq_len,
        enc_attn_dim_head=dim // heads, enc_ff_mult=2,
        dec_num_tokens=vocab, dec_depth=depth, dec_heads=heads, dec_max_seq_len=max_seq_len,
        dec_attn_dim_head=dim // heads, dec_ff_mult=2,
        **flags)
    if bug is not None:
        if bug not in BUGS:
            raise ValueError(f"no bug {bug!r}; one of {', '.join(BUGS)}")
        _inject(model, bug)
    model.foreign_bug = bug                 # read by the adapter (the caller's own bug)
    return model


def attentions(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def decoder_self_attentions(model: XTransformer) -> list[Attention]:
    return [m for m in model.decoder.net.attn_layers.modules()
            if isinstance(m, Attention) and m.causal]


def _inject(model: XTransformer, bug: str) -> None:
    if bug == "no_scale":
        for attn in attentions(model):
            attn.attend.scale = 1.0
    elif bug == "no_causal":
        for attn in decoder_self_attentions(model):
            attn.causal = attn.attend.causal = False
    elif bug == "shared_qkv":
        for attn in attentions(model):
            attn.to_k = attn.to_v = attn.to_q
    elif bug == "zero_positions":
        for wrapper in (model.encoder, model.decoder.net):
            layers = wrapper.attn_layers
            if layers.rotary_pos_emb is not None:
                layers.rotary_pos_emb.inv_freq.zero_()          # a buffer: saved, never trained
            tables = [m.emb for m in (wrapper.pos_emb,) if isinstance(getattr(m, "emb", None), nn.Embedding)]
            tables += [layers.rel_pos.relative_attention_bias] if layers.rel_pos is not None else []
            for table in tables:
                with torch.no_grad():
                    table.weight.zero_()
                table.weight.requires_grad_(False)


# -- the adapter tndebug calls -------------------------------------------------------------
def _source_keep(model, src, pad_id):
    if getattr(model, "foreign_bug", None) == "inverted_pad_mask":
        return src == pad_id                # the bug: True at padding
    return src != pad_id                    # x-transformers' masks are True where kept


def encode(model, src, pad_id):
    return model.encoder(src, mask=_source_keep(model, src, pad_id),
                         return_embeddings=True)                     # [B, S, d]


def forward(model, src, tgt, pad_id):
    """XTransformer.forward without its loss: the encoder, then the decoder's TransformerWrapper
    (AutoregressiveWrapper.net) with context and context_mask, as XTransformer.forward and
    .generate call them."""
    keep = _source_keep(model, src, pad_id)
    memory = model.encoder(src, mask=keep, return_embeddings=True)
    return model.decoder.net(tgt, context=memory, context_mask=keep)  # [B, T, V]
