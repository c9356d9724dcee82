"""Tap points: every documented HookPoint exists under its module path, shows the documented
shape, delivers gradients, leaves nothing behind, and observing attention only changes the path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tndebug.config import ModelConfig
from tndebug.model import HookPoint
from tndebug.inject import make_model
from tndebug.model.attention import MultiHeadAttention

B, S, T = 3, 7, 5
ATTN = ("q", "k", "v", "scores", "masked_scores", "probs", "z", "out")


def documented_taps(cfg: ModelConfig) -> set[str]:
    names = {"hook_logits", "encoder.hook_out", "decoder.hook_out"}
    for emb in ("src_embed", "tgt_embed"):
        names |= {f"{emb}.hook_{f}" for f in ("tok", "pe", "out")}
    for stack, attns, n_sub in (("encoder", ("self_attn",), 2), ("decoder", ("self_attn", "cross_attn"), 3)):
        for i in range(cfg.n_layers):
            layer = f"{stack}.layers.{i}"
            names.add(f"{layer}.hook_out")
            names |= {f"{layer}.{a}.hook_{f}" for a in attns for f in ATTN}
            names |= {f"{layer}.ffn.hook_{f}" for f in ("hidden", "out")}
            names |= {f"{layer}.sublayer.{j}.hook_resid" for j in range(n_sub)}
    return names


def expected_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    d, h, d_k = cfg.d_model, cfg.n_heads, cfg.d_k
    L = S if name.startswith(("encoder", "src_embed")) else T          # the query length
    Lk = S if ".cross_attn." in name else L                             # the key length
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "hook_logits":
        return (B, T, cfg.tgt_vocab)
    if leaf == "hook_pe":
        return (1, L, d)
    if ".ffn.hook_hidden" in name:
        return (B, L, cfg.d_ff)
    if "attn." in name:
        return {"hook_q": (B, h, L, d_k), "hook_k": (B, h, Lk, d_k), "hook_v": (B, h, Lk, d_k),
                "hook_z": (B, h, L, d_k), "hook_out": (B, L, d)}.get(leaf, (B, h, L, Lk))
    return (B, L, d)


def batch(cfg: ModelConfig):
    src = torch.randint(2, cfg.src_vocab, (B, S))
    tgt = torch.randint(2, cfg.tgt_vocab, (B, T))
    tgt[:, 0] = 1
    src[1, 4:] = cfg.pad_id
    tgt[1, 3:] = cfg.pad_id
    return src, tgt


@pytest.fixture
def model():
    return make_model(ModelConfig.tiny(dropout=0.0)).eval()


def test_every_documented_tap_exists_with_its_module_path(model):
    points = {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}
    assert set(points) == documented_taps(model.cfg)
    assert model.hook_points.keys() == points.keys()
    for name, point in points.items():
        assert point.name == name
    for name in ("encoder.layers.0.self_attn.hook_scores", "decoder.layers.1.cross_attn.hook_probs",
                 "encoder.layers.0.sublayer.1.hook_resid", "decoder.hook_out", "hook_logits",
                 "src_embed.hook_pe", "decoder.layers.0.ffn.hook_hidden"):
        assert name in points


def test_forward_hooks_see_the_documented_shapes(model):
    seen = {}
    handles = [p.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, tuple(o.shape)))
               for n, p in model.hook_points.items()]
    logits = model(*batch(model.cfg))
    for h in handles:
        h.remove()
    assert seen.keys() == model.hook_points.keys()      # every tap fires on one forward
    wrong = {n: (s, expected_shape(n, model.cfg)) for n, s in seen.items() if s != expected_shape(n, model.cfg)}
    assert not wrong
    assert logits.shape == (B, T, model.cfg.tgt_vocab)


def test_probs_tap_holds_a_distribution_over_keys(model):
    out = {}
    point = model.hook_points["decoder.layers.1.cross_attn.hook_probs"]
    handle = point.register_forward_hook(lambda m, i, o: out.__setitem__("p", o))
    src, tgt = batch(model.cfg)
    model(src, tgt)
    handle.remove()
    p = out["p"]                                                          # [B, h, T, S]
    torch.testing.assert_close(p.sum(-1), torch.ones(B, model.cfg.n_heads, T))
    assert (p[1, :, :, 4:] == 0).all()                                    # pads get no weight


@pytest.mark.parametrize("name", ["encoder.layers.0.sublayer.1.hook_resid", "decoder.layers.0.self_attn.hook_probs",
                                  "src_embed.hook_out", "hook_logits"])
def test_grad_hook_delivers_the_gradient_of_the_activation(model, name):
    point = model.hook_points[name]
    got, acts = [], []
    h1 = point.add_grad_hook(lambda n, g: got.append((n, g.clone())))

    def keep(module, inputs, out):   # returns None: a forward hook's return value replaces the output
        out.retain_grad()
        acts.append(out)

    h2 = point.register_forward_hook(keep)
    src, tgt = batch(model.cfg)
    logits = model(src, tgt)
    F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=0).backward()
    h1.remove()
    h2.remove()
    assert len(got) == 1 and got[0][0] == name
    torch.testing.assert_close(got[0][1], acts[0].grad)
    assert got[0][1].abs().sum() > 0


def test_hooks_leave_no_residue_after_removal(model, monkeypatch):
    calls = {"explicit": 0}
    explicit = MultiHeadAttention.explicit
    monkeypatch.setattr(MultiHeadAttention, "explicit",
                        lambda self, *a: (calls.__setitem__("explicit", calls["explicit"] + 1), explicit(self, *a))[1])
    src, tgt = batch(model.cfg)
    before = model(src, tgt)
    assert calls["explicit"] == 0                        # nothing observed: every attention fused
    fired = []
    handles = []
    for n, p in model.hook_points.items():
        handles.append(p.register_forward_hook(lambda *a: fired.append(1)))
        handles.append(p.register_forward_pre_hook(lambda *a: None))
        handles.append(p.add_grad_hook(lambda *a: fired.append(2)))
    model(src, tgt).sum().backward()
    assert fired and calls["explicit"] == 3 * model.cfg.n_layers
    for h in handles:
        h.remove()
    for p in model.hook_points.values():
        assert not p.active
        assert not p._forward_hooks and not p._forward_pre_hooks and not p._grad_fns
    fired.clear()
    calls["explicit"] = 0
    after = model(src, tgt)
    after.sum().backward()
    assert not fired and calls["explicit"] == 0
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_observing_scores_switches_to_the_explicit_path_without_changing_outputs(model, monkeypatch):
    calls = []
    explicit = MultiHeadAttention.explicit
    monkeypatch.setattr(MultiHeadAttention, "explicit", lambda self, *a: (calls.append(self), explicit(self, *a))[1])
    src, tgt = batch(model.cfg)
    fused = model(src, tgt)
    assert not calls
    target = model.decoder.layers[0].self_attn
    handle = target.hook_scores.register_forward_hook(lambda *a: None)
    observed = model(src, tgt)
    handle.remove()
    assert calls == [target]                             # only the observed module switched
    torch.testing.assert_close(observed, fused, atol=1e-5, rtol=1e-5)
