"""ln-placement's missing-residual test (`tndebug/probes/_skip_path.py`): skip shares of healthy
and broken blocks, at initialisation and after training, calibration runs apart from the rest.

    python bench/residual_skip.py                      # -> bench/results/residual_skip.json, .md

Each case is `tndebug.check(model, forward, probes="ln-placement")` on the model as built (seed 0)
and again after STEPS Adam steps (lr 3e-3; decoder-only and encoder-only models learn to copy the
first half of a sequence into the second, encoder-decoders the copy task). Per case: the skip
share of every block (median over tokens of the output's relative move over the input's, with
every weight in the block held), whether ln-placement/residual-missing was reported, and which
parts it named.

* calibration (MIN_SHARE was set looking at these): tndebug's tiny model Pre-LN and Post-LN,
  healthy and `no_attn_residual`; nanoGPT (tests/foreign/nanogpt.py) healthy and with the
  attention residual removed; at initialisation only.
* evaluation (reported; nothing was set on them): every healthy model of tests/foreign and
  tests/foreign/styles, Hugging Face GPT-2, BERT (MaskedLM and BertModel), Llama, BART
  (ConditionalGeneration and BartModel), T5, tndebug's own model over pre/post x LayerNorm/RMSNorm
  x encoder-decoder/decoder-only; residuals scaled (nanoGPT x + 0.1 f(x), DeepNet 2 x + f(x));
  broken: nanoGPT without the FFN residual and without both, tndebug's `no_attn_residual` and
  `no_residual` in both placements; each at initialisation and after training.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "foreign"))
from _provenance import Provenance, provenance_line  # noqa: E402

import tndebug  # noqa: E402
from tndebug.capture.adapters import import_file  # noqa: E402
from tndebug.probes import _skip_path  # noqa: E402

STEPS = 100
FOREIGN = ROOT / "tests" / "foreign"
NANOGPT_EDITS = {
    "attn": {"x = x + self.attn(self.ln_1(x), pad)": "x = self.attn(self.ln_1(x), pad)"},
    "ffn": {"return x + self.mlp(self.ln_2(x))": "return self.mlp(self.ln_2(x))"},
    "scaled": {"x = x + self.attn(self.ln_1(x), pad)": "x = x + 0.1 * self.attn(self.ln_1(x), pad)"},
    "deepnet": {"x = x + self.attn(self.ln_1(x), pad)": "x = 2.0 * x + self.attn(self.ln_1(x), pad)"},
}
NANOGPT_EDITS["both"] = {**NANOGPT_EDITS["attn"], **NANOGPT_EDITS["ffn"]}


def _nanogpt(edit: str | None, folder: Path):
    text = (FOREIGN / "nanogpt.py").read_text()
    for old, new in (NANOGPT_EDITS[edit] if edit else {}).items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = folder / f"nanogpt_{edit or 'healthy'}.py"
    path.write_text(text)
    return import_file(path)


def _hf(name: str):
    import transformers as tf
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    bart = dict(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                max_position_embeddings=64, decoder_start_token_id=1, forced_eos_token_id=None, **ids)
    bert = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, pad_token_id=0)
    return {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=2,
                                                         n_positions=64, **ids)),
        "gpt2-768": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=768, n_layer=2,
                                                             n_head=12, n_positions=64, **ids)),
        "bert-mlm": lambda: tf.BertForMaskedLM(tf.BertConfig(**bert)),
        "bert-model": lambda: tf.BertModel(tf.BertConfig(**bert)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **ids)),
        "bart-cg": lambda: tf.BartForConditionalGeneration(tf.BartConfig(**bart)),
        "bart-model": lambda: tf.BartModel(tf.BartConfig(**bart)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
    }[name]()


def _hf_forward(name: str):
    if name == "bert-model":
        return "encoder", lambda m, ids, pad: m(input_ids=ids, attention_mask=(ids != pad).long()).last_hidden_state
    if name == "bart-model":
        return "seq2seq", lambda m, s, t, pad: m(input_ids=s, attention_mask=(s != pad).long(),
                                                  decoder_input_ids=t, use_cache=False).last_hidden_state
    return None, None


def cases(folder: Path):
    """(set, name, expected, build () -> (model, forward, arch, kind)); expected: "error" | "clean"."""
    from tndebug.config import ModelConfig
    from tndebug.inject import make_model

    def ours(norm, nk="layernorm", arch="seq2seq", faults=()):
        return lambda: (make_model(ModelConfig.tiny(norm=norm, norm_kind=nk, arch=arch).with_faults(*faults)),
                        None, None, "seq2seq" if arch == "seq2seq" else "ours-decoder")

    def nano(edit):
        mod = _nanogpt(edit, folder)
        return lambda: (mod.build(), mod.forward, "decoder", "decoder")

    for norm in ("pre", "post"):
        yield "calibration", f"tndebug-{norm}", "clean", ours(norm)
        yield "calibration", f"tndebug-{norm}-no_attn_residual", "error", ours(norm, faults=("no_attn_residual",))
    yield "calibration", "nanogpt", "clean", nano(None)
    yield "calibration", "nanogpt-attn-removed", "error", nano("attn")

    for edit, expected in (("ffn", "error"), ("both", "error"), ("scaled", "clean"), ("deepnet", "clean")):
        yield "evaluation", f"nanogpt-{edit}", expected, nano(edit)
    for norm in ("pre", "post"):
        for fault in ("no_attn_residual", "no_residual"):
            yield "evaluation", f"tndebug-decoder-{norm}-{fault}", "error", ours(norm, arch="decoder", faults=(fault,))
        yield "evaluation", f"tndebug-{norm}-no_residual", "error", ours(norm, faults=("no_residual",))
        for nk in ("layernorm", "rmsnorm"):
            for arch in ("seq2seq", "decoder"):
                if (nk, arch) != ("layernorm", "seq2seq"):
                    yield "evaluation", f"tndebug-{arch}-{norm}-{nk}", "clean", ours(norm, nk, arch)
    hf = FOREIGN / "hf_models.py"
    for arch in ("bart", "marian", "t5"):
        for impl in ("eager", "sdpa"):
            yield "evaluation", f"foreign/hf_models-{arch}-{impl}", "clean", (
                lambda arch=arch, impl=impl: (import_file(hf).build(arch=arch, attn_implementation=impl),
                                              import_file(hf).forward, None, "seq2seq"))
    for name in ("blenderbot_small", "prescaled_q", "relbias", "seq_first", "tied_fused", "mask_fills"):
        yield "evaluation", f"foreign/{name}", "clean", (
            lambda name=name: (import_file(FOREIGN / f"{name}.py").build(),
                               import_file(FOREIGN / f"{name}.py").forward, None, "seq2seq"))
    for name in ("nanogpt", "rotary_gpt"):
        mod = import_file(FOREIGN / f"{name}.py")
        for v in mod.VARIANTS:
            yield "evaluation", f"foreign/{name}-{v}", "clean", (
                lambda mod=mod, v=v: (mod.build(variant=v), mod.forward, "decoder", "decoder"))
    eg = import_file(FOREIGN / "einsum_gpt.py")
    for st in eg.STYLES:
        yield "evaluation", f"foreign/einsum_gpt-{st}", "clean", (
            lambda st=st: (eg.EinsumLM(st), eg.forward, "decoder", "decoder"))
    yield "evaluation", "foreign/minibert", "clean", (
        lambda: (import_file(FOREIGN / "minibert.py").build(), None, "encoder", "encoder"))
    for opt in ("xtransformers", "xgpt"):
        try:
            mod = import_file(FOREIGN / f"{opt}.py")
        except ImportError:
            continue
        for v in mod.VARIANTS:
            kind = "decoder" if opt == "xgpt" else "seq2seq"
            yield "evaluation", f"foreign/{opt}-{v}", "clean", (
                lambda mod=mod, v=v, kind=kind: (mod.build(variant=v), mod.forward,
                                                 "decoder" if kind == "decoder" else None, kind))
    for path in sorted((FOREIGN / "styles").glob("*.py")):
        yield "evaluation", f"styles/{path.stem}", "clean", (
            lambda path=path: (import_file(path).build(), import_file(path).forward, "decoder", "decoder-nopad"))
    for name in ("gpt2", "gpt2-768", "bert-mlm", "bert-model", "llama", "bart-cg", "bart-model", "t5"):
        arch, fwd = _hf_forward(name)
        kind = {"bert-mlm": "hf-mlm", "bert-model": "encoder", "bart-model": "seq2seq"}.get(
            name, "hf-seq2seq" if name in ("bart-cg", "t5") else "hf-lm")
        yield "evaluation", f"hf/{name}", "clean", (
            lambda name=name, fwd=fwd, arch=arch, kind=kind: (_hf(name), fwd, arch if arch != "seq2seq" else None, kind))


def _train(model, forward, kind: str, steps: int) -> float:
    """Adam, lr 3e-3: one-stack models copy a random half, encoder-decoders the copy task."""
    from tndebug.data import get_task
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    task = get_task("copy")
    vocab = 11
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        half = torch.randint(3, vocab, (16, 8), generator=g)
        ids = torch.cat([half, half], dim=1)                                       # [16, 16]
        if kind in ("decoder", "decoder-nopad"):
            logits = forward(model, ids[:, :-1], None if kind == "decoder-nopad" else 0)
            out = ids[:, 1:]
        elif kind == "ours-decoder":
            logits, out = model(ids[:, :-1]), ids[:, 1:]
        elif kind == "hf-lm":
            logits, out = model(input_ids=ids[:, :-1]).logits, ids[:, 1:]
        elif kind in ("encoder", "hf-mlm"):
            logits = (forward(model, ids, 0) if forward is not None and kind == "encoder"
                      else model(input_ids=ids).logits if kind == "hf-mlm" else model(ids))
            out = ids
            if logits.shape[-1] < vocab:                                            # hidden states
                logits, out = logits, ids % logits.shape[-1]
        else:
            b = task.batch(g, 16)
            if kind == "hf-seq2seq":
                logits = model(input_ids=b.src, attention_mask=(b.src != 0).long(),
                               decoder_input_ids=b.tgt_in).logits
            elif forward is not None:
                logits = forward(model, b.src, b.tgt_in, 0)
            else:
                logits = model(b.src, b.tgt_in)
            logits = logits[0] if isinstance(logits, tuple) else getattr(logits, "logits", logits)
            if logits.dim() == 2:                                                   # [B*T, V]
                logits = logits.reshape(b.tgt_in.shape[0], b.tgt_in.shape[1], -1)
            out = b.tgt_out
            if logits.shape[-1] < task.tgt_vocab:
                out = out % logits.shape[-1]
        loss = F.cross_entropy(logits.flatten(0, 1), out.flatten(), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def _check(model, forward, arch, kind) -> dict:
    kw = {"arch": arch} if arch else {}
    if kind == "decoder-nopad":
        kw["pad_id"] = None
    seen: list = []
    original = _skip_path.block_skips

    def recording(*a, **k):
        out = original(*a, **k)
        seen.append(out)
        return out
    _skip_path.block_skips = recording
    try:
        report = tndebug.check(model, forward, probes="ln-placement", **kw)
    finally:
        _skip_path.block_skips = original
    blocks = seen[0] if seen else []
    found = [f for f in report.findings if f.code == "ln-placement/residual-missing"]
    shares = [b.share for b in blocks if b.share is not None]
    return {"shares": [round(s, 6) for s in shares],
            "no_verdict": sorted({b.reason for b in blocks if b.share is None}),
            "error": bool(found), "parts": [f.evidence["parts_without_residual"] for f in found],
            "where": [f.where for f in found]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--only", help="cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "residual_skip.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prov = Provenance.start(__file__, argv)
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for subset, name, expected, build in cases(Path(tmp)):
            if args.only and args.only not in name:
                continue
            t0 = time.perf_counter()
            row = {"set": subset, "case": name, "expected": expected}
            try:
                torch.manual_seed(0)
                model, forward, arch, kind = build()
                row["init"] = _check(model.eval(), forward, arch, kind)
                if subset == "evaluation":
                    row["train_loss"] = round(_train(model, forward, kind, args.steps), 4)
                    row["trained"] = _check(model, forward, arch, kind)
            except Exception as e:  # noqa: BLE001 - a case that cannot run is recorded, not fatal
                row["failed"] = f"{type(e).__name__}: {e}"
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            states = [row.get(w) for w in ("init", "trained") if row.get(w)]
            print(f"{subset:11s} {name:40s} {expected:5s} " + "  ".join(
                f"{w}: {'ERROR' if s['error'] else 'clean'} min {min(s['shares']) if s['shares'] else None}"
                for w, s in zip(("init", "trained"), states)) + (f"  FAILED {row['failed']}" if "failed" in row else ""),
                flush=True)
    summary = {}
    for subset in ("calibration", "evaluation"):
        for expected in ("clean", "error"):
            got = [(r, r[w]) for r in rows if r["set"] == subset and r["expected"] == expected
                   for w in ("init", "trained") if w in r]
            shares = [s for _, g in got for s in g["shares"]]
            summary[f"{subset}/{expected}"] = {
                "checks": len(got), "errors": sum(g["error"] for _, g in got),
                "min_share": min(shares) if shares else None, "max_share": max(shares) if shares else None,
                "no_verdict_checks": sum(1 for _, g in got if not g["shares"])}
    out = {"threshold": _skip_path.MIN_SHARE, "steps": args.steps, "summary": summary, "cases": rows,
           "failed": [r["case"] for r in rows if "failed" in r]}
    out["provenance"] = prov.finish()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    md = ["# ln-placement residual-missing: skip shares (bench/residual_skip.py)", "",
          provenance_line(out["provenance"]), "",
          f"Threshold MIN_SHARE = {_skip_path.MIN_SHARE:g}; trained = {args.steps} Adam steps.", "",
          "| set / expected | checks | residual-missing errors | min share | max share | no verdict |",
          "|---|---|---|---|---|---|"]
    for k, v in summary.items():
        md.append(f"| {k} | {v['checks']} | {v['errors']} | {v['min_share']} | {v['max_share']} | "
                  f"{v['no_verdict_checks']} |")
    md += ["", "| case | set | expected | init | trained |", "|---|---|---|---|---|"]
    for r in rows:
        def cell(s):
            if not s:
                return r.get("failed", "")
            verdict = "ERROR " + "/".join("+".join(p) for p in s["parts"]) if s["error"] else "clean"
            share = f"min {min(s['shares']):.3g}" if s["shares"] else "no verdict: " + "; ".join(s["no_verdict"])
            return f"{verdict}, {share}"
        md.append(f"| {r['case']} | {r['set']} | {r['expected']} | {cell(r.get('init'))} | {cell(r.get('trained'))} |")
    path.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
