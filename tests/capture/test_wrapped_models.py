"""A model inside a wrapper is reported in the names the user's model prints (issue 48): the
attribute of activation checkpointing (`_checkpoint_wrapped_module`), FSDP1, torch.compile
(`_orig_mod`) or TransformerLens's bridge (`_original_component`) never reaches a finding, and a
checkpointed block's recompute inside backward is not recorded as a second site (`attn#1`)."""
from __future__ import annotations

import json

import pytest
import torch

import tndebug
from tndebug.findings import Finding, user_path

transformers = pytest.importorskip("transformers")


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, bos_token_id=1,
        eos_token_id=2))


def places(report) -> set[tuple[str, str]]:
    return {(f.code, f.where) for f in report.findings}


def test_user_path_drops_only_wrappers_attributes():
    assert user_path("transformer.h.0._checkpoint_wrapped_module.attn") == "transformer.h.0.attn"
    assert user_path("_orig_mod.encoder.layers.0") == "encoder.layers.0"
    assert user_path("blocks.0._original_component.attn._original_component") == "blocks.0.attn"
    assert user_path("all heads of x._fsdp_wrapped_module.attn attend alike") == \
        "all heads of x.attn attend alike"
    assert user_path("my_orig_mod.attn._orig_mode") == "my_orig_mod.attn._orig_mode"   # whole names only
    f = Finding("head-collapse", "info", "in a._orig_mod.b", where="_orig_mod.a.b",
                evidence={"modules": {"a._checkpoint_wrapped_module.b": 4}})
    assert (f.where, f.message, f.evidence) == ("a.b", "in a.b", {"modules": {"a.b": 4}})


def test_checkpointed_blocks_read_as_the_plain_model():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    plain = tndebug.check(gpt2())
    model = gpt2()
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = checkpoint_wrapper(block)
    wrapped = tndebug.check(model)
    assert wrapped.verdict == plain.verdict and places(wrapped) == places(plain)
    assert plain.findings and not [f for f in wrapped.findings
                                   if "_checkpoint_wrapped_module" in f.where + f.message or "#" in f.where]
    assert "_checkpoint_wrapped_module" not in json.dumps(wrapped.to_dict())     # coverage, run too
    assert wrapped.probes["missing-scale"]["coverage"] == plain.probes["missing-scale"]["coverage"]


@pytest.mark.slow
def test_a_compiled_model_is_checked_as_its_eager_module():
    """Before: check recompiled the model at every capture (over 300 s for a 2-layer GPT-2)."""
    plain = tndebug.check(gpt2())
    compiled = tndebug.check(torch.compile(gpt2()))
    assert compiled.verdict == plain.verdict and places(compiled) == places(plain)
