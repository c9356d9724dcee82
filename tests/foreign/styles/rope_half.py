"""A character-level GPT-NeoX / Hugging Face-style model: a fused query_key_value Linear, rotary
positions with rotate_half (feature i paired with i + D/2) and cos/sin caches, attention by
causal F.scaled_dot_product_attention, parallel attention and MLP residual."""
import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, seq_len):
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


class NeoXAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, max_positions):
        super().__init__()
        self.num_heads, self.head_size = num_heads, hidden_size // num_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_size, max_positions)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, self.num_heads, 3 * self.head_size)
        query, key, value = qkv.permute(0, 2, 1, 3).chunk(3, dim=-1)      # [b, h, t, d]
        cos, sin = self.rotary_emb(t)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        attn = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(attn.transpose(1, 2).reshape(b, t, -1))


class NeoXLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, max_positions):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.attention = NeoXAttention(hidden_size, num_heads, max_positions)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                 nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x):
        return x + self.attention(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))


class NeoXLM(nn.Module):
    def __init__(self, vocab_size, hidden_size=32, num_heads=4, num_layers=2, max_positions=32):
        super().__init__()
        self.embed_in = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(NeoXLayer(hidden_size, num_heads, max_positions)
                                    for _ in range(num_layers))
        self.final_layer_norm = nn.LayerNorm(hidden_size)
        self.embed_out = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.embed_out(self.final_layer_norm(x))


def build(vocab_size=96, **kw):
    return NeoXLM(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
