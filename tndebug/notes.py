"""What the four seed tutorial notes say, as plain data.

The notes are in /work/shared/seeds/ (written in Chinese):

* 000: a hand-written PyTorch 1.13 walkthrough with a pitfall table;
* 001: a code companion to a slide deck, in the style of the annotated Transformer;
* 002: a source-level dissection of the Transformer;
* 003: a "day 14" reading guide to The Annotated Transformer.

This module holds two tables (each probe's probable cause, paraphrased
from the notes with citations such as "[note 001]", is its class's `cause`; each fault's
fix text, in the words of the notes, is `faults.FAULT_NOTES`, beside the faults):

SEED_NOTES
    note id -> one-line English title.
NOTE_CLAIMS
    Concrete claims in the notes that a measurement can confirm or refute.
    Each entry is a dict with the keys note, claim, quote (the original
    Chinese, at most 80 chars), checkable_how and flag.  The flag gives our
    verdict: "contradicts ..." or "wrong (measured ...)" where we checked
    with torch on CPU, or "" when the claim is plausible but unchecked.

The notes are not reliable.  Several of their claims are wrong or
contradict each other (see the flags).  Treat them as hypotheses for
tndebug to test, not as ground truth.
"""
from __future__ import annotations

SEED_NOTES: dict[str, str] = {
    "000": "Hand-written 'Attention is all you need' code notes (PyTorch 1.13): "
           "module-by-module walkthrough, training config (BPE, Noam, smoothing), pitfall table",
    "001": "Slide-deck companion: paper formulas to debuggable PyTorch (annotated-Transformer "
           "style MHA/PE/LayerNorm/Noam/LabelSmoothing) with per-section troubleshooting",
    "002": "Source-level dissection: multi-head split, sinusoidal vs learned PE, Post-LN vs "
           "Pre-LN, padding/causal masks, lr/dropout/smoothing, training pitfalls",
    "003": "Day-14 guide to The Annotated Transformer (Rush 2018 / Huang et al. 2022): pre-norm "
           "deviation from paper, mask shapes, KLDiv label smoothing, copy task",
}

NOTE_CLAIMS: list[dict] = [
    {
        "note": "000",
        "claim": "Pre-LN (LN before residual) is a mistake: layer-3 output variance >5.0 and "
                 "Adam fails; Post-LN stays at 0.9-1.1",
        "quote": "若前置，则第3层输出方差可能飙升至5.0以上，Adam优化器直接失效",
        "checkable_how": "Per-layer residual RMS at init for Pre-/Post-LN; train both with "
                         "and without warmup",
        "flag": "contradicts 002,003 (Pre-LN is more stable) and Xiong 2020; our CPU sim "
                "(6 layers, unit input) gives Pre-LN var 2.15 at layer 3 (linear growth, normal)",
    },
    {
        "note": "001",
        "claim": "LayerNorm inside the sublayer (pre-norm) causes gradient instability",
        "quote": "常见错误是把LayerNorm放在Sublayer(x)内部，这会导致梯度不稳定",
        "checkable_how": "Per-layer grad norms at init (Xiong: Pre-LN flat, Post-LN grows "
                         "toward output)",
        "flag": "contradicts 002 and 003 (annotated code is pre-norm; most LLMs use it)",
    },
    {
        "note": "002",
        "claim": "Pre-LN trains more stably and needs no learning-rate warmup for deep models",
        "quote": "Pre-LN的训练更稳定不需要学习率预热就能训练深层模型",
        "checkable_how": "Train Pre-LN and Post-LN without warmup at the same lr; compare "
                         "divergence rate",
        "flag": "consistent with Xiong 2020; contradicts 000 and 001",
    },
    {
        "note": "000",
        "claim": "Without 1/sqrt(d_k) the attention tends to uniform (high entropy) and "
                 "loses focus; loss drops slowly",
        "quote": "注意力分布趋向均匀（entropy高），丧失聚焦能力",
        "checkable_how": "Normalised attention entropy at step 0 with vs without scale",
        "flag": "wrong (measured: normalised entropy 0.14 unscaled vs 0.88 scaled, max-p "
                "0.80 vs 0.13); contradicts 001,002 (one-hot/sharp)",
    },
    {
        "note": "001",
        "claim": "Without scaling, softmax goes near one-hot, gradients vanish, early "
                 "loss oscillates",
        "quote": "导致Softmax输出趋近于one-hot分布，梯度消失",
        "checkable_how": "Max attention prob and grad norm of W_Q/W_K at step 0, "
                         "scaled vs unscaled",
        "flag": "confirmed at init (max-p 0.80 unscaled); note 000 says the opposite",
    },
    {
        "note": "000",
        "claim": "For d_k=64 the raw QK^T dot product has mean ~64 and std ~8",
        "quote": "QK^T点积均值约64，标准差约8",
        "checkable_how": "Sample unit-variance q,k with d_k=64; measure mean/std of q.k",
        "flag": "half wrong (measured mean 0.00, std 8.01): variance is d_k, mean is 0",
    },
    {
        "note": "001",
        "claim": "Forgetting transpose after view makes matmul raise a size mismatch",
        "quote": "若此处维度错位（如忘记transpose），matmul会报size mismatch",
        "checkable_how": "Run self-attention with view(B,T,h,d_k) without transpose; "
                         "check for an error",
        "flag": "wrong (measured: matmul runs silently, (B,T,h,h) scores mixing positions; "
                "errors only if T!=S); note 000 claims the same",
    },
    {
        "note": "002",
        "claim": "-inf in masked_fill makes softmax NaN, so use -1e9 (equivalent masking)",
        "quote": "负无穷在softmax里会导致NaN而-1e9足够小",
        "checkable_how": "Softmax of a partly vs fully masked row with -inf / -1e9; "
                         "-1e9 fill in fp16",
        "flag": "partly wrong: NaN only for fully masked rows (all -1e9 gives uniform "
                "1/n); -1e9 overflows fp16 (masked_fill raises); 000/001 use -inf",
    },
    {
        "note": "000",
        "claim": "LayerNorm eps=1e-6 can make var+eps zero on GPU and trigger NaN; "
                 "eps=1e-3 gives a jagged loss",
        "quote": "eps=1e-6时，GPU浮点精度下var(x)+eps可能为0，触发NaN",
        "checkable_how": "LayerNorm on constant rows with eps 1e-6/1e-8/1e-12 in fp32 and "
                         "fp16",
        "flag": "wrong for fp32 (finite even at 1e-12); in fp16 1e-6 is representable, "
                "1e-8 and 1e-12 round to 0",
    },
    {
        "note": "000",
        "claim": "With dropout=0.0 every head in layer 4 collapsed to the same pattern; "
                 "dropout=0.1 restored diversity",
        "quote": "dropout=0.0时，第4层所有头均坍缩，启用dropout=0.1后恢复多样性",
        "checkable_how": "Pairwise head JS divergence/entropy per layer, dropout 0 vs 0.1, "
                         "several seeds",
        "flag": "wrong (measured, copy task, dropout 0 vs 0.1, tiny 400 steps x 4 seeds and "
                "small 300 x 3: mean pairwise head JS 0.28 vs 0.23 bits and 0.59 vs 0.59, no "
                "layer below 0.01 bits); FAILURE_MODES: redundant heads are normal, only exact "
                "duplication is a bug",
    },
    {
        "note": "000",
        "claim": "warmup 4000 found by grid search; warmup 1000 sends loss to inf within 100 "
                 "steps; 8000 is 0.12 worse at step 4000",
        "quote": "warmup_steps=1000：前期学习率过高，梯度爆炸，loss在100步内升至inf",
        "checkable_how": "Noam lr values (w=1000: lr@100=1.4e-4, peak 1.4e-3) and short "
                         "training runs per warmup",
        "flag": "implausible: at step 100 the w=1000 lr is only 1.4e-4, lower than the "
                "w=4000 peak (7.0e-4)",
    },
    {
        "note": "002",
        "claim": "Loss went NaN from a too-high lr; warmup plus a peak lr of ~1e-4 fixed it",
        "quote": "后来加了预热学习率峰值控制在1e-4左右训练就稳定了",
        "checkable_how": "Log peak lr; Noam(d=512,w=4000) peaks at 6.99e-4",
        "flag": "contradicts the Noam schedule in 000/001/003 (peak ~7e-4, factor 1)",
    },
    {
        "note": "000",
        "claim": "Loss stuck at ~3.5 means PE not added or pads attended (attention "
                 "uniform)",
        "quote": "训练loss不下降，始终在3.5左右",
        "checkable_how": "Compare the plateau with ln V and the unigram entropy; run the "
                         "PE-permutation test",
        "flag": "the 3.5 is vocab-dependent (ln 37000=10.5), so not a universal signature",
    },
    {
        "note": "000",
        "claim": "max_len=128 (= longest train sentence) silently truncates PE and costs "
                 "2.3 BLEU; use >=256",
        "quote": "max_len=128时，模型在验证集上BLEU分数下降2.3分",
        "checkable_how": "Feed seq_len>max_len through PositionalEncoding; observe "
                         "error vs silent truncation",
        "flag": "doubtful: x + pe[:, :T] with T>max_len raises a shape error rather than "
                "truncating (note 002: 'out of bounds')",
    },
    {
        "note": "000",
        "claim": "Label smoothing puts eps/(V-1) on every other class; CrossEntropyLoss "
                 "cannot do smoothing",
        "quote": "其他类为ε/(vocab_size-1)",
        "checkable_how": "Unit-test the criterion: gradient on the pad column at uniform "
                         "logits",
        "flag": "contradicts 001/003 (eps/(V-2), pad column and rows zeroed); "
                "CrossEntropyLoss has label_smoothing since torch 1.10",
    },
    {
        "note": "001",
        "claim": "Usage example feeds raw logits to the KLDivLoss label smoothing criterion",
        "quote": "pred = torch.randn(2, 1000) # logits",
        "checkable_how": "Check that the criterion input rows logsumexp to 0 (log-probs)",
        "flag": "bug: 003 says KLDivLoss needs log_softmax input, not logits",
    },
    {
        "note": "001",
        "claim": "Embeddings x sqrt(d_model) keep the embedding from dominating, else PE is "
                 "drowned; embedding norm ~22.6",
        "quote": "否则PE信号被Embedding淹没",
        "checkable_how": "rho = RMS(emb*scale)/RMS(PE) with and without the scale",
        "flag": "direction wrong: scaling enlarges emb; with xavier (V=1000) unscaled rho ~0.05. "
                "Measured norm 863, not 22.6",
    },
    {
        "note": "002",
        "claim": "Overfitting a tiny dataset to ~100% accuracy shows the model and code "
                 "are basically correct",
        "quote": "如果模型能在这个小数据集上达到接近100%的准确率说明模型结构和代码逻辑基本没问题",
        "checkable_how": "Inject view-without-transpose, no_causal_mask etc.; see whether "
                         "the copy task still reaches ~100%",
        "flag": "contradicted by FAILURE_MODES (a copy task missed view-without-"
                "transpose); 003 makes the same copy-task claim",
    },
    {
        "note": "000",
        "claim": "Vocabulary must be sorted so that <unk>=0 and <pad>=1",
        "quote": "确保<unk>索引为0，<pad>为1",
        "checkable_how": "Compare pad id used by vocab, masks and criterion",
        "flag": "conflicts with 002 (create_padding_mask pad_token=0) and 001 "
                "(padding_idx=0); risk of pad-id mismatch",
    },
    {
        "note": "000",
        "claim": "Resuming without step_num resets warmup, lr jumps, and loss rises 0.3",
        "quote": "学习率预热会重置，导致后续训练学习率突变",
        "checkable_how": "lr just before and after resume vs schedule(global_step); "
                         "loss jump",
        "flag": "",
    },
    {
        "note": "003",
        "claim": "Label smoothing (0.9/0.1) worsens perplexity but improves BLEU",
        "quote": "困惑度会变差，但 BLEU 会提高",
        "checkable_how": "Train eps=0 vs 0.1; compare held-out perplexity and BLEU/accuracy",
        "flag": "",
    },
]
