"""report.md: every finding explained, figures embedded, and the PNGs real."""
import re

from matplotlib.image import imread

from tndebug.probes import probe_cause

PNG = b"\x89PNG\r\n\x1a\n"
EXPECTED = {"curves.png", "entropy.png", "head_similarity.png", "attention_enc_self.png",
            "attention_dec_self.png", "attention_cross.png", "depth.png"}


def test_findings_are_explained(tiny_run):
    md = (tiny_run["dir"] / "report.md").read_text()
    assert md.startswith("# tndebug report: ERRORS")
    assert "> **RUN DIVERGED at step 8.**" in md
    # the error about step 0 is reported at the end, after the step-4 warning: still the first
    assert "> **First sign:** missing-scale at step 0 in decoder.layers.1.cross_attn" in md
    error = md.index("### 1. ERROR `missing-scale` at step 0")
    warn = md.index("### 2. WARN `missing-scale` at step 4")
    assert error < warn
    block = md[warn:md.index("## Probes")]
    assert "**Symptom:** entropy fell below the floor" in block
    assert "- **Evidence:** `entropy` = 0.01235\n  - **threshold:** 0.05" in block
    assert probe_cause("missing-scale") in block
    assert "**Fix:** Divide the scores by sqrt(d_k)." in block
    assert "**Where:** `encoder.layers.0.self_attn` (layer 0, head 2)" in block
    assert "| `stand-in-skipped` | skipped |" in md


def test_figures_are_embedded_and_valid_pngs(tiny_run):
    md = (tiny_run["dir"] / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", md)
    assert {l.split("/")[-1] for l in links} == EXPECTED
    for link in links:
        path = tiny_run["dir"] / link
        assert path.read_bytes()[:8] == PNG, link
        h, w = imread(path).shape[:2]
        assert 200 <= h <= 1600 and 300 <= w <= 1800, (link, h, w)


def test_nested_evidence_as_sub_bullets():
    from tndebug.findings import Finding
    from tndebug.report import Report
    from tndebug.reporters.markdown import render
    f = Finding("mask-broadcast", "error", "future keys visible", where="decoder.layers.0.self_attn",
                step=0, evidence={"forbidden_mass": 0.4,
                                  "modules": {"decoder.layers.0.self_attn": {"mass_max": 1.0}},
                                  "thresholds": {"mass": 1e-6}})
    md = render(Report(run={"status": "completed"}, findings=[f]))
    assert "- **Evidence:** `forbidden_mass` = 0.4" in md
    assert "  - `modules`:\n    - `decoder.layers.0.self_attn`: mass_max=1" in md
    assert "  - **thresholds:** mass: 1.000e-06" in md
    assert probe_cause("mask-broadcast") in md
