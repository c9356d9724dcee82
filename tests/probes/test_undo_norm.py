"""A block output that is a normalisation module's output is checked by undoing the module's
own affine (probes/_depth_stats.undoes_to_normalised), where the stream's statistics alone
cannot tell: a rank-deficient stream (trained Post-LN Marian had two near-null directions, so
ln-placement said "placement unknown" on 6 of 10 healthy foreign-corpus runs)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tndebug.capture.generic import GenericCapture
from tndebug.capture.trace import Trace
from tndebug.probes._depth_stats import undoes_to_normalised

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "foreign"))


def _affine_ln(d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.copy_(0.5 + torch.rand(d, generator=g))
        ln.bias.copy_(torch.randn(d, generator=g))
    return ln, g


def test_undoing_the_norm_tells_a_norm_output_from_its_input():
    ln, g = _affine_ln()
    x = torch.randn(4, 10, 16, generator=g) * torch.rand(4, 10, 1, generator=g) * 3
    keep = torch.ones(4, 10, dtype=torch.bool)
    norm = (ln.weight, ln.bias)
    assert undoes_to_normalised(ln(x), keep, norm) is True
    assert undoes_to_normalised(x, keep, norm) is None          # not its output: no verdict, never False
    rms = nn.RMSNorm(16)
    with torch.no_grad():
        rms.weight.copy_(0.5 + torch.rand(16, generator=g))
    assert undoes_to_normalised(rms(x), keep, (rms.weight, None)) is True
    zero = ln.weight.detach().clone()
    zero[0] = 0
    assert undoes_to_normalised(ln(x), keep, (zero, ln.bias)) is None


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_capture_marks_the_stream_points_a_norm_module_produced(norm_first):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 16)
            self.encoder = nn.ModuleDict({"layers": nn.ModuleList(
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                           norm_first=norm_first) for _ in range(2))})

        def forward(self, src):
            x = self.emb(src)
            for layer in self.encoder["layers"]:
                x = layer(x)
            return x

    model = Model().eval()
    src = torch.randint(1, 12, (3, 7))
    with torch.no_grad(), GenericCapture(model).recording(("stream",), Trace(src=src)) as trace:
        model(src)
    points = [sp for sp in trace.streams if sp.kind == "layer"]
    assert len(points) == 2
    if norm_first:                          # Pre-LN: the block output is a sum, no norm's
        assert all(sp.norm is None for sp in points)
    else:                                   # Post-LN: norm2's output, with norm2's own affine
        for sp, layer in zip(points, model.encoder["layers"]):
            assert sp.norm is not None and sp.norm[0] is not None
            torch.testing.assert_close(sp.norm[0], layer.norm2.weight.detach())


@pytest.mark.slow
def test_trained_post_ln_marian_gets_its_placement():
    """The foreign corpus's healthy Marian, seed 1, 10 Adam steps: its block outputs are
    rank-deficient (second smallest singular value ~3e-4 of the typical one) and the gains
    have moved off 1; undoing final_layer_norm tells Post-LN."""
    pytest.importorskip("transformers")
    import foreign_corpus as FC
    path = FC.make_checkpoint("hf-marian", "eager", None, 1, Path(pytest.importorskip("tempfile").mkdtemp()))
    report = FC.run_triage("hf-marian", path)
    assert report.probes["ln-placement"]["status"] == "pass", report.probes["ln-placement"]
    placement = [f.message for f in report.findings if f.code == "ln-placement/placement"]
    assert placement and "post-LN" in placement[0]
