"""One defect in many modules is one block in every reporter, its modules listed and counted;
report.json keeps every finding and adds `groups`."""
import io
import json
import re

from tndebug.findings import Finding, group_findings, message_template
from tndebug.report import Report
from tndebug.reporters import console, markdown

MODULES = [f"{stack}.layers.{i}.{kind}" for stack, kinds in
           (("encoder", ("self_attn",)), ("decoder", ("self_attn", "cross_attn")))
           for i in range(2) for kind in kinds]                     # six attention modules


def six_module_report() -> Report:
    fs = [Finding("head-collapse", "error",
                  f"Q, K and V come from one projection in {m}: the same Linear ({m}.w_q) "
                  f"computes them; {70 + i}% of tokens attend most to themselves",
                  where=m, step=0, evidence={"self_argmax": 0.7 + i / 100, "threshold": 1e-6},
                  fix="Use three separate Linear layers for Q, K and V")
          for i, m in enumerate(MODULES)]
    fs.append(Finding("loss-health", "warning", "initial loss 9.1 is above ln V + 2", step=0))
    return Report(run={"status": "completed"}, findings=fs,
                  probes={"head-collapse": {"status": "fail"}, "loss-health": {"status": "warn"}})


def test_groups_by_probe_severity_fix_and_message_up_to_modules_and_numbers():
    r = six_module_report()
    groups = group_findings(r.findings)
    assert [g.count for g in groups] == [6, 1]
    assert groups[0].wheres == tuple(MODULES) and groups[0].step == 0
    assert "<module>" in message_template(r.findings[0])
    other_fix = Finding("head-collapse", "error", r.findings[0].message.replace(MODULES[0], MODULES[1]),
                        where=MODULES[1], fix="something else")
    assert len(group_findings([r.findings[0], other_fix])) == 2          # another fix: another defect


def test_markdown_one_block_listing_the_modules():
    md = markdown.render(six_module_report())
    assert md.count("ERROR `head-collapse`") == 1
    assert "### 1. ERROR `head-collapse` at step 0, in 6 modules" in md
    assert "- **Where** (6 findings, in 6 modules):" in md
    for m in MODULES:
        assert f"  - `{m}` (step 0)" in md
    assert "71% (70% above)" in md                      # what differs, not the whole message again
    assert "### 2. WARN `loss-health`" in md


def test_console_one_row_listing_the_modules():
    buf = io.StringIO()
    console.print_summary(six_module_report(), console.Console(file=buf, width=160, highlight=False))
    out = buf.getvalue()
    assert len(re.findall(r"^ ERROR ", out, re.M)) == 1 and "6 modules" in out
    assert all(m in out for m in MODULES)


def test_json_keeps_every_finding_and_adds_groups(tmp_path):
    r = six_module_report()
    d = json.loads(r.write_json(tmp_path / "report.json").read_text())
    assert len(d["findings"]) == 7
    g = d["groups"][0]
    assert g["modules"] == MODULES and g["count"] == 6 and g["findings"] == list(range(6))
    assert {"probe", "severity", "message", "fix", "step"} <= set(g)
    assert Report.from_dict(d).findings == r.findings


def test_many_findings_of_few_kinds_stay_short():
    """An all-NaN checkpoint: a NaN in every one of 94 places is a handful of rows, not 94."""
    fs = [Finding("nan-scores", "error", f"{m}.hook_probs: softmax produced NaN in {n} rows",
                  where=m, step=3, fix="Replay the batch") for n, m in
          enumerate(f"encoder.layers.{i}.self_attn" for i in range(47))]
    fs += [Finding("gradient-flow", "error", f"non-finite gradient in decoder.layers.{i} at step 3",
                   where=f"decoder.layers.{i}", step=3) for i in range(47)]
    buf = io.StringIO()
    console.print_summary(Report(run={}, findings=fs), console.Console(file=buf, width=80))
    assert len(buf.getvalue().splitlines()) < 45
    assert len(group_findings(fs)) == 2


def test_tensorboard_text_is_grouped_too(tmp_path, capsys):
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    from tndebug.reporters.session import ReportSession
    s = ReportSession(tmp_path, fmt="text", figures=False)
    s.finish(six_module_report())
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    text = tensor_util.make_ndarray(acc.Tensors("report/text_summary")[-1].tensor_proto).item().decode()
    assert text.count("ERROR `head-collapse`") == 1 and "in 6 modules" in text
