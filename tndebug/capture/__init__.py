"""The capture stage: a model's forward (and backward) pass in, one `Trace` out.

    model (tap points, or foreign code) -> capture -> Trace -> probes

* `trace`: the Trace types every probe reads (AttentionRecord, StreamPoint, the read names);
* `taps`: tndebug's own model, from its HookPoints (`TapCapture`);
* foreign code, by behaviour (`GenericCapture`), split by job: `structure` (names as hints),
  `generic` (discovery of attention sites, FFNs and embeddings; the recording's hooks),
  `recording` and `streams` (what one recording has seen), `projections` (q/k provenance, mask
  or bias), `patching` (the torch primitives intercepted while recording);
* `adapters`: how to call a user's model, forward(model, src, tgt, pad_id) -> logits.
"""
from tndebug.capture.generic import GenericCapture
from tndebug.capture.structure import is_attention
from tndebug.capture.projections import masked_by_addition, projection_weights
from tndebug.capture.taps import TapCapture
from tndebug.capture.trace import AttentionRecord, StreamPoint, Trace, check_reads

__all__ = ["AttentionRecord", "GenericCapture", "StreamPoint", "TapCapture", "Trace",
           "check_reads", "is_attention", "masked_by_addition", "projection_weights"]
