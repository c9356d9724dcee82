"""A user-style encoder-decoder as many paper tutorials write it: `forward(src, trg)` builds its
own masks and returns flattened logits [B*T, V]; the blocks sit in ModuleLists called
`layer_stack` and return tuples (output, attention). Nothing here is named as tndebug's
built-in adapters expect. `make(bug=...)` switches one bug on in the user's own lines."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = {"name": None}


class DotAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = F.softmax(attn, dim=-1)
        return torch.matmul(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k):
        super().__init__()
        self.n_head, self.d_k = n_head, d_k
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.fc = nn.Linear(n_head * d_k, d_model, bias=False)
        temperature = 1.0 if BUG["name"] == "no_scale" else d_k ** 0.5
        self.attention = DotAttention(temperature)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, q, k, v, mask=None):
        B, Lq, Lk, H, dk = q.size(0), q.size(1), k.size(1), self.n_head, self.d_k
        residual = q
        q = self.w_qs(q).view(B, Lq, H, dk).transpose(1, 2)
        k = self.w_ks(k).view(B, Lk, H, dk).transpose(1, 2)
        v = self.w_vs(v).view(B, Lk, H, dk).transpose(1, 2)
        if mask is not None:
            mask = mask.unsqueeze(1)
        out, attn = self.attention(q, k, v, mask=mask)
        out = out.transpose(1, 2).contiguous().view(B, Lq, -1)
        return self.layer_norm(self.fc(out) + residual), attn


class FeedForward(nn.Module):
    def __init__(self, d_model, d_inner):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_inner), nn.Linear(d_inner, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x):
        return self.layer_norm(self.w_2(F.relu(self.w_1(x))) + x)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k)
        self.pos_ffn = FeedForward(d_model, d_inner)

    def forward(self, x, mask):
        x, attn = self.slf_attn(x, x, x, mask=mask)
        return self.pos_ffn(x), attn


class DecoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k)
        self.enc_attn = MultiHeadAttention(n_head, d_model, d_k)
        self.pos_ffn = FeedForward(d_model, d_inner)

    def forward(self, y, memory, self_mask, cross_mask):
        y, a1 = self.slf_attn(y, y, y, mask=self_mask)
        y, a2 = self.enc_attn(y, memory, memory, mask=cross_mask)
        return self.pos_ffn(y), a1, a2


def sinusoid_table(n_position, d):
    pos = torch.arange(n_position, dtype=torch.float64)[:, None]
    i = torch.arange(d, dtype=torch.float64)[None, :]
    angle = pos / torch.pow(10000.0, 2 * torch.div(i, 2, rounding_mode="floor") / d)
    table = torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle))
    return table.float().unsqueeze(0)


class PositionalTable(nn.Module):
    def __init__(self, d, n_position=200):
        super().__init__()
        self.register_buffer("pos_table", sinusoid_table(n_position, d))

    def forward(self, x):
        return x + self.pos_table[:, :x.size(1)].clone().detach()


class Encoder(nn.Module):
    def __init__(self, vocab, d_model, d_inner, n_layers, n_head, d_k, pad):
        super().__init__()
        self.src_word_emb = nn.Embedding(vocab, d_model, padding_idx=pad)
        self.position_enc = PositionalTable(d_model)
        self.layer_stack = nn.ModuleList(EncoderLayer(d_model, d_inner, n_head, d_k)
                                         for _ in range(n_layers))
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, mask):
        x = self.layer_norm(self.position_enc(self.src_word_emb(src)))
        for layer in self.layer_stack:
            x, _ = layer(x, mask)
        return x


class Decoder(nn.Module):
    def __init__(self, vocab, d_model, d_inner, n_layers, n_head, d_k, pad):
        super().__init__()
        self.trg_word_emb = nn.Embedding(vocab, d_model, padding_idx=pad)
        self.position_enc = PositionalTable(d_model)
        self.layer_stack = nn.ModuleList(DecoderLayer(d_model, d_inner, n_head, d_k)
                                         for _ in range(n_layers))
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, trg, memory, self_mask, cross_mask):
        y = self.layer_norm(self.position_enc(self.trg_word_emb(trg)))
        for layer in self.layer_stack:
            y, _, _ = layer(y, memory, self_mask, cross_mask)
        return y


class Seq2Seq(nn.Module):
    def __init__(self, vocab=40, pad=0, d_model=32, d_inner=64, n_layers=2, n_head=4):
        super().__init__()
        self.pad = pad
        d_k = d_model // n_head
        self.encoder = Encoder(vocab, d_model, d_inner, n_layers, n_head, d_k, pad)
        self.decoder = Decoder(vocab, d_model, d_inner, n_layers, n_head, d_k, pad)
        self.trg_word_prj = nn.Linear(d_model, vocab, bias=False)

    def forward(self, src_seq, trg_seq):
        src_mask = (src_seq != self.pad).unsqueeze(-2)
        T = trg_seq.size(1)
        causal = (1 - torch.triu(torch.ones((1, T, T), device=trg_seq.device), diagonal=1)).bool()
        if BUG["name"] == "no_causal":
            causal = torch.ones_like(causal)
        trg_mask = (trg_seq != self.pad).unsqueeze(-2) & causal
        memory = self.encoder(src_seq, src_mask)
        out = self.decoder(trg_seq, memory, trg_mask, src_mask)
        logits = self.trg_word_prj(out)
        return logits.view(-1, logits.size(2))


def make(bug=None):
    BUG["name"] = bug
    torch.manual_seed(0)
    return Seq2Seq()
