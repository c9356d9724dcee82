"""`tndebug triage DIR`: a Hugging Face `save_pretrained` directory, no user code (issue 11).

    report = triage_hf(TriageOptions("./my-model/", attn="sdpa"))

1. config.json -> AutoConfig (local files only, HF_HUB_OFFLINE=1: never a network call); an
   unknown model_type or a shape that is none of the three below is a one-line UsageError;
2. the model from `AutoModelForSeq2SeqLM.from_config` (a decoder-only model, GPT2, Llama, ...:
   `AutoModelForCausalLM`, called as hf/decoder_only.py says; an encoder-only one, Bert, Roberta, ...:
   `AutoModelForMaskedLM`, as encoder_only.py says), the weights read with safetensors (or
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
   --text / --data: data.py.

transformers is imported only inside functions: the core package never needs it.
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tndebug.data import Batch
from tndebug.errors import UsageError
from tndebug.findings import Finding
from tndebug.subject import Subject
from tndebug.hf.encoder_decoder import attention_weights, choose_ids, make_adapter
from tndebug.hf.decoder_only import LM_CALLS, choose_lm_ids, lm_ids_note, make_lm_adapter
from tndebug.hf.encoder_only import MLM_CALLS, MLM_LOSS, make_mlm_adapter, mlm_ids_note
from tndebug.hf.load import (INSTALL, WEIGHTS, _line, init_missing, load_tied,  # noqa: F401
                             read_weights, renamed, sliced_output, weight_files)
from tndebug.hf.load import transformers_offline as _transformers  # noqa: F401 - tests

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


# -- config and model --------------------------------------------------------------------------
def load_config(folder: Path):
    """(transformers, the config, "seq2seq" | "decoder" | "encoder")."""
    tf = _transformers()
    cfg_path = folder / "config.json"
    if cfg_path.exists() and not cfg_path.is_file():
        raise UsageError(f"{cfg_path} is a {'directory' if cfg_path.is_dir() else 'special file'}, "
                         f"not a file; a save_pretrained directory holds its configuration in "
                         f"the JSON file config.json")
    if not cfg_path.is_file():
        weights = next((folder / n for n in WEIGHTS if (folder / n).is_file()), None)
        raise UsageError(f"{folder} has no config.json; pass a directory written by "
                         f"model.save_pretrained(DIR) (config.json + model.safetensors)"
                         + (f", or the file {weights} itself to triage it as a plain checkpoint"
                            if weights and not weights.name.endswith(".json") else ""))
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise UsageError(f"{cfg_path} is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise UsageError(f"{cfg_path} has no model_type; it is not a transformers config")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(f"{cfg_path}: model_type {model_type!r} is unknown to transformers "
                         f"{tf.__version__} (a newer transformers, or a model with custom code, "
                         f"which tndebug does not run)")
    shape = ("an encoder-decoder" if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else
             _shape(model_type, raw, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES))
    kinds = {"an encoder-decoder": "seq2seq", "a decoder-only": "decoder", "an encoder-only": "encoder"}
    if shape not in kinds:
        raise UsageError(f"{folder} holds a {model_type} model "
                         f"({', '.join(raw.get('architectures') or []) or 'no architectures'}) "
                         f"with no language-model head of the three shapes tndebug triages: "
                         f"encoder-decoders (AutoModelForSeq2SeqLM), decoder-only models "
                         f"(AutoModelForCausalLM) and encoder-only models (AutoModelForMaskedLM)")
    archs = raw.get("architectures") or []
    if shape == "an encoder-only" and archs and not any("MaskedLM" in a for a in archs):
        raise UsageError(f"{folder} holds an encoder-only model with a {', '.join(archs)} head: "
                         f"triage builds the masked-LM one (AutoModelForMaskedLM), whose weights "
                         f"this directory does not hold (a {archs[0].split('For')[0]}ForMaskedLM's "
                         f"save_pretrained directory is triaged)")
    try:
        config = tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise UsageError(f"{cfg_path} could not be read by transformers: {_line(e)}") from None
    return tf, config, kinds[shape]


def build_model(tf, config, attn: str | None, kind: str = "seq2seq", *, init: bool = True) -> nn.Module:
    """The model in float32 whatever config.dtype says: 16-bit weights are upcast exactly on
    load, so every tolerance is fp32's while the values are the file's (issue 19; the saved
    dtype still decides the fp16 hazards, as run.compute_dtype).

    `init` False: the weights are left uninitialised (transformers' `no_init_weights`), for a
    model whose weights all come from the file: drawing 139M random numbers was half of building
    a BART-base-size model and its peak memory. Buffers computed in the modules' constructors
    are computed as ever; what only the initialisation fills and the file lacks is filled by
    `init_missing` after loading."""
    kw = {"attn_implementation": attn} if attn else {}
    kw["dtype"] = torch.float32
    auto = {"decoder": tf.AutoModelForCausalLM, "encoder": tf.AutoModelForMaskedLM}.get(
        kind, tf.AutoModelForSeq2SeqLM)
    quiet = nullcontext()
    if not init:
        try:
            from transformers.initialization import no_init_weights       # transformers 5
        except ImportError:
            try:
                from transformers.modeling_utils import no_init_weights   # transformers 4
            except ImportError:
                no_init_weights = None
        quiet = no_init_weights() if no_init_weights is not None else quiet
    try:
        with quiet:
            model = auto.from_config(config, **kw)
        if not init:
            model.tie_weights()     # no_init_weights skips it with the init: ties as config.json says
        return model
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"cannot build {config.model_type} from config.json"
                         f"{f' with --attn {attn}' if attn else ''}: {_line(e)}") from None


# -- ids and the adapter: tndebug/hf/encoder_decoder.py ---------------------------------------
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


# -- triage ------------------------------------------------------------------------------------------
def triage_hf(opts, patch=None, sinks=()):
    """Triage a save_pretrained directory. `patch(model, adapter)` (tests): change the loaded
    model in place, or return (forward, encode) to call it differently."""
    from tndebug import driver, judge
    from tndebug.hf.wording import package_code, scale_switches
    from tndebug.triage import hygiene
    from tndebug.probes._head_weights import duplicate_heads
    from tndebug.probes import TRIAGE_PROBES
    from tndebug.triage.options import OWN_CODE_PROBES, probes_of, refuse_longer, weights_dtype
    from tndebug.capture import GenericCapture
    from tndebug.judge.fresh import SEED, seeded
    from tndebug.hf import checks as hf_checks, shift as hf_shift
    from tndebug.hf.data import held_out, mask_token_id, token_names, tokenizer_specials
    from tndebug.hf.encoder_only import masked_lm_batch
    from tndebug.driver import PROBE_BATCH
    from tndebug.hf.resume import resume_state
    from tndebug.triage.userdata import check_vocab

    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = round(time.perf_counter() - t0 - sum(timings.values()), 3)

    folder = Path(opts.checkpoint)
    if opts.model or opts.adapter or opts.config or getattr(opts, "arch", None):
        raise UsageError(f"{folder} is a Hugging Face directory: --model, --adapter, --config "
                         f"and --arch do not apply (the model is built from its config.json)")
    attn = getattr(opts, "attn", None)
    tf, config, kind = load_config(folder)
    decoder, encoder = kind == "decoder", kind == "encoder"
    # a decoder-only model is also asked which labels it learnt from (label-shift), in a pass of
    # its own over the whole vocabulary (shift.py): the probes' pass sees a sliced output layer
    wanted = probes_of(opts.probes, OWN_CODE_PROBES if decoder else TRIAGE_PROBES)
    shift = decoder and hf_shift.NAME in wanted
    probe_names = [n for n in wanted if not (shift and n == hf_shift.NAME)]
    one_stack = decoder or encoder                  # called with one sequence of ids
    files = weight_files(folder)
    sd = read_weights(files)
    lap("load")
    model = build_model(tf, config, attn, kind, init=False)    # every weight comes from the file
    sd = renamed(model, sd)                            # saved names -> the model's (GPTNeoX)
    checks = hf_checks.tied_head(model, sd)            # before loading: unties as transformers does
    try:
        tied, unfilled = load_tied(model, sd, folder)
    except UsageError as e:                # an id config.json gets wrong may size a table (FSMT's
        wrong = hf_checks.ids_vs_tokenizer(folder, config)          # positions by pad_token_id)
        said = "; ".join(f"{f.where} = {f.evidence['config'][0]}, the tokenizer's "
                         f"{f.evidence['tokenizer'][0]}" for f in wrong if f.evidence.get("tokenizer"))
        if not said or "shape mismatch" not in str(e):
            raise
        raise UsageError(f"{e}; config.json disagrees with the saved tokenizer ({said}), and some "
                         f"classes size a table by such an id (FSMT's positions by pad_token_id): "
                         f"fix config.json's ids first") from None
    seeded(lambda: init_missing(model, unfilled))      # keys the file may lack (Marian's sinusoids)
    driver.give_back_freed()                          # the file's copy, now the model's
    more, files_note = hf_checks.weight_files_differ(folder, files, read_weights)
    checks += more + hf_checks.ids_vs_tokenizer(folder, config)
    model.eval()
    src_v = model.get_input_embeddings().num_embeddings
    out_emb = model.get_output_embeddings()
    tgt_v = getattr(out_emb, "out_features", None) or getattr(out_emb, "num_embeddings", None) or src_v
    keep = PROBE_VOCAB if tgt_v > PROBE_VOCAB and set(probe_names) <= set(TRIAGE_PROBES) else None
    ids = choose_lm_ids(config, min(src_v, tgt_v), keep) if one_stack else choose_ids(config, min(src_v, tgt_v))
    lo, hi = ids["content"]
    if keep:
        hi = min(hi, keep)

    def adapter(model):
        """(forward, encode) of an encoder-decoder, (forward, incremental) of a decoder-only
        model, (forward, None) of an encoder-only one; `patch` may replace them."""
        pair = (make_lm_adapter() if decoder else (make_mlm_adapter(), None) if encoder
                else make_adapter(ids["start"], ids["marker"]))
        return (patch(model, pair) or pair) if patch is not None else pair

    def call(fwd, model, src, tgt):
        """The probes' call: a decoder-only model is fed `tgt` alone (Subject kind "decoder"),
        an encoder-only one `src` alone (kind "encoder")."""
        if one_stack:
            return fwd(model, tgt if decoder else src, ids["pad"])
        return fwd(model, src, tgt, ids["pad"])

    def make_subject(model, forward, second):
        subject = Subject.of_kind(
            model, forward, None if encoder else second, kind=kind,
            capture=GenericCapture(model, kind=kind), pad_id=ids["pad"], bos_id=ids["marker"],
            src_vocab=hi, tgt_vocab=hi, first_content=lo,
            max_len=getattr(opts, "max_len", None) or getattr(config, "max_position_embeddings", None))
        if hasattr(subject.capture, "discover"):   # attention sites by behaviour, whatever the class
            subject.capture.discover(lambda: call(forward, model, batch.src[:2], batch.tgt_in[:2]))
        return subject

    def probe_fresh(names):
        """The probes `names` on AutoModel*.from_config(config), seeded: the code at
        initialisation, no weights loaded (issue 19)."""
        fresh = seeded(lambda: build_model(tf, config, attn, kind)).eval()
        fwd, second = adapter(fresh)
        sub = make_subject(fresh, fwd, second)
        main = [n for n in names if n != hf_shift.NAME]
        probed = driver.ProbeResult([], {}, {})
        if main:
            with sliced_output(fresh, keep, lambda: call(fwd, fresh, batch.src[:1, :3], batch.tgt_in[:1, :3])):
                probed = driver.probe_once(sub, main, batch, compute_dtype=dtype)
        return with_shift(probed, sub) if hf_shift.NAME in names else probed

    def with_shift(probed, sub):
        """`probed` with label-shift's findings and status, judged on the user's data when given
        (else the probes' random ids) over the whole vocabulary."""
        t = time.perf_counter()
        found, entry = hf_shift.label_shift(sub, data if data is not None else batch)
        seconds = {**probed.seconds, hf_shift.NAME: round(time.perf_counter() - t, 3)}
        return driver.ProbeResult(probed.findings + found, {**probed.statuses, hf_shift.NAME: entry},
                                  seconds, probed.batch)

    forward, second = adapter(model)

    data, source, data_checks = held_out(opts, folder, ids, ids["marker"], config, kind)
    head_unrun = None                     # why an untied head was not judged, if it was not
    if data is not None:
        check_vocab(Batch(data.tgt_in if decoder else data.src, data.tgt_in, data.tgt_out),
                    src_v, tgt_v, source)
        if not encoder:                   # an untied head that does not fit the trained body
            from tndebug.hf.head import judge_head
            t_in = data.tgt_in.clone()
            if not decoder:
                t_in[:, 0] = ids["start"]  # as the model is called: led by the decoder start
            head_found, head_unrun = judge_head(
                model, None if decoder else data.src, t_in, data.tgt_out, ids["pad"],
                fresh=lambda: seeded(lambda: build_model(tf, config, attn, kind)))
            data_checks = data_checks + head_found
    # data given but not read (config.json's pad is a real token of it: data_checks names it)
    unused = f"{source} was not used (the pad_token_id error)" if data is None and source else ""
    if data is None and not encoder:      # the same head, unjudged: the verdict says so
        from tndebug.hf.head import head_unchecked
        head_unrun = head_unchecked(model, unused)
    # the probes' recorded pass, and so every figure: the user's data when given, else random
    # ids (the exact tests build their own inputs either way)
    batch = probe_batch(data, keep, ids["pad"]) if data is not None else random_batch(
        Subject(model, forward, pad_id=ids["pad"], bos_id=ids["marker"], src_vocab=hi,
                tgt_vocab=hi, first_content=lo, kind=kind))
    names = token_names(folder, batch[:2]) if sinks else {}      # the figures' axis labels
    subject = make_subject(model, forward, second)
    from tndebug.probes.lm_decoding import tokenizer_padding_side
    subject.padding_side = tokenizer_padding_side(folder)   # lm-decoding: does it pad left
    if data is not None:
        refuse_longer(subject, (data.src, data.tgt_in), source)
    dtype = weights_dtype(sd)           # the saved dtype: decides fp16 hazards (compute: fp32)
    lap("model")

    findings = hygiene.non_finite(sd) + hygiene.implausible(sd) + checks + data_checks + resume_state(folder)
    with sliced_output(model, keep, lambda: call(forward, model, batch.src[:1, :3],
                                                  batch.tgt_in[:1, :3])) as keep:
        probed = driver.probe_once(subject, probe_names, batch, compute_dtype=dtype, sinks=sinks,
                                   token_names=names)
    if shift:
        probed = with_shift(probed, subject)
    probe_seconds = probed.seconds
    auto = ("AutoModelForCausalLM" if decoder else "AutoModelForMaskedLM" if encoder
            else "AutoModelForSeq2SeqLM")
    how = f"{auto}.from_config(config), seed {SEED}, attn {attn or 'from config'}"
    lap("probes")
    heads = duplicate_heads(attention_weights(model))
    swept, reason = data, ""
    if data is not None and encoder:                  # scored as trained: masked positions
        mask_id = mask_token_id(folder, config)
        swept = None if mask_id is None else Batch(*masked_lm_batch(
            data, mask_id, ids["pad"], [*ids["specials"].values(), *tokenizer_specials(folder)]))
        reason = ("" if mask_id is not None else "the masked-LM objective needs the mask id, "
                  "which neither config.json (mask_token_id) nor a tokenizer in DIR gives")
    if swept is not None:
        sweep_ev = hygiene.temperature_sweep(
            lambda s, t: subject.logits(s, t), subject.capture.scaling, swept, ids["pad"], tgt_v,
            data="--data")
    else:
        reason = reason or unused or ("needs in-distribution data: " + (
            "pass --text FILE (one sequence per line, tokenised with the tokenizer in DIR) or "
            "--data FILE.pt ({'ids': LongTensor[N, T]})" if one_stack else
            "pass --text FILE (source<TAB>target per line, tokenised with the tokenizer in DIR) "
            "or --data FILE.pt") + "; random ids cannot say whether the checkpoint was trained "
            "with the scale its code applies")
        sweep_ev = {"verdict": "skipped", "reason": reason}   # recorded as not run
    lap("hygiene")
    run = {"mode": "triage", "checkpoint": str(folder), "format": "huggingface",
           "container": "save_pretrained", "layout": "huggingface", "model_type": config.model_type,
           "model": type(model).__name__, "adapter": "huggingface",
           "transformers_version": tf.__version__,
           "attn_implementation": getattr(model.config, "_attn_implementation", None),
           "weight_files": [p.name for p in files], "tied_keys_restored": tied,
           **({"weight_files_note": files_note} if files_note else {}),
           "task": None, "data": source or "none (--text or --data: the temperature sweep needs it)",
           "probe_data": (f"{source}: its first {min(PROBE_BATCH, len(batch.tgt_out))} sequences "
                          f"(the exact tests build their own inputs)" if data is not None else
                          f"random ids from the model's vocabulary ({lo}..{hi - 1}; special ids "
                          f"excluded)"),
           "figures_batch": (f"{source} (the probes' recorded batch; axis tokens "
                             f"{'decoded with the saved tokenizer' if names else 'as ids'})"
                             if data is not None else
                             f"the probes' random ids (axis tokens "
                             f"{'decoded with the saved tokenizer' if names else 'as ids'})"),
           "held_out_sequences": int((data if data is not None else batch).src.shape[0]),
           "probes_see_logits_of_ids": f"0..{keep - 1} (of {tgt_v}; exact)" if keep else f"all {tgt_v}",
           "compute_dtype": str(dtype).removeprefix("torch."),
           "arithmetic": "float32" + (f" ({str(dtype).removeprefix('torch.')} weights upcast exactly: "
                                      f"fp32 tolerances)" if dtype != torch.float32 else ""),
           "weight_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in sd.values()
                                    if v.is_floating_point()}),
           "pad_id": ids["pad"], "bos_id": None if encoder else ids["start"], "special_ids": ids["specials"],
           "ids_note": lm_ids_note(ids) if decoder else mlm_ids_note(ids) if encoder else (
               f"pad {ids['pad']} (pad_token_id) and decoder start {ids['start']} "
               f"({ids['start_from']}) come from config.json; --pad-id/--bos-id are not "
               f"used" + (f"; probes mark column 0 with id {ids['marker']}, which the "
                          f"adapter feeds as {ids['start']}" if ids["marker"] != ids["start"] else "")),
           "arch": kind, **({"calls": LM_CALLS} if decoder else
                            {"calls": MLM_CALLS, "loss": MLM_LOSS} if encoder else {}),
           "attention_modules": sorted(subject.capture.attention),
           "probes_run": probe_names + [hf_shift.NAME] * shift,
           "probe_inputs": subject.inputs(),
           "temperature_sweep": sweep_ev, "timings_s": timings, "probe_seconds": probe_seconds,
           "wall_s": round(time.perf_counter() - t0, 3), "status": "completed"}
    # the fresh model runs the installed package's unmodified code with its class defaults for
    # every scale switch (else the config chose the scale: the error stays, its fix names them);
    # a patch, or a function swapped into the package's modules, is not the package's code
    return judge.conclude(run, probed.findings, probed.statuses, judge.Context(
        one_pass=True, probe_fresh=probe_fresh, fresh_how=how,
        package_code=package_code(model, config, patched=patch is not None),
        probe_names=probe_names + [hf_shift.NAME] * shift,
        weights_finite=hygiene.weights_finite(sd), first=findings, checks=heads,
        hf_model=model, hf_switches=scale_switches(config), sweep=sweep_ev,
        not_run=[("checkpoint", "the untied-head test", head_unrun)] if head_unrun else [],
        order=probe_names, started=t0))


def _shape(model_type: str, raw: dict, causal: dict, masked: dict) -> str:
    """What a directory that is no encoder-decoder holds, from its saved architectures first
    (BERT has a causal-LM head class too, yet a BertForMaskedLM is an encoder), then from the
    head classes its model_type has."""
    archs = " ".join(raw.get("architectures") or [])
    if any(w in archs for w in ("CausalLM", "LMHeadModel")) or raw.get("is_decoder"):
        return "a decoder-only"
    if model_type in masked:
        return "an encoder-only"
    return "a decoder-only" if model_type in causal else "not an encoder-decoder"
