"""missing-scale on Hugging Face decoder-only models: q and k reach the score product rotated
(RoPE: Llama, Qwen2, Mistral, GPT-NeoX) or from a fused Conv1D computed with torch.addmm
(GPT-2), and are still traced to their projections, so every attention module is checked; a
scale removed from the loaded model (`scaling = 1.0`) is named. Below, the matcher itself:
rotations are traced by per-vector norms with the fold exact, norm-changing maps are not."""
from __future__ import annotations

import math

import pytest
import torch

from tndebug.capture.projections import find_projection

transformers = pytest.importorskip("transformers")

from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

try:
    from test_hf_decoder import ARCHS, ATTN, L, config
except ImportError:  # tests/triage imported as a package
    from tests.triage.test_hf_decoder import ARCHS, ATTN, L, config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROPE = ("llama", "qwen2", "mistral", "gpt_neox")
D_K = 16                                                          # 64 wide, 4 heads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_decoder_scale")
    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config(arch)).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def scaled(value):
    """Every attention's `scaling` (what HF attention modules multiply the scores by) set to
    value(module): the bug written into the loaded model."""
    def patch(model, adapter):
        for m in model.modules():
            if isinstance(getattr(m, "scaling", None), float):
                m.scaling = value(m)
    return patch


def scale_findings(report):
    return [f for f in report.findings
            if f.probe == "missing-scale"]


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_healthy_scale_is_checked_in_every_attention_module(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn, probes="missing-scale"))
    st = report.probes["missing-scale"]
    assert st["status"] == "pass", st
    assert sorted(st["coverage"]) == sorted(report.run["attention_modules"])
    assert len(st["coverage"]) == L and {c["status"] for c in st["coverage"].values()} == {"checked"}
    assert not scale_findings(report)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("arch", ARCHS)
def test_unscaled_attention_is_named(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn, probes="missing-scale"),
                       patch=scaled(lambda m: 1.0))
    found = scale_findings(report)
    assert [(f.severity, f.code) for f in found] == [("error", "missing-scale/absent")], found
    f = found[0]
    assert f.where in report.run["attention_modules"]
    assert len(f.evidence["modules"]) == L                         # every module, one finding
    assert abs(f.evidence["scale_x_sqrt_dk"] - math.sqrt(D_K)) < 1e-3   # exact: 1 * sqrt(16)
    assert f.evidence["qk_traced_by"] == ("norms" if arch in ROPE else "values")
    assert report.probes["missing-scale"]["status"] == "fail"


@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_scale_by_d_model_is_named(dirs, arch):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn="eager", probes="missing-scale"),
                       patch=scaled(lambda m: 64 ** -0.5))
    found = scale_findings(report)
    assert [(f.severity, f.code) for f in found] == [("error", "missing-scale/by-d-model")], found
    assert abs(found[0].evidence["scale_x_sqrt_dk"] - 0.5) < 1e-3


def test_gpt2_conv1d_ffn_is_found_by_gradient_flow(dirs):
    report = triage_hf(TriageOptions(str(dirs["gpt2"]), probes="gradient-flow"))
    cov = report.probes["gradient-flow"]["coverage"]
    assert all(cov.get(f"transformer.h.{i}.mlp", {}).get("status") == "checked" for i in range(L)), cov


# -- the matcher -----------------------------------------------------------------------------------
B, H, T = 3, 4, 10


def rope(x, partial=1.0):
    """Rotate pairs (i, i + r/2) of the first r = partial * d_k dimensions by a position angle.
    # [B, h, T, d_k]"""
    r = int(x.shape[-1] * partial)
    t = torch.arange(x.shape[-2], dtype=torch.float32)[:, None]
    ang = t * 10000 ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)       # [T, r/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [T, r]
    xr, xp = x[..., :r], x[..., r:]
    half = torch.cat([-xr[..., r // 2:], xr[..., :r // 2]], -1)
    return torch.cat([xr * cos + half * sin, xp], -1)


def heads(chunk, h=H):
    return chunk.reshape(B, T, h, -1).transpose(1, 2)                         # [B, h, T, d_k]


def projection(width, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 32, generator=g)
    w = torch.randn(width, 32, generator=g)
    return x, x @ w.T, w                                                       # [B, T, width]


@pytest.mark.parametrize("partial", (1.0, 0.25))
def test_a_rotated_operand_is_traced_by_norms_with_its_fold_exact(partial):
    lin = projection(H * D_K)
    q = rope(0.25 * heads(lin[1]), partial)                # a scale folded in before the rotation
    s, inp, _, where = find_projection(q, [lin])
    assert where[-1] == "norms" and inp is lin[0]
    assert abs(s - 0.25) < 1e-6


def test_a_plain_head_split_still_matches_by_values_with_its_sign():
    lin = projection(H * D_K)
    s, _, _, where = find_projection(-0.5 * heads(lin[1]), [lin])
    assert where[-1] == "values" and abs(s + 0.5) < 1e-6


def test_grouped_query_fused_per_head_and_addmm_outputs_are_traced():
    kv = projection(2 * D_K)                                      # 2 key heads for 4 query heads
    k = rope(heads(kv[1], 2)).repeat_interleave(2, dim=1)
    assert find_projection(k, [kv])[3][-1] == "norms"
    x, out, w = projection(3 * H * D_K)                           # [q_h k_h v_h] per head (NeoX)
    k = rope(out.reshape(B, T, H, 3 * D_K)[..., D_K:2 * D_K].transpose(1, 2))
    assert find_projection(k, [(x, out, w)])[3][1:4] == (3, 1, "heads")
    flat = (x.reshape(B * T, -1), out.reshape(B * T, -1), w)      # Conv1D: [B*T, width]
    q = heads(out.reshape(B, T, 3, H * D_K)[:, :, 0])
    assert find_projection(q, [flat])[3][1:] == (3, 0, "blocks", "", "values")


def test_norm_changing_maps_are_not_traced():
    lin = projection(H * D_K)
    q = heads(lin[1])
    qk_norm = q / q.pow(2).mean(-1, keepdim=True).sqrt()                  # per-head RMS norm
    log_n = q * (1 + 0.1 * torch.arange(T, dtype=torch.float32))[:, None]  # a position factor
    other = rope(heads(projection(H * D_K, seed=1)[1]))
    for operand in (qk_norm, log_n, other):
        assert find_projection(rope(operand), [lin]) is None


def test_norms_that_do_not_vary_prove_nothing():
    """A projection whose head vectors all have one norm: any rotation, or any other tensor of
    unit vectors, would fit; no match rather than a guess."""
    x, out, w = projection(H * D_K)
    unit = heads(out) / heads(out).norm(dim=-1, keepdim=True)
    lin = (x, unit.transpose(1, 2).reshape(B, T, -1), w)
    assert find_projection(rope(unit), [lin]) is None


@pytest.mark.parametrize("bug", (False, True))
def test_gpt2_reordered_baddbmm_path_is_fitted_with_its_alpha(tmp_path, bug):
    """`reorder_and_upcast_attn`: the scores are torch.baddbmm(empty, q, k, beta=0,
    alpha=scaling); the alpha is the scale, the empty input is no mask."""
    cfg = config("gpt2")
    cfg.reorder_and_upcast_attn = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gpt2")
    report = triage_hf(TriageOptions(str(tmp_path / "gpt2"), attn="eager", probes="missing-scale"),
                       patch=scaled(lambda m: 1.0) if bug else None)
    st = report.probes["missing-scale"]
    assert {c["status"] for c in st["coverage"].values()} == {"checked"}, st
    found = [(f.severity, f.code) for f in scale_findings(report)]
    assert found == ([("error", "missing-scale/absent")] if bug else []), found
