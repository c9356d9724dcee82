"""missing-scale on Hugging Face attention whose q|k|v come out of one fused map in chunks of
unequal width, or whose score operands are 3-D: multi-query Falcon ([h*dk | dk | dk]) and
GPT-BigCode (`c_attn`), Falcon's new decoder architecture ([q_1..q_r k v] per kv group),
grouped-query Phi-3 (`qkv_proj`: [h*dk | g*dk | g*dk]) and BLOOM (per-head [q_h k_h v_h], the
product `alibi.baddbmm` on [B*h, T, dk]). Each healthy model is checked in every attention
module with no finding; the same model with its scale removed is named `missing-scale/absent`.
Below, the matcher itself on hand-made tensors. (Qwen3 normalises q and k per head after the
projection: its "no verdict" is honest and stays; tests/triage/test_hf_decoder_scale.py.)"""
from __future__ import annotations

import math

import pytest
import torch

from tndebug.capture.projections import find_projection, same_map

transformers = pytest.importorskip("transformers")

from tndebug.triage.hf_dir import triage_hf                               # noqa: E402
from tndebug.triage.run import TriageOptions                          # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V, D, H, L = 128, 32, 4, 2
D_K = D // H


def config(arch: str):
    T = transformers
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    dec = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
               num_attention_heads=H, max_position_embeddings=64, **ids)
    return {
        "falcon": lambda: T.FalconConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L,
                                         num_attention_heads=H, **ids),        # multi-query
        "falcon_grouped": lambda: T.FalconConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L,
                                                 num_attention_heads=H, new_decoder_architecture=True,
                                                 num_kv_heads=2, **ids),
        "gpt_bigcode": lambda: T.GPTBigCodeConfig(vocab_size=V, n_embd=D, n_layer=L, n_head=H,
                                                  n_positions=64, multi_query=True, **ids),
        "phi3": lambda: T.Phi3Config(**dec, num_key_value_heads=2),
        "bloom": lambda: T.BloomConfig(vocab_size=V, hidden_size=D, n_layer=L, n_head=H, **ids),
    }[arch]()


CASES = [(a, attn) for a in ("falcon", "falcon_grouped", "gpt_bigcode", "phi3") for attn in ("eager", "sdpa")]
CASES += [("bloom", "eager")]                                  # BLOOM has no SDPA path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_projections")
    out = {}
    for arch in sorted({a for a, _ in CASES}):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config(arch)).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def unscaled(monkeypatch, arch):
    """The scale removed from the loaded model, the way its own code would lose it: the factor
    its attention multiplies the scores by set to 1 (`scaling`, BLOOM's `inv_norm_factor`); or,
    for Falcon, whose RoPE path divides by math.sqrt(head_dim) in the code (eager) or leaves it
    to SDPA, q multiplied by sqrt(d_k) after the rotation, which undoes the one division."""
    if arch.startswith("falcon"):
        import transformers.models.falcon.modeling_falcon as mf
        rotate = mf.apply_rotary_pos_emb

        def rotated_unscaled(q, k, *args, **kwargs):
            q, k = rotate(q, k, *args, **kwargs)
            return q * math.sqrt(q.shape[-1]), k
        monkeypatch.setattr(mf, "apply_rotary_pos_emb", rotated_unscaled)
        return None

    def patch(model, adapter):
        n = 0
        for m in model.modules():
            for attr in ("scaling", "inv_norm_factor"):
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, 1.0)
                    n += 1
        assert n == L, n                                         # one per attention module
    return patch


def scale_findings(report):
    return [f for f in report.findings
            if f.probe == "missing-scale"]


@pytest.mark.parametrize("arch,attn", CASES)
def test_healthy_fused_projection_is_checked_in_every_attention_module(dirs, arch, attn):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn, probes="missing-scale"))
    st = report.probes["missing-scale"]
    assert st["status"] == "pass", st
    assert sorted(st["coverage"]) == sorted(report.run["attention_modules"])
    assert len(st["coverage"]) == L and {c["status"] for c in st["coverage"].values()} == {"checked"}
    assert not scale_findings(report)


@pytest.mark.parametrize("arch,attn", CASES)
def test_unscaled_fused_projection_is_named(dirs, arch, attn, monkeypatch):
    report = triage_hf(TriageOptions(str(dirs[arch]), attn=attn, probes="missing-scale"),
                       patch=unscaled(monkeypatch, arch))
    found = scale_findings(report)
    assert [(f.severity, f.code) for f in found] == [("error", "missing-scale/absent")], found
    f = found[0]
    assert len(f.evidence["modules"]) == L                         # every module, one finding
    assert abs(f.evidence["scale_x_sqrt_dk"] - math.sqrt(D_K)) < 1e-3   # exact: 1 * sqrt(8)
    assert report.probes["missing-scale"]["status"] == "fail"


# -- the matcher on hand-made tensors ------------------------------------------------------
B, T = 3, 5


def fused(widths, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 16, generator=g)
    w = torch.randn(sum(widths) * D_K, 16, generator=g)
    return x, x @ w.T, w                                                       # [B, T, width]


def heads(chunk):
    return chunk.reshape(B, T, -1, D_K).transpose(1, 2)                        # [B, c, T, dk]


@pytest.mark.parametrize("g", (1, 2))
def test_unequal_blocks_are_split_at_the_widths_of_the_operands(g):
    lin = fused((H, g, g))                                        # [q | k | v], g kv heads
    out = lin[1]
    q = 0.5 * heads(out[..., :H * D_K])
    k = heads(out[..., H * D_K:(H + g) * D_K]).repeat_interleave(H // g, dim=1)
    sq, _, q_map, q_at = find_projection(q, [lin])
    sk, _, k_map, k_at = find_projection(k, [lin], q_shape=q.shape)
    assert abs(sq - 0.5) < 1e-6 and abs(sk - 1) < 1e-6
    assert q_at[1:] in (((H, g, g), 0, "blocks", "", "values"), (2, 0, "blocks", "", "values"))
    # g < H kv heads repeated as repeat_kv does: the order is recorded (kv_order)
    assert k_at[1:] == ((H, g, g), 1, "blocks", "interleaved" if 1 < g < H else "", "values")
    assert not same_map(q_map, k_map)
    # k's g heads unrepeated (Falcon's eager product broadcasts them) match too
    k_g = heads(out[..., H * D_K:(H + g) * D_K])                               # [B, g, T, dk]
    assert find_projection(k_g, [lin], q_shape=q.shape)[3][1:3] == ((H, g, g), 1)


def test_the_k_width_is_told_from_the_q_heads():
    """A broadcast multi-query k ([B, 1, T, dk]) tells nothing of the split by itself: a chunk
    of one head fits [q | k | v] only with the 4 query heads the product's q has."""
    lin = fused((H, 1, 1))
    k = heads(lin[1][..., H * D_K:(H + 1) * D_K])                            # [B, 1, T, dk]
    assert find_projection(k, [lin]) is None
    assert find_projection(k, [lin], q_shape=(B, H, T, D_K))[3][1:3] == ((H, 1, 1), 1)


def test_grouped_interleave_and_3d_operands():
    x, out, w = fused((H, 2, 2))                                  # [q_1 q_2 k v] per kv group
    grouped = out.reshape(B, T, 2, H // 2 + 2, D_K)
    q = grouped[:, :, :, :H // 2].reshape(B, T, H, D_K).transpose(1, 2)
    k = grouped[:, :, :, H // 2].transpose(1, 2).repeat_interleave(H // 2, dim=1)
    assert find_projection(k, [(x, out, w)], q_shape=q.shape)[3][1:] == ((2, 1, 1), 1, "heads", "interleaved", "values")
    # the same kv heads tiled (k.repeat(1, r, 1, 1)) are traced too, and say so
    tiled = grouped[:, :, :, H // 2].transpose(1, 2).repeat(1, H // 2, 1, 1)
    assert find_projection(tiled, [(x, out, w)], q_shape=q.shape)[3][1:] == ((2, 1, 1), 1, "heads", "tiled", "values")
    # the same q and k flattened to [B*h, T, dk] (BLOOM's baddbmm operands)
    q3, k3 = -2.0 * q.reshape(B * H, T, D_K), k.reshape(B * H, T, D_K)
    s, _, _, at = find_projection(q3, [(x, out, w)])
    assert abs(s + 2.0) < 1e-6 and at[1:] == ((2, 1, 1), 0, "heads", "", "values")
    assert find_projection(k3, [(x, out, w)], q_shape=q3.shape)[3][1:3] == ((2, 1, 1), 1)


def test_a_chunk_of_another_map_is_not_matched():
    lin = fused((H, 1, 1))
    other = fused((H, 1, 1), seed=1)[1]
    k = heads(other[..., H * D_K:(H + 1) * D_K])
    assert find_projection(k, [lin], q_shape=(B, H, T, D_K)) is None
