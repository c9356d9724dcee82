"""`tndebug triage CHECKPOINT`: diagnose a checkpoint and, with --model, the code that made it.

Exit codes: 0 nothing at or above --fail-on; 1 findings; 2 bad input, or a checkpoint that was
not examined (unsafe pickle without --trust-checkpoint: its globals are listed, never run).
Outputs (report.json, and what the reporters add) are written only once triage has succeeded;
the output directory is checked and locked before (tndebug/outputs.py has the rule).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tndebug.commands.flags import (HelpFormatter, add_code_options, add_fail_on, add_model_options, add_verbose,
                                    out_path, positive_int)
from tndebug.errors import UsageError
from tndebug.probes import PROBE_NAMES

if TYPE_CHECKING:                       # torch: imported once the flags are checked (plan_of)
    from tndebug.triage.options import TriageOptions

OUTPUTS = ("Outputs: --out DIR is refused (exit 2, before any work) when it is a file, lies "
           "under a file, is not writable, is in use by another tndebug, or already holds a "
           "tndebug report or run (a training run's report.json included), unless --overwrite. "
           "Without --out: ./triage-<parent dir>-<file stem>, or the first free of NAME-2, "
           "NAME-3, ... Written there: report.json, report.md, figures/*.png (not with "
           "--no-figures) and tb/ (TensorBoard; a previous triage's events are replaced, a "
           "training run's tb/ is kept and none is written).")
EXITS = ("Exit codes: 0 clean: nothing at or above --fail-on, and every probe that applies checked "
         "the model; 1 findings at or above it; 4 no such finding, but a probe that applies could "
         "not check the model (verdict INCOMPLETE or UNCHECKED, with the reason); 2 bad input or "
         "usage, or a checkpoint that was not examined (an unsafe pickle: its globals are "
         "listed, never run); 3 internal error; 130 interrupted.")

EPILOG = """examples:
  tndebug triage model.pt                    # layout recognised from the keys
  tndebug triage model.pt --heads 8 --task reverse
  tndebug triage ckpt.pt --model mymodel.py:make_model --adapter annotated
  tndebug triage ckpt.pt --model seq2seq.py:build --adapter seq2seq.py:forward \\
                         --config cfg.json
  tndebug triage model.pt --data held_out.pt # your own held-out batches
  tndebug triage ./my-model/ --attn sdpa --text pairs.tsv
                                             # a save_pretrained directory
see docs/triage.md"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "triage", help="diagnose a checkpoint (and your model code, with --model)",
        description="Load a checkpoint safely, recognise or load the model, and run every probe "
                    "that makes sense for weights, plus checkpoint hygiene checks.\n\n" + OUTPUTS
                    + "\n\n" + EXITS,
        epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="a .pt/.pth (torch.save) or .safetensors file, or a Hugging "
                                      "Face save_pretrained directory (needs tndebug[hf])")
    p.add_argument("--model", metavar="FILE.py:FACTORY",
                   help="build your own module (kwargs from --config, else the checkpoint's config)")
    add_model_options(
        p, config="factory kwargs with --model; sizes/heads/norm without it",
        adapter="how to call the model: forward(model, src, tgt, pad_id) -> logits, or "
                "forward(model, ids, pad_id) -> logits for a decoder-only or encoder-only model "
                "(gpt: model(idx); bert: model(ids), the model masking its own pads)",
        arch="with --model: what your model is, when its code cannot say: decoder (GPT-style, "
             "causal) and encoder (BERT-style, bidirectional) are called alike, forward(model, "
             "ids, pad_id) (default: an encoder when the class name says "
             "Bert/Roberta/Electra/Encoder/MLM, else a decoder; the report says which)",
        data="your own held-out batches for every comparison triage makes (the temperature "
             "sweep, layout settling, the probes' batch): a torch.save file {'src': "
             "LongTensor[N,S], 'tgt': LongTensor[N,T]} with tgt BOS-led and right-padded with "
             "--pad-id, or a function returning that dict; triage feeds tgt[:, :-1] and scores "
             "tgt[:, 1:]. A decoder- or encoder-only model: {'ids': LongTensor[N,T]} (optionally "
             "with 'attention_mask'), one sequence per row (default: --task)",
        max_len="the longest sequence your model takes (its position table); the probes' "
                "batches fit it (default: the checkpoint's config, else found by calling the "
                "model)",
        pad_id="the padding token id of your vocabulary: masked in the held-out batches and "
               "ignored by the loss (default 0); `none`: your data have no padding "
               "(character-level text; a decoder- or encoder-only model's own code)",
        bos_id="the id that starts every decoder input (default 1)", bos_default=1)
    p.add_argument("--task", default="copy", choices=("copy", "reverse", "sort", "translate"),
                   help="built-in held-out data when --data is not given (default: copy; its "
                        "token scheme is in docs/triage.md)")
    p.add_argument("--attn", choices=("eager", "sdpa"),
                   help="Hugging Face directory: the attention implementation to triage under "
                        "(default: the config's, else transformers' default)")
    p.add_argument("--text", metavar="FILE",
                   help="Hugging Face directory: held-out text, tokenised with the tokenizer "
                        "saved in the directory: source<TAB>target lines for an encoder-decoder, "
                        "one sequence per line for a decoder-only or encoder-only model. It is "
                        "the probes' recorded batch (every figure shows it, with its tokens on "
                        "the axes) and the temperature sweep's data. --data for a directory: "
                        "{'src', 'tgt'} (encoder-decoder) or {'ids': LongTensor[N,T]} (one stack)")
    p.add_argument("--heads", type=positive_int,
                   help="number of attention heads, >= 1 (not in the weights)")
    p.add_argument("--norm", choices=("pre", "post"), help="LayerNorm placement (nn.Transformer layout)")
    p.add_argument("--probe", default=None,
                   help=f"probes to run: all, none or a,b (default: those that judge weights; "
                        f"known: {', '.join(PROBE_NAMES)})")
    p.add_argument("--out", type=out_path, default=None, metavar="DIR",
                   help="output directory (default: ./triage-<parent dir>-<file stem>, numbered "
                        "-2, -3, ... when taken); see Outputs above")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the reports and figures already in --out, and tb/ when a "
                        "previous triage wrote it (a checkpoint, or a training run's tb/, is "
                        "never removed)")
    p.add_argument("--format", choices=("text", "json", "md"), default="text",
                   help="what goes to stdout at the end: the findings table, the JSON report, or "
                        "the Markdown report (default text); with json or md, what your code "
                        "prints goes to stderr, so stdout is the report alone")
    add_fail_on(p)
    add_code_options(p)
    add_verbose(p)
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle code in the file (only for files you trust)")
    p.add_argument("--no-figures", action="store_true",
                   help="skip figures/ (attention maps, head entropy and similarity, depth, the "
                        "findings' evidence); report.md and tb/ are still written")
    p.set_defaults(func=main)


@dataclass(frozen=True)
class TriagePlan:
    """One `tndebug triage` call, resolved once from the parsed flags before any work: what to
    triage (the library's TriageOptions), and what the CLI does with the Report (the codes kept
    and dropped, the output place, stdout's format, the exit threshold, the figures)."""
    options: TriageOptions
    select: tuple[str, ...] = ()        # finding codes or probe names, checked (--select)
    ignore: tuple[str, ...] = ()        # the same, dropped (--ignore)
    out: str | None = None              # --out (None: ./triage-<parent>-<stem>, numbered)
    overwrite: bool = False
    format: str = "text"                # stdout: text | json | md
    fail_on: str = "error"
    figures: bool = True                # not --no-figures
    verbose: bool = False


def main(args) -> int:
    from tndebug.outputs import claim_output, triage_default
    plan = plan_of(args)
    from tndebug.reporters.oneshot import previous_mode   # torch: once the flags are checked
    previous = previous_mode(plan.out) if plan.out and plan.overwrite else None   # whose tb/ it is
    with claim_output(plan.out, triage_default(plan.options.checkpoint), overwrite=plan.overwrite,
                      kind="triage") as out:                  # checked and locked before any work
        return _triage(plan, out, previous)


def plan_of(args) -> TriagePlan:
    """The flags checked, cheapest first (a bad path, name, code or JSON is one line before torch
    is imported), and resolved into the plan; nothing is written yet."""
    from tndebug.outputs import resolve_output, triage_default
    from pathlib import Path

    from tndebug.paths import checkpoint_file, code_spec, data_file, hf_only, text_file
    found = checkpoint_file(args.checkpoint)  # cheap checks first, before torch: a missing, empty
    hf_only(args.checkpoint, args.attn, args.text)   # or special checkpoint, a binary --text,
    if args.text:                                     # --data, --out
        text_file(args.text)
    if args.data:
        data_file(args.data)
    if Path(args.checkpoint).is_dir() and (Path(args.checkpoint) / "config.json").exists() and (
            args.model or args.adapter or args.config or getattr(args, "arch", None)):
        raise UsageError(f"{args.checkpoint} is a Hugging Face directory: --model, --adapter, "
                         f"--config and --arch do not apply (the model is built from its "
                         f"config.json)")           # before --model's file is looked for
    if args.model:
        code_spec(args.model, "--model")
    if args.adapter and ":" in args.adapter:
        code_spec(args.adapter, "--adapter")
    from tndebug.commands import cheap   # torch-free: a bad name, code or JSON is one line, fast
    from tndebug.paths import config_json
    cheap.probes(args.probe)
    cheap.adapter(args.adapter, " with def forward(model, src, tgt, pad_id) -> logits (decoder- "
                                "or encoder-only: forward(model, ids, pad_id))")
    config_json(args.config)
    cheap.codes(args.select, "--select")
    cheap.codes(args.ignore, "--ignore")
    cheap.out_place(args.out)
    hf_files = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    hf_dir = Path(args.checkpoint).is_dir() and (Path(args.checkpoint) / "config.json").is_file()
    if found is None and not any((Path(args.checkpoint) / n).is_file() for n in hf_files):
        raise UsageError(f"{args.checkpoint} is a directory with no checkpoint.pt, model.pt or "
                         f"model.safetensors in it; pass the checkpoint file itself")
    resolve_output(args.out, triage_default(args.checkpoint), overwrite=args.overwrite, kind="triage")
    if found is not None and not args.trust_checkpoint and not hf_dir:
        _refuse_pickled_code(found)          # before --out is claimed (--overwrite clears it)
    from tndebug.triage.options import TriageOptions

    from tndebug import judge            # torch: only once the flags parsed (a bad flag is refused before it)
    return TriagePlan(
        TriageOptions(args.checkpoint, model=args.model, config=args.config, adapter=args.adapter,
                      task=args.task, pad_id=args.pad_id, bos_id=args.bos_id, heads=args.heads,
                      norm=args.norm, probes=args.probe, trust=args.trust_checkpoint, data=args.data,
                      attn=args.attn, text=args.text, max_len=args.max_len, arch=args.arch),
        select=tuple(judge.codes_option(args.select, "--select")),    # before any work
        ignore=tuple(judge.codes_option(args.ignore, "--ignore")),
        out=args.out, overwrite=args.overwrite, format=args.format, fail_on=args.fail_on,
        figures=not args.no_figures, verbose=args.verbose)


def _refuse_pickled_code(path) -> None:
    """A torch.save zip whose pickle names code outside torch's weights-only allowlist: refused
    (one line, exit 2) before the output directory is claimed, so that a refused file leaves
    nothing behind and clears nothing. torch's own list of those globals, read from the
    archive's pickle without running it; a legacy (non-zip) pickle is judged by the loader."""
    import zipfile
    from tndebug.safeload import unsafe_globals
    from tndebug.triage.loading import UnsafeCheckpoint
    if zipfile.is_zipfile(path) and (unsafe := unsafe_globals(path)):
        raise UnsafeCheckpoint(path, unsafe)


def _triage(plan: TriagePlan, out, previous: str | None = None) -> int:
    from tndebug import judge
    from tndebug.memory import map_large_blocks
    from tndebug.reporters.oneshot import tensorboard_place
    from tndebug.reporters.session import ReportSession
    from tndebug.triage.loading import UnsafeCheckpoint
    from tndebug.triage.run import triage

    map_large_blocks()           # freed tensors' pages go back: peak memory (issue 21)
    # figures and tb/ from the probed pass itself; deferred: nothing is written before it succeeded
    session = ReportSession(out, fmt=plan.format, tensorboard=tensorboard_place(out, previous),
                            figures=plan.figures, defer=True, verbose=plan.verbose)
    # stdout is the report's: with --format json or md, what the user's code prints (its import,
    # factory, forward; nanoGPT's "number of parameters: ...") goes to stderr
    theirs = contextlib.redirect_stdout(sys.stderr) if plan.format != "text" else contextlib.nullcontext()
    try:
        with theirs:
            report = judge.select_codes(triage(plan.options, sinks=session.sinks), list(plan.select),
                                        list(plan.ignore))
    except UnsafeCheckpoint:
        raise                 # a refused input: one line, exit 2, nothing written (claim_output
                              # removes the directory it made)
    from tndebug.memory import give_back_freed
    give_back_freed()            # the model is gone: the figures are drawn without its pages
    return session.finish(report, fail_on=plan.fail_on)
