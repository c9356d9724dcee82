"""Code judged apart from weights (issue 19): with --model, a checkpoint whose weights are NaN
still gets its code's exact tests (nan-scores, missing-scale, mask-broadcast), run on the
user's factory called again (seeded, no weights loaded); findings say which they came from."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import TINY, zoo, zoo_spec
from tndebug.triage.run import TriageOptions, triage


def _ckpt(tmp_path, nan: bool, **bugs):
    """An annotated-style model saved with its config; `nan`: every weight matrix NaN (as a
    -inf mask fill makes a checkpoint from step 0)."""
    torch.manual_seed(0)
    sd = zoo("annotated").make_model(11, 11, **TINY, **bugs).state_dict()
    if nan:
        sd = {k: torch.full_like(v, float("nan")) if v.is_floating_point() and v.dim() == 2 else v
              for k, v in sd.items()}
    path = tmp_path / "model.pt"
    torch.save({"model": sd, "config": {"src_vocab": 11, "tgt_vocab": 11, **TINY, **bugs}}, path)
    return path


def _triage(path, **kw):
    return triage(TriageOptions(str(path), model=zoo_spec("annotated", "make_model"), **kw))


def test_missing_causal_mask_named_on_fresh_init_when_weights_are_nan(tmp_path):
    report = _triage(_ckpt(tmp_path, True, causal=False))
    assert any(f.probe == "checkpoint" and f.severity == "error" for f in report.findings)  # NaN named
    mask = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "error"]
    assert mask, [(f.probe, f.severity, f.message) for f in report.findings]
    assert all(f.evidence["judged_on"] == "fresh init" for f in mask)
    assert any("future" in f.message or "causal" in f.message.lower() for f in mask), mask[0].message
    assert report.probes["mask-broadcast"]["status"] == "fail"
    assert report.probes["mask-broadcast"]["fresh_init"]["status"] == "fail"


def test_healthy_code_with_nan_weights_gets_no_code_finding(tmp_path):
    report = _triage(_ckpt(tmp_path, True))
    fresh = [f for f in report.findings if f.evidence.get("judged_on") == "fresh init"
             and f.severity in ("warning", "error")]
    assert not fresh, [(f.probe, f.message) for f in fresh]
    assert report.probes["mask-broadcast"]["fresh_init"]["status"] == "pass"


def test_finite_weights_are_judged_on_the_checkpoint_alone(tmp_path):
    report = _triage(_ckpt(tmp_path, False, causal=False))
    mask = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "error"]
    assert mask and all("judged_on" not in f.evidence for f in mask)
    assert "fresh_init" not in report.probes["mask-broadcast"]


def _moved(tmp_path, fold: bool, grow: float):
    """The T5-style user model with W_Q grown `grow`x, as training moves it out of the init band."""
    from t5style_user import annotated, make_model
    torch.manual_seed(0)
    model = make_model(fold=fold)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, annotated.MultiHeadedAttention):
                m.linears[0].weight *= grow
                m.linears[0].bias *= grow
    path = tmp_path / "t5style.pt"
    torch.save({"model": model.state_dict(), "config": {"fold": fold}}, path)
    return path


def test_user_code_folding_the_scale_at_init_is_by_design(tmp_path):
    spec = f"{Path(__file__).parent / 't5style_user.py'}:make_model"
    report = triage(TriageOptions(str(_moved(tmp_path, True, 3.0)), model=spec, probes="missing-scale"))
    scale = [f for f in report.findings if f.probe == "missing-scale" and "modules" in f.evidence]
    assert scale and all(f.severity == "info" for f in scale), [(f.severity, f.message) for f in scale]
    assert any(f.evidence["judged_on"] == "fresh init" for f in scale)
    report = triage(TriageOptions(str(_moved(tmp_path, False, 1.0)), model=spec, probes="missing-scale"))
    errors = [f for f in report.findings if f.probe == "missing-scale" and f.severity == "error"]
    assert errors and all(f.evidence["judged_on"] == "checkpoint" for f in errors)


def test_nan_weights_get_one_file_finding_and_no_statistics_through_them(tmp_path):
    """Issue 19: a checkpoint NaN from step 0 got a non-finite-gradient error with the fix 'keep
    residual + LayerNorm and Xavier init' (and dead-unit warnings with an init fix), and one
    error per tensor. Statistics measured through NaN weights say only that the weights are
    NaN: withdrawn, the probe 'no verdict' with the reason; the file gets one error."""
    report = _triage(_ckpt(tmp_path, True))
    (nan,) = [f for f in report.findings if f.code == "checkpoint/nonfinite-weights"]
    assert "more tensors" in nan.message and len(nan.evidence["tensors"]) > 1
    stats = [f for f in report.findings if f.probe in ("gradient-flow", "variance-drift", "nan-scores",
                                                        "head-collapse", "ln-placement")
             and f.severity != "info"]
    assert not stats, [(f.probe, f.message) for f in stats]
    st = report.probes["gradient-flow"]
    assert st["status"] == "no verdict" and "non-finite" in st["reason"], st
    assert report.verdict == "errors"
