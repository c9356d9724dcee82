"""Hugging Face's wing (issue 46): everything tndebug knows about a transformers model that no user
code wraps, in one folder that capture, the judge, triage and the library call.

    build.py            config.json: which of the three shapes, and the model it builds
    load.py             the weight files, read (safetensors or a safe load) and loaded tie-aware
    encoder_decoder.py  how an encoder-decoder (BART, T5, Marian, ...) is called, its ids, and the
                        attention projections of every family
    decoder_only.py     how a causal LM (GPT-2, Llama, Qwen2, ...) is called, as generate() does
    encoder_only.py     how a masked LM (Bert, Roberta, ...) is called, and its masked batch
    checks.py, head.py  the head and file checks: a tied head saved apart, two weight files that
                        differ, ids against the tokenizer; an untied head that does not fit the body
    shift.py            label-shift's own pass over the whole vocabulary (decoder-only)
    wording.py          findings in Hugging Face terms (a judge pass), the package a model runs

Each file sits at the layer of what it imports (tests/test_layers.py), the judge's or below: the
front-end that triages a directory (`tndebug triage DIR`, with its --text/--data and a Trainer
checkpoint's resume state) ends in the judge, so it lives in tndebug/triage/ (hf_dir.py,
hf_data.py, hf_resume.py) and calls this wing. An architecture family's
quirks go in its family file, never in a probe. transformers is an optional dependency: the files
that need it import it inside the function that uses it, and say so. The Trainer callback is a
front-end and stays in tndebug/integrations/hf.py. This package file imports nothing."""
