"""The setup forward `variance-drift` and `ln-placement` share: the residual stream on a random
batch wide enough for `_depth_stats`' null-vector test, and its gradients, computed once per run
and kept in `RunContext.extras`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tndebug.capture.model_parts import affine_dims
from tndebug.capture.trace import Trace
from tndebug.memory import give_back_freed

SETUP_TRACE = "depth_stats.setup_trace"      # RunContext.extras key: one trace for both probes
SETUP_GRADS = "depth_stats.setup_grads"      # ... and the trace whose gradients they read
GRAD_ROWS = 16           # the sequences of the gradient pass (probe_batch's smallest batch)
BLOCK_TOKENS = 576       # tokens per forward of the wide batch (in_blocks): 48 sequences of 12


def probe_batch(subject, width: int | None = None, length: int = 12):
    """A random batch with enough non-pad tokens (> 2·width) for the null-vector test."""
    batch = 16 if width is None else min(256, max(16, -(-3 * width // length)))
    return subject.random_batch(batch, length, length, pad_share=0.3)


def setup_trace(run) -> Trace:
    """The residual stream on a random batch wide enough for the null-vector test (eval mode);
    its gradients are in `setup_grads(run)` (parameter .grad untouched).

    `variance-drift` and `ln-placement` both start from it, so it is computed once per run and
    kept in `run.extras`. The gradients come from a pass over the first GRAD_ROWS-sequence
    batch only, and the wide batch (3x the width in tokens: 192 sequences on a 768-wide model)
    runs without grad: the null-vector test needs tokens in proportion to the width, the
    per-layer gradient norms (ln-placement's evidence) do not, and a graph kept for backward
    over 192 sequences through 12 layers costs GBs and most of the setup's time. On a model
    up to 64 wide the two batches are the same one and a single pass gives both."""
    cached = run.extras.get(SETUP_TRACE)
    if cached is not None:
        return cached
    subject = run.subject
    src, tgt = probe_batch(subject)                      # GRAD_ROWS sequences
    grads = _with_grads(run, src, tgt)
    run.extras[SETUP_GRADS] = grads
    if not grads.streams:
        return grads                             # nothing to test; the probes skip
    wide = probe_batch(subject, grads.streams[-1].x.shape[-1])
    if wide[0].shape == src.shape and wide[1].shape == tgt.shape:
        trace = grads                            # the same seeded draw: one pass gives both
    else:
        trace = _streams_only(subject, wide, [sp.name for sp in grads.streams], output_head(subject, grads))
        give_back_freed()                        # the blocks' passes, before the next setups
    run.extras[SETUP_TRACE] = trace
    return trace


def output_head(subject, trace: Trace) -> str | None:
    """The module that turns the stream into the logits, told from `trace` (a recording that
    kept every module's output in order): the last module called after the last stream point
    that is a leaf one-matrix module (`affine_dims`) taking the stream's width d and giving
    the logits' shape (triage may cut its rows to the ids it probes). None when there is no
    such module (a head written as `x @ E.T` in forward). No stream point is recorded after
    it, so a pass that wants the stream alone can stop as it is called: on a 50k vocabulary
    the head is a third of the forward's work, and its logits 460 MB on the wide batch."""
    if trace.logits is None or not trace.streams or not trace.order:
        return None
    last = trace.streams[-1].name
    after = [i for i, (name, _) in enumerate(trace.order) if name == last]
    if not after:
        return None
    d = trace.streams[-1].x.shape[-1]
    modules = dict(subject.model.named_modules())
    for name, x in reversed(trace.order[after[-1] + 1:]):
        m = modules.get(name)
        if m is not None and x.shape == trace.logits.shape and not any(True for _ in m.children()) \
                and (affine_dims(m) or (None,))[0] == d:
            return name
    return None


def setup_grads(run, trace: Trace) -> Trace:
    """The trace holding the stream's gradients for `trace`: the setup's gradient pass when
    `trace` is the setup trace, else `trace` itself (a training step's trace has its own)."""
    if run is not None and trace is run.extras.get(SETUP_TRACE):
        return run.extras.get(SETUP_GRADS, trace)
    return trace


def _streams_only(subject, batch, names: list[str], head: str | None = None) -> Trace:
    """The stream points of `batch` (eval, no grad), stopped before the output `head` when one
    is given. Asked as "grad.stream", a generic capture records the stream points alone;
    "stream" also keeps every module's output for NaN provenance (2.2 GB on 192 sequences of
    a 768-wide 12-layer model). When that gives other points than the gradient pass's `names`
    (tndebug's taps record the embedding output for "stream" only), the batch runs again as
    "stream", and whole."""
    with subject.evaluating():
        trace = in_blocks(subject, batch, ("grad.stream",), head)
        if [sp.name for sp in trace.streams] != names:
            trace = subject.trace(*batch, reads=("stream",))
    return trace


def in_blocks(subject, batch, reads, head: str | None) -> Trace:
    """`subject.trace(*batch, reads, stop_before=head)`, run BLOCK_TOKENS tokens at a time and
    joined (Trace.joined; whole when the parts cannot be joined). In eval mode each sequence's
    stream is its own, so the figures are the whole batch's (to float rounding); what the
    forward allocates on the way is a block's, not the batch's: the wide batch of a 768-wide
    12-layer model (192 x 12 tokens) took 0.5 GB more resident memory whole than in 48-row
    blocks (GPT-2 small triage, issue 21's <= 3x the weights)."""
    src, tgt = batch
    rows = max(1, BLOCK_TOKENS // max(1, src.shape[1] + tgt.shape[1]))
    if src.shape[0] <= rows:
        return subject.trace(src, tgt, reads=reads, stop_before=head)
    parts = [subject.trace(src[i:i + rows], tgt[i:i + rows], reads=reads, stop_before=head)
             for i in range(0, src.shape[0], rows)]
    joined = Trace.joined(parts, src, tgt)
    return joined if joined is not None else subject.trace(src, tgt, reads=reads, stop_before=head)


def _with_grads(run, src, tgt) -> Trace:
    """A recorded forward and backward (eval mode) filling Trace.grads at the stream points.
    Backward asks for the gradients of the 1-d parameters only (norm gains, biases): the
    stream's gradients are the same whatever is asked, every stream point above the first
    such parameter gets one, and no weight-sized gradient is computed or allocated. Points
    left without one (a layer with no 1-d parameter below them) get the full backward."""
    subject, model = run.subject, run.subject.model
    trace = Trace(src=src, tgt=tgt, pad_id=subject.pad_id)
    was = model.training
    model.eval()
    try:
        with torch.enable_grad(), subject.capture.recording(("stream", "grad.stream"), trace):
            logits = subject.logits(src, tgt)                  # [B, T, V]
        trace.logits = logits.detach()
        params = [p for p in model.parameters() if p.requires_grad]
        if logits.requires_grad and params:
            V = logits.shape[-1]
            pred, gold = logits[:, :-1].reshape(-1, V), tgt[:, 1:].reshape(-1)
            loss = (run.criterion(pred, gold) if run.criterion is not None
                    else F.cross_entropy(pred, gold, ignore_index=subject.pad_id))
            small = [p for p in params if p.dim() <= 1]
            torch.autograd.grad(loss, small or params, allow_unused=True,
                                retain_graph=bool(small))        # fills trace.grads
            blocks = [sp for sp in trace.streams if sp.kind in ("sublayer", "layer")]
            if small and any(sp.name not in trace.grads for sp in blocks):
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        model.train(was)
    return trace


def setup_trace_or_skip(probe, run) -> Trace | None:
    """`setup_trace(run)`, or None once `probe.skip(reason)` says why the model gave none."""
    if run.subject.capture is None:
        probe.skip("the model exposes no residual-stream capture")
        return None
    try:
        trace = setup_trace(run)
    except Exception as e:  # noqa: BLE001 - a model that cannot run a random batch
        probe.skip(f"setup forward failed: {type(e).__name__}: {e}")
        return None
    if not trace.streams:
        probe.skip("no transformer blocks were found in this model's forward (the test reads "
                   "the stream between them)")
        return None
    return trace
