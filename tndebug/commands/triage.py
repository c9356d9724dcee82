"""`tndebug triage CHECKPOINT`: diagnose a checkpoint and, with --model, the code that made it.

Exit codes: 0 nothing at or above --fail-on; 1 findings; 2 bad input, or a checkpoint that was
not examined (unsafe pickle without --trust-checkpoint: its globals are listed, never run).
Outputs (report.json, and what the reporters add) are written only once triage has succeeded.
"""
from __future__ import annotations

import sys

from tndebug.findings import Finding
from tndebug.probes import PROBE_NAMES
from tndebug.report import Report

EPILOG = """examples:
  tndebug triage model.pt                                   # layout recognised from the keys
  tndebug triage model.pt --heads 8 --task reverse
  tndebug triage ckpt.pt --model mymodel.py:make_model --adapter annotated
  tndebug triage ckpt.pt --model seq2seq.py:build --adapter seq2seq.py:forward --config cfg.json
  tndebug triage model.pt --data held_out.pt                # your own held-out batches
  tndebug triage ./my-model/ --attn sdpa --text pairs.tsv   # a Hugging Face save_pretrained dir
see docs/triage.md"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "triage", help="diagnose a checkpoint (and your model code, with --model)",
        description="Load a checkpoint safely, recognise or load the model, and run every probe "
                    "that makes sense for weights, plus checkpoint hygiene checks.",
        epilog=EPILOG, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a .pt/.pth (torch.save) or .safetensors file, or a Hugging "
                                      "Face save_pretrained directory (needs tndebug[hf])")
    p.add_argument("--model", metavar="FILE.py:FACTORY",
                   help="build your own module (kwargs from --config, else the checkpoint's config)")
    p.add_argument("--config", metavar="JSON|FILE.json",
                   help="factory kwargs with --model; sizes/heads/norm without it")
    p.add_argument("--adapter", metavar="annotated|tndebug|FILE.py:FUNCTION",
                   help="how to call the model: forward(model, src, tgt, pad_id) -> logits")
    p.add_argument("--data", metavar="FILE.pt|FILE.py:FUNCTION",
                   help="your own held-out batches for every comparison triage makes (the "
                        "temperature sweep, layout settling, the probes' batch): a torch.save "
                        "file {'src': LongTensor[N,S], 'tgt': LongTensor[N,T]} with tgt BOS-led "
                        "and right-padded with --pad-id, or a function returning that dict; "
                        "triage feeds tgt[:, :-1] and scores tgt[:, 1:] (default: --task)")
    p.add_argument("--task", default="copy", choices=("copy", "reverse", "sort", "translate"),
                   help="built-in held-out data when --data is not given (default: copy; its "
                        "token scheme is in docs/triage.md)")
    p.add_argument("--attn", choices=("eager", "sdpa"),
                   help="Hugging Face directory: the attention implementation to triage under "
                        "(default: the config's, else transformers' default)")
    p.add_argument("--text", metavar="FILE",
                   help="Hugging Face directory: held-out source<TAB>target lines, tokenised with "
                        "the tokenizer saved in the directory (for the temperature sweep)")
    p.add_argument("--pad-id", type=int, default=0)
    p.add_argument("--bos-id", type=int, default=1)
    p.add_argument("--heads", type=int, help="number of attention heads (not in the weights)")
    p.add_argument("--norm", choices=("pre", "post"), help="LayerNorm placement (nn.Transformer layout)")
    p.add_argument("--probe", default=None,
                   help=f"probes to run: all, none or a,b (default: those that judge weights; "
                        f"known: {', '.join(PROBE_NAMES)})")
    p.add_argument("--out", default=None, help="output directory (default: ./triage-<checkpoint>)")
    p.add_argument("--format", choices=("text", "json", "md"), default="text")
    p.add_argument("--fail-on", choices=("error", "warning", "info", "never"), default="error")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle code in the file (only for files you trust)")
    p.set_defaults(func=main)


def main(args) -> int:
    from tndebug.reporters.session import ReportSession
    from tndebug.triage.loading import UnsafeCheckpoint
    from tndebug.triage.run import TriageOptions, output_name, triage

    opts = TriageOptions(args.checkpoint, model=args.model, config=args.config,
                         adapter=args.adapter, task=args.task, pad_id=args.pad_id,
                         bos_id=args.bos_id, heads=args.heads, norm=args.norm, probes=args.probe,
                         trust=args.trust_checkpoint, data=args.data, attn=args.attn,
                         text=args.text)
    out = args.out or output_name(args.checkpoint)
    try:
        report = triage(opts)
    except UnsafeCheckpoint as e:
        print(f"tndebug: error: {e}", file=sys.stderr)
        finding = Finding("checkpoint", "error", f"unsafe pickle: {len(e.globals)} globals outside "
                          f"torch's weights-only allowlist; not loaded", where=str(e.path),
                          evidence={"unsafe_globals": e.globals},
                          fix="re-save as a state_dict or .safetensors, or pass --trust-checkpoint")
        report = Report(run={"mode": "triage", "checkpoint": str(e.path), "status": "refused"},
                        findings=[finding], probes={"checkpoint": {"status": "fail"}},
                        first_sign=finding)
        ReportSession(out, fmt=args.format, tensorboard=False).finish(report, fail_on="never")
        return 2
    session = ReportSession(out, fmt=args.format, tensorboard=False)
    return session.finish(report, fail_on=args.fail_on)
