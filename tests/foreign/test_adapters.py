"""The adapter layer on foreign code: what a user adapter may return, the built-in annotated
adapter using the model's own mask functions, and the Hugging Face models' bugs doing what they
say in both attention implementations."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from tndebug.errors import UsageError
from tndebug.triage import TriageOptions, triage
from tndebug.capture.adapters import (TNDEBUG_MASKS_NOTE, annotated_forward, as_logits,
                                     builtin_adapter, import_file, resolve_adapter)

from foreign_corpus import HERE, ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
B, T, V = 2, 5, 7
TGT = torch.ones(B, T, dtype=torch.long)


# -- what a user adapter may return -----------------------------------------------------------
def test_tuple_flat_and_output_object_become_batch_first_logits():
    logits = torch.randn(B, T, V)
    assert as_logits((logits, {"attn": None}), TGT, "a") is logits
    assert as_logits([None, logits], TGT, "a") is logits
    assert torch.equal(as_logits(logits.reshape(B * T, V), TGT, "a"), logits)
    assert as_logits(types.SimpleNamespace(logits=logits), TGT, "a") is logits


@pytest.mark.parametrize("out, words", [
    (torch.randn(T, B, V), "sequence-first"),
    (torch.randn(B * T + 1, V), "(11, 7)"),
    (("no", "tensors"), "tuple with no tensor"),
    (3.0, "a float"),
])
def test_other_outputs_are_a_usage_error_naming_them(out, words):
    with pytest.raises(UsageError, match=r"expected logits \[B, T, V\] = \[2, 5, V\]") as e:
        as_logits(out, TGT, "my.py:forward")
    assert words in str(e.value) and "my.py:forward" in str(e.value)


def test_a_user_adapter_returning_flat_logits_is_triaged(tmp_path):
    """prescaled_q returns [B*T, V] and relbias (logits, hidden): triage runs on both."""
    spec = f"{HERE / 'prescaled_q.py'}:forward"
    model = import_file(HERE / "prescaled_q.py").build()
    adapter = resolve_adapter(spec, model)
    src = torch.randint(3, 11, (B, 6))
    assert adapter.forward(model, src, TGT, 0).shape == (B, T, 16)
    torch.save({"model": model.state_dict(), "config": {}}, tmp_path / "p.pt")
    report = triage(TriageOptions(str(tmp_path / "p.pt"), model=f"{HERE / 'prescaled_q.py'}:build",
                                  adapter=spec))
    assert report.run["layout"] == "user code"


def test_a_wrong_shape_from_the_adapter_stops_triage(tmp_path):
    user = tmp_path / "user.py"
    user.write_text("from torch import nn\n"
                    "def build():\n    return nn.Embedding(11, 4)\n"
                    "def forward(model, src, tgt, pad_id):\n    return model(tgt)[..., None]\n")
    torch.save({"model": import_file(user).build().state_dict()}, tmp_path / "u.pt")
    with pytest.raises(UsageError, match=r"returned a tensor of shape \(2, \d+, 4, 1\); expected logits"):
        triage(TriageOptions(str(tmp_path / "u.pt"), model=f"{user}:build", adapter=f"{user}:forward"))


# -- the built-in annotated adapter uses the model's own mask code -----------------------------
ANNOTATED_LIKE = '''
import torch
from torch import nn
CALLS = []

class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Identity(), nn.Identity()
        self.src_embed, self.tgt_embed = nn.Embedding(11, 4), nn.Embedding(11, 4)
        self.generator = nn.Linear(4, 11)
    def encode(self, src, src_mask):
        return self.src_embed(src)
    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.tgt_embed(tgt)
    def forward(self, src, tgt, src_mask, tgt_mask):
        CALLS.append(tgt_mask)
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)
'''
SUBSEQUENT = '''
def subsequent_mask(size):          # the user's own, with a bug: no future hidden
    return torch.ones(1, size, size, dtype=torch.bool)
'''
BATCH = '''
class Batch:
    @staticmethod
    def make_std_mask(tgt, pad):
        CALLS.append("make_std_mask")
        return (tgt != pad).unsqueeze(-2) & torch.ones(1, tgt.shape[-1], tgt.shape[-1], dtype=torch.bool).tril()
'''


@pytest.mark.parametrize("extra, source", [("", "tndebug"), (SUBSEQUENT, "subsequent_mask"),
                                           (SUBSEQUENT + BATCH, "Batch.make_std_mask")])
def test_annotated_adapter_builds_masks_with_the_models_own_functions(tmp_path, extra, source):
    path = tmp_path / f"annotated_{source.replace('.', '_')}.py"
    path.write_text(ANNOTATED_LIKE + extra)
    mod = import_file(path)
    model = mod.EncoderDecoder()
    adapter = resolve_adapter(None, model)            # guessed: it looks like The Annotated Transformer
    assert adapter.name == "annotated"
    assert adapter.note == (TNDEBUG_MASKS_NOTE if source == "tndebug" else None)
    annotated_forward(model, torch.tensor([[3, 4, 0]]), torch.tensor([[1, 5, 6, 7]]), 0)
    tgt_mask = mod.CALLS[-1]
    if source == "subsequent_mask":                    # the user's bug reaches the model
        assert tgt_mask.all()
    else:
        assert torch.equal(tgt_mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    if source == "Batch.make_std_mask":
        assert "make_std_mask" in mod.CALLS


def test_builtin_adapter_without_a_model_has_no_note():
    assert builtin_adapter("annotated").note is None and builtin_adapter("tndebug").note is None


# -- the Hugging Face models: the bugs are real in both implementations --------------------------
def _hf():
    pytest.importorskip("transformers")
    return import_file(HERE / "hf_models.py")


def _future_leak(H, model) -> float:
    """Max change of the logits at positions < 3 when the target token at position 3 changes."""
    torch.manual_seed(1)
    src = torch.randint(3, 16, (2, 7))
    src[0, 5:] = 0
    tgt = torch.randint(3, 16, (2, 6))
    tgt[:, 0] = 1
    changed = tgt.clone()
    changed[:, 3] = torch.where(tgt[:, 3] == 15, 3, tgt[:, 3] + 1)
    with torch.no_grad():
        a, b = H.forward(model, src, tgt, 0), H.forward(model, src, changed, 0)
    return float((a[:, :3] - b[:, :3]).abs().max())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["bart", "marian", "t5"])
def test_hf_bugs_apply_in_both_attention_implementations(arch, impl):
    H = _hf()
    torch.manual_seed(0)
    healthy = H.build(arch, impl).eval()
    assert healthy.config._attn_implementation == impl
    assert _future_leak(H, healthy) == 0.0
    torch.manual_seed(0)
    assert _future_leak(H, H.build(arch, impl, bug="no_causal").eval()) > 1e-6
    src = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    tgt = torch.tensor([[1, 5, 6], [1, 8, 9]])
    with torch.no_grad():
        base = H.forward(healthy, src, tgt, 0)
        for bug in H.BUGS[arch]:
            torch.manual_seed(0)
            assert not torch.allclose(H.forward(H.build(arch, impl, bug=bug).eval(), src, tgt, 0), base), bug
        torch.manual_seed(0)
        other = H.build(arch, "sdpa" if impl == "eager" else "eager").eval()
        torch.testing.assert_close(H.forward(other, src, tgt, 0), base, atol=1e-5, rtol=1e-4)
    if arch != "t5":
        torch.manual_seed(0)
        unscaled = H.build(arch, impl, bug="no_scale")
        assert all(a.scaling == 1.0 for a in H._attentions(unscaled))


def test_core_package_does_not_import_transformers():
    code = ("import sys, tndebug, tndebug.cli, tndebug.triage, tndebug.triage.run; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
