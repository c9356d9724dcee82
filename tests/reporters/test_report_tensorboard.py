"""TensorBoard output, read back with TensorBoard's own reader."""
import io
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from tndebug.reporters.tensorboard import TensorBoardSink
from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace

KINDS = ("enc_self", "dec_self", "cross")
SIZES = {ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0, ea.TENSORS: 0,
         ea.COMPRESSED_HISTOGRAMS: 0, ea.AUDIO: 0}


def load(tb_dir: Path) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(tb_dir), size_guidance=SIZES)
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def acc(tiny_run):
    return load(tiny_run["dir"] / "tb")


def test_one_writer_one_event_file(tiny_run):
    files = list((tiny_run["dir"] / "tb").iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents"), files


def test_per_head_scalars_for_every_layer_and_kind(acc):
    scalars = set(acc.Tags()["scalars"])
    for kind in KINDS:
        for layer in range(2):
            for head in range(4):
                for metric in ("entropy", "max_prob", "similarity"):
                    tag = f"attn/{kind}/layer{layer}/head{head}/{metric}"
                    assert tag in scalars, tag
                    assert [e.step for e in acc.Scalars(tag)] == [0, 4, 8]
            assert f"attn/{kind}/layer{layer}/diversity" in scalars
    for stack in ("encoder", "decoder"):
        assert f"depth/{stack}/layer1/resid_rms" in scalars
        assert f"grad/{stack}/layer0/norm" in scalars


def test_training_scalars(acc):
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(9))
    assert all(np.isfinite(e.value) for e in loss)
    assert len(acc.Scalars("train/lr")) == 9
    assert acc.Scalars("eval/accuracy")[-1].value == pytest.approx(0.5)


def test_head_diversity_layout(acc):
    events = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tensor_util.make_ndarray(events[-1].tensor_proto).item())
    cats = {c.title: c for c in layout.category}
    assert "Head diversity" in cats
    charts = {ch.title: list(ch.multiline.tag) for ch in cats["Head diversity"].chart}
    scalars = acc.Tags()["scalars"]
    for kind in KINDS:
        for layer in range(2):
            (regex,) = charts[f"{kind} layer {layer}: entropy per head"]
            matched = [t for t in scalars if re.fullmatch(regex, t)]
            assert sorted(matched) == [f"attn/{kind}/layer{layer}/head{h}/entropy" for h in range(4)]
    assert "Head similarity" in cats and "Depth" in cats


def test_histograms_at_probe_steps_only(acc):
    hists = acc.Tags()["histograms"]
    for tag in ("hist/stream/encoder.layers.0.hook_out", "hist/stream/decoder.hook_out",
                "hist/attn/cross/layer1/probs", "hist/ffn/decoder.layers.0.ffn"):
        assert tag in hists, tag
        events = acc.Histograms(tag)
        assert [e.step for e in events] == [0, 4, 8]
        assert events[0].histogram_value.num > 0
    probs = acc.Histograms("hist/attn/enc_self/layer0/probs")[-1].histogram_value
    assert 0.0 <= probs.min and probs.max <= 1.0
    assert [e.value for e in acc.Scalars("nonfinite/total")] == [0, 0, 0]


def test_attention_images(acc):
    from matplotlib.image import imread
    for kind in KINDS:
        for layer in range(2):
            events = acc.Images(f"attn_maps/{kind}/layer{layer}")
            assert [e.step for e in events] == [0, 4, 8]
            img = imread(io.BytesIO(events[-1].encoded_image_string), format="png")
            assert img.shape[0] >= 64 and img.shape[1] > 4 * img.shape[0] - 10   # 4 heads side by side


def test_text_report_and_hparams(acc, tiny_run):
    text = tensor_util.make_ndarray(acc.Tensors("report/text_summary")[-1].tensor_proto).item()
    text = text.decode()
    assert "ERRORS" in text and "missing-scale" in text and "DIVERGED" in text
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["preset"].string_value == "tiny" and hp["steps"].number_value == 9
    assert hp["status"].string_value == "diverged"
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metric_tags = {m.name.tag for m in exp.metric_infos}
    assert {"hparams/final_loss", "hparams/exact_match", "hparams/findings_errors"} <= metric_tags
    for tag in metric_tags:                                  # each metric has its scalar
        assert acc.Scalars(tag)
    assert acc.Scalars("hparams/findings_errors")[-1].value == 1


def test_nan_tensors_do_not_crash_and_are_counted(tmp_path):
    sink = TensorBoardSink(tmp_path)
    x = torch.randn(2, 5, 8)
    x[0, 0, :3] = float("nan")
    x[1, 2, 0] = float("inf")
    probs = torch.softmax(torch.randn(2, 4, 5, 5), -1)
    probs[0, 1] = float("nan")
    trace = Trace(step=3, streams=[StreamPoint("encoder.layers.0.hook_out", "encoder", 0, "layer", x)],
                  grads={"decoder.hook_out": torch.full((2, 5, 8), float("nan"))},
                  attention={"encoder.layers.0.self_attn": AttentionRecord(
                      "encoder.layers.0.self_attn", "enc_self", 0, probs=probs)})
    sink.on_trace(3, trace)
    sink.on_metric(3, "attn/enc_self/layer0/head0/entropy", float("nan"))
    sink.close()
    sink.close()                                                       # idempotent
    acc = load(tmp_path)
    assert acc.Scalars("nonfinite/stream/encoder.layers.0.hook_out")[0].value == 4
    assert acc.Scalars("nonfinite/grad/decoder.hook_out")[0].value == 80
    assert acc.Scalars("nonfinite/attn/enc_self/layer0/probs")[0].value == 25
    assert acc.Scalars("nonfinite/total")[0].value == 4 + 80 + 25
    hist = acc.Histograms("hist/stream/encoder.layers.0.hook_out")[0].histogram_value
    assert hist.num == 80 - 4 and np.isfinite([hist.min, hist.max, hist.sum]).all()
    assert "hist/grad/decoder.hook_out" not in acc.Tags()["histograms"]   # nothing finite to draw
    assert acc.Images("attn_maps/enc_self/layer0")                      # NaN drawn, not fatal
    assert np.isnan(acc.Scalars("attn/enc_self/layer0/head0/entropy")[0].value)


def test_only_add_scalar_and_only_here():
    root = Path(__file__).parents[2] / "tndebug"
    for path in root.rglob("*.py"):
        src = path.read_text()
        assert "add_scalars(" not in src, path
        if path.name != "tensorboard.py":
            assert not re.search(r"^\s*(from|import) (torch\.utils\.)?tensorboard", src, re.M), path


def test_histograms_and_images_are_sparse_and_exact(tmp_path):
    from tndebug.reporters.recorder import plan_every
    assert (plan_every(60), plan_every(400), plan_every(10_000)) == (50, 50, 500)
    sink = TensorBoardSink(tmp_path, heavy_every=plan_every(400))
    x = torch.linspace(-2.0, 2.0, 101).reshape(1, 1, 101)
    for step in range(0, 121):                       # a probe that runs every step
        sink.on_trace(step, Trace(step=step, streams=[StreamPoint("encoder.hook_out", "encoder",
                                                                  None, "stack", x)]))
        sink.on_trace(step, Trace(step=step))        # an empty trace is never drawn
    sink.close()
    events = load(tmp_path).Histograms("hist/stream/encoder.hook_out")
    assert [e.step for e in events] == [0, 50, 100]
    h = events[0].histogram_value
    assert (h.min, h.max, h.num) == (-2.0, 2.0, 101)
    assert h.sum == pytest.approx(0.0, abs=1e-5) and h.sum_squares == pytest.approx(float((x * x).sum()))
    assert sum(h.bucket) == 101 and list(h.bucket_limit) == sorted(h.bucket_limit)


def test_one_tag_per_quantity(tmp_path):
    """A probe's `loss/train` and `lr/observed` are the trainer's `train/loss` and `train/lr`:
    one tag each, one value a step, whichever of the two logged it first."""
    sink = TensorBoardSink(tmp_path)
    for step in range(5):
        sink.on_metric(step, "loss/train", 2.0 - step / 10)          # the probe first ...
        sink.on_metric(step, "lr/observed", 1e-3)
        sink.log_scalars(step, {"train/loss": 2.0 - step / 10, "train/lr": 1e-3})   # ... then the trainer
    sink.log_scalars(5, {"train/loss": 1.4, "train/lr": 1e-3})
    sink.on_metric(5, "loss/train", 1.4)
    sink.close()
    acc = load(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr"} <= tags and not tags & {"loss/train", "lr/observed"}
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(6))
    assert [e.step for e in acc.Scalars("train/lr")] == list(range(6))


def test_a_resumed_run_purges_the_steps_written_after_the_checkpoint(tmp_path):
    """Killed at step 14 after a checkpoint at step 10; the resumed run writes 10.. again."""
    first = TensorBoardSink(tmp_path)
    for step in range(15):
        first.log_scalars(step, {"train/loss": 1.0})
    first.close()
    # a resumed run starts seconds later; event files sort by name (its time in seconds, then
    # a per-process counter that sorts as text: "...10" before "...9"), so keep them a second apart
    time.sleep(1.05)
    resumed = TensorBoardSink(tmp_path, purge_step=10)
    for step in range(10, 20):
        resumed.log_scalars(step, {"train/loss": 2.0})
    resumed.close()
    events = load(tmp_path).Scalars("train/loss")
    assert [e.step for e in events] == list(range(20))
    assert [e.value for e in events] == [1.0] * 10 + [2.0] * 10


def test_images_at_the_final_step_too(tmp_path):
    sink = TensorBoardSink(tmp_path, heavy_every=50)
    sink.final_step = 59
    probs = torch.full((1, 2, 3, 3), 1 / 3)
    for step in (0, 10, 50, 59):
        sink.on_trace(step, Trace(step=step, attention={"encoder.layers.0.self_attn": AttentionRecord(
            "encoder.layers.0.self_attn", "enc_self", 0, probs=probs)}))
    sink.close()
    assert [e.step for e in load(tmp_path).Images("attn_maps/enc_self/layer0")] == [0, 50, 59]
