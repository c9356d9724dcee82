"""TensorBoard: the only module that imports it (its protos: the event file is framed by
reporters/event_file.py, not by `SummaryWriter`, whose import costs 0.24 s). One event file in
`out_dir/tb`.

Scalars are written as TensorBoard's `add_scalar` writes them (a `simple_value` per tag), but
all the scalars of one step go in one event, with the wall time of the first, and the events of
up to EVENT_BATCH steps are handed to the writer thread together: each hand-over wakes that
thread, and one a tag (`train/lr` every step, a hundred metrics on a probed step) was most of
`tndebug.watch`'s cost on unprobed steps (`bench/watch_breakdown.py`). Held events go out before anything else is written (histograms, images, the layout, the
report), so the file stays in step order, and at `flush` and `close`.

What goes in (tags):

* every probe metric as it arrives (`attn/enc_self/layer0/head1/entropy`, `depth/...`, `grad/...`);
* the trainer's scalars (`train/loss`, `train/lr`, `eval/accuracy`, ...); a probe metric that
  repeats one (`loss/train`, `lr/observed`: SAME_AS) goes under the trainer's tag, once a step;
* at probed steps only, and of those only the first, multiples of `heavy_every` (about 20
  per run; some probes run every step) and the run's last step: histograms `hist/stream/<tap>`,
  `hist/attn/<kind>/layer<N>/probs`, `hist/ffn/<module>`, `hist/grad/<tap>` of whole tensors
  (non-finite values left out and counted in `nonfinite/<same name>`, plus `nonfinite/total`),
  and attention maps `attn_maps/<kind>/layer<N>` (heads side by side, example 0 of the batch);
* a custom-scalars layout: "Head diversity" (one multiline chart per layer and attention type
  over all heads' entropy, and each type's `diversity` across layers), "Head similarity",
  "Depth" (resid_rms and grad norm of all layers of a stack);
* at the end: the Markdown report (`report` text), and the run's hyperparameters with its final
  metrics (`hparams/<name>` scalars) in the same directory, for the HParams dashboard.

A resumed run passes `purge_step` (the checkpoint's step): TensorBoard then drops the events
the killed run wrote from that step on (between its last checkpoint and the kill), so no step
appears twice.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tensorboard.compat.proto.event_pb2 import Event, SessionLog, SourceMetadata
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

from tndebug import manifest
from tndebug import tags
from tndebug.reporters.attention_image import attention_image
from tndebug.reporters.event_file import EventFile
from tndebug.reporters.recorder import on_cadence
from tndebug.reporters.tb_run import chart_order, hparams_and_metrics
from tndebug.capture.trace import Trace

HIST_BINS = 30                   # equal-width buckets between the finite min and max
HIST_SAMPLE = 16384              # bucket counts from a strided sample of at most this many values
EVENT_BATCH = 64                 # steps of scalar events held before they are written together
HEAVY_EVERY = 50                 # histograms and images at step 0 and every N steps (at most)
# the charts: which stats of which tag family (tndebug/tags.py) get one
CHARTED_HEAD_STATS = ("entropy", "similarity")       # -> "Head diversity" / "Head similarity"
CHARTED_DEPTH_STATS = ("resid_rms", "rank")          # -> "Depth"
# probe metrics that are the trainer's own scalars under another name: one tag per quantity
SAME_AS = {tags.LOSS_TRAIN: "train/loss", tags.LR_OBSERVED: "train/lr"}


class TensorBoardSink:
    """A ProbeEngine sink (`on_metric`, `on_trace`) that also takes the trainer's scalars."""

    def __init__(self, log_dir: str | Path, *, histograms: bool = True, images: bool = True,
                 heavy_every: int | None = None, flush_secs: int = 30,
                 purge_step: int | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.writer = _Writer(self.log_dir, flush_secs)
        manifest.record(self.writer.path)   # listed now: a run killed before its report has it
        self.writer.add_event(Event(file_version="brain.Event:2",
                                    source_metadata=SourceMetadata(writer="tndebug")))
        self.writer.flush()
        if purge_step:                  # TensorBoard drops this file's earlier runs' steps >= it
            self.writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.add_event(Event(step=purge_step,
                                        session_log=SessionLog(status=SessionLog.START)))
        self._written: dict[str, int] = {}             # SAME_AS tag -> last step written
        self.histograms, self.images = histograms, images
        self.heavy_every = heavy_every or HEAVY_EVERY   # steps that get histograms and images
        self.final_step: int | None = None             # ... and the run's last step
        self.grow = False                              # unknown length: the interval grows
        self._heavy_steps: set[int] = set()
        self.charts: dict[str, dict[str, list]] = {}   # category -> title -> ["Multiline", [regex]]
        self._layout_written: int = 0                  # number of charts in the last layout written
        self._step = 0
        self._values: list = []                        # this step's scalars, not yet written
        self._values_step: int | None = None
        self._values_wall = 0.0
        self._held: list[tuple] = []                   # (Summary, step, wall time), not yet written
        self._charted: set[str] = set()                # tags already given a chart (or none)
        self.closed = False

    # -- sink interface -------------------------------------------------------------------
    def on_metric(self, step: int, tag: str, value: float) -> None:
        if self.closed:
            return
        if step > self._step:
            self._step_boundary()
            self._step = step
        tag = SAME_AS.get(tag, tag)
        if self._once(tag, step):
            self.scalar(tag, value, step)
            if tag not in self._charted:
                self._charted.add(tag)
                self._chart_for(tag)

    def log_scalars(self, step: int, scalars: dict) -> None:
        if self.closed:
            return
        for tag, value in scalars.items():
            if value is not None and self._once(tag, step):
                self.scalar(tag, value, step)

    def scalar(self, tag: str, value, step: int) -> None:
        """One scalar, as `add_scalar` writes it; held until the step's other scalars are in."""
        if self._values_step != step:
            self._write_values()
            self._values_step, self._values_wall = step, time.time()
        self._values.append(Summary.Value(tag=tag, simple_value=float(value)))

    def _write_values(self) -> None:
        """The step's scalars become one event, held until EVENT_BATCH steps are."""
        self._hold_step()
        if len(self._held) >= EVENT_BATCH:
            self._file()

    def _hold_step(self) -> None:
        if self._values:
            self._held.append((Summary(value=self._values), self._values_step, self._values_wall))
        self._values, self._values_step = [], None

    def _file(self):
        """The file writer, once every held scalar event is written to it (in step order)."""
        file_writer = self.writer
        self._hold_step()
        held, self._held = self._held, []
        for summary, step, wall in held:
            file_writer.add_summary(summary, step, wall)
        return file_writer

    def _once(self, tag: str, step: int) -> bool:
        """False for a SAME_AS tag already written at `step` (by the trainer or the probe)."""
        if tag not in SAME_AS.values():
            return True
        if self._written.get(tag, -1) >= step:
            return False
        self._written[tag] = step
        return True

    def on_trace(self, step: int, trace: Trace) -> None:
        if self.closed:
            return
        self._step_boundary()
        if not self.wants_heavy(step, trace):
            return
        self._heavy_steps.add(step)
        if self.histograms:
            named = [(f"stream/{p.name}", p.x) for p in trace.streams]
            named += [(f"attn/{r.tag}/probs", r.probs) for r in trace.records() if r.probs is not None]
            named += [(f"ffn/{site}", x) for site, x in trace.ffn_hidden.items()]
            named += [(f"grad/{name}", g) for name, g in trace.grads.items()]
            self.add_histograms(step, named)
        if self.images:
            file_writer = self._file()
            for r in trace.records():
                if r.probs is not None and r.probs.dim() == 4 and r.probs.shape[0] > 0:
                    file_writer.add_summary(_image(f"attn_maps/{r.tag}", attention_image(r.probs[0])),
                                            step)

    def wants_heavy(self, step: int, trace: Trace) -> bool:
        """Histograms and images at the first probed step, at multiples of `heavy_every`
        (probes run at least that often on the steps that matter; some run every step) and at
        `final_step`, the run's last (the engine captures it for the sinks)."""
        if step in self._heavy_steps or not (trace.streams or trace.attention or trace.grads
                                             or trace.ffn_hidden):
            return False
        return not self._heavy_steps or on_cadence(step, self.heavy_every, self.grow) \
            or step == self.final_step

    # -- pieces ---------------------------------------------------------------------------
    def add_histograms(self, step: int, named: list[tuple[str, torch.Tensor]]) -> int:
        """Histograms `hist/<name>`; NaN/Inf left out and counted. Returns the non-finite total.

        min, max, sum, sum of squares and count are exact over the whole tensor; the bucket
        counts come from a strided sample of at most HIST_SAMPLE values, scaled to the count.
        Computed with torch where the tensors live, with two host syncs for all of them.
        """
        named = [(n, t.detach().reshape(-1).float()) for n, t in named
                 if t is not None and t.numel() and t.is_floating_point()]
        if not named:
            return 0
        dev = named[0][1].device
        ranges = torch.stack([torch.stack(torch.aminmax(x)).to(dev) for _, x in named]).cpu().tolist()
        rows = []
        for (_, x), (lo, hi) in zip(named, ranges):
            bad = 0
            if not (math.isfinite(lo) and math.isfinite(hi)):    # rare: leave NaN/Inf out
                ok = torch.isfinite(x)
                x = x[ok]
                bad = int(ok.numel() - x.numel())
                lo, hi = torch.stack(torch.aminmax(x)).tolist() if x.numel() else (0.0, 0.0)
            rows.append((x, bad, lo, hi))
        device_rows = [torch.cat([torch.stack([x.sum(), torch.dot(x, x)]),
                                  torch.histc(x[::max(1, x.numel() // HIST_SAMPLE)], HIST_BINS,
                                              lo, hi) if hi > lo else torch.zeros(HIST_BINS,
                                                                                  device=x.device)])
                       for x, _, lo, hi in rows if x.numel()]
        host = iter(torch.stack([r.to(dev) for r in device_rows]).cpu().double().tolist()
                    if device_rows else [])
        file_writer = self._file()
        total = 0
        for (name, _), (x, bad, lo, hi) in zip(named, rows):
            total += bad
            if bad:
                self.scalar(f"nonfinite/{name}", bad, step)
            n = x.numel()
            if not n:
                continue
            s, ss, *counts = next(host)
            if hi > lo:
                scale = n / max(sum(counts), 1.0)
                limits = torch.linspace(lo, hi, HIST_BINS + 1, dtype=torch.float64).tolist()
                buckets = [0.0] + [c * scale for c in counts]
            else:                                                # one distinct value
                limits, buckets = [lo, hi + max(abs(hi), 1.0) * 1e-6], [0.0, float(n)]
            proto = HistogramProto(min=lo, max=hi, num=n, sum=s, sum_squares=ss,
                                   bucket_limit=limits, bucket=buckets)
            file_writer.add_summary(Summary(value=[Summary.Value(tag=f"hist/{name}",
                                                                 histo=proto)]), step)
        self.scalar("nonfinite/total", total, step)
        return total

    def _chart_for(self, tag: str) -> None:
        """A custom-scalar chart for the family of `tag` (tags.py), the first time one is seen."""
        got = tags.parse(tag)
        if got is None:
            return
        fam, p = got
        if fam is tags.HEAD and p["stat"] in CHARTED_HEAD_STATS:
            cat = "Head diversity" if p["stat"] == "entropy" else "Head similarity"
            self._chart(cat, f"{p['kind']} layer {p['layer']}: {p['stat']} per head",
                        fam.regex(kind=p["kind"], layer=p["layer"], stat=p["stat"]))
        elif fam is tags.DIVERSITY:
            self._chart("Head diversity", f"{p['kind']}: diversity per layer",
                        fam.regex(kind=p["kind"]))
        elif fam is tags.DEPTH and p["stat"] in CHARTED_DEPTH_STATS:
            self._chart("Depth", f"{p['stack']}: {p['stat']} per layer",
                        fam.regex(stack=p["stack"], stat=p["stat"]))
        elif fam is tags.GRAD:
            self._chart("Depth", f"{p['stack']}: gradient norm per layer", fam.regex(stack=p["stack"]))

    def _chart(self, category: str, title: str, regex: str) -> None:
        charts = self.charts.setdefault(category, {})
        if title not in charts:
            charts[title] = ["Multiline", [regex]]

    def _n_charts(self) -> int:
        return sum(len(c) for c in self.charts.values())

    def _step_boundary(self) -> None:
        """A probed step's metrics are all in: write the layout if it grew (normally once)."""
        if self._n_charts() > self._layout_written:
            self.write_layout()

    def write_layout(self) -> None:
        ordered = {cat: dict(sorted(self.charts[cat].items(), key=lambda kv: chart_order(kv[0])))
                   for cat in ("Head diversity", "Head similarity", "Depth") if cat in self.charts}
        self._file().add_summary(_custom_scalars(ordered), self._step)
        self._layout_written = self._n_charts()

    # -- the end --------------------------------------------------------------------------
    def write_summary(self, run: dict, markdown: str, step: int, extra_metrics: dict) -> None:
        """The Markdown report as text, and hparams with the run's final metrics."""
        if self.closed:
            return
        self._step_boundary()
        self._file()
        self.writer.add_summary(_text("report", markdown), step)
        hp, metrics = hparams_and_metrics(run, extra_metrics)
        for summary in _hparams(hp, metrics):
            self._file().add_summary(summary, step)
        for tag, value in metrics.items():
            self.scalar(tag, value, step)

    def flush(self) -> None:
        if not self.closed:
            self._file()
            self.writer.flush()

    def close(self) -> None:
        if not self.closed:
            self._step_boundary()
            self._file()
            self.writer.flush()
            self.writer.close()
            self.closed = True


class _Writer(EventFile):
    """SummaryWriter's FileWriter.add_summary, synchronously into one EventFile."""

    def add_summary(self, summary: Summary, step: int | None = None,
                    walltime: float | None = None) -> None:
        self.add_event(Event(summary=summary), step, walltime)


def _plugin(name: str, content: bytes = b"") -> SummaryMetadata:
    return SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=name, content=content))


def _text(tag: str, text: str) -> Summary:
    """`SummaryWriter.add_text`'s summary."""
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf_8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return Summary(value=[Summary.Value(tag=f"{tag}/text_summary", tensor=tensor,
                                        metadata=_plugin("text", TextPluginData(version=0)
                                                         .SerializeToString()))])


def _custom_scalars(layout: dict) -> Summary:
    """torch's `summary.custom_scalars` for {category: {title: ["Multiline", [regex]]}}."""
    from tensorboard.plugins.custom_scalar import layout_pb2
    categories = [layout_pb2.Category(title=cat, chart=[
        layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=spec[1]))
        for title, spec in charts.items()]) for cat, charts in layout.items()]
    tensor = TensorProto(dtype="DT_STRING", tensor_shape=TensorShapeProto(),
                         string_val=[layout_pb2.Layout(category=categories).SerializeToString()])
    return Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor,
                                        metadata=_plugin("custom_scalars"))])


def _hparams(hp: dict, metrics: dict) -> tuple[Summary, Summary, Summary]:
    """torch's `summary.hparams(hp, metrics)` for numbers (bools too), strings and None; the
    plugin's constants written out (its metadata module imports the TensorFlow stub)."""
    from tensorboard.plugins.hparams.api_pb2 import DataType, Experiment, HParamInfo, \
        MetricInfo, MetricName, Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, \
        SessionEndInfo, SessionStartInfo

    def summary(tag: str, **data) -> Summary:
        content = HParamsPluginData(version=0, **data).SerializeToString()
        return Summary(value=[Summary.Value(tag=f"_hparams_/{tag}", metadata=_plugin("hparams", content))])

    start, infos = SessionStartInfo(), []
    for k, v in hp.items():
        if v is None:
            continue
        if isinstance(v, (int, float)):
            start.hparams[k].number_value = v
            kind = "DATA_TYPE_FLOAT64"
        else:
            start.hparams[k].string_value = str(v)
            kind = "DATA_TYPE_STRING"
        infos.append(HParamInfo(name=k, type=DataType.Value(kind)))
    exp = Experiment(hparam_infos=infos, metric_infos=[MetricInfo(name=MetricName(tag=k))
                                                        for k in metrics])
    return (summary("experiment", experiment=exp),
            summary("session_start_info", session_start_info=start),
            summary("session_end_info",
                    session_end_info=SessionEndInfo(status=Status.Value("STATUS_SUCCESS"))))


def _image(tag: str, rgb) -> Summary:
    """What `add_image(tag, rgb, dataformats="HWC")` writes for a uint8 [H, W, 3] array, at
    PNG compression 3: faster than `add_image`'s default, which also converts to float and
    back; the file is a little larger."""
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG", compress_level=3)
    image = Summary.Image(height=rgb.shape[0], width=rgb.shape[1], colorspace=3,
                          encoded_image_string=buf.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])
