"""A GPT with its heads as separate modules (a ModuleList of `Head`s, each with its own key,
query and value Linear of width head_size), in the style of a well-known lecture. `by_width=True`
scales each head's scores by C**-0.5 with C the embedding width, the mistake students copy from
it; healthy: head_size**-0.5."""
import torch
from torch import nn
import torch.nn.functional as F
n_embd, block_size, V = 32, 32, 24
class Head(nn.Module):
    def __init__(self, head_size, by_width=False):
        super().__init__()
        self.by_width = by_width
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer('tril', torch.tril(torch.ones(block_size, block_size)))
    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * (C if self.by_width else k.shape[-1]) ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float('-inf'))
        wei = F.softmax(wei, dim=-1)
        return wei @ self.value(x)
class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, head_size, by_width=False):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size, by_width) for _ in range(num_heads)])
        self.proj = nn.Linear(n_embd, n_embd)
    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))
class Block(nn.Module):
    def __init__(self, by_width=False):
        super().__init__()
        self.sa = MultiHeadAttention(4, n_embd // 4, by_width)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))
class BigramLM(nn.Module):
    def __init__(self, by_width=False):
        super().__init__()
        self.token_embedding_table = nn.Embedding(V, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(Block(by_width), Block(by_width))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, V)
    def forward(self, idx):
        B, T = idx.shape
        x = self.token_embedding_table(idx) + self.position_embedding_table(torch.arange(T))
        return self.lm_head(self.ln_f(self.blocks(x)))
def forward(model, ids, pad_id): return model(ids)
