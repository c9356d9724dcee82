"""End to end: user-style models with hand-written bugs, trained briefly and saved the way
users save them; triage must name the right probe and the module in the user's own naming,
and report nothing (no warning, no error) for the healthy ones."""
from __future__ import annotations

import math

import pytest
import torch

from tndebug.triage import TriageOptions, triage
from tndebug.probes.base import DECODER_ONLY

from conftest import TINY, ZOO, zoo, zoo_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_cache: dict = {}


def checkpoint(tmp_path_factory, name: str, bugs: dict, steps: int = 20):
    """Train zoo model `name` with `bugs` for `steps` steps on copy; save {model, optimizer,
    step, config}. Cached for the session."""
    key = (name, tuple(sorted(bugs.items())), steps)
    if key in _cache:
        return _cache[key]
    train = zoo("train")
    mod = zoo(name)
    torch.manual_seed(0)
    if name == "annotated":
        config = {"src_vocab": 11, "tgt_vocab": 11, **TINY, "fill": None, **bugs}
        model, forward = mod.make_model(**config), mod.forward_logits
    else:
        config = {"dropout": 0.0, **bugs} if name == "torch_seq2seq" else dict(bugs)
        model, forward = mod.build(**config), mod.forward
    model, opt, loss = train.train(model, lambda m, s, t, p: forward(m, s, t, p),
                                   steps=steps, batch=32 if steps <= 50 else 64)
    path = tmp_path_factory.mktemp("zoo") / f"{name}.pt"
    train.save(path, model, opt, steps, config)
    _cache[key] = path, loss
    return path, loss


def user_triage(name: str, path, **kw):
    factory = "make_model" if name == "annotated" else "build"
    adapter = "annotated" if name == "annotated" else zoo_spec(name, "forward")
    return triage(TriageOptions(str(path), model=zoo_spec(name, factory), adapter=adapter, **kw))


def flagged(report) -> set[tuple[str, str]]:
    return {(f.probe, f.where) for f in report.findings if f.severity in ("warning", "error")}


def probes_flagged(report) -> set[str]:
    return {p for p, _ in flagged(report)}


BUGS = [
    ("annotated", {"scale": False}, "missing-scale", "encoder.layers.0.self_attn"),
    ("annotated", {"causal": False}, "mask-broadcast", "decoder.layers.0.self_attn"),
    ("annotated", {"mask_axis": "query"}, "mask-broadcast", "encoder.layers.0.self_attn"),
    ("annotated", {"pe": False}, "positional-encoding", "src_embed.0"),
    ("annotated", {"shared_qkv": True}, "head-collapse", "encoder.layers.0.self_attn"),
    ("annotated", {"final_norm": False}, "ln-placement", "encoder"),
    ("torch_seq2seq", {"pe": False}, "positional-encoding", "src_tok_emb"),
    ("torch_seq2seq", {"causal": False}, "mask-broadcast", "transformer.decoder.layers.0.self_attn"),
    ("torch_seq2seq", {"memory_mask": False}, "mask-broadcast", "transformer.decoder.layers.0.multihead_attn"),
    ("sdpa_model", {"scale": False}, "missing-scale", "enc.0.attn"),
    ("sdpa_model", {"causal": False}, "mask-broadcast", "dec.0.attn"),
    ("sdpa_model", {"shared_qk": True}, "head-collapse", "enc.0.attn"),
]


@pytest.mark.parametrize("name, bugs, probe, where", BUGS,
                         ids=[f"{n}-{'-'.join(map(str, b))}" for n, b, _, _ in BUGS])
def test_bug_is_named_by_probe_and_module(tmp_path_factory, name, bugs, probe, where):
    path, _ = checkpoint(tmp_path_factory, name, bugs)
    report = user_triage(name, path)
    assert (probe, where) in flagged(report), report.findings
    if name != "sdpa_model":         # the exact set: nothing else fires
        assert probes_flagged(report) == {probe}, flagged(report)


def test_no_sqrt_d_model_is_a_named_deviation_when_the_model_uses_positions(tmp_path_factory):
    """Omitting the sqrt(d_model) is a deviation from the paper that models train with (issue 19):
    positional-encoding names it as info while the encoder's order test shows positions used."""
    bugs = {"emb_scale": False, "src_vocab_size": 1000, "tgt_vocab_size": 1000}
    path, _ = checkpoint(tmp_path_factory, "torch_seq2seq", bugs)
    report = user_triage("torch_seq2seq", path)
    assert flagged(report) == set(), report.findings
    named = [f for f in report.findings if f.probe == "positional-encoding" and f.severity == "info"]
    assert any(f.where == "src_tok_emb" and "sqrt(d_model)" in f.message for f in named), named


def test_fill_1e9_in_an_fp32_model_is_an_fp16_advisory(tmp_path_factory):
    """The Annotated Transformer's own -1e9 fill: info on an fp32 checkpoint (docs/severity.md)."""
    path, _ = checkpoint(tmp_path_factory, "annotated", {"fill": -1e9})
    report = user_triage("annotated", path)
    assert flagged(report) == set(), report.findings
    (f,) = [f for f in report.findings if f.probe == "nan-scores"]
    assert f.severity == "info" and f.where == "encoder.layers.0.self_attn"
    assert "fp32 model: only matters if you switch on fp16 autocast" in f.message
    assert report.run["compute_dtype"] == "float32"


@pytest.mark.parametrize("name", ["annotated", "torch_seq2seq", "sdpa_model"])
def test_healthy_briefly_trained_models_are_clean(tmp_path_factory, name):
    path, _ = checkpoint(tmp_path_factory, name, {})
    report = user_triage(name, path)
    assert flagged(report) == set()
    assert report.run["layout"] == "user code"
    assert all(v["status"] not in ("skipped", "no verdict") or v.get("reason") == DECODER_ONLY
               for v in report.probes.values()), report.probes          # every probe that applies ran


def test_healthy_annotated_checkpoint_without_its_code(tmp_path_factory):
    path, _ = checkpoint(tmp_path_factory, "annotated", {})
    report = triage(TriageOptions(str(path)))
    assert report.run["layout"] == "annotated" and report.run["inferred_config"]["n_heads"] == 4
    assert flagged(report) == set()


def test_bug_found_in_the_weights_without_the_code(tmp_path_factory):
    """W_Q = W_K = W_V survives conversion into tndebug's model: the weights show it."""
    path, _ = checkpoint(tmp_path_factory, "annotated", {"shared_qkv": True})
    report = triage(TriageOptions(str(path)))
    assert ("head-collapse", "encoder.layers.0.self_attn") in flagged(report)


# -- trained to solve the task: the temperature sweep and the inference of unknowns --------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["annotated", "torch_seq2seq"])
def test_trained_healthy_checkpoint_is_clean_and_matched(tmp_path_factory, name):
    path, loss = checkpoint(tmp_path_factory, name, {}, steps=300)
    assert loss < 0.5
    report = user_triage(name, path)
    assert flagged(report) == set()
    assert report.run["temperature_sweep"]["verdict"] == "not applicable"   # its own code


@pytest.mark.slow
def test_nn_transformer_checkpoint_settles_heads_norm_and_scale_by_loss(tmp_path_factory):
    path, _ = checkpoint(tmp_path_factory, "torch_seq2seq", {}, steps=300)
    sd = torch.load(path, weights_only=True)
    sd["config"] = {}                                  # nothing says heads or norm
    torch.save(sd, path.with_name("noconfig.pt"))
    report = triage(TriageOptions(str(path.with_name("noconfig.pt"))))
    cfg = report.run["inferred_config"]
    assert (cfg["n_heads"], cfg["norm"], report.run["emb_scale"]) == (4, "post", True)
    assert flagged(report) == set()
    assert any(f.probe == "checkpoint" and "inferred" in f.message for f in report.findings)


@pytest.mark.slow
def test_checkpoint_trained_without_the_scale(tmp_path_factory):
    """Trained by code without 1/sqrt(d_k): its own code looks matched, but the probe sees the
    code; loaded into correct code (no --model), the temperature sweep finds alpha ~ sqrt(d_k)."""
    path, loss = checkpoint(tmp_path_factory, "annotated", {"scale": False}, steps=300)
    assert loss < 0.5
    own = user_triage("annotated", path)
    assert own.run["temperature_sweep"]["verdict"] == "not applicable"     # matched by construction
    assert ("missing-scale", "encoder.layers.0.self_attn") in flagged(own)
    converted = triage(TriageOptions(str(path)))
    sweep = converted.run["temperature_sweep"]
    assert sweep["verdict"] == "mismatch" and sweep["best_alpha"] >= 2.0    # sqrt(8) = 2.83
    assert sweep["significant"] and sweep["paired"]["share_better"] >= 0.75
    (f,) = [f for f in converted.findings if f.probe == "missing-scale" and f.severity == "error"]
    assert "without the 1/sqrt(d_k)" in f.message
    # the same with the user's own held-out batches (here: the copy task written to a file)
    from tndebug.data import eval_set, get_task
    b = eval_set(get_task("copy"), n=32, seed=5)
    torch.save({"src": b.src, "tgt": torch.cat([b.tgt_in[:, :1], b.tgt_out], 1)},
               path.with_name("held_out.pt"))
    with_data = triage(TriageOptions(str(path), data=str(path.with_name("held_out.pt"))))
    sweep = with_data.run["temperature_sweep"]
    assert sweep["verdict"] == "mismatch" and sweep["data"] == "--data" and sweep["paired"]["n"] == 32
    assert with_data.run["data"].startswith("--data ") and with_data.run["task"] is None
