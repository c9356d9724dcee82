"""The real-bug corpus: bugs reported in public issue trackers and fix PRs of Transformer code,
each reconstructed as a switch on the model of `model.py` (a swapped-in subclass from
`mechanisms.py`, a setting, or a training-loop variant from `loops.py`).

Every entry records the thread it comes from (the address as the issue search gave it),
whether the bug changes what the model computes on real tokens (`changes`), and the finding
expected from tndebug: the probe that owns the failure mode and its severity (docs/severity.md);
`expected_severity=None` means the model must stay clean (no warning or error).

    from bugs import BUGS, build
    model = build(BUGS["no_scale"], seed=0)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import mechanisms as X
from model import Config, Embeddings, MultiHeadAttention, PositionalEncoding, Residual, Seq2Seq


def _swap(*pairs) -> Callable:
    def apply(model):
        for base, buggy in pairs:
            X.swap(model, base, buggy)
    return apply


def _swap_table(buggy: type) -> Callable:
    """The PositionalEncoding swapped for `buggy` *and its table rebuilt*: the buffer is made in
    __init__, so swapping the class alone left the healthy table in place (the PE-table bugs
    were inert in this corpus until issue 45)."""
    def apply(model):
        X.swap(model, PositionalEncoding, buggy)
        for m in model.modules():
            if type(m) is buggy:
                m.pe.copy_(m.table(m.d_model, m.max_len).unsqueeze(0))
    return apply


def _nothing(model) -> None:
    return None


def _doubled_attention_residual(model) -> None:
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.res[0].__class__ = X.ResidualDoubled          # the attention sublayer only (BitNet)


def _logit_scale(model) -> None:
    X.swap(model, Embeddings, X.UnscaledEmbedding)
    X.swap(model, Seq2Seq, X.LogitScale)
    model.generator.weight = model.tgt_embed[0].lut.weight   # tied, as the paper's section 3.4


def _scale_in_pe(model) -> None:
    X.swap(model, Embeddings, X.UnscaledEmbedding)
    X.swap(model, PositionalEncoding, X.ScaleInPE)


@dataclass(frozen=True)
class Bug:
    name: str
    url: str                       # the thread, exactly as the issue search returned it
    reported: str                  # what the thread reports, in one line (our words)
    changes: str                   # "yes", "no", or when it bites ("fp16 only", ...)
    expected_probe: str | None     # the probe that owns the failure mode; None: stay clean
    expected_severity: str | None  # "error" | "warning" | "info" | None (clean)
    apply: Callable = _nothing     # the switch, on a built model
    config: dict = field(default_factory=dict)   # Config overrides
    front: str = "check"           # "check" (tndebug.check) | "watch" (a training loop)
    loop: dict = field(default_factory=dict)     # loops.run_watch options for front="watch"

    @property
    def benign(self) -> bool:
        return self.expected_severity is None


def build(bug: Bug | None = None, seed: int = 0) -> Seq2Seq:
    torch.manual_seed(seed)
    model = Seq2Seq(replace(Config(), **(bug.config if bug else {})))
    if bug is not None:
        bug.apply(model)
    return model


A = MultiHeadAttention
_ALL = [
    # -- masks --------------------------------------------------------------------------------
    Bug("pad_mask_on_queries_inf", "https://github.com/hyunwoongko/transformer/pull/40",
        "decoder pad mask unsqueeze(1).unsqueeze(3) masks query rows; with -inf a pad row is all -inf -> NaN",
        "yes", "nan-scores", "error", _swap((Seq2Seq, X.PadMaskOnQueries), (A, X.NegInfFill))),
    Bug("pad_mask_on_queries_1e4", "https://github.com/hyunwoongko/transformer/pull/40",
        "the same mask as shipped, filled with -10000: 'works despite this bug' (pad query rows only)",
        "pad query rows only", None, None, _swap((Seq2Seq, X.PadMaskOnQueries), (A, X.Fill1e4))),
    Bug("no_tgt_mask", "https://github.com/alex-matton/causal-transformer-decoder/issues/1",
        "no causal target mask in training: the decoder copies future tokens",
        "yes", "mask-broadcast", "error", _swap((Seq2Seq, X.NoTgtMask))),
    Bug("bidirectional_decoder_mask", "https://github.com/huggingface/transformers/issues/48745",
        "decoders built a bidirectional (padding-only) mask: future tokens leak",
        "yes", "mask-broadcast", "error", _swap((Seq2Seq, X.PadOnlyTgtMask))),
    Bug("float_tril_added", "https://github.com/pytorch/pytorch/issues/21518",
        "a 0/1 tril passed as float attn_mask is added to the scores (+1 / +0): causality not enforced",
        "yes", "mask-broadcast", "error", _swap((Seq2Seq, X.FloatTrilTgtMask), (A, X.AddFloatMask))),
    Bug("fill_from_mask", "https://github.com/30stomercury/Interaction-Aware-Attention-Network/issues/1",
        "paddings = mask * -1e8 is 0 where the mask is 0, so masked scores are set to 0, not masked",
        "yes", "mask-broadcast", "error", _swap((A, X.FillFromMask))),
    Bug("all_ones_src_mask", "https://github.com/yg211/bert_nli/pull/3",
        "attention masks initialised to 1 everywhere: padded tokens attended",
        "yes", "mask-broadcast", "error", _swap((Seq2Seq, X.AllOnesSrcMask))),
    Bug("inverted_src_mask", "https://github.com/pytorch/pytorch/pull/39321",
        "key_padding_mask True means 'ignore'; a mask with True at real tokens masks them instead",
        "yes", "mask-broadcast", "error", _swap((Seq2Seq, X.InvertedSrcMask))),
    Bug("true_is_pad_mask", "https://github.com/mlwithme/TransformerTranslation/issues/2",
        "question: a mask True at pads passed straight to masked_fill; answered: correct as written",
        "no", None, None, _swap((Seq2Seq, X.TrueIsPadMasks), (A, X.TrueIsPadFill))),
    Bug("additive_mask_1e4", "https://github.com/huggingface/transformers/issues/542",
        "question: the mask is added, not multiplied; answered: (1 - mask) * -10000 is the mask",
        "no", None, None, _swap((A, X.AdditiveMask))),
    Bug("triu_diagonal_1", "https://github.com/TransformerLensOrg/TransformerLens/issues/284",
        "question: triu(diagonal=1) excludes the diagonal; answered: it marks the forbidden keys",
        "no", None, None, _swap((Seq2Seq, X.TriuForbidden))),
    # -- mask fill and norms under float16 --------------------------------------------------
    Bug("neg_inf_fill", "https://github.com/THUwangcy/ReChorus/issues/8",
        "masked_fill with -inf gives NaN when every key of a row is masked",
        "on a source made only of pads", "nan-scores", "info", _swap((A, X.NegInfFill))),
    Bug("fill_1e10_fp16", "https://github.com/bentrevett/pytorch-seq2seq/issues/191",
        "masked_fill(mask == 0, -1e10) cannot be converted to half precision",
        "fp16 only", "nan-scores", "info", _swap((A, X.Fill1e10))),
    Bug("ln_eps_1e-12_fp16", "https://github.com/wenet-e2e/wenet/pull/907",
        "LayerNorm eps=1e-12 rounds to 0 in float16: NaN after model.half()",
        "fp16 only", "nan-scores", "info", config={"ln_eps": 1e-12}),
    # -- the scale ----------------------------------------------------------------------------
    Bug("no_scale", "https://github.com/huggingface/blog/pull/2893",
        "attention code example without the 1/sqrt(d_k) of its own formula",
        "yes", "missing-scale", "error", _swap((A, X.NoScale))),
    Bug("scale_by_d_k", "https://github.com/delzac/cntkx/issues/10",
        "ScaledDotProductAttention without the square root: scores divided by d_k",
        "yes", "missing-scale", "error", _swap((A, X.ScaleByDk))),
    Bug("scale_after_softmax", "https://github.com/FrancescoSaverioZuppichini/ViT/issues/2",
        "softmax(energy) * scaling: the scale applied after the softmax",
        "yes", "missing-scale", "error", _swap((A, X.ScaleAfterSoftmax))),
    Bug("scale_split_qk", "https://github.com/openai/guided-diffusion/issues/38",
        "question: 1/sqrt(sqrt(ch)) looks wrong; answered: applied to q and to k it is 1/sqrt(ch)",
        "no", None, None, _swap((A, X.ScaleSplitQK))),
    Bug("scale_on_q", "https://github.com/karpathy/minGPT/pull/55",
        "the sqrt(d) scaling moved onto q instead of the attention matrix (same numbers)",
        "no", None, None, _swap((A, X.ScaleOnQ))),
    # -- the softmax --------------------------------------------------------------------------
    Bug("softmax_dim0", "https://github.com/PetrochukM/PyTorch-NLP/issues/2",
        "attention softmax over dim 0 (the batch) instead of the keys",
        "yes", "mask-broadcast", "error", _swap((A, X.SoftmaxBatchDim))),
    Bug("softmax_dim2_on_4d", "https://github.com/FudanNLP/fastNLP/issues/254",
        "softmax(dim=2) written for 3-D scores is over the queries on 4-D [B, h, T, S]",
        "yes", "mask-broadcast", "error", _swap((A, X.SoftmaxDim2))),
    # -- heads --------------------------------------------------------------------------------
    Bug("split_heads_no_transpose", "https://github.com/reczoo/FuxiCTR/issues/30",
        "heads split by view(batch * heads, -1, dim) without the transpose",
        "yes", "mask-broadcast", "error", _swap((A, X.SplitNoTranspose))),
    Bug("merge_heads_no_permute", "https://github.com/jsbaan/transformer-from-scratch/pull/6",
        "missing permute before the reshape that concatenates the heads",
        "yes", "mask-broadcast", "error", _swap((A, X.MergeNoPermute))),
    Bug("merge_no_permute_one_head", "https://github.com/hackiey/QAnet-pytorch/issues/2",
        "the same missing permute, with 1 head: 'the result seems not changing'",
        "no", None, None, _swap((A, X.MergeNoPermute)), config={"heads": 1}),
    Bug("attn_dropout_in_eval", "https://github.com/meta-pytorch/torchtune/pull/1803",
        "SDPA dropout_p passed unconditionally: attention dropout also in eval mode",
        # named by mask-broadcast's first exact test (two identical eval calls must agree),
        # which every comparison rests on; train-mode reads module flags and cannot see it
        "yes (eval outputs random)", "mask-broadcast", "error", _swap((A, X.DropoutAlways))),
    # -- positions and embeddings -------------------------------------------------------------
    Bug("pe_single_row", "https://github.com/DiffPoseTalk/DiffPoseTalk/issues/20",
        "x + pe[:, x.shape[1], :]: one PE row (position T's) added to every position",
        "yes", "positional-encoding", "error", _swap((PositionalEncoding, X.PESingleRow))),
    Bug("pe_indexed_by_batch", "https://github.com/songyangco/GETNext/issues/2",
        "the positional encoding added along the batch dimension: one PE per sequence",
        "yes", "positional-encoding", "error", _swap((PositionalEncoding, X.PEByBatch))),
    Bug("pe_precedence", "https://github.com/zju3dv/LoFTR/issues/41",
        "-log(10000) / d_model // 2 parses as -1: other frequencies; 'a minor performance increase' when fixed",
        "PE values only (positions still encoded)", None, None, _swap_table(X.PEPrecedence)),
    Bug("pe_integer_division", "https://github.com/Kyubyong/transformer/pull/81",
        "integer division in the PE exponent gives 0: every frequency 1",
        "yes: one frequency in every pair, positions about 2*pi*k apart alias (issue 45: a "
        "miss on the held-out real-bug set)", "positional-encoding", "warning",
        _swap_table(X.PEIntegerDivision)),
    Bug("sqrt_d_model_in_pe", "https://github.com/SamLynnEvans/Transformer/issues/10",
        "embedding not multiplied by sqrt(d_model); answered: the PE class multiplies it",
        "no", None, None, _scale_in_pe),
    Bug("logit_side_scale", "https://github.com/jadore801120/attention-is-all-you-need-pytorch/issues/138",
        "shared-embedding factor d_model^-0.5 on the logits; answered: the same ratio, other side",
        "no (an equivalent parametrisation)", None, None, _logit_scale),
    # -- residuals ----------------------------------------------------------------------------
    Bug("residual_of_normed_input", "https://github.com/Howuhh/faster-trajectory-transformer/issues/3",
        "pre-norm block written norm_x = norm(x); norm_x + attn(norm_x): the residual carries norm(x)",
        "yes", "ln-placement", "error", _swap((Residual, X.ResidualOfNorm))),
    Bug("residual_x_plus_x", "https://github.com/kyegomez/BitNet/issues/32",
        "x = attn(x); x = x + x: the attention output added to itself, no residual",
        "yes", "ln-placement", "error", _doubled_attention_residual),   # residual-missing (exact)
    # -- the training loop (tndebug.watch) ----------------------------------------------------
    Bug("no_zero_grad", "https://github.com/tenstorrent/tt-blacksmith/pull/711",
        "zero_grad left out of the trainer: gradients accumulate across steps",
        "yes", "zero-grad", "error", front="watch", loop={"zero_grad": False}),
    Bug("no_train_after_eval", "https://github.com/shubhamagarwal92/mmd/issues/14",
        "model.eval() in evaluate, no model.train() after it: dropout off for the rest of training",
        "yes", "train-mode", "warning", front="watch", loop={"eval_at": 3}),
    Bug("no_train_after_eval_no_dropout", "https://github.com/tk-rusch/coRNN/issues/1",
        "model.train() not called after model.eval(); answered: no dropout or batch-norm, no effect",
        "no", None, None, config={"dropout": 0.0}, front="watch", loop={"eval_at": 3}),
    Bug("warmup_restart_on_resume", "https://github.com/lightly-ai/lightly-train/pull/301",
        "scheduler state not saved: the lr resets to the start of warmup on resume",
        "yes", "lr-schedule", "error", front="watch", loop={"resume": "restart_warmup"}),
    Bug("smoothing_loss_counts_pad", "https://github.com/k-tahiro/bert-summarizer/pull/41",
        "a label-smoothing loss that does not ignore padding positions",
        "yes", "label-smoothing", "error", front="watch", loop={"criterion": "smooth_no_ignore"}),
    Bug("smoothing_uniform_part_counts_pad", "https://github.com/pytorch/pytorch/issues/73205",
        "CrossEntropyLoss label_smoothing: the uniform part counts ignored samples",
        "yes", "label-smoothing", "error", front="watch", loop={"criterion": "smooth_uniform_all_rows"}),
    Bug("smoothing_mass_on_pad", "https://github.com/OpenNMT/OpenNMT/issues/570",
        "the line one_hot[ignore_index] = 0 asked about; without it smoothing mass goes to <pad>",
        "yes", "label-smoothing", "warning", front="watch", loop={"criterion": "smooth_onto_pad"}),
]
BUGS: dict[str, Bug] = {b.name: b for b in _ALL}
assert len(BUGS) == len(_ALL), "bug names must be unique"
