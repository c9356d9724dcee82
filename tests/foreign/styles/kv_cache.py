"""A character-level GPT with a KV cache for generation: forward(idx, past_key_values=None)
returns (logits, presents); each layer's (k, v) are concatenated to the cached ones and the
position ids continue from the cache's length. `incremental` decodes as generate() would."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class CachedAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)), persistent=False)

    def forward(self, x, layer_past=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if layer_past is not None:
            past_k, past_v = layer_past
            k = torch.cat((past_k, k), dim=-2)
            v = torch.cat((past_v, v), dim=-2)
        present = (k, v)
        S = k.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[S - T:S, :S] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y), present


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CachedAttention(n_embd, n_head, block_size)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, layer_past=None):
        a, present = self.attn(self.ln_1(x), layer_past)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class CachedGPT(nn.Module):
    def __init__(self, vocab_size, n_embd=32, n_head=4, n_layer=2, block_size=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, past_key_values=None):
        past_length = 0 if past_key_values is None else past_key_values[0][0].size(-2)
        pos = torch.arange(past_length, past_length + idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        presents = []
        for i, block in enumerate(self.h):
            x, present = block(x, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.lm_head(self.ln_f(x)), presents


def build(vocab_size=96, **kw):
    return CachedGPT(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids)[0]


def incremental(model, ids, pad_id, split):
    """The prompt ids[:, :split] in one call, then one token at a time through the cache."""
    _, past = model(ids[:, :split])
    out = []
    for t in range(split, ids.size(1)):
        logits, past = model(ids[:, t:t + 1], past_key_values=past)
        out.append(logits)
    return torch.cat(out, dim=1)
