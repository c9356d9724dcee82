"""lm-decoding's rotary tests (tndebug/probes/_rotary.py): positions inside attention must be
relative. Healthy rotary models (a nanoGPT-style user model with RoPE, tests/foreign/rotary_gpt.py;
HF Llama, Qwen2, Mistral, GPTNeoX with its partial rotary, eager and SDPA) pass over three seeds;
models whose positions are absolute by design (GPT-2's wpe, nanoGPT's wpe, tndebug's sinusoidal
decoder) are not applicable, never an error. Each injected bug (a method substituted from here:
rotary on q only, on v too, q and k paired differently, positions restarting per chunk) is named
by its code at the first attention, and no other probe errs on it; a bug in a later layer only
is seen through position_ids + c (the HF adapter's shift)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tndebug import driver
from tndebug.capture.generic import GenericCapture
from tndebug.hf.decoder_only import make_lm_adapter
from tndebug.config import ModelConfig
from tndebug.data import Batch
from tndebug.inject import make_model
from tndebug.probes import TRIAGE_PROBES
from tndebug.probes.base import RunContext
from tndebug.probes.lm_decoding import LMDecoding
from tndebug.subject import Subject, tndebug_subject

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))
import nanogpt  # noqa: E402
import rotary_gpt  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SEEDS = (0, 1, 2)
V = 1000
CODES = {"q_only": "rotary-shift", "pairing": "rotary-shift", "chunks": "rotary-shift",
         "v_too": "rotary-values"}


def user_subject(module, model) -> Subject:
    model.eval()
    s = Subject(model, module.forward, pad_id=0, bos_id=1, src_vocab=11, tgt_vocab=11,
                capture=GenericCapture(model, kind="decoder"), kind="decoder", max_len=32)
    s.capture.discover(lambda: module.forward(model, torch.randint(2, 11, (1, 8)), 0))
    return s


def hf_subject(arch: str, attn: str, seed: int, patch=None) -> Subject:
    T = transformers
    sizes = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    cfg = {"gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64),
           "gpt_neox": lambda: T.GPTNeoXConfig(**sizes),          # rotary_pct 0.25: partial rotary
           "llama": lambda: T.LlamaConfig(**sizes, num_key_value_heads=2),
           "qwen2": lambda: T.Qwen2Config(**sizes, num_key_value_heads=2),
           "mistral": lambda: T.MistralConfig(**sizes, num_key_value_heads=2)}[arch]()
    torch.manual_seed(seed)
    m = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    if patch is not None:
        patch(m)
    f, inc = make_lm_adapter()
    s = Subject(m, f, pad_id=V - 1, bos_id=1, src_vocab=V - 1, tgt_vocab=V - 1, first_content=3,
                capture=GenericCapture(m, kind="decoder"), kind="decoder", incremental=inc,
                max_len=64)
    s.capture.discover(lambda: f(m, torch.randint(3, 100, (1, 8)), V - 1))
    return s


def rotary_findings(s: Subject) -> tuple[LMDecoding, list]:
    p = LMDecoding()
    p.setup(RunContext(subject=s))
    return p, [(f.severity, f.code, f.where) for f in p.findings if f.code.split("/")[-1]
               in ("rotary-shift", "rotary-values")]


def rotary_cover(p: LMDecoding) -> dict:
    return {k: v for k, v in p.coverage.items() if k == "rotary" or k.endswith(("attn", "attention"))}


def other_errors(s: Subject) -> list:
    """Errors of every triage probe but lm-decoding's rotary codes, on a language-model batch."""
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(s.first_content, min(s.tgt_vocab, 40), (8, 13), generator=g).to(s.device)
    seq[:, 0] = s.bos_id
    res = driver.probe_once(s, TRIAGE_PROBES, Batch(seq[:, :0], seq[:, :-1], seq[:, 1:]))
    return [(f.code, f.where) for f in res.findings if f.severity == "error"
            and not f.code.endswith(("rotary-shift", "rotary-values"))]


# -- healthy: checked and passed, or not applicable; never a finding ---------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", rotary_gpt.VARIANTS)
def test_a_users_rotary_model_passes(variant, seed):
    torch.manual_seed(seed)
    p, found = rotary_findings(user_subject(rotary_gpt, rotary_gpt.build(variant)))
    assert not found
    assert p.coverage["transformer.h.0.attn"]["status"] == "checked"


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("attn", ("eager", "sdpa"))
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral", "gpt_neox"))
def test_hf_rotary_models_pass(arch, attn, seed):
    p, found = rotary_findings(hf_subject(arch, attn, seed))
    assert not found, found
    site = "gpt_neox.layers.0.attention" if arch == "gpt_neox" else "model.layers.0.self_attn"
    assert p.coverage[site]["status"] == "checked"
    assert p.findings == [] or all(f.severity == "info" for f in p.findings)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("attn", ("eager", "sdpa"))
def test_gpt2_is_absolute_by_design_not_an_error(attn, seed):
    p, found = rotary_findings(hf_subject("gpt2", attn, seed))
    assert not found
    assert p.coverage["rotary"]["status"] == "not applicable"
    assert "absolute" in p.coverage["rotary"]["reason"]


@pytest.mark.parametrize("seed", SEEDS)
def test_absolute_user_and_own_models_are_not_applicable(seed):
    torch.manual_seed(seed)
    subjects = [user_subject(nanogpt, nanogpt.build()),
                tndebug_subject(make_model(ModelConfig.tiny(arch="decoder", dropout=0.0)))]
    for s in subjects:
        p, found = rotary_findings(s)
        assert not found
        assert p.coverage["rotary"]["status"] == "not applicable"


# -- faulty: the finding, at the first attention; no other probe errs -------------------------
@pytest.mark.parametrize("variant", rotary_gpt.VARIANTS)
@pytest.mark.parametrize("bug", rotary_gpt.BUGS)
def test_a_users_rotary_bug_is_named(bug, variant):
    for seed in SEEDS:
        torch.manual_seed(seed)
        s = user_subject(rotary_gpt, rotary_gpt.broken(rotary_gpt.build(variant), bug))
        _, found = rotary_findings(s)
        assert found == [("error", f"lm-decoding/{CODES[bug]}", "transformer.h.0.attn")], (seed, found)


@pytest.mark.slow
@pytest.mark.parametrize("bug", rotary_gpt.BUGS)
def test_no_other_probe_errs_on_a_rotary_bug(bug):
    torch.manual_seed(0)
    s = user_subject(rotary_gpt, rotary_gpt.broken(rotary_gpt.build("manual"), bug))
    assert other_errors(s) == []


def _hf_q_only(monkeypatch, arch):
    mod = sys.modules[type(transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                 num_hidden_layers=1, num_attention_heads=1))).__module__]
    if arch != "llama":
        mod = __import__(f"transformers.models.{arch}.modeling_{arch}", fromlist=["x"])
    orig = mod.apply_rotary_pos_emb

    def q_only(q, k, cos, sin, *a, **kw):
        return orig(q, k, cos, sin, *a, **kw)[0], k
    monkeypatch.setattr(mod, "apply_rotary_pos_emb", q_only)


def _chunks_in(layer: int):
    """Layer `layer`'s attention gets the rotary angles of its position_ids restarting every 4
    (positions that ignore position_ids, arange(T) % 4, do not move with a shift: only the
    periodic test, in the first layer, sees those)."""
    def patch(m):
        rot, attn = m.model.rotary_emb, m.model.layers[layer].self_attn
        forward = attn.forward

        def chunked(*args, position_embeddings=None, **kw):
            pos = kw["position_ids"] % 4
            return forward(*args, position_embeddings=rot(position_embeddings[0], pos), **kw)
        attn.forward = chunked
    return patch


@pytest.mark.slow
@pytest.mark.parametrize("attn", ("eager", "sdpa"))
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
def test_hf_rotary_on_q_only_is_named(monkeypatch, arch, attn):
    _hf_q_only(monkeypatch, arch)
    s = hf_subject(arch, attn, 0)
    _, found = rotary_findings(s)
    assert found == [("error", "lm-decoding/rotary-shift", "model.layers.0.self_attn")]
    assert other_errors(s) == []


@pytest.mark.slow
@pytest.mark.parametrize("attn", ("eager", "sdpa"))
def test_hf_chunked_positions_in_a_later_layer_are_seen_by_the_shift(attn):
    s = hf_subject("llama", attn, 0, patch=_chunks_in(1))
    p, found = rotary_findings(s)
    assert found == [("error", "lm-decoding/rotary-shift", "")]
    assert p.findings[0].evidence["shift"]["delta"] > p.findings[0].evidence["shift"]["tol"]
    s0 = hf_subject("llama", attn, 0, patch=_chunks_in(0))       # in the first: named there
    assert rotary_findings(s0)[1] == [("error", "lm-decoding/rotary-shift", "model.layers.0.self_attn")]


# -- trained: properties that hold only at initialisation have drifted -----------------------
_trained: dict = {}


def trained(seed: int, **sizes):
    """rotary_gpt trained 300 steps on copy as a language model (nanogpt_corpus.train)."""
    from nanogpt_corpus import train
    key = (seed, tuple(sorted(sizes.items())))
    if key not in _trained:
        torch.manual_seed(seed)
        m = rotary_gpt.build(**sizes)
        _trained[key] = (m.state_dict(), train(m, steps=300, seed=seed))
    m = rotary_gpt.build(**sizes)
    m.load_state_dict(_trained[key][0])
    return m.eval(), _trained[key][1]


def warnings_and_errors(s: Subject, gave_up=()) -> list:
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(s.first_content, s.tgt_vocab, (8, 13), generator=g)
    seq[:, 0] = s.bos_id
    res = driver.probe_once(s, TRIAGE_PROBES, Batch(seq[:, :0], seq[:, :-1], seq[:, 1:]))
    odd = {n: st for n, st in res.statuses.items() if st["status"] not in ("pass", "fail")
           and not (n in gave_up and st["status"] == "no verdict")}
    assert not odd, odd                                      # no probe broke or gave up
    return [(f.severity, f.code, f.where) for f in res.findings if f.severity in ("warning", "error")]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sizes", ({}, {"n_head": 4, "n_kv_head": 2}), ids=("mha", "gqa"))
def test_a_trained_rotary_model_is_clean_and_its_bugs_are_named(seed, sizes):
    m, loss = trained(seed, **sizes)
    assert loss < 1.0                                        # it learnt copy (chance: ~2.2)
    s = user_subject(rotary_gpt, m)
    # a known gap of the capture, not of the rotary test: with k and v repeated per group
    # (repeat_interleave after the projection) q and k at the product are not traced to the
    # projections, so missing-scale has no verdict on GQA user code
    gave_up = ("missing-scale",) if sizes else ()
    assert warnings_and_errors(s, gave_up) == []
    p, _ = rotary_findings(s)
    assert p.coverage["transformer.h.0.attn"]["status"] == "checked"
    for bug in rotary_gpt.BUGS:                              # the trained weights in broken code
        m, _ = trained(seed, **sizes)
        s = user_subject(rotary_gpt, rotary_gpt.broken(m, bug))
        assert warnings_and_errors(s, gave_up) == [("error", f"lm-decoding/{CODES[bug]}",
                                           "transformer.h.0.attn")], (bug, seed)
