"""tndebug.watch on user-style models in the user's own loop: a healthy run is clean; bugs that
only training shows are named by the right probe at the right step; nothing outlives the block."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch import nn

import models as M
import tndebug
from tndebug.errors import UsageError
from tndebug.probes.base import Probe

WARMUP = 20


def lam(step):                        # Noam-shaped: linear warmup, then 1/sqrt decay
    return min((step + 1) / WARMUP, (WARMUP / (step + 1)) ** 0.5)


def serious(report):
    return [(f.probe, f.severity, f.where, f.step) for f in report.findings
            if f.severity in ("warning", "error")]


def watched_run(kind, steps=30, *, lr=1e-3, out=None, **kw):
    build, forward = M.MODELS[kind]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    with tndebug.watch(model, opt, forward=forward, out=out, quiet=True, lr_schedule=sched,
                       total_steps=steps, **kw) as dbg:
        losses = M.train(kind, model, opt, steps, scheduler=sched)
    return dbg, losses


@pytest.mark.parametrize("kind", ["annotated", "torch", "sdpa", "bart"])
def test_healthy_run_is_clean(kind, tmp_path):
    dbg, losses = watched_run(kind, out=tmp_path / kind)
    assert losses[-1] < losses[0]
    assert serious(dbg.report) == [], dbg.report.findings
    assert dbg.report.verdict == "clean" and dbg.exit_code == 0
    probes = dbg.report.probes
    for name in ("loss-health", "gradient-flow", "lr-schedule"):
        assert probes[name]["status"] == "pass", (name, probes[name])
        assert probes[name]["steps_observed"] > 0
    assert probes["mask-broadcast"]["status"] == "pass"
    assert dbg.report.run["steps"] == 30 and dbg.report.run["mode"] == "watch"
    saved = json.loads((tmp_path / kind / "report.json").read_text())
    assert saved["verdict"] == "clean"
    assert (tmp_path / kind / "report.md").is_file() and any((tmp_path / kind / "tb").iterdir())


@pytest.mark.parametrize("kind", ["sdpa", "bart"])
def test_diverging_lr_is_named_at_its_step(kind):
    build, forward = M.MODELS[kind]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e4)
    with tndebug.watch(model, opt, forward=forward, quiet=True) as dbg:
        losses = M.train(kind, model, opt, 20)
    first_nan = next(i for i, x in enumerate(losses) if x != x)
    assert dbg.diverged == first_nan
    assert dbg.report.run["status"] == "diverged"
    errors = [f for f in dbg.report.findings if f.severity == "error"
              and f.probe in ("nan-scores", "loss-health")]
    assert errors and errors[0].step == first_nan, dbg.report.findings
    assert dbg.exit_code == 1


def test_criterion_given_raw_logits():
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kl = nn.KLDivLoss(reduction="batchmean")

    def criterion(logits, target):    # note 001's LabelSmoothing, fed the logits themselves
        true = torch.full_like(logits, 0.1 / (M.V - 2))
        true.scatter_(1, target[:, None], 0.9)
        true[:, M.PAD] = 0
        return kl(logits, true)

    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True) as dbg:
        M.train("sdpa", model, opt, 20, criterion=criterion)
    (f,) = [f for f in dbg.report.findings if f.severity == "error"]
    assert (f.probe, f.where, f.step) == ("loss-health", "criterion", 0)
    assert "raw logits" in f.message


def _resume(restore_scheduler: bool):
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    declared = lambda s: 3e-3 * lam(s)                       # noqa: E731 - the schedule as written
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True, lr_schedule=declared) as first:
        M.train("sdpa", model, opt, WARMUP, scheduler=sched)
    assert serious(first.report) == []
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    model2 = M.FusedSDPA()
    model2.load_state_dict(state["model"])
    opt2 = torch.optim.Adam(model2.parameters(), lr=3e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lam)     # the user's resume code
    opt2.load_state_dict(state["opt"])
    if restore_scheduler:
        sched2.load_state_dict(state["sched"])
    else:                                                    # the bug: warmup starts again
        for group in opt2.param_groups:
            group["lr"] = 3e-3 * lam(0)
    with tndebug.watch(model2, opt2, forward=M.fused_forward, quiet=True, lr_schedule=declared,
                       start_step=WARMUP) as dbg:
        M.train("sdpa", model2, opt2, 10, scheduler=sched2, seed=1)
    return dbg


def test_warmup_restarted_on_resume():
    dbg = _resume(restore_scheduler=False)
    errors = [f for f in dbg.report.findings if f.severity == "error"]
    assert [(f.probe, f.step) for f in errors] == [("lr-schedule", WARMUP)], dbg.report.findings
    assert "warmup restarted" in errors[0].message


def test_resume_that_keeps_the_schedule_is_clean():
    dbg = _resume(restore_scheduler=True)
    assert serious(dbg.report) == [], dbg.report.findings
    assert dbg.report.run["start_step"] == WARMUP


def test_dead_relus():
    torch.manual_seed(0)
    model = M.FusedSDPA()
    for m in model.modules():
        if isinstance(m, M.MLP):
            nn.init.constant_(m.fc.bias, -3.0)               # every unit starts below zero
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True) as dbg:
        M.train("sdpa", model, opt, 20)
    found = {(f.probe, f.where) for f in dbg.report.findings if f.severity == "warning"}
    assert {("gradient-flow", f"{s}.{i}.mlp") for s in ("enc", "dec") for i in (0, 1)} <= found
    assert {p for p, _ in found} == {"gradient-flow"}


def test_step_loss_before_the_optimizer_and_gradient_accumulation():
    """dbg.step(loss=) before optimizer.step(); two micro-batches a step: one recorded."""
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    seen = []
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True) as dbg:
        for step in range(12):
            opt.zero_grad()
            for _ in range(2):
                src, tgt = M.copy_batch(g)
                loss = M.train_step("sdpa", model, src, tgt) / 2
                loss.backward()
            dbg.step(loss=loss * 2)
            opt.step()
            seen.append(dbg._step)
    assert dbg.report.run["steps"] == 12
    assert dbg.report.probes["loss-health"]["steps_observed"] == 2     # steps 0 and 10
    assert serious(dbg.report) == []


def test_nothing_outlives_the_block():
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True) as dbg:
        M.train("sdpa", model, opt, 12)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert torch.autograd.backward.__module__ == "torch.autograd"
    refs = [weakref.ref(model), weakref.ref(opt)]
    del model, opt
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert dbg.report.verdict == "clean"


class Broken(Probe):
    name = "broken"
    reads = ("stream",)

    def observe(self, trace, info):
        raise RuntimeError("a bug in a probe")


def test_a_probe_that_raises_is_reported_and_switched_off():
    from tndebug.probes import make_probes
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    broken = Broken(schedule=lambda s: True)
    probes = make_probes(["loss-health"]) + [broken]
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True, probes=probes) as dbg:
        losses = M.train("sdpa", model, opt, 12)
    assert len(losses) == 12
    (f,) = [f for f in dbg.report.findings if f.probe == "broken"]
    assert f.severity == "info" and "probe broken failed at observe (step 0)" in f.message
    assert dbg.report.probes["broken"]["status"] == "no verdict"
    assert dbg.report.probes["loss-health"]["status"] == "pass"


def test_without_an_optimizer_dbg_step_is_the_moment():
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with tndebug.watch(model, forward=M.fused_forward, quiet=True,
                       probes="loss-health,gradient-flow,lr-schedule") as dbg:
        for _ in range(11):
            src, tgt = M.copy_batch(g)
            loss = M.train_step("sdpa", model, src, tgt)
            opt.zero_grad()
            loss.backward()
            dbg.step(loss=loss, lr=0.1)
            opt.step()
    assert dbg.report.probes["loss-health"]["steps_observed"] == 2
    assert dbg.report.probes["gradient-flow"]["status"] == "pass"
    assert any("no optimizer" in n for n in dbg.report.run["notes"])


def test_bad_input_one_clear_message_each():
    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(M.V, 16), nn.Linear(16, M.V)

        def forward(self, src, tgt):
            return self.out(self.emb(tgt))

    with pytest.raises(UsageError, match="found no attention in NoAttention"):
        with tndebug.watch(NoAttention(), forward=lambda m, s, t, p: m(s, t)):
            pass
    model = M.FusedSDPA()
    with pytest.raises(UsageError, match=r"returned a tensor of shape \(2, 6\); expected logits"):
        with tndebug.watch(model, forward=lambda m, s, t, p: m(s, t, p)[..., 0]):
            pass
    with pytest.raises(UsageError, match="sequence-first"):
        tndebug.check(model, lambda m, s, t, p: m(s, t, p).transpose(0, 1))
    class NeedsPad(M.FusedSDPA):          # three required inputs: no built-in call fits
        def forward(self, src, tgt, pad_id):
            return super().forward(src, tgt, pad_id)

    with pytest.raises(UsageError, match="do not know how to call NeedsPad: pass forward="):
        tndebug.watch(NeedsPad()).__enter__()
    with pytest.raises(UsageError, match="optimizer must be a torch.optim.Optimizer"):
        tndebug.watch(model, "adam")
    with pytest.raises(UsageError, match="unknown probe 'head-colapse'"):
        tndebug.watch(model, forward=M.fused_forward, probes="head-colapse").__enter__()
    dbg = tndebug.watch(model, forward=M.fused_forward, quiet=True, probes="loss-health")
    with pytest.raises(UsageError, match=r"dbg.step\(\) called before the block"):
        dbg.step()
    with dbg:
        pass
    with pytest.raises(UsageError, match=r"dbg.step\(\) called after the block"):
        dbg.step(loss=1.0)
    assert dbg.report.verdict == "unchecked"
    assert any("no training step was observed" in n for n in dbg.report.run["notes"])


def test_capture_only_on_steps_a_probe_reads_the_model():
    """The recording (module hooks, patched attention ops) opens on the steps whose due probes
    read the trace, decided before the forward; lr-schedule alone (every step) reads none. It
    hooks what the due probes read: gradient-flow's steps (FFN activations) leave attention
    alone."""
    from tndebug.probes import make_probes
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    recorded, holder = [], []
    mine = {"", "enc.0", "lm_head"}          # the watch's (root, logits head), this test's

    def seen(module, args):                  # the user's forward, not the probes' own calls
        if holder and not holder[0]._busy:
            recorded.append({n for n, m in model.named_modules() if n not in mine
                             and (m._forward_hooks or m._forward_pre_hooks)})
    model.enc[0].register_forward_pre_hook(seen)
    probes = make_probes("all")
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True, probes=probes,
                       budget=None) as dbg:            # every scheduled step (test_budget thins)
        holder.append(dbg)
        M.train("sdpa", model, opt, 24)
    expected = [any(p.reads and p.schedule(s) for p in probes) for s in range(24)]
    assert [bool(h) for h in recorded] == expected
    assert sum(expected) < 12 and not expected[3]
    assert dbg.report.probes["lr-schedule"]["steps_observed"] == 24
    ffn_only = [s for s in range(24) if [p.name for p in probes if p.reads and p.schedule(s)]
                == ["gradient-flow"]]
    assert ffn_only, "no step on which gradient-flow alone reads the model"
    assert any(n.endswith("attn.proj") for n in recorded[0])          # step 0: everything
    for s in ffn_only:      # the FFNs' output Linear (its input) and the token embedding (layout)
        assert recorded[s] == {"wte", "enc.0.mlp.fc2", "enc.1.mlp.fc2", "dec.0.mlp.fc2",
                               "dec.1.mlp.fc2"}, recorded[s]


def test_the_issue_loop_dbg_step_after_the_optimizer():
    """`dbg.step(loss=loss)` at the end of the loop, as in the issue: the steps still come from
    the optimizer's hooks; the loss after the step is checked for NaN."""
    torch.manual_seed(0)
    model = M.FusedSDPA()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, forward=M.fused_forward, quiet=True) as dbg:
        M.train("sdpa", model, opt, 21, dbg=dbg, step_after=True)
    assert dbg.report.run["steps"] == 21 and dbg.report.run["stopped_at_step"] == 21
    assert dbg.report.probes["loss-health"]["steps_observed"] == 3
    assert serious(dbg.report) == []


def test_annotated_layout_needs_no_forward():
    """The Annotated Transformer's layout is called by the built-in adapter; the report says
    that the mask tests then judged tndebug's masks."""
    torch.manual_seed(0)
    model = M.annotated()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tndebug.watch(model, opt, quiet=True) as dbg:
        M.train("annotated", model, opt, 11)
    assert dbg.report.run["adapter"] == "annotated"
    assert any("tndebug" in n and "mask" in n for n in dbg.report.run["notes"])
    assert serious(dbg.report) == [] and dbg.report.probes["loss-health"]["steps_observed"] == 2
