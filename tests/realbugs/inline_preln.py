"""An encoder-decoder written by hand with w_q/w_k/w_v/w_o and its Pre-LN sublayers inline in
each layer's forward (no sublayer modules). bug=True: `x = self.norm1(x); x = x + self.attn(x,
x, x, mask)` in every self-attention, the residual carrying the normalised input (the
faster-trajectory-transformer #3 bug, written the way the held-out real-bug set wrote it)."""
import math, torch
from torch import nn
import torch.nn.functional as F

class MHA(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.dk = h, d // h
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d, d) for _ in range(4))
    def forward(self, q, k, v, mask=None):
        B, T, _ = q.shape
        S = k.shape[1]
        q = self.w_q(q).view(B, T, self.h, self.dk).transpose(1, 2)
        k = self.w_k(k).view(B, S, self.h, self.dk).transpose(1, 2)
        v = self.w_v(v).view(B, S, self.h, self.dk).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dk)
        if mask is not None:
            s = s.masked_fill(~mask, -1e9)
        z = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
        return self.w_o(z)

class EncLayer(nn.Module):
    def __init__(self, d, h, bug):
        super().__init__()
        self.bug = bug
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = MHA(d, h)
        self.ff = nn.Sequential(nn.Linear(d, 4*d), nn.ReLU(), nn.Linear(4*d, d))
    def forward(self, x, mask):
        if self.bug:
            x = self.norm1(x)
            x = x + self.attn(x, x, x, mask)
        else:
            n = self.norm1(x)
            x = x + self.attn(n, n, n, mask)
        return x + self.ff(self.norm2(x))

class DecLayer(nn.Module):
    def __init__(self, d, h, bug):
        super().__init__()
        self.bug = bug
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn, self.cross = MHA(d, h), MHA(d, h)
        self.ff = nn.Sequential(nn.Linear(d, 4*d), nn.ReLU(), nn.Linear(4*d, d))
    def forward(self, x, mem, smask, tmask):
        if self.bug:
            x = self.n1(x)
            x = x + self.self_attn(x, x, x, tmask)
        else:
            n = self.n1(x)
            x = x + self.self_attn(n, n, n, tmask)
        n = self.n2(x)
        x = x + self.cross(n, mem, mem, smask)
        return x + self.ff(self.n3(x))

class Seq2Seq(nn.Module):
    def __init__(self, V=16, d=32, h=4, L=2, bug=False):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(V, d), nn.Embedding(V, d)
        pe = torch.zeros(64, d); pos = torch.arange(64)[:, None].float()
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.enc = nn.ModuleList(EncLayer(d, h, bug) for _ in range(L))
        self.dec = nn.ModuleList(DecLayer(d, h, bug) for _ in range(L))
        self.enc_norm, self.dec_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.out = nn.Linear(d, V)
        self.d = d
    def forward(self, src, tgt, pad=0):
        smask = (src != pad)[:, None, None, :]
        T = tgt.shape[1]
        tmask = (tgt != pad)[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
        x = self.src_emb(src) * math.sqrt(self.d) + self.pe[:src.shape[1]]
        for l in self.enc: x = l(x, smask)
        mem = self.enc_norm(x)
        y = self.tgt_emb(tgt) * math.sqrt(self.d) + self.pe[:T]
        for l in self.dec: y = l(y, mem, smask, tmask)
        return self.out(self.dec_norm(y))

def forward(model, src, tgt, pad_id):
    return model(src, tgt, pad_id)
