"""Findings on a user's model point at the line in the user's file where the evidence was made
(issue 48): the score product for missing-scale, the mask or the softmax for mask-broadcast,
the SDPA call for both; report.json carries it, the console and report.md show it."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

import tndebug
from tndebug.findings import Finding
from tndebug.report import Report

from nanogpt_text import load, model_file


def check(tmp_path, attention, probes):
    path, lines = model_file(tmp_path, attention)
    report = tndebug.check(load(path).build(), arch="decoder", pad_id=None, probes=probes)
    return report, path, lines


def errors(report, code):
    return [f for f in report.findings if f.code == code]


def test_missing_scale_points_at_the_score_line(tmp_path):
    report, path, lines = check(tmp_path, "no_scale", "missing-scale")
    (f,) = errors(report, "missing-scale/absent")
    assert f.source["file"] == str(path)
    assert f.source["line"] == lines["scores"]
    assert f.source["function"] == "CausalSelfAttention.forward"
    assert f.source["code"].startswith("att = (q @ k.transpose(-2, -1))")
    assert "d_k = 64 / 4 heads = 16, so divide by 4" in f.fix      # the user's numbers
    assert f.fix.endswith(f"In your code (model.py:{lines['scores']}): "
                          f"`att = (q @ k.transpose(-2, -1)) / 4`  # sqrt(d_k), d_k = 16.") \
        or f"({path}:{lines['scores']}): `att = (q @ k.transpose(-2, -1)) / 4`" in f.fix


def test_sdpa_call_is_the_line(tmp_path):
    report, path, lines = check(tmp_path, "sdpa_no_scale", "missing-scale")
    (f,) = errors(report, "missing-scale/absent")
    assert (f.source["file"], f.source["line"]) == (str(path), lines["sdpa"])
    assert "drop the scale= argument of `y = F.scaled_dot_product_attention(" in f.fix


@pytest.mark.parametrize("attention, code, marker", [
    ("no_mask", "mask-broadcast/causal-leak", "softmax"),        # where the mask should go
    ("mask_transposed", "mask-broadcast/causal-transposed", "mask"),
])
def test_mask_findings_point_at_the_mask_or_softmax(tmp_path, attention, code, marker):
    report, path, lines = check(tmp_path, attention, "mask-broadcast")
    found = [f for f in report.findings if f.severity == "error"]
    assert [f.code for f in found] == [code]
    assert (found[0].source["file"], found[0].source["line"]) == (str(path), lines[marker])


def test_healthy_model_has_no_error_and_old_findings_load(tmp_path):
    report, _, _ = check(tmp_path, "healthy", "missing-scale,mask-broadcast")
    assert not [f for f in report.findings if f.severity == "error"]
    old = Finding("missing-scale", "error", "m", code="missing-scale/absent").to_dict()
    assert "source" not in old and Finding.from_dict(old).source is None


def test_source_in_json_console_and_markdown(tmp_path):
    report, path, lines = check(tmp_path, "no_scale", "missing-scale")
    back = Report.from_dict(report.to_dict()) if hasattr(Report, "from_dict") else None
    (d,) = [f for f in report.to_dict()["findings"] if f["code"] == "missing-scale/absent"]
    assert {k: d["source"][k] for k in ("file", "line", "function")} == \
        {"file": str(path), "line": lines["scores"], "function": "CausalSelfAttention.forward"}
    if back is not None:
        assert errors(back, "missing-scale/absent")[0].source == d["source"]
    from tndebug.reporters.console import summary
    out = io.StringIO()
    Console(file=out, width=120, no_color=True).print(summary(report, width=120))
    text = "".join(out.getvalue().replace("│", "").split())      # folded cells joined
    assert "".join((f"source: {path}:{lines['scores']} (CausalSelfAttention.forward): "
                    f"att = (q @ k.transpose(-2, -1))").split()) in text
    from tndebug.reporters.markdown import render
    md = render(report)
    assert f"**Source:** `{path}:{lines['scores']} (CausalSelfAttention.forward)`" in md
    assert f">{lines['scores']:5d}          att = (q @ k.transpose(-2, -1))" in md


def test_no_op_line_names_the_forward_def_and_packages_are_marked(tmp_path):
    from tndebug.capture.source import file_kind, forward_def, pick, source_text
    path, _ = model_file(tmp_path, "healthy")
    module = load(path).CausalSelfAttention(64, 4, 8)
    loc = forward_def(module)
    def_line = path.read_text().splitlines().index("    def forward(self, x):") + 1
    assert (loc["file"], loc["line"], loc["function"]) == (str(path), def_line,
                                                          "CausalSelfAttention.forward")
    assert pick({"forward": loc}, "scores", "sdpa") is loc           # the fallback
    assert "its forward; no line of the op was found" in source_text(loc)
    site = "/usr/lib/python3/site-packages"
    assert file_kind(f"{site}/transformers/models/gpt2/modeling_gpt2.py") == "transformers"
    assert file_kind(f"{site}/x_transformers/x_transformers.py") is None    # another package: skipped
    assert file_kind(torch_file()) is None
    assert file_kind(str(path)) == "user"


def torch_file() -> str:
    import torch.nn.functional as F
    return F.__file__


def test_tndebug_own_model_gets_no_line_of_the_calling_script():
    """The walk stops where tndebug called the model: a model in no user file (tndebug's own)
    gets no source, never the line of this test that called check."""
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model
    model = make_model(ModelConfig.tiny().with_faults("no_scale"))
    report = tndebug.check(model, probes="missing-scale")
    found = errors(report, "missing-scale/absent")
    assert found and all(f.source is None for f in found)


def test_assert_clean_shows_the_line(tmp_path):
    from tndebug.library.check import CheckResult
    report, path, lines = check(tmp_path, "no_scale", "missing-scale")
    with pytest.raises(AssertionError) as e:
        CheckResult(report).assert_clean("error")
    assert f"source: {path}:{lines['scores']} (CausalSelfAttention.forward): att = (q @" in str(e.value)


def test_a_package_file_is_shown_from_its_package_folder():
    # an HF finding read `/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/transformers/
    # models/qwen2/modeling_qwen2.py:187`, wrapped over three rows at 80 columns
    from tndebug.capture.source import shown_path, source_text
    file = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/transformers/models/qwen2/modeling_qwen2.py"
    assert shown_path(file) == "transformers/models/qwen2/modeling_qwen2.py"
    text = source_text({"file": file, "line": 187, "function": "Qwen2Attention.forward",
                        "package": "transformers", "code": "attn_output = attn(q, k, v)"})
    assert text.startswith("transformers/models/qwen2/modeling_qwen2.py:187 (Qwen2Attention.forward) "
                           "[package: transformers]")
