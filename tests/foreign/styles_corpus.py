"""The user-style corpus (issue 45): decoder-only models written the many ways people write
them (tests/foreign/styles/*.py, one healthy file per style: sequence-first einsum attention
with the scale folded into q, per-head modules, rotary as a complex product, with rotate_half and
on interleaved pairs, ALiBi, no positions at all (NoPE), a KV cache, grouped-query heads), and
encoder-only ones (bidirectional, no mask: enc_*.py): batch-first einsum with a learned table,
T5's relative position bias, a sinusoidal table with per-head modules, rotary with SDPA).

Every bug is a one-line edit of the healthy file (`Bug.old` -> `Bug.new`; an empty `new` deletes
the line), written out as the user's own file, so the corpus knows where each bug is: the
mutated line (`bug_lines`). Each model is trained on character-level text with no pad token
(Python's pydoc topics, the text of bench/first_contact.py), saved as a plain state dict, and
triaged as a user would:

    tndebug triage CKPT --model FILE.py:build --adapter FILE.py:forward --data ids.pt --pad-id none

An encoder is trained to restore characters: 15% of each window replaced by random characters
(BERT's rate, no mask id: every id stays a character), cross-entropy against the original text
at every position (the target triage scores an encoder-only model with), and triaged with
`--arch encoder` (a forward(model, ids, pad_id) is read as decoder-only without it).

Shared by tests/foreign/test_styles.py and bench/foreign.py (`--corpus styles`). Nothing here
set a threshold: the corpus was written after every probe it scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tndebug.capture.adapters import import_file
from tndebug.triage import TriageOptions, triage

HERE = Path(__file__).resolve().parent
STYLE_DIR = HERE / "styles"
BLOCK, BATCH = 32, 16
# '\n' and printable ASCII: a fixed vocabulary of 96 characters, every model's vocab_size
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
STOI = {c: i for i, c in enumerate(CHARS)}


@dataclass(frozen=True)
class Bug:
    old: str                       # the healthy line's text (a substring, found exactly once)
    new: str                       # what it becomes ("" : the line is deleted)
    probe: str | None              # the probe that owns it; None: benign, must stay clean
    trained: str = "buggy"         # "buggy": trained with the bug; "healthy": weights trained by
                                   # the healthy code, then run by the edited one (a port)
    what: str = ""


_NO_SCALE = "missing-scale"
_MASK = "mask-broadcast"
_POS = "positional-encoding"
_ROT = "lm-decoding"               # rotary-shift / rotary-values / kv-cache
BUGS: dict[str, dict[str, Bug]] = {
    "einsum_tbhd": {
        "no_scale": Bug("q = q * self.head_dim ** -0.5", "", _NO_SCALE, what="the scale folded into q deleted"),
        "no_causal": Bug('attn = scores.masked_fill(self.future[:T, :T, None, None], float("-inf")).softmax(dim=1)',
                         "attn = scores.softmax(dim=1)", _MASK, what="no causal mask"),
        "softmax_dim": Bug(".softmax(dim=1)", ".softmax(dim=0)", _MASK, what="softmax over the queries"),
        "pos_unused": Bug("x = self.tok(idx) + self.pos[:T]", "x = self.tok(idx)", _POS,
                          what="the position table never added"),
    },
    "head_modules": {
        "no_scale": Bug("wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5", "wei = q @ k.transpose(-2, -1)",
                        _NO_SCALE),
        "scale_by_width": Bug("wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5",
                              "wei = q @ k.transpose(-2, -1) * C ** -0.5", _NO_SCALE,
                              what="scaled by the embedding width C, not the head size"),
        "triu": Bug('self.register_buffer("tril", torch.tril(', 'self.register_buffer("tril", torch.triu(',
                    _MASK, what="the mask transposed"),
        "softmax_dim": Bug("wei = F.softmax(wei, dim=-1)", "wei = F.softmax(wei, dim=1)", _MASK),
        "pos_unused": Bug("x = tok_emb + pos_emb", "x = tok_emb", _POS),
    },
    "rope_complex": {
        "rope_unapplied": Bug("xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)", "", _POS),
        "k_only": Bug("xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)",
                      "xq_out = torch.view_as_real(xq_).flatten(3)", _ROT, what="rotary on k only"),
        "no_scale": Bug("scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)",
                        "scores = torch.matmul(xq, xk.transpose(2, 3))", _NO_SCALE),
        "no_causal": Bug("h = layer(h, freqs_cis, mask)", "h = layer(h, freqs_cis, None)", _MASK,
                         what="the mask built but not passed"),
    },
    "rope_half": {
        "rope_unapplied": Bug("query, key = apply_rotary_pos_emb(query, key, cos, sin)", "", _POS),
        "q_only": Bug("k_embed = (k * cos) + (rotate_half(k) * sin)", "k_embed = k", _ROT),
        "halves": Bug("emb = torch.cat((freqs, freqs), dim=-1)", "emb = freqs.repeat_interleave(2, dim=-1)",
                      _ROT, what="cos/sin laid out for interleaved pairs, rotate_half pairs i, i + D/2"),
        "no_causal": Bug("is_causal=True", "is_causal=False", _MASK),
    },
    "rope_interleaved": {
        "rope_unapplied": Bug("return (tensor * cos) + (rotate_every_two(tensor) * sin)", "return tensor", _POS),
        "q_only": Bug("key = apply_rotary_pos_emb(key, sin, cos)", "", _ROT),
        "pairs": Bug("t[None, :, None, :].repeat_interleave(2, dim=3)", "t[None, :, None, :].repeat(1, 1, 1, 2)",
                     _ROT, what="sin/cos laid out for halves, rotate_every_two pairs 2i, 2i+1"),
        "no_scale": Bug("attn_weights = attn_weights / self.scale_attn", "", _NO_SCALE),
        "sign": Bug("torch.stack((-x2, x1), dim=-1)", "torch.stack((x2, -x1), dim=-1)", None,
                    what="benign: every pair rotated by -angle, still relative"),
    },
    "alibi": {
        "alibi_unapplied": Bug("att = att + self.alibi[:, :T, :T]", "", _POS),
        "no_causal": Bug("att = att.masked_fill(self.causal_mask[:T, :T], float(\"-inf\"))", "", _MASK),
        "no_scale": Bug("att = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)",
                        "att = q @ k.transpose(-2, -1)", _NO_SCALE),
    },
    "nope": {
        "no_causal": Bug("is_causal=True", "is_causal=False", _MASK),
        "no_scale": Bug("is_causal=True)", "is_causal=True, scale=1.0)", _NO_SCALE),
    },
    "kv_cache": {
        "cache_positions": Bug("pos = torch.arange(past_length, past_length + idx.size(1), device=idx.device)",
                               "pos = torch.arange(idx.size(1), device=idx.device)", _ROT,
                               what="positions restart at 0 on every cached step"),
        "cache_v_from_k": Bug("v = torch.cat((past_v, v), dim=-2)", "v = torch.cat((past_k, v), dim=-2)", _ROT),
        "cache_mask": Bug("self.bias[S - T:S, :S] == 0", "self.bias[:T, :S] == 0", _ROT,
                          what="the causal mask not offset by the cache's length"),
        "no_scale": Bug("att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))",
                        "att = q @ k.transpose(-2, -1)", _NO_SCALE),
    },
    "enc_einsum_learned": {
        "pos_unused": Bug("x = self.tok(ids) + self.pos[:T]", "x = self.tok(ids)", _POS,
                          what="the learned position table never added"),
        "no_scale": Bug('scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.d_head ** 0.5',
                        'scores = torch.einsum("bqhd,bkhd->bhqk", q, k)', _NO_SCALE),
        "softmax_dim": Bug("attn = scores.softmax(dim=-1)", "attn = scores.softmax(dim=-2)", _MASK,
                           what="softmax over the queries"),
    },
    "enc_t5_relbias": {
        "bias_unapplied": Bug("scores = scores + bias", "", _POS, what="the relative bias never added"),
        "no_scale": Bug("scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)",
                        "scores = q @ k.transpose(-1, -2)", _NO_SCALE),
        "softmax_dim": Bug("attn = torch.softmax(scores, dim=-1)", "attn = torch.softmax(scores, dim=-2)",
                           _MASK, what="softmax over the queries"),
    },
    "enc_sin_heads": {
        "pe_unused": Bug("x = x + self.pe[:ids.shape[1]]", "", _POS, what="the sinusoidal table never added"),
        "no_scale": Bug("wei = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])",
                        "wei = q @ k.transpose(-2, -1)", _NO_SCALE),
        "softmax_dim": Bug("wei = F.softmax(wei, dim=-1)", "wei = F.softmax(wei, dim=1)", _MASK,
                           what="softmax over the queries"),
    },
    "enc_rope": {
        "rope_unapplied": Bug("q, k = self.rotary(q, k)", "", _POS, what="rotary never applied"),
        "no_scale": Bug("z = F.scaled_dot_product_attention(q, k, v)",
                        "z = F.scaled_dot_product_attention(q, k, v, scale=1.0)", _NO_SCALE),
    },
    "gqa": {
        "kv_tiled": Bug("return x.repeat_interleave(n_rep, dim=1)", "return x.repeat(1, n_rep, 1, 1)",
                        "checkpoint", trained="healthy",
                        what="weights trained with repeat_interleave, run with tiled heads"),
        "no_causal": Bug("scores = scores + mask", "", _MASK),
        "k_only": Bug("q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin",
                      "q, k = q, k * cos + rotate_half(k) * sin", _ROT),
    },
}
STYLES = tuple(BUGS)
# encoder-only (bidirectional) styles: trained to restore corrupted characters, --arch encoder
ENCODERS = frozenset(s for s in STYLES if s.startswith("enc_"))
CORRUPT = 0.15                     # BERT's share of positions replaced
# healthy copies in 16 bits (issue 44: no false error on a half-precision model)
HALF_STYLES = ("head_modules", "rope_half", "alibi", "gqa")
HALF_DTYPES = (torch.bfloat16, torch.float16)
# the healthy NoPE model: no position mechanism by design, at most info (issue 45)
BY_DESIGN = {"nope": "no positions (NoPE)"}


def healthy_source(style: str) -> str:
    return (STYLE_DIR / f"{style}.py").read_text()


def source(style: str, bug: str | None) -> tuple[str, list[int]]:
    """The user's file with `bug` written in, and the bug's lines (1-based) in that file: the
    edited line, or for a deleted line the lines before and after where it stood (the op that
    is missing belongs between them)."""
    text = healthy_source(style)
    if bug is None:
        return text, []
    b = BUGS[style][bug]
    n = text.count(b.old)
    if n != 1:
        raise ValueError(f"{style}/{bug}: {b.old!r} occurs {n} times in the healthy file, not once")
    at = text.index(b.old)
    line = text.count("\n", 0, at) + 1
    lines = text.split("\n")
    if b.new:
        lines[line - 1] = lines[line - 1].replace(b.old, b.new)
        return "\n".join(lines), [line]
    del lines[line - 1]
    return "\n".join(lines), [line - 1, line]


def text_ids() -> torch.Tensor:
    """Python's pydoc topics as one stream of character ids (no pad token: every id is a char)."""
    from pydoc_data.topics import topics
    s = "".join(topics[k] for k in sorted(topics))
    return torch.tensor([STOI.get(c, STOI["?"]) for c in s], dtype=torch.long)


def held_out(data: torch.Tensor, n: int = 24) -> torch.Tensor:
    """n windows of BLOCK characters from the last tenth of the text (never trained on)."""
    start = len(data) - len(data) // 10
    return torch.stack([data[start + i * BLOCK:start + (i + 1) * BLOCK] for i in range(n)])


def train(model, forward, data: torch.Tensor, steps: int, seed: int, lr: float = 3e-3,
          encoder: bool = False) -> float:
    """AdamW on random windows of the first nine tenths, next-character cross-entropy; an
    encoder (`encoder`): the window with CORRUPT of its characters replaced by random ones, the
    cross-entropy against the original window at every position."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    end = len(data) - len(data) // 10 - BLOCK - 1
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ix = torch.randint(end, (BATCH,), generator=g).tolist()
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        if encoder:
            y = x
            hit = torch.rand(x.shape, generator=g) < CORRUPT
            x = torch.where(hit, torch.randint(len(CHARS), x.shape, generator=g), x)
        loss = F.cross_entropy(forward(model, x, None).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.detach())


@dataclass
class Case:
    style: str
    bug: str | None
    file: Path                     # the user's model file (with the bug written in)
    checkpoint: Path
    data: Path                     # held-out ids, {'ids': [N, BLOCK]}
    bug_lines: list[int]
    loss: float


def make_checkpoint(style: str, bug: str | None, seed: int, folder: Path, steps: int = 600,
                    data: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> Case:
    """The user's file with `bug` written in, trained `steps` steps from init seed `seed` (by
    the healthy file where the bug is a port, Bug.trained), saved as a plain state dict; with
    `dtype` (a healthy model only) the weights saved in that dtype, as `model.half()` /
    `model.bfloat16()` then `save` would (the fp32 checkpoint of the same seed is reused when
    `folder` holds it)."""
    folder = Path(folder)
    text, lines = source(style, bug)
    file = folder / f"{style}-{bug or 'healthy'}-{seed}.py"
    file.write_text(text)
    fp32 = folder / f"{style}-{bug or 'healthy'}-{seed}.pt"
    if dtype is not None and bug is None and fp32.exists():
        saved = torch.load(fp32)
        state, loss = saved["model"], saved["loss"]
    else:
        data = text_ids() if data is None else data
        trained_by = file
        if bug is not None and BUGS[style][bug].trained == "healthy":
            trained_by = folder / f"{style}-healthy-train-{seed}.py"
            trained_by.write_text(healthy_source(style))
        module = import_file(trained_by)
        torch.manual_seed(seed)
        model = module.build(vocab_size=len(CHARS))
        loss = train(model, module.forward, data, steps, seed, encoder=style in ENCODERS)
        state = model.state_dict()
        torch.save({"model": state, "step": steps, "loss": loss}, fp32)
    ckpt = fp32
    if dtype is not None:
        ckpt = folder / f"{style}-{bug or 'healthy'}-{seed}-{str(dtype).removeprefix('torch.')}.pt"
        torch.save({"model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                    "step": steps, "loss": loss}, ckpt)
    ids = folder / "char_ids.pt"
    if not ids.exists():
        torch.save({"ids": held_out(text_ids() if data is None else data)}, ids)
    return Case(style, bug, file, ckpt, ids, lines, loss)


def run_triage(case: Case, **kw):
    if case.style in ENCODERS:
        kw.setdefault("arch", "encoder")
    return triage(TriageOptions(str(case.checkpoint), model=f"{case.file}:build",
                                adapter=f"{case.file}:forward", data=str(case.data), pad_id=None, **kw))


def expected_probe(style: str, bug: str | None) -> str | None:
    return None if bug is None else BUGS[style][bug].probe
