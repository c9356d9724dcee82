"""ln-placement/residual-missing: a block whose output keeps none of its input (`_skip_path`).

The bug `x = self.attn(self.ln_1(x))` for `x = x + self.attn(self.ln_1(x))` was CLEAN before:
a block with no residual around a sublayer has no residual to find by tensor identity."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tndebug
from tndebug.config import ModelConfig
from tndebug.data import get_task
from tndebug.inject import make_model
from tndebug.probes import _skip_path

NANOGPT = Path(__file__).resolve().parents[1] / "foreign" / "nanogpt.py"
ATTN = "x = x + self.attn(self.ln_1(x), pad)"
FFN = "return x + self.mlp(self.ln_2(x))"
EDITS = {                                   # one-line edits of the user's file
    "healthy": {},
    "attn": {ATTN: "x = self.attn(self.ln_1(x), pad)"},
    "ffn": {FFN: "return self.mlp(self.ln_2(x))"},
    "both": {ATTN: "x = self.attn(self.ln_1(x), pad)", FFN: "return self.mlp(self.ln_2(x))"},
    "scaled": {ATTN: "x = x + 0.1 * self.attn(self.ln_1(x), pad)"},             # x + a f(x)
    "deepnet": {ATTN: "x = 2.0 * x + self.attn(self.ln_1(x), pad)"},            # a x + f(x)
}


def nanogpt(tmp_path: Path, edit: str):
    text = NANOGPT.read_text()
    for old, new in EDITS[edit].items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / f"nanogpt_{edit}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module                 # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def missing(report) -> list:
    return [f for f in report.findings if f.code == "ln-placement/residual-missing"]


def train_lm(model, forward, steps: int = 60, vocab: int = 11):
    """Adam on sequences that repeat a random half: the model learns to copy (weights move)."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        half = torch.randint(1, vocab, (16, 8), generator=g)
        ids = torch.cat([half, half], dim=1)                                   # [16, 16]
        logits = forward(model, ids[:, :-1], 0)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), float(loss.detach())


def train_paper(model, steps: int = 60):
    task, g = get_task("copy"), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        b = task.batch(g, 16)
        loss = F.cross_entropy(model(b.src, b.tgt_in).flatten(0, 1), b.tgt_out.flatten(), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("edit, parts", [
    ("attn", ["transformer.h.0.attn"]),
    ("ffn", ["ffn"]),
    ("both", ["transformer.h.0.attn", "ffn"]),
])
def test_nanogpt_without_a_residual_is_an_error_at_init_and_after_training(tmp_path, edit, parts):
    mod = nanogpt(tmp_path, edit)
    torch.manual_seed(0)
    model = mod.build()
    for when in ("init", "trained"):
        if when == "trained":
            model, _ = train_lm(model, mod.forward)
        (f,) = missing(tndebug.check(model, mod.forward, probes="ln-placement", arch="decoder"))
        assert f.severity == "error" and f.step == 0, when
        assert f.evidence["blocks"] == ["transformer.h.0", "transformer.h.1"], when
        assert f.evidence["skip_share"] < _skip_path.MIN_SHARE < f.evidence["share_nothing_held"]
        assert f.evidence["parts_without_residual"] == parts, (when, f.evidence)
        assert f.where == ("transformer.h.0.attn" if "ffn" != parts[0] else "transformer.h.0")
        assert "x + self.attn(self.ln_1(x))" in f.fix


@pytest.mark.parametrize("edit", ["healthy", "scaled", "deepnet"])
def test_nanogpt_with_its_residuals_plain_or_scaled_is_not_flagged(tmp_path, edit):
    mod = nanogpt(tmp_path, edit)
    torch.manual_seed(0)
    model = mod.build()
    for when in ("init", "trained"):
        if when == "trained":
            model, _ = train_lm(model, mod.forward)
        report = tndebug.check(model, mod.forward, probes="ln-placement", arch="decoder")
        assert missing(report) == [], (edit, when)
        cover = report.probes["ln-placement"]["coverage"]
        assert {cover["transformer.h.0"]["status"], cover["transformer.h.1"]["status"]} == {"checked"}


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_paper_model_without_its_attention_residual_is_named_per_stack(norm):
    torch.manual_seed(0)
    model = make_model(ModelConfig.tiny(norm=norm).with_faults("no_attn_residual"))
    for when in ("init", "trained"):
        if when == "trained":
            model = train_paper(model)
        found = {f.evidence["blocks"][0]: f for f in missing(tndebug.check(model, probes="ln-placement"))}
        assert set(found) == {"encoder.layers.0", "decoder.layers.0"}, (norm, when)
        for stack, f in found.items():
            assert f.severity == "error" and f.where == f"{stack}.self_attn", (norm, when)
            assert f.evidence["parts_without_residual"] == [f"{stack}.self_attn"], f.evidence
            assert f.evidence["blocks"] == [f"{stack.rsplit('.', 1)[0]}.{i}" for i in (0, 1)]


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_paper_model_healthy_is_not_flagged_and_every_residual_removed_is(norm):
    torch.manual_seed(0)
    assert missing(tndebug.check(make_model(ModelConfig.tiny(norm=norm)), probes="ln-placement")) == []
    found = missing(tndebug.check(make_model(ModelConfig.tiny(norm=norm).with_faults("no_residual")),
                                  probes="ln-placement"))
    assert {f.evidence["blocks"][0] for f in found} == {"encoder.layers.0", "decoder.layers.0"}
    enc = next(f for f in found if f.where.startswith("encoder"))
    assert enc.evidence["parts_without_residual"] == ["encoder.layers.0.self_attn", "ffn"]


def _hf_models():
    tf = pytest.importorskip("transformers")
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=2,
                                                         n_positions=64, **ids)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, intermediate_size=64,
                                                         pad_token_id=0)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, max_position_embeddings=64,
                                                            **ids)),
        "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            decoder_start_token_id=1, forced_eos_token_id=None, **ids)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
    }


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "bart", "t5"])
def test_hugging_face_models_keep_their_input(name):
    torch.manual_seed(0)
    report = tndebug.check(_hf_models()[name]().eval(), probes="ln-placement")
    assert missing(report) == []
    cover = report.probes["ln-placement"]["coverage"]
    assert any(c["status"] == "checked" and ".0" in w for w, c in cover.items()), cover


def test_the_attention_residual_points_at_the_blocks_line_that_lost_it(tmp_path):
    # it pointed at the attention's forward def (issue 48: the line the bug was written in)
    mod = nanogpt(tmp_path, "attn")
    torch.manual_seed(0)
    (f,) = missing(tndebug.check(mod.build(), mod.forward, probes="ln-placement", arch="decoder"))
    assert f.source["code"] == "x = self.attn(self.ln_1(x), pad)" and not f.source.get("def")


SUBLAYERS = """\
import torch
import torch.nn.functional as F
from torch import nn


class SublayerConnection(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(z.transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn = Attention(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.res = nn.ModuleList(SublayerConnection(d) for _ in range(2))

    def forward(self, x):
        x = self.res[0](x, lambda y: self.attn(y))
        return self.res[1](x, self.ff)


class LM(nn.Module):
    def __init__(self, vocab=40, d=32, heads=4, layers=2, max_len=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def build():
    return LM()


def forward(model, ids, pad_id):
    return model(ids)
"""


def test_a_residual_lost_in_a_sublayer_connection_is_placed_in_its_forward(tmp_path):
    """The Annotated Transformer's SublayerConnection written `x = f(norm(x)); return x + x`
    (kyegomez/BitNet#32): the residual is lost in that class's forward, not on the layer's line
    that passes it the attention (`x = self.res[0](x, lambda y: self.attn(y))`, where a search
    of the layer's source for the attention's call pointed before)."""
    text = SUBLAYERS.replace("        return x + self.dropout(sublayer(self.norm(x)))",
                             "        x = self.dropout(sublayer(self.norm(x)))\n        return x + x")
    path = tmp_path / "sublayers_doubled.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    (f,) = missing(tndebug.check(mod.build(), mod.forward, probes="ln-placement", arch="decoder",
                                 pad_id=None))
    assert f.evidence["parts_without_residual"] == ["layers.0.attn", "ffn"]   # one class: both
    assert (f.source["function"], f.source["code"]) == (
        "SublayerConnection.forward", "x = self.dropout(sublayer(self.norm(x)))"), f.source
