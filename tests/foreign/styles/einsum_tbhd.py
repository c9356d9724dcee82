"""A character-level GPT written sequence-first, the way several packages write attention:
activations [T, B, C], heads [T, B, H, D], scores by einsum, the 1/sqrt(D) folded into q.
Learned absolute positions. tndebug calls it batch-first through `forward` below."""
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.to_qkv = nn.Linear(n_embd, 3 * n_embd)
        self.out = nn.Linear(n_embd, n_embd)
        self.register_buffer("future", torch.ones(block_size, block_size).triu(1).bool(),
                             persistent=False)

    def forward(self, x):                                    # x: [T, B, C]
        T, B, C = x.shape
        q, k, v = self.to_qkv(x).view(T, B, 3, self.n_head, self.head_dim).unbind(2)
        q = q * self.head_dim ** -0.5                        # [T, B, H, D]
        scores = torch.einsum("tbhd,sbhd->tsbh", q, k)       # [T, S, B, H]
        attn = scores.masked_fill(self.future[:T, :T, None, None], float("-inf")).softmax(dim=1)
        y = torch.einsum("tsbh,sbhd->tbhd", attn, v)
        return self.out(y.reshape(T, B, C))


class Layer(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, block_size)
        self.ff = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class SeqFirstLM(nn.Module):
    def __init__(self, vocab_size, n_embd=32, n_head=4, n_layer=2, block_size=32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Parameter(torch.randn(block_size, 1, n_embd) * 0.02)
        self.layers = nn.ModuleList(Layer(n_embd, n_head, block_size) for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):                                  # idx: [T, B] -> logits [T, B, V]
        T = idx.shape[0]
        x = self.tok(idx) + self.pos[:T]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(vocab_size=96, **kw):
    return SeqFirstLM(vocab_size, **kw)


def forward(model, ids, pad_id):
    return model(ids.t()).transpose(0, 1)                    # batch-first in and out
