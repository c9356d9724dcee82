"""Residual-stream statistics along depth, shared by `variance-drift` and `ln-placement`.

Everything here reads `Trace.streams` only, so it works on any model whose capture fills
the stream points. Shapes: x [B, T, d] at one stream point, keep [B, T] its non-pad tokens.

* `depth_profile`: per stream point, r = ‖X − 1x̄ᵀ‖_F / ‖X‖_F per sequence (Dong et al. 2021;
  FAILURE_MODES 5a), the token RMS, and the retention of the point before.
* `norm_signature` / `is_normalised`: is x the output of a LayerNorm (or RMSNorm), whatever
  its learned gain and bias? (FAILURE_MODES 2.6, generalised to a trained affine.)
* `detect_placement`: pre-LN vs post-LN from the block outputs.
The setup forward both probes start from (a wide random batch and its gradients) is in
`_depth_setup`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tndebug.capture.trace import StreamPoint, Trace
from tndebug.probes._depth_setup import SETUP_TRACE

# A LayerNorm output x = γ ⊙ z + β with Σ_i z_i = 0 satisfies Σ_i x_i/γ_i = const for every
# token: the token-centred matrix has a null vector, so its smallest singular value is ~0
# (~1e-7 of the typical one in float32). Measured (tiny/small/base, init and 300 steps):
# post-LN block outputs ≤ 4e-6, pre-LN block outputs ≥ 1.2e-2 unless rank-deficient.
NULL_RATIO = 1e-4
# ...but a rank-deficient stream (few distinct tokens, rank collapse) has null vectors for
# another reason; then the second smallest singular value is ~0 too and we cannot tell.
# (a no-verdict gate; set on the same runs as NULL_RATIO; held out: foreign, realbugs)
SECOND_RATIO = 1e-3
# Unit-affine LayerNorm (any model at init): per-token mean ~0 and std constant.
# Exact to float rounding: set on no run (e19bac1); reported on det-eval, foreign, realbugs.
DIRECT_TOL = 1e-3
# A LayerNorm output's tokens lie on one ellipsoid, up to its eps: z = (x - mu) / sqrt(var + eps)
# has norm^2 d var/(var + eps), so a low-variance stream (var ~1e-3 at init with std-0.02
# weights, eps 1e-5, as Blenderbot's final norm sees) spreads the tokens' norms by ~1%: 0.2%
# measured. A stream that is only centred (the one other way to get the null vector) spreads
# them by tens of %.
# Set on HF Blenderbot at init (6d4b6c0; was 1e-3): foreign's HF styles are not held out for it.
SPHERE_TOL = 1e-2
MAX_SVD_TOKENS = 4096
PLACEMENT = "depth_stats.placement"          # RunContext.extras key: detect_placement's answer


def module_path(name: str) -> str:
    """`encoder.layers.0.sublayer.1.hook_resid` -> `encoder.layers.0.sublayer.1`."""
    head, _, leaf = name.rpartition(".")
    return head if head and leaf.startswith("hook_") else name


def stack_groups(trace: Trace) -> list[tuple[str, list[StreamPoint]]]:
    """Stream points grouped by stack, in order; an embedding point joins the stack after it."""
    groups: list[tuple[str, list[StreamPoint]]] = []
    pending: list[StreamPoint] = []
    for sp in trace.streams:
        if sp.kind == "embed" or sp.stack == "embed":
            pending.append(sp)
            continue
        if not groups or groups[-1][0] != sp.stack or pending:
            groups.append((sp.stack, pending + [sp]))
            pending = []
        else:
            groups[-1][1].append(sp)
    return groups


def token_keep(trace: Trace, stack: str, x: torch.Tensor) -> torch.Tensor:
    """Non-pad tokens of `x` [B, T, d]: the source for the encoder, the target for the decoder."""
    ids = trace.src if stack == "encoder" else trace.tgt if stack == "decoder" else None
    if ids is not None and ids.shape == x.shape[:2]:
        return (ids != trace.pad_id).to(x.device)
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


def depth_profile(xs: list[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """[P, 3] per stream point of one shape (each [B, T, d], P of them, in depth order):

    * r: ‖X − 1x̄ᵀ‖_F / ‖X‖_F over each sequence's non-pad tokens, averaged over sequences
      (NaN for sequences with < 2 tokens);
    * the RMS of the stream over non-pad tokens;
    * retention: the cosine between the token-centred previous point and this one, averaged
      over sequences; ~1 with a residual add, ~0 when x = f(x) (row 0: NaN).

    Each point is centred once and reused for the next point's retention; no boolean
    indexing, so no device sync.
    """
    w = keep.unsqueeze(-1).float()                           # [B, T, 1]
    n = w.sum(1, keepdim=True)                               # [B, 1, 1]
    few = n.view(-1) < 2                                     # sequences with < 2 tokens: NaN
    n_tokens = w.sum()
    nan = float("nan")
    rows, prev, prev_norm = [], None, None
    for x in xs:
        x = x.float()
        xw = x * w
        c = (x - xw.sum(1, keepdim=True) / n.clamp(min=1)).mul_(w)        # token-centred
        c_norm = torch.linalg.vector_norm(c, dim=(1, 2))                   # [B]
        x_norm = torch.linalg.vector_norm(xw, dim=(1, 2))                  # [B]
        r = (c_norm / x_norm.clamp(min=1e-15)).masked_fill(few, nan).nanmean()
        rms = (x_norm.square().sum() / (n_tokens * x.shape[-1]).clamp(min=1)).sqrt()
        if prev is None:
            kept = r.new_tensor(nan)
        else:
            cos = (prev * c).sum((1, 2)) / (prev_norm * c_norm).clamp(min=1e-30)   # (einsum: 10x slower on CPU)
            kept = cos.masked_fill(few, nan).nanmean()
        rows.append(torch.stack([r, rms, kept]))
        prev, prev_norm = c, c_norm
    return torch.stack(rows)


@dataclass
class NormSignature:
    mean_ratio: float      # mean over tokens of |mean_i x_i| / rms(x)
    std_cv: float          # coefficient of variation of the per-token std
    null_ratio: float      # σ_min / σ_rms of the token-centred matrix (NaN: too few tokens)
    second_ratio: float    # σ_{d-1} / σ_rms
    sphere_residual: float  # tokens rescaled by the null vector lie on one sphere (LayerNorm: ~0; NaN: not tested)
    rms_residual: float    # residual of the RMSNorm identity Σ_i w_i x_i² = 1 (NaN: not tested)
    tokens: int
    width: int

    def as_evidence(self) -> dict:
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in vars(self).items()}


THREADED_WIDTH = 256      # LAPACK on d x d matrices this wide or wider keeps torch's threads


@contextmanager
def _one_thread(width: int = 0):
    """Small LAPACK calls run 100x slower when their threads fight other work for the cores;
    from THREADED_WIDTH on, the work outweighs the threads' cost (768 wide, 2 cores, measured:
    eigh 0.149 -> 0.080 s, lstsq 0.156 -> 0.102 s on two threads), so they are kept."""
    n = torch.get_num_threads()
    torch.set_num_threads(n if width >= THREADED_WIDTH else 1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def norm_signature(x: torch.Tensor, keep: torch.Tensor) -> NormSignature:
    """The numbers `is_normalised` decides on (syncs to the host; setup time only)."""
    with _one_thread(x.shape[-1]):
        return _signature(x, keep)


def _signature(x: torch.Tensor, keep: torch.Tensor) -> NormSignature:
    X = x.detach()[keep].to("cpu", torch.float64)           # [N, d]
    X = X[X.isfinite().all(-1)]       # NaN rows say nothing of placement (and LAPACK rejects them)
    if X.shape[0] > MAX_SVD_TOKENS:
        X = X[torch.linspace(0, X.shape[0] - 1, MAX_SVD_TOKENS).long()]
    N, d = X.shape
    mu, sd = X.mean(-1), X.std(-1, unbiased=False)
    rms = X.pow(2).mean(-1).sqrt().clamp(min=1e-30)
    mean_r = float((mu.abs() / rms).mean()) if N else float("nan")
    cv = float(sd.std(unbiased=False) / sd.mean().clamp(min=1e-30)) if N else float("nan")
    null = second = sphere = rres = float("nan")
    if N >= d + 2:
        Xc = X - X.mean(0)
        evals, evecs = torch.linalg.eigh(Xc.T @ Xc)         # ascending; σ_i² of the centred tokens
        sv = evals.clamp(min=0).sqrt()
        s_rms = evals.clamp(min=0).mean().sqrt().clamp(min=1e-30)
        null, second = float(sv[0] / s_rms), float(sv[1] / s_rms)
        if null < NULL_RATIO:
            # With v ∝ 1/γ (the null vector), y_t = v ⊙ x_t = s·z_t + c lies on one sphere
            # ‖y_t − c‖ = const: fit 2 y·c + k = ‖y‖² and keep the relative residual.
            y = X * evecs[:, 0]                              # [N, d]
            A = torch.cat([2 * y, torch.ones(N, 1, dtype=y.dtype)], dim=1)   # [N, d + 1]
            rhs = y.pow(2).sum(-1, keepdim=True)             # [N, 1]
            fit = torch.linalg.lstsq(A, rhs).solution
            sphere = float((A @ fit - rhs).norm() / rhs.norm().clamp(min=1e-30))
        else:
            # RMSNorm: Σ_i w_i x_i² = 1 for every token (w = 1/γ²)
            A = X.pow(2)                                     # [N, d]
            ones = torch.ones(N, 1, dtype=A.dtype)
            w = torch.linalg.lstsq(A, ones).solution
            rres = float((A @ w - ones).norm() / N ** 0.5)
    return NormSignature(mean_r, cv, null, second, sphere, rres, N, d)


def is_normalised(sig: NormSignature) -> bool | None:
    """True: x is a LayerNorm/RMSNorm output; False: it is not; None: cannot tell."""
    if sig.mean_ratio < DIRECT_TOL and sig.std_cv < DIRECT_TOL:
        return True                      # unit-gain LayerNorm, e.g. any model at init
    if sig.null_ratio != sig.null_ratio:  # NaN: fewer tokens than features
        return None
    if sig.second_ratio < SECOND_RATIO:
        return None                      # rank-deficient (few distinct tokens, collapse): cannot tell
    if sig.null_ratio < NULL_RATIO:
        return sig.sphere_residual < SPHERE_TOL
    if sig.rms_residual < NULL_RATIO:
        return True                      # RMSNorm with a learned gain
    return False


def undoes_to_normalised(x: torch.Tensor, keep: torch.Tensor, norm: tuple) -> bool | None:
    """A stream point that is a normalisation module's output, checked by undoing the module's
    own affine: z = (x - bias) / weight. True: z is a LayerNorm's or an RMSNorm's (one rms for
    every token); None: it is not, or cannot be undone
    (a zero weight). Exact where the statistics of x alone cannot tell (a rank-deficient
    stream: Marian's trained Post-LN blocks have two near-null directions), whatever the
    number of tokens. Never False: a module whose weight means something else (a gain of
    1 + w) leaves the question open rather than wrongly answered."""
    weight, bias = norm
    X = x.detach()[keep].to("cpu", torch.float64)                       # [N, d]
    X = X[X.isfinite().all(-1)]
    if X.shape[0] < 2:
        return None
    if bias is not None:
        X = X - bias.detach().to("cpu", torch.float64)
    if weight is not None:
        w = weight.detach().to("cpu", torch.float64)
        if bool((w.abs() < 1e-12).any()):
            return None
        X = X / w
    rms = X.pow(2).mean(-1).sqrt()
    # a LayerNorm's z (mean 0, std sqrt(var / (var + eps))) and an RMSNorm's have one rms for
    # every token, up to eps's spread (SPHERE_TOL's reason); a stream that is not normalised
    # spreads it by tens of % (the tokens' norms differ)
    return True if float(rms.std(unbiased=False) / rms.mean().clamp(min=1e-30)) < SPHERE_TOL else None


def signature_at(trace: Trace, sp: StreamPoint, stack: str | None = None) -> NormSignature:
    return norm_signature(sp.x, token_keep(trace, stack or sp.stack, sp.x))


def block_points(trace: Trace) -> list[StreamPoint]:
    """Block outputs: the layer outputs, else the sublayer outputs (no embeddings, no stacks)."""
    layers = [sp for sp in trace.streams if sp.kind == "layer"]
    return layers or [sp for sp in trace.streams if sp.kind == "sublayer"]


def stack_outputs(trace: Trace) -> list[StreamPoint]:
    """The last stream point of kind "stack" for each stack (what the next part reads)."""
    last: dict[str, StreamPoint] = {}
    for sp in trace.streams:
        if sp.kind == "stack":
            last[sp.stack] = sp
    return list(last.values())


def detect_placement(trace: Trace, run=None) -> tuple[str, dict]:
    """("post" | "pre" | "mixed" | "unknown", evidence) from the block outputs of one trace;
    with `run`, the setup trace's answer is kept in run.extras (variance-drift and
    ln-placement both ask: an eigendecomposition per block output)."""
    if run is not None and trace is run.extras.get(SETUP_TRACE):
        if PLACEMENT not in run.extras:
            run.extras[PLACEMENT] = _detect_placement(trace)
        label, ev = run.extras[PLACEMENT]
        return label, dict(ev)
    return _detect_placement(trace)


def _detect_placement(trace: Trace) -> tuple[str, dict]:
    verdicts = []
    worst_null_post, least_null_pre = 0.0, float("inf")
    for sp in block_points(trace):
        sig = signature_at(trace, sp)
        v = is_normalised(sig)
        if v is None and sp.norm is not None:
            with _one_thread():
                v = undoes_to_normalised(sp.x, token_keep(trace, sp.stack, sp.x), sp.norm)
        verdicts.append(v)
        if v is True and sig.null_ratio == sig.null_ratio:
            worst_null_post = max(worst_null_post, sig.null_ratio)
        if v is False:
            least_null_pre = min(least_null_pre, sig.null_ratio)
    yes, no = verdicts.count(True), verdicts.count(False)
    evidence = {"block_outputs": len(verdicts), "normalised": yes, "not_normalised": no,
                "undecided": verdicts.count(None),
                "threshold_null_ratio": NULL_RATIO, "threshold_direct": DIRECT_TOL}
    if yes:
        evidence["max_null_ratio_normalised"] = worst_null_post
    if no:
        evidence["min_null_ratio_not_normalised"] = least_null_pre
    if yes and not no:
        return "post", evidence
    if no and not yes:
        return "pre", evidence
    if yes and no:
        return "mixed", evidence
    return "unknown", evidence

