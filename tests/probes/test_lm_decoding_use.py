"""lm-decoding's left-pad finding follows the user's use (issue 44, docs/severity.md): an error
where this run's batches or the model's config left-pad, else a warning that says when it would
bite; its evidence is rounded to 3 significant digits."""
from __future__ import annotations

import types

import torch

from tndebug.config import ModelConfig
from tndebug.inject import make_model
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.lm_decoding import LMDecoding
from tndebug.subject import tndebug_subject


def judged(batch=None, padding_side=None):
    torch.manual_seed(0)
    m = make_model(ModelConfig.tiny(arch="decoder", dropout=0.0)
                   .with_faults("positions_ignore_left_pad"))
    if padding_side:
        m.config = types.SimpleNamespace(padding_side=padding_side)
    run = RunContext(subject=tndebug_subject(m))
    p = LMDecoding()
    p.setup(run)
    if batch is not None:
        info = StepInfo(step=0, tgt_in=batch)
        p.update(p.observe(None, info), info)
    p.finish(run)
    (f,) = p.findings
    return p, f


def rows(left: bool) -> torch.Tensor:
    ids = torch.randint(3, 10, (4, 8), generator=torch.Generator().manual_seed(0))
    if left:
        ids[1, :3] = 0                                   # pad id 0 before row 1's tokens
    else:
        ids[1, -3:] = 0                                  # right-padded
    return ids


def test_without_left_padding_it_is_a_warning_that_says_when_it_bites():
    p, f = judged(rows(left=False))
    assert (f.code, f.severity) == ("lm-decoding/left-pad", "warning")
    assert "left-padded for batched generation" in f.message
    assert f.evidence["left_padding_used"] is False and p.status() == "warn"


def test_left_padded_batches_keep_it_an_error():
    _, f = judged(rows(left=True))
    assert (f.code, f.severity) == ("lm-decoding/left-pad", "error")
    assert "1 row(s) of your batches begin with pads" in f.message


def test_a_config_that_pads_left_keeps_it_an_error():
    _, f = judged(padding_side="left")
    assert f.severity == "error" and "padding_side='left'" in f.message


def test_its_evidence_is_rounded():
    _, f = judged()
    for part in ("left_pad", "right_pad"):
        for v in f.evidence[part].values():
            if isinstance(v, float):
                assert v == float(f"{v:.3g}"), (part, v)


def test_a_saved_tokenizer_that_pads_left_keeps_it_an_error(tmp_path):
    # triage of a Hugging Face directory sets subject.padding_side from tokenizer_config.json
    import json
    from tndebug.triage.hf_data import tokenizer_padding_side
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"padding_side": "left"}))
    assert tokenizer_padding_side(tmp_path) == "left"
    assert tokenizer_padding_side(tmp_path / "none") is None
    torch.manual_seed(0)
    m = make_model(ModelConfig.tiny(arch="decoder", dropout=0.0)
                   .with_faults("positions_ignore_left_pad"))
    s = tndebug_subject(m)
    s.padding_side = tokenizer_padding_side(tmp_path)
    run = RunContext(subject=s)
    p = LMDecoding()
    p.setup(run)
    p.finish(run)
    (f,) = p.findings
    assert f.severity == "error" and "padding_side='left'" in f.message
