"""A character-level GPT-J-style model: rotary positions on interleaved pairs (features 2i and
2i+1, `rotate_every_two`), sin/cos from one sinusoid table, the causal mask applied with
torch.where and the dtype's minimum, manual attention in float32."""
import torch
from torch import nn


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim))
    sinusoid_inp = torch.einsum("i,j->ij", torch.arange(num_pos, dtype=torch.float), inv_freq)
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(tensor, sin, cos):
    sin, cos = (t[None, :, None, :].repeat_interleave(2, dim=3) for t in (sin, cos))
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_positions):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool)),
                             persistent=False)
        self.register_buffer("embed_positions", create_sinusoidal_positions(max_positions, self.head_dim),
                             persistent=False)
        self.scale_attn = self.head_dim ** 0.5

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)   # [b, t, h, d]
        key = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        value = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        sin, cos = torch.split(self.embed_positions[:t], self.head_dim // 2, dim=-1)
        key = apply_rotary_pos_emb(key, sin, cos)
        query = apply_rotary_pos_emb(query, sin, cos)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        attn_weights = torch.matmul(query.float(), key.float().transpose(-1, -2))
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(self.bias[:t, :t], attn_weights, mask_value)
        attn_weights = attn_weights / self.scale_attn
        attn_weights = attn_weights.softmax(dim=-1).to(value.dtype)
        out = torch.matmul(attn_weights, value).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(out)


class GPTJBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, max_positions):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.attn = GPTJAttention(embed_dim, num_heads, max_positions)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x):
        h = self.ln_1(x)
        return x + self.attn(h) + self.mlp(h)


class GPTJ(nn.Module):
    def __init__(self, vocab_size, n_embd=32, n_head=4, n_layer=2, n_positions=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.h = nn.ModuleList(GPTJBlock(n_embd, n_head, n_positions) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(vocab_size=96, **kw):
    return GPTJ(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)
