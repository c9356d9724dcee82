"""Which labels a Hugging Face decoder-only checkpoint learnt from (label-shift, issue 21).

Hugging Face causal-LM models shift their labels inside (`model(input_ids, labels=input_ids)`);
a loop that shifts them too (`labels=ids[:, 1:]`) trains the model on the token after next, and a
loss of the user's own on unshifted labels teaches it to repeat its input. label-shift judges
that from the trained weights' predictions (probes/label_shift.py, `_finish_once`): argmax over
the whole vocabulary. The probes' recorded pass sees a sliced output layer (hf.PROBE_VOCAB ids)
and an argmax over a slice is not the model's, so this pass runs apart, without gradients, over
the whole vocabulary, a few rows at a time (the logits of a 50k vocabulary are 200 KB a token)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tndebug.data import Batch
from tndebug.findings import Finding
from tndebug.probes.base import RunContext, StepInfo
from tndebug.probes.label_shift import LabelShiftProbe

NAME = "label-shift"
LOGIT_BYTES = 64 << 20        # fp32 logits per forward (rows x T x V x 4) kept under this


def label_shift(subject, data: Batch) -> tuple[list[Finding], dict]:
    """label-shift's findings and status entry for `subject` (a decoder-only one, its output
    layer whole) on `data` (tgt_in: the ids as fed, tgt_out: the next ids, pads ignored)."""
    probe = LabelShiftProbe()
    run = RunContext(subject=subject, mode="triage", device=str(subject.device))
    probe.setup(run)
    ids, tgt_out = data.tgt_in.to(subject.device), data.tgt_out.to(subject.device)
    empty = ids[:, :0]                          # a decoder-only subject has no source
    preds, loss_sum, scored = [], 0.0, 0
    with torch.no_grad(), subject.evaluating():
        i, rows = 0, 1                          # the first row tells the vocabulary's width
        while i < ids.shape[0]:
            logits = subject.logits(empty[i:i + rows], ids[i:i + rows])
            width = logits.shape[-1]
            preds.append(logits.argmax(-1))
            t = tgt_out[i:i + rows]
            loss_sum += float(F.cross_entropy(logits.reshape(-1, width).float(), t.reshape(-1),
                                              ignore_index=subject.pad_id, reduction="sum"))
            scored += int((t != subject.pad_id).sum())
            del logits
            i, rows = i + rows, max(1, LOGIT_BYTES // (4 * width * max(1, ids.shape[1])))
    loss = torch.tensor(loss_sum / scored if scored else float("nan"))
    probe.update(probe.counts(ids, torch.cat(preds), tgt_out, loss), StepInfo(0, loss=loss))
    probe.finish(run)
    return list(probe.findings), probe.status_entry()
