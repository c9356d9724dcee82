"""Every finding code tndebug can report, with its meaning: each probe's declared kinds
(`Probe.codes`) and the codes of findings no probe makes (triage's checks of the file and
weights, the front-ends'). `tndebug probes --codes` lists them; `--select`/`--ignore` and the
library's `select=`/`ignore=` are checked against them (judge.codes_option)."""
from __future__ import annotations

from tndebug.probes import PROBE_NAMES, probe_class

# Findings that are not a probe's own: triage's checks of the file and weights, and the front-ends'.
# A code a probe declares (`Probe.codes`) is listed there, once, never again here.
OTHER_CODES = {
    "checkpoint/nonfinite-weights": "non-finite values in the saved weights",
    "checkpoint/implausible-values": "finite values no training produces (|w| > 1e30, a negative "
                                     "second moment): a damaged file",
    "checkpoint/config-mismatch": "the saved config disagrees with the weights' shapes",
    "checkpoint/rebuilt-code": "triage rebuilt tndebug's code without the faults the checkpoint was trained with",
    "checkpoint/inferred-config": "what the weights could not say, settled from held-out loss",
    "checkpoint/tied-head-differs": "HF: the saved head differs from the embedding it is tied to",
    "checkpoint/head-unfit": "HF (--data): an untied head that does not fit the trained body",
    "checkpoint/id-vs-tokenizer": "HF: a config id the saved tokenizer contradicts",
    "checkpoint/start-id-ordinary": "HF: decoder_start_token_id is an ordinary token",
    "checkpoint/id-vs-data": "HF: a config id the targets of --data/--text contradict",
    "checkpoint/weight-files-differ": "HF: two weight files with different weights",
    "checkpoint/kv-head-order": "grouped-query kv heads repeated in the other order than the weights'",
    "pad-id/mid-sequence": "watch: the pad id occurs mid-sequence in your batches",
    "watch/stopped": "watch: tndebug stopped probing (a tndebug bug)",
    "<probe>/probe-failed": "watch: a probe raised and was switched off",
}


def all_codes() -> list[tuple[str, str]]:
    """Every finding code with its meaning: each probe's declared kinds, then the others."""
    out = [(f"{name}/{kind}", meaning) for name in PROBE_NAMES
           for kind, meaning in probe_class(name).codes.items()]
    return out + sorted(OTHER_CODES.items())
