"""A nanoGPT-style model file, as a user would write it, for tests that point at its lines.

`model_file(tmp_path, attention=...)` writes it with the attention's body swapped in and
returns (path, the line numbers of each marked statement)."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

HEAD = '''\
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
'''

TAIL = '''\
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build():
    torch.manual_seed(0)
    return GPT()
'''

ATTENTION = {
    # nanoGPT's manual path, as it is
    "healthy": '''
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # @scores
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))  # @mask
        att = F.softmax(att, dim=-1)  # @softmax
        y = att @ v  # (B, nh, T, hs)
''',
    # the scale removed
    "no_scale": '''
        att = (q @ k.transpose(-2, -1))  # @scores
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))  # @mask
        att = F.softmax(att, dim=-1)  # @softmax
        y = att @ v  # (B, nh, T, hs)
''',
    # the causal mask forgotten
    "no_mask": '''
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # @scores
        att = F.softmax(att, dim=-1)  # @softmax
        y = att @ v  # (B, nh, T, hs)
''',
    # the causal mask transposed (triu for tril)
    "mask_transposed": '''
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # @scores
        att = att.masked_fill(self.bias[:, :, :T, :T].transpose(-2, -1) == 0, float('-inf'))  # @mask
        att = F.softmax(att, dim=-1)  # @softmax
        y = att @ v  # (B, nh, T, hs)
''',
    # the flash path, with scale=1.0 passed
    "sdpa_no_scale": '''
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)  # @sdpa
''',
}


def model_file(folder: Path, attention: str = "healthy", name: str = "model.py"):
    """(path of the written model file, {marker: line number})."""
    text = HEAD + textwrap.indent(textwrap.dedent(ATTENTION[attention]).lstrip("\n"), " " * 8) + TAIL
    path = Path(folder) / name
    path.write_text(text)
    lines = {}
    for n, line in enumerate(text.splitlines(), 1):
        if "# @" in line:
            lines[line.rsplit("# @", 1)[1].strip()] = n
    return path, lines


def load(path: Path):
    """The module at `path` (its own name, so two tests' files never collide)."""
    name = f"nanogpt_{abs(hash(str(path))) % 10**8}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
