"""A Hugging Face BlenderbotSmall from a small config (nothing is downloaded), called as a user of
`transformers` calls it (issue 19: a half-trained one was reported as a rank collapse).

    tndebug triage ckpt.pt --model blenderbot_small.py:build --adapter blenderbot_small.py:forward
"""
from __future__ import annotations

from transformers import BlenderbotSmallConfig, BlenderbotSmallForConditionalGeneration


def build(vocab: int = 16, d_model: int = 32, layers: int = 2, heads: int = 4, d_ff: int = 64,
          attn_implementation: str = "eager"):
    config = BlenderbotSmallConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None)
    config._attn_implementation = attn_implementation
    return BlenderbotSmallForConditionalGeneration(config)


def forward(model, src, tgt, pad_id):
    return model(input_ids=src, attention_mask=(src != pad_id).long(), decoder_input_ids=tgt,
                 decoder_attention_mask=(tgt != pad_id).long(), use_cache=False).logits   # [B, T, V]
