"""Design judged at initialisation, dtypes of the saved weights (issue 19), on Hugging Face
directories: a T5 trained until rms(q)/rms(k) leaves the band around 1/sqrt(d_k) is by design
(its initialisation folds the scale: judged on from_config), a BART without the scale stays an
error; a healthy BART saved in fp16 / bf16 is clean and says which dtype decided what."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tndebug.probes.missing_scale import FOLD_BAND                    # noqa: E402
from conftest import clean_but_for_data  # noqa: E402
from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

from test_hf import config, describe, flagged, patch_for              # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D_KV = 64          # a wide head: q starts 1/8 of k, so 30 AdamW steps of 1e-3 move it out of the band


def _trained_t5(folder: Path, steps: int = 30, model=None) -> Path:
    """A small T5 (d_model 64, 2 heads of 64; or `model`) trained `steps` AdamW steps at lr 1e-3
    on copying."""
    torch.manual_seed(0)
    if model is None:
        cfg = transformers.T5Config(vocab_size=96, d_model=64, d_kv=D_KV, d_ff=64, num_layers=2,
                                    num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                    relative_attention_num_buckets=8,
                                    relative_attention_max_distance=16, feed_forward_proj="relu",
                                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        src = torch.randint(2, 96, (32, 8), generator=g)
        loss = model(input_ids=src, labels=torch.cat([src, torch.full((32, 1), 1)], 1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder


T5_FAMILY = {     # the T5 family's other members: the fix above was made on T5 alone
    "mt5": lambda kw: transformers.MT5Config(**kw),
    "umt5": lambda kw: transformers.UMT5Config(**kw),        # a relative bias in every layer
    "longt5-local": lambda kw: transformers.LongT5Config(encoder_attention_type="local",
                                                         local_radius=4, **kw),
    "longt5-tglobal": lambda kw: transformers.LongT5Config(
        encoder_attention_type="transient-global", local_radius=4, global_block_size=4, **kw),
}


@pytest.mark.parametrize("name", sorted(T5_FAMILY))
def test_trained_t5_family_is_clean(name, tmp_path):
    """Issue 19 measured a missing-scale error on every trained T5-family model (MT5, UMT5,
    LongT5 local and transient-global among them); trained 30 AdamW steps here, each is clean,
    its scale judged by design (on the checkpoint, or at a fresh init where training moved it)."""
    torch.manual_seed(0)
    cfg = T5_FAMILY[name](dict(
        vocab_size=96, d_model=64, d_kv=D_KV, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, feed_forward_proj="relu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0))
    folder = _trained_t5(tmp_path / name, model=transformers.AutoModelForSeq2SeqLM.from_config(cfg))
    report = triage_hf(TriageOptions(str(folder)))
    # no data given: clean but for the temperature sweep (and MT5/UMT5's untied-head test)
    assert not flagged(report) and clean_but_for_data(report), (describe(report.findings),
                                                                 report.incomplete())
    assert report.probes["missing-scale"]["status"] == "pass"
    scale = [f for f in report.findings if f.probe == "missing-scale" and "modules" in f.evidence]
    assert scale and all("by design" in f.message for f in scale), describe(scale)


def test_trained_t5_is_by_design_judged_at_init(tmp_path):
    folder = _trained_t5(tmp_path / "t5")
    report = triage_hf(TriageOptions(str(folder), probes="missing-scale"))
    scale = [f for f in report.findings if f.probe == "missing-scale" and "modules" in f.evidence]
    assert scale and all(f.severity == "info" for f in scale), describe(report.findings)
    assert not flagged(report), describe(report.findings)
    at_init = [f for f in scale if f.evidence["judged_on"] == "fresh init"]
    assert at_init, "no module left the band: train longer\n" + describe(scale)
    band = (1 / math.sqrt(D_KV) / FOLD_BAND, 1 / math.sqrt(D_KV) * FOLD_BAND)
    for f in at_init:      # the checkpoint alone would be an error: out of band there, in it at init
        assert "by design (the initialisation folds the scale into W_Q" in f.message
        for site, r in f.evidence["checkpoint_qk_rms_ratio"].items():
            assert not band[0] <= r <= band[1], (site, r, band)
            assert band[0] <= f.evidence["init_qk_rms_ratio"][site] <= band[1]
    assert all(f.evidence["judged_on"] == "checkpoint" for f in scale if f not in at_init)
    assert report.probes["missing-scale"]["status"] == "pass"
    assert report.probes["missing-scale"]["fresh_init"]["folded_at_init"]


def test_unscaled_bart_stays_an_error_at_init(tmp_path):
    """BART's code without the scale (the patch reaches the fresh model too): no fold at init."""
    torch.manual_seed(0)
    folder = tmp_path / "bart"
    transformers.AutoModelForSeq2SeqLM.from_config(config("bart")).save_pretrained(folder)
    report = triage_hf(TriageOptions(str(folder), probes="missing-scale"), patch=patch_for("no_scale"))
    errors = [f for f in report.findings if f.probe == "missing-scale" and f.severity == "error"]
    assert errors and all(f.evidence["judged_on"] == "checkpoint" for f in errors), describe(report.findings)
    assert report.probes["missing-scale"]["fresh_init"]["unscaled_at_init"]
    assert report.probes["missing-scale"]["status"] == "fail"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_healthy_16bit_bart_is_clean(tmp_path, dtype):
    """model.half().save_pretrained: the model computes in float32 on the file's values (an
    exact upcast), fp32 tolerances; compute_dtype is the saved dtype (it decides fp16 hazards)."""
    torch.manual_seed(0)
    folder = tmp_path / dtype
    model = transformers.AutoModelForSeq2SeqLM.from_config(config("bart"))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    report = triage_hf(TriageOptions(str(folder)))
    assert not flagged(report), describe(report.findings)
    assert report.run["compute_dtype"] == dtype and report.run["weight_dtypes"] == [dtype]
    assert report.run["arithmetic"].startswith(f"float32 ({dtype} weights upcast exactly")


def test_nan_weights_do_not_hide_a_missing_causal_mask(tmp_path):
    """NaN weights in the file: the code's exact tests also run on from_config (issue 19)."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    folder = tmp_path / "bart_nan"
    transformers.AutoModelForSeq2SeqLM.from_config(config("bart")).save_pretrained(folder)
    sd = load_file(str(folder / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) if v.dim() == 2 else v for k, v in sd.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    report = triage_hf(TriageOptions(str(folder)), patch=patch_for("no_causal"))
    mask = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "error"]
    assert mask and all(f.evidence["judged_on"] == "fresh init" for f in mask), describe(report.findings)
    assert report.probes["mask-broadcast"]["status"] == "fail"
    healthy = triage_hf(TriageOptions(str(folder)))
    assert not [f for f in healthy.findings if f.evidence.get("judged_on") == "fresh init"
                and f.severity in ("warning", "error")], describe(healthy.findings)
