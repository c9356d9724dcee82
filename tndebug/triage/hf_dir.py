"""`tndebug triage DIR`: a Hugging Face `save_pretrained` directory, no user code (issue 11).

    report = triage_hf(TriageOptions("./my-model/", attn="sdpa"))

1. config.json -> AutoConfig (local files only, HF_HUB_OFFLINE=1: never a network call); an
   unknown model_type or a shape that is none of the three below is a one-line UsageError;
2. the model from `AutoModelForSeq2SeqLM.from_config` (a decoder-only model, GPT2, Llama, ...:
   `AutoModelForCausalLM`, called as hf/decoder_only.py says; an encoder-only one, Bert, Roberta, ...:
   `AutoModelForMaskedLM`, as hf/encoder_only.py says), the weights read with safetensors (or
   torch.load(weights_only=True) for .bin), sharded or not, and loaded tie-aware: a missing key
   is accepted only when it shares storage with a loaded one after `tie_weights()`;
3. the built-in adapter calls it as a user of transformers does (`input_ids`, `attention_mask`
   with 1 = keep, `decoder_input_ids`, `decoder_attention_mask`, `.logits`); pad and
   decoder-start ids come from the config;
4. the probes' recorded pass (their statistics, and every figure) runs on the user's data when
   --data or --text FILE (tokenised with the tokenizer saved in DIR) is given, else on random
   ids from the model's vocabulary (special ids excluded); the exact tests build their own
   inputs. The temperature sweep needs in-distribution data and is skipped, with a note,
   without it; the axis tokens of the figures are the saved tokenizer's where DIR has one;
5. findings keep HF's module naming; fixes are rewritten for HF code (hf/wording.py).
   config.json and the model: hf/build.py; the weights: hf/load.py; --text / --data: hf_data.py.

`HFTriage.run` names the steps. transformers is an optional dependency: this file never imports
it (hf/build.py, hf/load.py and hf/wording.py do, inside functions), so the core package never
needs it. It sits in triage/, not in the HF wing: it is `tndebug triage`'s front-end for a
directory, above the judge it ends in, while the wing stays below the judge (tests/test_layers.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from tndebug import driver, judge
from tndebug.capture import GenericCapture
from tndebug.data import Batch
from tndebug.driver import PROBE_BATCH
from tndebug.errors import UsageError
from tndebug.hf.build import build_model, load_config
from tndebug.hf.checks import ids_vs_tokenizer, tied_head, weight_files_differ
from tndebug.hf.decoder_only import LM_CALLS, choose_lm_ids, lm_ids_note, make_lm_adapter
from tndebug.hf.encoder_decoder import attention_weights, choose_ids, make_adapter
from tndebug.hf.encoder_only import MLM_CALLS, MLM_LOSS, make_mlm_adapter, masked_lm_batch, mlm_ids_note
from tndebug.hf.head import head_unchecked, judge_head
from tndebug.hf.load import WEIGHTS, init_missing, load_tied, read_weights, renamed, sliced_output, weight_files
from tndebug.hf.shift import NAME as LABEL_SHIFT, label_shift
from tndebug.hf.wording import package_code, scale_switches
from tndebug.judge.fresh import SEED, seeded
from tndebug.probes import TRIAGE_PROBES
from tndebug.probes.head_collapse_weights import duplicate_heads
from tndebug.report import Report
from tndebug.subject import Subject
from tndebug.triage import hygiene
from tndebug.triage.hf_data import (held_out, mask_token_id, token_names, tokenizer_padding_side,
                                     tokenizer_specials)
from tndebug.triage.hf_resume import resume_state
from tndebug.triage.options import OWN_CODE_PROBES, probes_of, refuse_longer, weights_dtype
from tndebug.triage.userdata import check_vocab

OWN_CHECKPOINTS = ("checkpoint.pt", "model.pt")     # tndebug's (and plain torch) files win
HELD_OUT, SRC_LEN, TGT_LEN = 16, 12, 12             # the random batch for the probes' pass
# The probes see the logits of ids [0, PROBE_VOCAB) of a larger vocabulary (exact for those ids):
# a 58k-word output layer costs more than the whole 6+6-layer stack at the probes' batch sizes,
# and a change in the decoder's output shows in 2048 directions as well as in 58k.
PROBE_VOCAB = 2048


def is_hf_dir(path: str) -> bool:
    """A directory that looks like `save_pretrained` output (config.json or HF weight files)."""
    p = Path(path)
    if not p.is_dir() or any((p / n).is_file() for n in OWN_CHECKPOINTS):
        return False
    return (p / "config.json").is_file() or any((p / n).is_file() for n in WEIGHTS)


# -- the probes' batch -------------------------------------------------------------------------
def probe_batch(data: Batch, keep: int | None, pad: int) -> Batch:
    """The user's batch as the probes' recorded pass sees it: with the output layer sliced to
    `keep` ids (PROBE_VOCAB), a target id at or above it is scored as pad (ignored), since its
    logit is not computed; the inputs are the user's, whatever their ids."""
    if keep is None:
        return data
    return Batch(data.src, data.tgt_in, data.tgt_out.masked_fill(data.tgt_out >= keep, pad))


def random_batch(subject: Subject, n: int = HELD_OUT) -> Batch:
    """Random content ids, BOS (marker)-led targets, about a third of the rows right-padded; an
    encoder-only subject's targets are its ids (encoder_only.MLM_LOSS)."""
    src, tgt = subject.random_batch(n, SRC_LEN, TGT_LEN + 1, pad_share=0.3,
                                    generator=torch.Generator().manual_seed(0))
    if not subject.has_target:
        return Batch(src.cpu(), src.cpu(), src.cpu())
    tgt_out = tgt[:, 1:]
    tgt_in = tgt[:, :-1].masked_fill(tgt_out == subject.pad_id, subject.pad_id)
    return Batch(src.cpu(), tgt_in.cpu(), tgt_out.cpu())


# -- triage ------------------------------------------------------------------------------------
def triage_hf(opts, patch=None, sinks=()) -> Report:
    """Triage a save_pretrained directory. `patch(model, adapter)` (tests): change the loaded
    model in place, or return (forward, encode) to call it differently."""
    return HFTriage(opts, patch, sinks).run()


class HFTriage:
    """One `tndebug triage DIR`, its steps in `run`'s order; each step leaves what the later ones
    read as attributes (the judge's fresh pass calls `probe_fresh` after `run` has filled them)."""

    def __init__(self, opts, patch=None, sinks=()):
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.opts, self.patch, self.sinks = opts, patch, sinks
        self.folder = Path(opts.checkpoint)
        self.attn = getattr(opts, "attn", None)

    def lap(self, name: str) -> None:
        self.timings[name] = round(time.perf_counter() - self.t0 - sum(self.timings.values()), 3)

    def run(self) -> Report:
        opts = self.opts
        if opts.model or opts.adapter or opts.config or getattr(opts, "arch", None):
            raise UsageError(f"{self.folder} is a Hugging Face directory: --model, --adapter, "
                             f"--config and --arch do not apply (the model is built from its config.json)")
        self.tf, self.config, self.kind = load_config(self.folder)
        self.decoder, self.encoder = self.kind == "decoder", self.kind == "encoder"
        self.one_stack = self.decoder or self.encoder          # called with one sequence of ids
        # a decoder-only model is also asked which labels it learnt from (label-shift), in a pass of
        # its own over the whole vocabulary (shift.py): the probes' pass sees a sliced output layer
        wanted = probes_of(opts.probes, OWN_CODE_PROBES if self.decoder else TRIAGE_PROBES)
        self.shift = self.decoder and LABEL_SHIFT in wanted
        self.probe_names = [n for n in wanted if not (self.shift and n == LABEL_SHIFT)]
        self.load_weights()
        self.choose_ids()
        self.forward, self.second = self.adapter(self.model)
        self.read_data()
        self.make_subject_and_batch()
        probed = self.probe()
        return self.conclude(probed, self.temperature_sweep())

    # -- the model and its ids ---------------------------------------------------------------------
    def load_weights(self) -> None:
        """The model built from config.json, every weight from the file, loaded tie-aware; the
        file checks' findings in `self.checks`."""
        folder, config = self.folder, self.config
        self.files = weight_files(folder)
        self.sd = read_weights(self.files)
        self.lap("load")
        model = build_model(self.tf, config, self.attn, self.kind, init=False)
        self.sd = renamed(model, self.sd)                  # saved names -> the model's (GPTNeoX)
        self.checks = tied_head(model, self.sd)      # before loading: unties as transformers does
        try:
            self.tied, unfilled = load_tied(model, self.sd, folder)
        except UsageError as e:            # an id config.json gets wrong may size a table (FSMT's
            wrong = ids_vs_tokenizer(folder, config)                    # positions by pad_token_id)
            said = "; ".join(f"{f.where} = {f.evidence['config'][0]}, the tokenizer's "
                             f"{f.evidence['tokenizer'][0]}" for f in wrong if f.evidence.get("tokenizer"))
            if not said or "shape mismatch" not in str(e):
                raise
            raise UsageError(f"{e}; config.json disagrees with the saved tokenizer ({said}), and some "
                             f"classes size a table by such an id (FSMT's positions by pad_token_id): "
                             f"fix config.json's ids first") from None
        seeded(lambda: init_missing(model, unfilled))      # keys the file may lack (Marian's sinusoids)
        driver.give_back_freed()                          # the file's copy, now the model's
        more, self.files_note = weight_files_differ(folder, self.files, read_weights)
        self.checks += more + ids_vs_tokenizer(folder, config)
        model.eval()
        self.model = model

    def choose_ids(self) -> None:
        """The vocabularies, the ids the probes see (`keep`: PROBE_VOCAB of a larger output
        layer), pad, start and marker ids, and the content range lo..hi-1."""
        model = self.model
        self.src_v = model.get_input_embeddings().num_embeddings
        out_emb = model.get_output_embeddings()
        self.tgt_v = (getattr(out_emb, "out_features", None) or getattr(out_emb, "num_embeddings", None)
                      or self.src_v)
        vocab = min(self.src_v, self.tgt_v)
        self.keep = (PROBE_VOCAB if self.tgt_v > PROBE_VOCAB and set(self.probe_names) <= set(TRIAGE_PROBES)
                     else None)
        self.ids = (choose_lm_ids(self.config, vocab, self.keep) if self.one_stack
                    else choose_ids(self.config, vocab))
        self.lo, self.hi = self.ids["content"]
        if self.keep:
            self.hi = min(self.hi, self.keep)

    # -- how the model is called ---------------------------------------------------------------------
    def adapter(self, model):
        """(forward, encode) of an encoder-decoder, (forward, incremental) of a decoder-only
        model, (forward, None) of an encoder-only one; `patch` may replace them."""
        ids = self.ids
        pair = (make_lm_adapter() if self.decoder else (make_mlm_adapter(), None) if self.encoder
                else make_adapter(ids["start"], ids["marker"]))
        return (self.patch(model, pair) or pair) if self.patch is not None else pair

    def call(self, fwd, model, src, tgt):
        """The probes' call: a decoder-only model is fed `tgt` alone (Subject kind "decoder"),
        an encoder-only one `src` alone (kind "encoder")."""
        if self.one_stack:
            return fwd(model, tgt if self.decoder else src, self.ids["pad"])
        return fwd(model, src, tgt, self.ids["pad"])

    def make_subject(self, model, forward, second) -> Subject:
        ids, batch = self.ids, self.batch
        subject = Subject.of_kind(
            model, forward, None if self.encoder else second, kind=self.kind,
            capture=GenericCapture(model, kind=self.kind), pad_id=ids["pad"], bos_id=ids["marker"],
            src_vocab=self.hi, tgt_vocab=self.hi, first_content=self.lo,
            max_len=(getattr(self.opts, "max_len", None)
                     or getattr(self.config, "max_position_embeddings", None)))
        if hasattr(subject.capture, "discover"):   # attention sites by behaviour, whatever the class
            subject.capture.discover(lambda: self.call(forward, model, batch.src[:2], batch.tgt_in[:2]))
        return subject

    def fresh_model(self):
        """AutoModel*.from_config(config), seeded: the code at initialisation, no weights loaded."""
        return seeded(lambda: build_model(self.tf, self.config, self.attn, self.kind))

    def probe_fresh(self, names):
        """The probes `names` on a fresh initialisation of the model's code (issue 19)."""
        fresh = self.fresh_model().eval()
        fwd, second = self.adapter(fresh)
        sub = self.make_subject(fresh, fwd, second)
        main = [n for n in names if n != LABEL_SHIFT]
        probed = driver.ProbeResult([], {}, {})
        batch = self.batch
        if main:
            with sliced_output(fresh, self.keep,
                               lambda: self.call(fwd, fresh, batch.src[:1, :3], batch.tgt_in[:1, :3])):
                probed = driver.probe_once(sub, main, batch, compute_dtype=self.dtype)
        return self.with_shift(probed, sub) if LABEL_SHIFT in names else probed

    def with_shift(self, probed, sub):
        """`probed` with label-shift's findings and status, judged on the user's data when given
        (else the probes' random ids) over the whole vocabulary."""
        t = time.perf_counter()
        found, entry = label_shift(sub, self.data if self.data is not None else self.batch)
        seconds = {**probed.seconds, LABEL_SHIFT: round(time.perf_counter() - t, 3)}
        return driver.ProbeResult(probed.findings + found, {**probed.statuses, LABEL_SHIFT: entry},
                                  seconds, probed.batch)

    # -- the user's data, the probes' batch, the probes --------------------------------------------
    def read_data(self) -> None:
        """--data / --text (`self.data`, None without), the findings of its ids, and the untied
        head judged on it (`self.head_unrun`: why it was not, if it was not)."""
        ids, model, decoder = self.ids, self.model, self.decoder
        self.data, self.source, self.data_checks = held_out(self.opts.data, getattr(self.opts, "text", None),
                                                            self.folder, ids, ids["marker"], self.config,
                                                            self.kind)
        data, self.head_unrun = self.data, None
        if data is not None:
            check_vocab(Batch(data.tgt_in if decoder else data.src, data.tgt_in, data.tgt_out),
                        self.src_v, self.tgt_v, self.source)
            if not self.encoder:              # an untied head that does not fit the trained body
                t_in = data.tgt_in.clone()
                if not decoder:
                    t_in[:, 0] = ids["start"]  # as the model is called: led by the decoder start
                head_found, self.head_unrun = judge_head(
                    model, None if decoder else data.src, t_in, data.tgt_out, ids["pad"],
                    fresh=self.fresh_model)
                self.data_checks = self.data_checks + head_found
        # data given but not read (config.json's pad is a real token of it: data_checks names it)
        self.unused = (f"{self.source} was not used (the pad_token_id error)" if data is None and self.source
                       else "")
        if data is None and not self.encoder:  # the same head, unjudged: the verdict says so
            self.head_unrun = head_unchecked(model, self.unused)

    def make_subject_and_batch(self) -> None:
        """The probes' recorded batch (and so every figure's): the user's data when given, else
        random ids (the exact tests build their own inputs either way), and the Subject."""
        ids, model, data = self.ids, self.model, self.data
        self.batch = probe_batch(data, self.keep, ids["pad"]) if data is not None else random_batch(
            Subject(model, self.forward, pad_id=ids["pad"], bos_id=ids["marker"], src_vocab=self.hi,
                    tgt_vocab=self.hi, first_content=self.lo, kind=self.kind))
        self.names = token_names(self.folder, self.batch[:2]) if self.sinks else {}   # axis labels
        self.subject = self.make_subject(model, self.forward, self.second)
        self.subject.padding_side = tokenizer_padding_side(self.folder)   # lm-decoding: pads left?
        if data is not None:
            refuse_longer(self.subject, (data.src, data.tgt_in), self.source)
        self.dtype = weights_dtype(self.sd)   # the saved dtype: decides fp16 hazards (compute: fp32)
        self.lap("model")

    def probe(self):
        """The file's findings, then the probes' one recorded pass (label-shift's own after it)."""
        sd, model, forward, batch = self.sd, self.model, self.forward, self.batch
        self.first = (hygiene.non_finite(sd) + hygiene.implausible(sd) + self.checks + self.data_checks
                      + resume_state(self.folder))
        with sliced_output(model, self.keep, lambda: self.call(forward, model, batch.src[:1, :3],
                                                                batch.tgt_in[:1, :3])) as keep:
            self.keep = keep
            probed = driver.probe_once(self.subject, self.probe_names, batch, compute_dtype=self.dtype,
                                       sinks=self.sinks, token_names=self.names)
        if self.shift:
            probed = self.with_shift(probed, self.subject)
        self.lap("probes")
        self.heads = duplicate_heads(attention_weights(model))      # the judge's head checks
        return probed

    def temperature_sweep(self) -> dict:
        """missing-scale's temperature sweep on in-distribution data (an encoder-only model's
        masked positions, as it was trained), or why it did not run."""
        ids, data, folder = self.ids, self.data, self.folder
        swept, reason = data, ""
        if data is not None and self.encoder:              # scored as trained: masked positions
            mask_id = mask_token_id(folder, self.config)
            swept = None if mask_id is None else Batch(*masked_lm_batch(
                data, mask_id, ids["pad"], [*ids["specials"].values(), *tokenizer_specials(folder)]))
            reason = ("" if mask_id is not None else "the masked-LM objective needs the mask id, "
                      "which neither config.json (mask_token_id) nor a tokenizer in DIR gives")
        if swept is not None:
            subject = self.subject
            sweep_ev = hygiene.temperature_sweep(
                lambda s, t: subject.logits(s, t), subject.capture.scaling, swept, ids["pad"], self.tgt_v,
                data="--data")
        else:
            reason = reason or self.unused or ("needs in-distribution data: " + (
                "pass --text FILE (one sequence per line, tokenised with the tokenizer in DIR) or "
                "--data FILE.pt ({'ids': LongTensor[N, T]})" if self.one_stack else
                "pass --text FILE (source<TAB>target per line, tokenised with the tokenizer in DIR) "
                "or --data FILE.pt") + "; random ids cannot say whether the checkpoint was trained "
                "with the scale its code applies")
            sweep_ev = {"verdict": "skipped", "reason": reason}   # recorded as not run
        self.lap("hygiene")
        return sweep_ev

    # -- the record and the judge ------------------------------------------------------------------
    def record(self, probed, sweep_ev: dict) -> dict:
        """report.json's `run`: what was triaged, how it was called, on what."""
        folder, model, config, ids, data, batch = (self.folder, self.model, self.config, self.ids,
                                                   self.data, self.batch)
        source, names, keep, tgt_v, dtype, lo, hi = (self.source, self.names, self.keep, self.tgt_v,
                                                     self.dtype, self.lo, self.hi)
        decoder, encoder = self.decoder, self.encoder
        on_tokens = f"{'decoded with the saved tokenizer' if names else 'as ids'}"
        return {"mode": "triage", "checkpoint": str(folder), "format": "huggingface",
                "container": "save_pretrained", "layout": "huggingface", "model_type": config.model_type,
                "model": type(model).__name__, "adapter": "huggingface",
                "transformers_version": self.tf.__version__,
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                "weight_files": [p.name for p in self.files], "tied_keys_restored": self.tied,
                **({"weight_files_note": self.files_note} if self.files_note else {}),
                "task": None, "data": source or "none (--text or --data: the temperature sweep needs it)",
                "probe_data": (f"{source}: its first {min(PROBE_BATCH, len(batch.tgt_out))} sequences "
                               f"(the exact tests build their own inputs)" if data is not None else
                               f"random ids from the model's vocabulary ({lo}..{hi - 1}; special ids "
                               f"excluded)"),
                "figures_batch": (f"{source} (the probes' recorded batch; axis tokens {on_tokens})"
                                  if data is not None else
                                  f"the probes' random ids (axis tokens {on_tokens})"),
                "held_out_sequences": int((data if data is not None else batch).src.shape[0]),
                "probes_see_logits_of_ids": f"0..{keep - 1} (of {tgt_v}; exact)" if keep else f"all {tgt_v}",
                "compute_dtype": str(dtype).removeprefix("torch."),
                "arithmetic": "float32" + (f" ({str(dtype).removeprefix('torch.')} weights upcast exactly: "
                                           f"fp32 tolerances)" if dtype != torch.float32 else ""),
                "weight_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in self.sd.values()
                                         if v.is_floating_point()}),
                "pad_id": ids["pad"], "bos_id": None if encoder else ids["start"],
                "special_ids": ids["specials"],
                "ids_note": lm_ids_note(ids) if decoder else mlm_ids_note(ids) if encoder else (
                    f"pad {ids['pad']} (pad_token_id) and decoder start {ids['start']} "
                    f"({ids['start_from']}) come from config.json; --pad-id/--bos-id are not "
                    f"used" + (f"; probes mark column 0 with id {ids['marker']}, which the "
                               f"adapter feeds as {ids['start']}" if ids["marker"] != ids["start"] else "")),
                "arch": self.kind, **({"calls": LM_CALLS} if decoder else
                                      {"calls": MLM_CALLS, "loss": MLM_LOSS} if encoder else {}),
                "attention_modules": sorted(self.subject.capture.attention),
                "probes_run": self.probe_names + [LABEL_SHIFT] * self.shift,
                "probe_inputs": self.subject.inputs(),
                "temperature_sweep": sweep_ev, "timings_s": self.timings, "probe_seconds": probed.seconds,
                "wall_s": round(time.perf_counter() - self.t0, 3), "status": "completed"}

    def conclude(self, probed, sweep_ev: dict) -> Report:
        """The one tail (judge.conclude). The fresh model runs the installed package's unmodified
        code with its class defaults for every scale switch (else the config chose the scale: the
        error stays, its fix names them); a patch, or a function swapped into the package's
        modules, is not the package's code."""
        auto = ("AutoModelForCausalLM" if self.decoder else "AutoModelForMaskedLM" if self.encoder
                else "AutoModelForSeq2SeqLM")
        run = self.record(probed, sweep_ev)
        return judge.conclude(run, probed.findings, probed.statuses, judge.Context(
            one_pass=True, probe_fresh=self.probe_fresh,
            fresh_how=f"{auto}.from_config(config), seed {SEED}, attn {self.attn or 'from config'}",
            package_code=package_code(self.model, self.config, patched=self.patch is not None),
            probe_names=self.probe_names + [LABEL_SHIFT] * self.shift,
            weights_finite=hygiene.weights_finite(self.sd), first=self.first, checks=self.heads,
            hf_model=self.model, hf_switches=scale_switches(self.config), sweep=sweep_ev,
            not_run=[("checkpoint", "the untied-head test", self.head_unrun)] if self.head_unrun else [],
            order=self.probe_names, started=self.t0))
