"""The probes' metric tags, declared once: each family's template, its parts, what it means.

    HEAD.build(kind="enc_self", layer=0, head=1, stat="entropy")  # 'attn/enc_self/layer0/head1/entropy'
    HEAD.parse("attn/enc_self/layer0/head1/entropy")              # {'kind': 'enc_self', 'layer': 0, ...}
    HEAD.regex(kind="enc_self", layer=0, stat="entropy")          # r'attn/enc_self/layer0/head\\d+/entropy'

Probes emit tags through `build` (`Probe.metric(step, tag, value)`); the readers (the figures in
reporters/plots.py, TensorBoard's charts in reporters/tensorboard.py, the Recorder's `series_of`)
read them back through `parse`, or `pattern` / `regex` where they need a regular expression
(TensorBoard's custom-scalar charts are regexes over tags). A part's regex is what a reader
accepts; `build` writes any value, so a site with no numbered layer (`layer=None`, written
`layer?`) is recorded but read by no per-layer figure or chart.
"""
from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass, field

KIND = r"enc_self|dec_self|cross"          # capture/trace.py's attention kinds
NUMBER = r"\d+"


@dataclass(frozen=True)
class TagFamily:
    """One kind of metric tag. `template` names its parts in braces; `parts` gives each part's
    regex (what readers accept) and `meaning` says what the value is; `stats` the leaf names the
    probes write, with their meaning (a reader may accept more: the part's regex decides)."""
    name: str
    template: str
    parts: dict[str, str]
    meaning: str
    stats: dict[str, str] = field(default_factory=dict)
    emitted_by: str = ""

    def build(self, **parts) -> str:
        """The tag for these parts (a `layer` or `head` of None is written `?`)."""
        missing = set(self.parts) - set(parts)
        if missing:
            raise ValueError(f"tag {self.name}: missing part(s) {', '.join(sorted(missing))}")
        return self.template.format(**{k: "?" if v is None else v for k, v in parts.items()})

    @property
    def pattern(self) -> re.Pattern:
        """The template as a regex with one named group per part, in template order."""
        return _compiled(self.template, tuple(sorted(self.parts.items())))

    def parse(self, tag: str) -> dict | None:
        """{part: value} of a tag of this family (numbers as int), or None."""
        m = self.pattern.fullmatch(tag)
        if m is None:
            return None
        return {k: int(v) if self.parts[k] == NUMBER else v for k, v in m.groupdict().items()}

    def regex(self, **fixed) -> str:
        """A regex source over the family's tags: each part in `fixed` literal, the others as
        their part's regex (TensorBoard's custom-scalar charts)."""
        return self.template.format(**{k: (str(fixed[k]) if k in fixed else self.parts[k])
                                       for k in self.parts})


@functools.lru_cache(maxsize=None)
def _compiled(template: str, parts: tuple) -> re.Pattern:
    regexes = dict(parts)
    out = []
    for literal, name, _, _ in string.Formatter().parse(template):
        out.append(re.escape(literal))
        if name is not None:
            out.append(f"(?P<{name}>{regexes[name]})")
    return re.compile("".join(out))


HEAD = TagFamily(
    "head", "attn/{kind}/layer{layer}/head{head}/{stat}",
    {"kind": KIND, "layer": NUMBER, "head": NUMBER, "stat": r"\w+"},
    "one attention head of one layer, over the real query rows of the probe batch",
    {"entropy": "mean attention entropy / ln(keys in play): 0 one key, 1 uniform",
     "max_prob": "mean of each query row's largest attention probability",
     "similarity": "mean 1 - JS divergence (bits) to the layer's other heads"},
    "head-collapse")
DIVERSITY = TagFamily(
    "diversity", "attn/{kind}/layer{layer}/diversity", {"kind": KIND, "layer": NUMBER},
    "mean JS divergence (bits) between every pair of the layer's heads", {}, "head-collapse")
DEPTH = TagFamily(
    "depth", "depth/{stack}/layer{layer}/{stat}",
    {"stack": r"encoder|decoder", "layer": NUMBER, "stat": r"\w+"},
    "the residual stream at one block's output",
    {"resid_rms": "RMS of the stream", "rank": "effective rank of the stream's tokens"},
    "variance-drift")
GRAD = TagFamily(
    "grad", "grad/{stack}/layer{layer}/norm", {"stack": r"\w+", "layer": NUMBER},
    "norm of the gradient of one layer's parameters (a module outside the numbered layers: "
    "`grad/<module path>/norm`, GRAD_OUTSIDE)", {}, "gradient-flow")
GRAD_OUTSIDE = TagFamily(
    "grad-module", "grad/{module}/norm", {"module": r"[\w.]+"},
    "norm of the gradient of one module outside the numbered layers (`total`: every parameter)",
    {}, "gradient-flow")
RELU = TagFamily(
    "relu", "relu/{stack}/layer{layer}/dead_fraction", {"stack": r"\w+", "layer": NUMBER},
    "share of one layer's feed-forward units that never fire on the probe batch", {},
    "gradient-flow")
SCALE = TagFamily(
    "scale", "scale/{kind}/layer{layer}/{stat}", {"kind": KIND, "layer": NUMBER, "stat": r"\w+"},
    "one attention site's score scale",
    {"scale_x_sqrt_dk": "the fitted score scale times sqrt(d_k): 1 for 1/sqrt(d_k)",
     "mean_max_prob": "mean largest attention probability of a query row",
     "norm_entropy": "mean attention entropy / ln(keys)"},
    "missing-scale")

PE_RHO = TagFamily(
    "pe-rho", "pe/{site}/rho", {"site": r"[\w.]+"},
    "rank correlation of the positional signal with position at one embedding site", {},
    "positional-encoding")
LABEL_SHIFT = TagFamily(
    "label-shift", "label-shift/{name}_rate", {"name": r"[a-z_]+?"},
    "share of positions whose prediction is the input token (`self`), the next one (`next`: "
    "healthy) or the one after next (`after_next`)", {},
    "label-shift")

FAMILIES = (HEAD, DIVERSITY, DEPTH, GRAD, RELU, SCALE, GRAD_OUTSIDE, PE_RHO, LABEL_SHIFT)
# (parse tries them in this order: the first that matches names the tag)

# single tags (no parts), with their meaning
LOSS_TRAIN, LR_OBSERVED = "loss/train", "lr/observed"
FIXED = {LOSS_TRAIN: "the training loss the run reports (TensorBoard: train/loss)",
         "loss/ce": "cross-entropy of the logits on the batch",
         "loss/ce_over_uniform": "loss/ce / ln V (1: no better than uniform)",
         "loss/plateau_ce": "the mean loss over the plateau window",
         LR_OBSERVED: "the optimizer's learning rate (TensorBoard: train/lr)",
         "lr/declared": "the schedule's declared learning rate",
         "grad/total/norm": "norm of the gradient of every parameter",
         "smoothing/criterion_q_pad": "the criterion's target mass on the pad id",
         "smoothing/pad_mass": "the model's predicted mass on the pad id",
         "pe/encoder/permutation_rel_diff": "relative change of the encoder output when the "
                                            "source is permuted (float32)",
         "pe/encoder/permutation_rel_diff_float64": "the same, rechecked in float64",
         "pe/decoder/swap_rel_diff": "relative change of the first mixing attention's output at "
                                     "later positions when two earlier tokens are swapped",
         "lr/update_ratio": "the update-to-weight ratio |lr * update| / |w| of a step"}


def parse(tag: str) -> tuple[TagFamily, dict] | None:
    """(the family, its parts) of a tag, or None for a single tag or one no family declares."""
    for fam in FAMILIES:
        got = fam.parse(tag)
        if got is not None:
            return fam, got
    return None
