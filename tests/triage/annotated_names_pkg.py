"""A package-style encoder-decoder with The Annotated Transformer's module names and methods
(encode, decode, generator) but its own calling convention: forward(src, tgt), a [B, S]
padding mask, asserted. tndebug guesses the annotated adapter from the names; it cannot call
it (issue 45)."""
import torch
from torch import nn

class Generator(nn.Module):
    def __init__(self, d, V):
        super().__init__(); self.proj = nn.Linear(d, V)
    def forward(self, x):
        return torch.log_softmax(self.proj(x), dim=-1)

class Seq2Seq(nn.Module):
    """Annotated-style names, its own [B, S] padding-mask convention, asserted."""
    def __init__(self, V=16, d=32):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(V, d), nn.Embedding(V, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 64, 0.0, batch_first=True), 1)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 64, 0.0, batch_first=True), 1)
        self.generator = Generator(d, V)
    def encode(self, src, src_mask):
        assert src_mask.dim() == 2, "src_mask must be [B, S] (True = pad)"
        return self.encoder(self.src_embed(src), src_key_padding_mask=src_mask)
    def decode(self, memory, src_mask, tgt, tgt_mask):
        assert src_mask.dim() == 2, "src_mask must be [B, S] (True = pad)"
        T = tgt.shape[1]
        return self.decoder(self.tgt_embed(tgt), memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), memory_key_padding_mask=src_mask)
    def forward(self, src, tgt):
        m = src == 0
        return self.generator(self.decode(self.encode(src, m), m, tgt, None))

def build():
    return Seq2Seq()
