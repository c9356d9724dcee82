"""A one-stack model read as decoder-only by a guess (its shape, or `forward(model, ids,
pad_id)` with no arch given): a BERT-style encoder and a GPT without its causal mask are called
alike, so the findings that an encoder gives by design when read as a decoder end their fix with
how to read it as an encoder. The verdict stays: the same evidence is two bugs in a decoder."""
from __future__ import annotations

GUESSES = ("guessed from", "read as decoder-only")    # capture/adapters.py, library/live.py

# what a bidirectional model trained as a masked LM shows when read as a decoder
BY_DESIGN_IN_AN_ENCODER = {
    "mask-broadcast/causal-leak": "every position sees every other",
    "label-shift/unshifted": "it predicts the token at its own position",
}


def guessed_decoder(run: dict) -> bool:
    """The run read a one-stack model as decoder-only without being told."""
    how = str(run.get("arch_from") or "")
    return run.get("arch") == "decoder" and any(g in how for g in GUESSES)


def arch_hints(run: dict) -> dict[str, str]:
    """code -> the sentence its fix ends with, for a decoder read by a guess; {} otherwise."""
    if not guessed_decoder(run):
        return {}
    return {code: (f" If this model is encoder-only on purpose (BERT-style: {why}), rerun with "
                   f"--arch encoder (arch='encoder' in tndebug.check and tndebug.watch).")
            for code, why in BY_DESIGN_IN_AN_ENCODER.items()}
