"""Figures of a diverged run plot what is finite and say where finite data ended; attention
maps carry token labels and show the last step; each figure shows one step."""
import torch

from tndebug.report import Report
from tndebug.reporters import figures_common, plots
from tndebug.reporters.recorder import Recorder
from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace

SRC = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
TGT = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 0]])


def trace(step, bad=False):
    probs = torch.full((2, 2, 4, 4), float("nan") if bad else 0.25)
    x = torch.full((2, 4, 8), float("inf") if bad else 1.0 + step)
    g = torch.full((2, 4, 8), 0.1)
    att = {f"{stack}.layers.{i}.{name}": AttentionRecord(f"{stack}.layers.{i}.{name}", kind, i,
                                                          probs=probs)
           for stack, name, kind in (("encoder", "self_attn", "enc_self"),
                                     ("decoder", "self_attn", "dec_self")) for i in range(2)}
    streams = [StreamPoint(f"{s}.layers.{i}.hook_out", s, i, "layer", x)
               for s in ("encoder", "decoder") for i in range(2)]
    return Trace(step=step, src=SRC, tgt=TGT, attention=att, streams=streams,
                 grads={f"{s}.layers.{i}.hook_out": g for s in ("encoder", "decoder") for i in range(2)})


def recorded(bad_from=None, steps=(0, 10, 20, 29), final=29) -> Recorder:
    rec = Recorder(every=10)
    rec.final_step = final
    for s in steps:
        rec.on_trace(s, trace(s, bad=bad_from is not None and s >= bad_from))
    for s in range(final + 1):
        nan = bad_from is not None and s >= bad_from
        rec.log_scalars(s, {"train/loss": float("nan") if nan else 3.0 - s / 30, "train/lr": 1e-3})
    return rec


def capture(monkeypatch):
    figs = []
    monkeypatch.setattr(figures_common, "save", lambda fig, path: figs.append(fig))
    return figs


def test_healthy_figures_show_the_final_step_with_token_labels(monkeypatch, tmp_path):
    figs = capture(monkeypatch)
    rec = recorded()
    p = plots.figure_attention_maps(rec, "dec_self", tmp_path)
    fig = figs[-1]
    assert "step 29" in fig._suptitle.get_text() and "step 29" in p.caption
    (ax, _bar) = fig.axes                                      # one tiled image and its colorbar
    assert [t.get_text() for t in ax.texts] == ["head 0", "head 1", "layer 0", "layer 1"]
    ys = [t.get_text() for t in ax.get_yticklabels()]
    xs = [t.get_text() for t in ax.get_xticklabels()]
    assert ys == ["BOS", "5", "6", "7"] * 2 and xs == ["BOS", "5", "6", "7"] * 2   # per block
    assert "queries" in ax.get_ylabel() and "keys" in ax.get_xlabel()
    assert p.labels == {"0.x": "keys (one block per head)", "0.y": "queries (one block per layer)",
                        "1.y": "attention probability"}
    p = plots.figure_attention_maps(rec, "enc_self", tmp_path)
    assert [t.get_text() for t in figs[-1].axes[0].get_yticklabels()][:4] == ["5", "6", "7", "pad"]


def test_depth_shows_one_step_in_both_panels(monkeypatch, tmp_path):
    figs = capture(monkeypatch)
    p = plots.figure_depth(recorded(), tmp_path)
    left, right = figs[-1].axes
    assert {l.get_label() for l in left.get_lines()} == {l.get_label() for l in right.get_lines()} \
        == {"encoder, step 0", "decoder, step 0", "encoder, step 29", "decoder, step 29"}
    assert "step 0 (dotted) and step 29 (solid)" in figs[-1]._suptitle.get_text()
    assert "both panels show the same steps" in p.caption


def test_log_axes_label_in_plain_text_not_mathtext(monkeypatch, tmp_path):
    """Mathtext labels (`$\\mathdefault{10^{-1}}$`) were parsed anew in every figure: a third of
    depth.png's drawing. The same ticks are labelled, with superscript digits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    figs = capture(monkeypatch)
    plots.figure_depth(recorded(), tmp_path)
    _, right = figs[-1].axes
    assert right.get_yscale() == "log"
    FigureCanvasAgg(figs[-1]).draw()
    labels = [t.get_text() for t in right.get_yticklabels(which="both") if t.get_text()]
    assert "10\u207b\u00b9" in labels and not any("$" in t for t in labels), labels
    fmt = figures_common.PlainLogFormatter(10.0, labelOnlyBase=False)
    assert [fmt(x) for x in (3e-2, 1.0, 2e5, -1e-3)] == ["3\u00d710\u207b\u00b2", "10\u2070", "2\u00d710\u2075",
                                                      "\u221210\u207b\u00b3"]


def test_diverged_run_plots_what_is_finite_and_says_so(monkeypatch, tmp_path):
    figs = capture(monkeypatch)
    rec = recorded(bad_from=20)
    report = Report(run={"status": "diverged", "stopped_at_step": 29})
    curves = plots.figure_curves(rec, report, tmp_path)
    assert "train/loss: no finite data after step 19" in curves.caption
    loss_ax = figs[-1].axes[0]
    assert max(loss_ax.get_lines()[0].get_xdata()) == 19
    assert any("no finite data after step 19" in t.get_text() for t in loss_ax.texts)
    lo, hi = loss_ax.get_xlim()
    assert lo < 0 and hi > 29                                   # the whole run, not +-0.04

    att = plots.figure_attention_maps(rec, "enc_self", tmp_path)
    assert "step 10" in att.caption and "no finite attention after step 10" in att.caption
    assert "no finite attention after step 10" in figs[-1]._suptitle.get_text()
    depth = plots.figure_depth(rec, tmp_path)
    assert "no finite data after step 10" in depth.caption.lower()
    ent = plots.figure_entropy(rec, tmp_path)
    assert "no finite data after step 10" in ent.caption


def test_all_nan_panels_say_no_finite_data(monkeypatch, tmp_path):
    figs = capture(monkeypatch)
    rec = Recorder()
    for s in range(5):
        rec.log_scalars(s, {"train/loss": float("nan"), "train/lr": 1e-3})
    curves = plots.figure_curves(rec, Report(run={"status": "diverged", "stopped_at_step": 4}),
                                 tmp_path)
    assert "train/loss: no finite data (steps 0-4)" in curves.caption
    assert any("no finite data" in t.get_text() for t in figs[-1].axes[0].texts)


def test_markdown_puts_the_note_next_to_the_figure(tmp_path):
    from tndebug.reporters.markdown import render
    rec = recorded(bad_from=20)
    ps = plots.make_figures(rec, Report(run={"status": "diverged", "stopped_at_step": 29}), tmp_path)
    md = render(Report(run={"status": "diverged"}), ps)
    block = md[md.index("![Loss and learning rate]"):]
    assert "no finite data after step 19" in block.split("###")[0]


def test_figures_pause_the_collector_and_free_their_cycles_after():
    import gc
    import weakref

    class Node:
        pass

    with figures_common.gc_paused():
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a                       # a cycle, as a Figure and its artists
        gone = weakref.ref(a)
        del a, b
    assert gc.isenabled() and gone() is None         # collected on the way out
    gc.disable()                                     # the caller's own choice is kept
    try:
        with figures_common.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
