"""The metric tags declared once (tndebug/tags.py, issue 20): each family builds, parses and
gives the same regexes the readers used before; the tags the real probes emit on a tiny run are
all declared; the readers (Recorder.series_of, TensorBoard's charts) read through it."""
from __future__ import annotations

import pytest

from tndebug import tags


@pytest.mark.parametrize("fam, parts, tag", [
    (tags.HEAD, dict(kind="enc_self", layer=0, head=1, stat="entropy"), "attn/enc_self/layer0/head1/entropy"),
    (tags.DIVERSITY, dict(kind="cross", layer=3), "attn/cross/layer3/diversity"),
    (tags.DEPTH, dict(stack="decoder", layer=2, stat="resid_rms"), "depth/decoder/layer2/resid_rms"),
    (tags.GRAD, dict(stack="encoder", layer=0), "grad/encoder/layer0/norm"),
    (tags.RELU, dict(stack="encoder", layer=1), "relu/encoder/layer1/dead_fraction"),
    (tags.SCALE, dict(kind="dec_self", layer=1, stat="scale_x_sqrt_dk"), "scale/dec_self/layer1/scale_x_sqrt_dk"),
    (tags.GRAD_OUTSIDE, dict(module="generator.proj"), "grad/generator.proj/norm"),
])
def test_build_and_parse_round_trip(fam, parts, tag):
    assert fam.build(**parts) == tag
    assert fam.parse(tag) == parts
    assert tags.parse(tag) == (fam, parts)


def test_parts_readers_do_not_accept_are_not_parsed():
    assert tags.HEAD.build(kind="enc_self", layer=None, head=0, stat="entropy") == \
        "attn/enc_self/layer?/head0/entropy"
    assert tags.HEAD.parse("attn/enc_self/layer?/head0/entropy") is None     # no layer: no figure
    assert tags.HEAD.parse("attn/other/layer0/head0/entropy") is None       # no such kind
    assert tags.DEPTH.parse("depth/encoder/layer0") is None
    assert tags.parse("loss/ce") is None and "loss/ce" in tags.FIXED
    with pytest.raises(ValueError, match="missing part"):
        tags.HEAD.build(kind="cross", layer=0, stat="entropy")


def test_regexes_are_the_ones_tensorboard_charted_before():
    """The custom-scalar charts' regexes, as reporters/tensorboard.py wrote them by hand."""
    assert tags.HEAD.regex(kind="enc_self", layer=0, stat="entropy") == r"attn/enc_self/layer0/head\d+/entropy"
    assert tags.DIVERSITY.regex(kind="cross") == r"attn/cross/layer\d+/diversity"
    assert tags.DEPTH.regex(stack="encoder", stat="rank") == r"depth/encoder/layer\d+/rank"
    assert tags.GRAD.regex(stack="decoder") == r"grad/decoder/layer\d+/norm"


def test_every_emitted_tag_is_declared(tmp_path):
    """The real probes on a 3-step tiny run: every metric tag is of a declared family, a declared
    single tag, or of a probe whose tags are its own (pe/, label-shift/)."""
    from report_helpers import run_tiny

    from tndebug.probes import make_probes
    from tndebug.reporters.session import ReportSession
    session = ReportSession(tmp_path, tensorboard=False, figures=False, markdown=False, echo=False)
    run_tiny(session, steps=3, probes=make_probes(["head-collapse", "variance-drift", "gradient-flow",
                                                   "missing-scale", "loss-health", "lr-schedule"]))
    seen = set(session.recorder.metrics)
    families = {tags.parse(t)[0].name for t in seen if tags.parse(t)}
    assert {"head", "diversity", "depth", "grad", "scale"} <= families, families
    undeclared = [t for t in seen if tags.parse(t) is None and t not in tags.FIXED]
    assert not undeclared, undeclared
    rec = session.recorder
    entropy = rec.series_of(tags.HEAD, kind="enc_self", stat="entropy")
    assert entropy and all(isinstance(l, int) and isinstance(h, int) for l, h in entropy)
    assert set(entropy) == {(p["layer"], p["head"]) for t in seen if (p := tags.HEAD.parse(t))
                            and p["kind"] == "enc_self" and p["stat"] == "entropy"}


def test_tensorboard_charts_come_from_the_declaration(tmp_path):
    pytest.importorskip("tensorboard")
    from tndebug.reporters.tensorboard import TensorBoardSink
    sink = TensorBoardSink(tmp_path / "tb")
    for tag in ("attn/dec_self/layer1/head0/entropy", "attn/dec_self/layer1/head0/similarity",
                "attn/dec_self/layer1/head0/max_prob", "attn/dec_self/layer1/diversity",
                "depth/decoder/layer1/rank", "grad/decoder/layer1/norm", "grad/total/norm", "loss/ce"):
        sink.on_metric(0, tag, 0.5)
    sink.close()
    assert sink.charts == {
        "Head diversity": {"dec_self layer 1: entropy per head": ["Multiline", [r"attn/dec_self/layer1/head\d+/entropy"]],
                           "dec_self: diversity per layer": ["Multiline", [r"attn/dec_self/layer\d+/diversity"]]},
        "Head similarity": {"dec_self layer 1: similarity per head":
                            ["Multiline", [r"attn/dec_self/layer1/head\d+/similarity"]]},
        "Depth": {"decoder: rank per layer": ["Multiline", [r"depth/decoder/layer\d+/rank"]],
                  "decoder: gradient norm per layer": ["Multiline", [r"grad/decoder/layer\d+/norm"]]}}
