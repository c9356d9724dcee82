"""Blocks found from behaviour: one module applied several times along depth (ALBERT's shared
layer, a Universal-Transformer-style `for _ in range(n): x = self.block(x)`) is one block per call.

Before, blocks were numbered children of `layers`/`blocks`/`h` only: such models had no stream
points, and variance-drift and ln-placement gave no verdict ("no transformer blocks were found")."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tndebug
from tndebug.capture.generic import GenericCapture
from tndebug.capture.trace import Trace


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, scale: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads, self.scale = heads, scale

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)       # (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))
        att = q @ k.transpose(-2, -1)                                            # (B, nh, T, T)
        if self.scale:
            att = att / math.sqrt(k.size(-1))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))          # (B, T, C)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, residual: bool, scale: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, scale)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.residual = residual

    def forward(self, x):
        a = self.attn(self.ln_1(x))
        x = x + a if self.residual else a
        return x + self.mlp(self.ln_2(x))


class SharedGPT(nn.Module):
    """nanoGPT with one block applied `n_layer` times (its weights shared across depth)."""

    def __init__(self, vocab: int = 11, d: int = 32, heads: int = 2, n_layer: int = 3,
                 max_len: int = 32, residual: bool = True, scale: bool = True) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.block = Block(d, heads, residual, scale)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.n_layer = n_layer

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))   # (B, T, C)
        for _ in range(self.n_layer):
            x = self.block(x)
        return self.lm_head(self.ln_f(x))                                          # (B, T, V)


class SharedGPTInAList(SharedGPT):
    """The shared block as the one numbered block `h.0`, called `n_layer` times."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.h = nn.ModuleList([self.block])
        del self.block

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))   # (B, T, C)
        for _ in range(self.n_layer):
            x = self.h[0](x)
        return self.lm_head(self.ln_f(x))                                          # (B, T, V)


def forward(model, ids, pad_id):
    return model(ids)


@pytest.mark.parametrize("cls, block", [(SharedGPT, "block"), (SharedGPTInAList, "h.0")])
def test_each_call_of_a_shared_block_is_a_stream_point_along_depth(cls, block):
    model = cls().eval()
    ids = torch.randint(1, 11, (4, 12))
    cap = GenericCapture(model, kind="decoder")
    cap.discover(lambda: model(ids))
    assert cap.layers == {block: ("decoder", 0)} and cap.repeated == {block}
    trace = Trace(src=ids, tgt=ids, pad_id=0)
    with cap.recording(("stream", "attn.probs"), trace):
        model(ids)
    layers = [(sp.name, sp.layer) for sp in trace.streams if sp.kind == "layer"]
    assert layers == [(block, 0), (f"{block}#1", 1), (f"{block}#2", 2)]     # was 0, 0, 0 (h.0)
    assert {s: r.layer for s, r in trace.attention.items()} == {
        f"{block}.attn": 0, f"{block}.attn#1": 1, f"{block}.attn#2": 2}


def test_a_module_called_on_one_stream_once_is_no_block():
    """Only repetition makes a block of an un-numbered module: one call is not depth."""
    model = SharedGPT(n_layer=1).eval()
    ids = torch.randint(1, 11, (2, 8))
    cap = GenericCapture(model, kind="decoder")
    cap.discover(lambda: model(ids))
    assert cap.layers == {} and cap.repeated == set()


def _statuses(report, names=("variance-drift", "ln-placement")) -> dict:
    return {n: report.probes[n]["status"] for n in names}


def test_shared_block_model_gets_a_verdict_and_its_removed_residual_is_found():
    healthy = tndebug.check(SharedGPT().eval(), forward, probes="variance-drift,ln-placement",
                            arch="decoder")
    assert _statuses(healthy) == {"variance-drift": "pass", "ln-placement": "pass"}, healthy.probes
    assert [f.severity for f in healthy.findings] == ["info"]          # its placement, read
    assert "pre-LN" in healthy.findings[0].message
    broken = tndebug.check(SharedGPT(residual=False).eval(), forward, probes="ln-placement",
                           arch="decoder")
    (f,) = [f for f in broken.findings if f.code == "ln-placement/residual-missing"]
    assert f.severity == "error" and f.where.startswith("block"), f
    assert f.evidence["parts_without_residual"] == ["block.attn"], f.evidence
    # an attention bug is still found, in every call of the shared attention (as before)
    unscaled = tndebug.check(SharedGPT(scale=False).eval(), forward, probes="missing-scale",
                             arch="decoder")
    (f,) = [f for f in unscaled.findings if f.probe == "missing-scale"]
    assert f.severity == "error" and set(f.evidence["modules"]) == {"block.attn", "block.attn#1",
                                                                     "block.attn#2"}


def test_albert_shared_layer_is_checked_along_depth():
    tf = pytest.importorskip("transformers")
    model = tf.AlbertForMaskedLM(tf.AlbertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, embedding_size=32)).eval()
    report = tndebug.check(model)
    assert _statuses(report) == {"variance-drift": "pass", "ln-placement": "pass"}, report.probes
    assert report.verdict == "clean" and report.exit_code() == 0          # was INCOMPLETE (4)
    cover = report.probes["ln-placement"]["coverage"]
    assert cover["albert.encoder.albert_layer_groups.0"]["status"] == "checked", cover
    # the stack found, what enters it is the embedding tap (the factorised embedding's output,
    # before embedding_hidden_mapping_in): its absolute positions are read there (was: "no
    # embedding taps", and the positions taken for relative ones, in attention)
    pe = report.probes["positional-encoding"]
    assert pe["coverage"]["albert.embeddings"]["status"] == "checked", pe
    assert "added to the embeddings (absolute)" in pe["coverage"][""]["reason"], pe
