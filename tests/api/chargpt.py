"""A character-level nanoGPT-style model and loop, written as such scripts usually are: the text
is one long stream of characters, id 0 is '\\n' (no pad token at all), batches are random windows
of block_size + 1 characters, `model(x, y) -> (logits, loss)` with plain cross-entropy.

    model = build(); opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, opt, steps=150)                # or inside tndebug.watch(..., pad_id=None)

Used by tests/api/test_no_pad.py (watch and check with pad_id=None) and the triage tests of
one-stack --data (tests/triage/test_one_stack_data.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LINES = ["the cat sat on the mat", "a rat ate the ham", "no hen can nest here",
         "the man met a cat", "ten hats on a mast", "one cot, one mat"]
CHARS = sorted(set("\n".join(LINES) + "\n"))           # '\n' sorts first: id 0
STOI = {c: i for i, c in enumerate(CHARS)}


def text(n_lines: int = 400, seed: int = 0) -> torch.Tensor:
    """The corpus as one stream of ids; every line ends in '\\n' (id 0)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(LINES), (n_lines,), generator=g).tolist()
    s = "".join(LINES[i] + "\n" for i in picks)
    return torch.tensor([STOI[c] for c in s], dtype=torch.long)


def get_batch(data: torch.Tensor, block: int, batch: int, g: torch.Generator):
    ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[i:i + block] for i in ix.tolist()])                # (B, T)
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix.tolist()])        # (B, T)
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)     # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))     # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v                                       # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int = len(CHARS), block_size: int = 32, n_layer: int = 2,
                 n_head: int = 2, n_embd: int = 32):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))    # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                                  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(**kw) -> CharGPT:
    return CharGPT(**kw)


def forward(model, ids, pad_id):
    """The user's adapter (decoder-only: three parameters); there is no pad to mask."""
    return model(ids)[0]                                                     # (B, T, V)


def train(model, opt, steps: int, *, block: int = 32, batch: int = 16, seed: int = 0) -> float:
    """The loop: random windows of the stream, model(x, y) -> (logits, loss). Returns the last loss."""
    data, g = text(seed=seed), torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x, y = get_batch(data, block, batch, g)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())
