"""positional-encoding's findings from the weights alone, which triage measures without a
forward (triage/hygiene.py: a stored PE table compared with the paper's sinusoids, and the
embedding/PE ratio rho read from the embedding's rows): their messages, evidence and fixes."""
from __future__ import annotations

from tndebug.findings import Finding


def stored_pe_finding(key: str, err: float, zero: bool) -> Finding:
    """The stored PE table `key` is not the sinusoidal one: max |diff| `err`, all zero or not."""
    return Finding("positional-encoding", "warning",
                   f"{key} is {'all zero' if zero else 'not the sinusoidal table'} "
                   f"(max |diff| {err:.2g}): the model was trained with a different PE than the "
                   f"paper's", where=key.rpartition(".")[0] or key, step=0,
                   evidence={"max_abs_diff": err, "all_zero": zero},
                   fix="check how the PE table is built (sin on even, cos on odd features)",
                   code="positional-encoding/stored-pe")


def emb_ratio_finding(where: str, rho: float, scale: float, rho_low: float,
                      rho_high: float) -> Finding:
    """rho = RMS(embedding x scale) / RMS(PE) outside [rho_low, rho_high]."""
    drowned = "the PE drowns the token embeddings" if rho < rho_low else "the embeddings drown the PE"
    return Finding("positional-encoding", "warning",
                   f"{where}: rho = RMS(embedding x {scale:.3g}) / RMS(PE) = {rho:.3g}: {drowned}",
                   where=where, step=0, evidence={"rho": rho, "scale": scale, "threshold_low": rho_low,
                                                  "threshold_high": rho_high},
                   fix="multiply the embeddings by sqrt(d_model) and initialise them N(0, 1/d_model) "
                       "(or Xavier), so that token and position parts are comparable",
                   code="positional-encoding/emb-ratio")
