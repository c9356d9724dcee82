import pytest
import torch

from tndebug.config import ModelConfig
from tndebug.harness import train_with_probes
from tndebug.probes.missing_scale import MissingScale
from tndebug.probes.schedule import at

try:
    from attn_handmade import HandAttention, HandModel, hand_subject, run_probe
except ImportError:  # tests/probes imported as a package
    from tests.probes.attn_handmade import HandAttention, HandModel, hand_subject, run_probe


def found(cfg, steps=2):
    _, findings, _ = train_with_probes(cfg, [MissingScale(at(1))], steps=steps, batch=8)
    return [(f.severity, f.where) for f in findings], findings


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_healthy_model_gives_no_finding(norm):
    assert found(ModelConfig.tiny(norm=norm))[0] == []


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_no_scale_is_fitted_at_one(norm):
    pairs, findings = found(ModelConfig.tiny(norm=norm).with_faults("no_scale"))
    assert pairs == [("error", "encoder.layers.0.self_attn")]      # once, all 6 modules in it
    f = findings[0]
    assert f.message.startswith("encoder.layers.0.self_attn: scale 1.000, expected 1/sqrt(16)=0.250 "
                                "(no 1/sqrt(d_k))")
    assert f.step == 0 and len(f.evidence["modules"]) == 6
    assert f.evidence["mean_max_prob"] > 0.4          # saturated softmax, as evidence


def test_scale_by_d_model_is_named():
    pairs, findings = found(ModelConfig.tiny().with_faults("scale_by_d_model"))
    assert pairs == [("error", "encoder.layers.0.self_attn")]
    f = findings[0]
    assert f.evidence["scale_used"] == {"form": "1/sqrt", "n": 64, "named": "d_model"}
    # the constant used and the one expected, each in the model's numbers
    assert f.message.startswith("encoder.layers.0.self_attn: scale 0.125 = 1/sqrt(64): divided by "
                                "sqrt(d_model), the width of all 4 heads together (64); expected "
                                "1/sqrt(16) = 0.250: 1/sqrt(d_k), one head's width = 64 / 4 heads = 16")


def test_per_head_modules_scaled_by_the_embedding_width_name_that_width(tmp_path):
    """The lecture's per-head modules written `* C ** -0.5` (C = n_embd): the message read
    "expected 1/sqrt(8)" then "(1/sqrt(d_model))"; it names C, the split and head_size."""
    import tndebug
    from tndebug.capture.adapters import import_file
    from pathlib import Path
    style = Path(__file__).resolve().parents[1] / "foreign" / "styles" / "head_modules.py"
    old = "wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5"
    text = style.read_text()
    assert text.count(old) == 1
    (tmp_path / "heads_by_width.py").write_text(text.replace(old, "wei = q @ k.transpose(-2, -1) * C ** -0.5"))
    mod = import_file(tmp_path / "heads_by_width.py")
    torch.manual_seed(0)
    report = tndebug.check(mod.build(), mod.forward, probes="missing-scale", arch="decoder", pad_id=None)
    (f,) = [f for f in report.findings if f.probe == "missing-scale"]
    assert f.code == "missing-scale/by-d-model" and f.severity == "error"
    assert f.evidence["scale_used"] == {"form": "1/sqrt", "n": 32, "split": True,
                                        "named": "the embedding width, split across per-head modules"}
    assert f.message.startswith("blocks.0.sa: scale 0.177 = 1/sqrt(32): each of its 4 per-head modules "
                                "divides by sqrt of the embedding width, C = n_embd = 32; expected "
                                "1/sqrt(8) = 0.354: 1/sqrt(head_size), each module's own width = "
                                "32 / 4 heads = 8"), f.message
    assert "(1/sqrt(d_model))" not in f.message
    assert "math.sqrt(head_size)" in f.fix


@pytest.mark.parametrize("divide, used, text", [
    (lambda d_k: d_k, {"form": "1/n", "n": 8, "named": "d_k"},
     "scale 0.125 = 1/8: divided by d_k itself (8), not by its square root; expected 1/sqrt(8) = 0.354"),
    (lambda d_k: 2.0, {"form": "1/sqrt", "n": 4.0, "named": "another constant"},
     "scale 0.500 = 1/sqrt(4): divided by sqrt(4), none of this attention's widths (d_k 8, d_model 32); "
     "expected 1/sqrt(8) = 0.354"),
], ids=["by-d_k", "other"])
def test_other_wrong_constants_name_the_constant_used(divide, used, text):
    class Divided(HandAttention):
        def score(self, q, k):
            return q @ k.transpose(-2, -1) / divide(self.d_k)

    (f,) = run_probe(hand_subject(HandModel(attn_cls=Divided)), MissingScale(at(1)))
    assert f.code == "missing-scale/wrong-constant" and f.evidence["scale_used"] == used
    assert text in f.message, f.message


# -- the same bug written by hand --------------------------------------------------------------
class NoScale(HandAttention):
    def score(self, q, k):
        return q @ k.transpose(-2, -1)          # the bug: no / math.sqrt(d_k)


def test_handmade_healthy_model_gives_no_finding():
    assert run_probe(hand_subject(HandModel()), MissingScale(at(1))) == []


@pytest.mark.parametrize("fields", [HandAttention.TAPS, ("q", "k", "probs", "out")],
                         ids=["scores", "probs-only"])
def test_handmade_no_scale_gives_the_same_finding(fields):
    findings = run_probe(hand_subject(HandModel(attn_cls=NoScale), fields=fields), MissingScale(at(1)))
    assert [(f.severity, f.where) for f in findings] == [("error", "enc.0.self_attn")]
    assert "scale 1.000, expected 1/sqrt(8)=0.354 (no 1/sqrt(d_k))" in findings[0].message
    assert findings[0].evidence["fit"] == ("scores" if "scores" in fields else "log-probs")


def test_head_averaged_probs_without_scores_are_skipped_not_judged():
    probe = MissingScale(at(1))
    assert run_probe(hand_subject(HandModel(attn_cls=NoScale), fields=("q", "k", "probs"),
                                  head_average=True), probe, steps=0) == []
    assert probe.status() == "no verdict"
    assert probe.coverage["enc.0.self_attn"]["status"] == "no verdict"


def test_scale_lost_during_training_is_caught_on_schedule():
    class Tempered(HandAttention):
        temperature = 1.0

        def score(self, q, k):
            return super().score(q, k) * self.temperature

    model = HandModel(attn_cls=Tempered)

    def drop_scale(step):
        if step == 1:
            for m in model.modules():
                if isinstance(m, Tempered):
                    m.temperature = m.d_k ** 0.5

    findings = run_probe(hand_subject(model), MissingScale(at(1)), steps=2, before_step=drop_scale)
    assert [(f.where, f.step) for f in findings] == [("enc.0.self_attn", 1)]
    assert "(no 1/sqrt(d_k))" in findings[0].message


def test_sixteen_bit_tolerance_is_wider():
    class SlightlyOff(HandAttention):
        def score(self, q, k):
            return super().score(q, k) * 1.005        # 0.5% off: an error in fp32, noise in fp16

    subject = hand_subject(HandModel(attn_cls=SlightlyOff))
    assert len(run_probe(subject, MissingScale(at(1)), steps=0)) == 1
    assert run_probe(subject, MissingScale(at(1)), steps=0, compute_dtype=torch.float16) == []


def test_fix_on_the_users_line_drops_a_one_space_comment():
    # karpathy's ng-video-lecture writes `wei = q @ k.transpose(-2,-1) # (B, T, hs) @ ...`: the
    # comment, after one space, was put inside the suggested parentheses (code that does not run)
    from tndebug.probes.missing_scale import your_line
    src = {"file": "gpt.py", "line": 83,
           "code": "wei = q @ k.transpose(-2,-1) # (B, T, hs) @ (B, hs, T) -> (B, T, T)"}
    fix = your_line(src, 16)
    assert "`wei = (q @ k.transpose(-2,-1)) / 4`" in fix
    compile(fix.split("`")[1], "fix", "exec")                       # the suggestion is Python
    keep = {"file": "gpt.py", "line": 9, "code": "att = einsum('bhid,bhjd->bhij', q, k)  # '#'"}
    assert "`att = (einsum('bhid,bhjd->bhij', q, k)) / 4`" in your_line(keep, 16)


# -- rotary whose cos/sin tables pair other features than its rotate function ------------------
_ROPE_EDITS = {      # (the corpus's mismatched-pairs bug, the scale removed as well)
    "rope_half": (("emb = torch.cat((freqs, freqs), dim=-1)", "emb = freqs.repeat_interleave(2, dim=-1)"),
                  ("is_causal=True)", "is_causal=True, scale=1.0)")),
    "rope_interleaved": (("t[None, :, None, :].repeat_interleave(2, dim=3)", "t[None, :, None, :].repeat(1, 1, 1, 2)"),
                         ("attn_weights = attn_weights / self.scale_attn", "")),
}


@pytest.mark.parametrize("style", sorted(_ROPE_EDITS))
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_mismatched_rotary_pairs_still_get_a_scale_verdict(tmp_path, style, scaled):
    """Such a "rotation" changes the vectors' norms, so q and k were matched neither by values
    nor by norms: no verdict, at init and after training. Every rotary map is the identity at
    position 0, where q and k match the projections by values (`_position0_projection`)."""
    import tndebug
    from pathlib import Path
    import torch.nn.functional as F
    from tndebug.capture.adapters import import_file
    text = (Path(__file__).resolve().parents[1] / "foreign" / "styles" / f"{style}.py").read_text()
    for old, new in _ROPE_EDITS[style][:1 if scaled else 2]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp_path / f"{style}_mismatched.py").write_text(text)
    mod = import_file(tmp_path / f"{style}_mismatched.py")
    torch.manual_seed(0)
    model = mod.build()
    for when in ("init", "trained"):
        if when == "trained":
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            g = torch.Generator().manual_seed(0)
            for _ in range(30):
                ids = torch.randint(0, 96, (8, 17), generator=g)
                loss = F.cross_entropy(mod.forward(model, ids[:, :-1], None).flatten(0, 1), ids[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
        report = tndebug.check(model, mod.forward, probes="missing-scale", arch="decoder", pad_id=None)
        cover = report.probes["missing-scale"]["coverage"]
        assert {c["status"] for c in cover.values()} == {"checked"}, (when, cover)
        found = [f for f in report.findings if f.probe == "missing-scale"]
        if scaled:
            assert found == [], (when, found)
        else:
            (f,) = found
            assert f.code == "missing-scale/absent" and f.severity == "error", (when, f)
            assert f.evidence["qk_traced_by"] == "position0", f.evidence
