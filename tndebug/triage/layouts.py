"""Recognise a checkpoint's layout from its keys and convert it into tndebug's model.

Three layouts are known:

* `tndebug`   our own (`encoder.layers.0.self_attn.w_q.weight`, `src_embed.lut.weight`).
* `annotated` The Annotated Transformer (`encoder.layers.0.self_attn.linears.0.weight`,
              `encoder.layers.0.sublayer.0.norm.a_2`, `src_embed.0.lut.weight`,
              `generator.proj.weight`); Pre-LN with a final norm; its LayerNorm divides by the
              unbiased std + eps, reproduced exactly by `StdLayerNorm`.
* `torch`     torch.nn.Transformer, possibly under a prefix (`transformer.encoder.layers.0.
              self_attn.in_proj_weight`, `linear1`, `norm1`), with the user's own embeddings and
              generator found by name and shape. nn.Transformer always has final norms, in
              Post-LN too; they are kept.

What the weights cannot say (the number of heads; Pre- or Post-LN for nn.Transformer; whether
the embeddings were multiplied by sqrt(d_model)) is listed in `Conversion.unknown` and settled by
the caller (flags, the checkpoint's config, or held-out loss).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from tndebug.errors import UsageError
from tndebug.inject import make_model
from tndebug.model.embedding import Embeddings, sinusoid_table

LAYOUTS = ("tndebug", "annotated", "torch")

# config aliases -> ModelConfig field
CONFIG_ALIASES = {
    "d_model": ("d_model", "hidden_size", "emb_size", "d_emb", "model_dim", "embed_dim", "dim"),
    "n_heads": ("n_heads", "h", "nhead", "num_heads", "heads", "n_head", "num_attention_heads"),
    "n_layers": ("n_layers", "N", "num_layers", "num_encoder_layers", "layers", "n_layer"),
    "d_ff": ("d_ff", "dim_feedforward", "ffn_dim", "ff_dim", "d_inner", "intermediate_size"),
    "src_vocab": ("src_vocab", "src_vocab_size", "input_vocab_size", "vocab_size", "vocab"),
    "tgt_vocab": ("tgt_vocab", "tgt_vocab_size", "trg_vocab_size", "output_vocab_size",
                  "vocab_size", "vocab"),
    "norm": ("norm", "norm_first"),
    "max_len": ("max_len", "maxlen", "max_seq_len", "max_position_embeddings"),
    "emb_scale": ("emb_scale", "scale_embedding"),
}


def normalise_config(cfg: dict | None) -> dict:
    """A checkpoint's config under ModelConfig's names (unknown keys dropped)."""
    out: dict = {}
    if not cfg:
        return out
    for name, aliases in CONFIG_ALIASES.items():
        for a in aliases:
            if a in cfg and cfg[a] is not None:
                v = cfg[a]
                if name == "emb_scale":
                    if isinstance(v, bool):
                        out[name] = v
                    continue
                if name == "norm":
                    v = ("pre" if v else "post") if a == "norm_first" else v
                    if v not in ("pre", "post"):
                        continue
                elif not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                out[name] = v if name == "norm" else int(v)
                break
    return out


class StdLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: a_2 * (x - mean) / (std + eps) + b_2, unbiased std."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.weight * (x - mean) / (std + self.eps) + self.bias


@dataclass
class Conversion:
    layout: str
    state_dict: dict[str, torch.Tensor]           # in tndebug's names
    sizes: dict                                    # ModelConfig fields the shapes fix
    unknown: dict[str, tuple] = field(default_factory=dict)   # field -> candidates
    final_norm: bool = True                        # the stacks end in a LayerNorm
    std_layer_norm: bool = False                   # annotated LayerNorm (unbiased std)
    renames: list[tuple[str, str]] = field(default_factory=list)   # tndebug path regex -> user path
    pe: torch.Tensor | None = None                 # the checkpoint's PE table, when it stores one
    pe_key: str = ""
    notes: list[str] = field(default_factory=list)

    def user_path(self, path: str) -> str:
        """A module path in tndebug's naming -> the same module in the checkpoint's naming."""
        for pat, rep in self.renames:
            path = re.sub(pat, rep, path)
        return path


def detect_layout(sd: dict[str, torch.Tensor]) -> str | None:
    keys = list(sd)
    if any(re.search(r"self_attn\.linears\.\d+\.weight$", k) for k in keys):
        return "annotated"
    if any(re.search(r"encoder\.layers\.\d+\.self_attn\.in_proj_weight$", k) for k in keys):
        return "torch"
    if any(re.search(r"encoder\.layers\.\d+\.self_attn\.w_q\.weight$", k) for k in keys) \
            and "src_embed.lut.weight" in sd:
        return "tndebug"
    return None


def describe_keys(sd: dict) -> str:
    ks = list(sd)
    return ", ".join(ks[:4]) + (f", ... ({len(ks)} keys)" if len(ks) > 4 else "")


def convert(sd: dict[str, torch.Tensor], layout: str) -> Conversion:
    """The checkpoint's tensors in tndebug's names; half-precision weights are examined in fp32."""
    sd = {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for k, v in sd.items()}
    conv = {"tndebug": _from_tndebug, "annotated": _from_annotated, "torch": _from_torch}[layout](sd)
    _check_stacks(conv)
    return conv


def head_candidates(d_model: int) -> tuple[int, ...]:
    """Head counts to try when nothing says: divisors of d_model with d_k >= 8, at most 32."""
    return tuple(h for h in range(1, 33) if d_model % h == 0 and d_model // h >= 8
                 and h in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)) or (1,)


# -- shared helpers -----------------------------------------------------------------------
def _count_layers(keys, stack: str) -> int:
    idx = {int(m.group(1)) for k in keys for m in [re.search(rf"(?:^|\.){stack}\.layers\.(\d+)\.", k)] if m}
    return max(idx) + 1 if idx else 0


def _sizes(sd: dict, emb_src: str, emb_tgt: str, ffn_key: str, n_enc: int, n_dec: int) -> dict:
    if n_enc != n_dec:
        raise UsageError(f"the encoder has {n_enc} layers and the decoder {n_dec}; tndebug's model "
                         f"needs the same N for both: triage the code itself with --model FILE.py:FACTORY")
    src_v, d = sd[emb_src].shape
    tgt_v = sd[emb_tgt].shape[0]
    return dict(d_model=int(d), src_vocab=int(src_v), tgt_vocab=int(tgt_v), n_layers=n_enc,
                d_ff=int(sd[ffn_key].shape[0]))


def _check_stacks(conv: Conversion) -> None:
    if conv.sizes["n_layers"] == 0:
        raise UsageError("no encoder layers found in the checkpoint; unknown layout: triage "
                         "the code itself with --model FILE.py:FACTORY")


def _pe_matches(pe: torch.Tensor, d: int) -> bool:
    """Does a stored PE table hold the paper's sinusoids?  pe [..., max_len, ..., d]"""
    table = pe.reshape(-1, d).float()                                          # [max_len, d]
    return bool(torch.allclose(table, sinusoid_table(table.shape[0], d), atol=1e-4))


# -- tndebug --------------------------------------------------------------------------------
def _from_tndebug(sd):
    keys = list(sd)
    sizes = _sizes(sd, "src_embed.lut.weight", "tgt_embed.lut.weight",
                   "encoder.layers.0.ffn.w_1.weight", _count_layers(keys, "encoder"),
                   _count_layers(keys, "decoder"))
    final = "encoder.norm.weight" in sd
    conv = Conversion("tndebug", dict(sd), sizes, final_norm=final)
    conv.unknown["n_heads"] = head_candidates(sizes["d_model"])
    if final:
        sizes["norm"] = "pre"
    else:   # Post-LN, or Pre-LN that forgot its final norm
        conv.unknown["norm"] = ("post", "pre")
    if sd["tgt_embed.lut.weight"].data_ptr() == sd["generator.proj.weight"].data_ptr():
        sizes["tie_embeddings"] = sizes["src_vocab"] == sizes["tgt_vocab"]
    return conv


# -- The Annotated Transformer -------------------------------------------------------------
_ANNOTATED = [
    (r"\.self_attn\.linears\.([0-3])\.", lambda m: f".self_attn.w_{'qkvo'[int(m.group(1))]}."),
    (r"\.src_attn\.linears\.([0-3])\.", lambda m: f".cross_attn.w_{'qkvo'[int(m.group(1))]}."),
    (r"\.feed_forward\.", lambda m: ".ffn."),
    (r"\.norm\.a_2$", lambda m: ".norm.weight"),
    (r"\.norm\.b_2$", lambda m: ".norm.bias"),
    (r"^(src|tgt)_embed\.0\.lut\.", lambda m: f"{m.group(1)}_embed.lut."),
]


def _from_annotated(sd):
    out, pe, pe_key, left = {}, None, "", []
    for k, v in sd.items():
        if re.fullmatch(r"(src|tgt)_embed\.1\.pe", k):
            if pe is None:
                pe, pe_key = v, k
            continue
        new = k
        for pat, rep in _ANNOTATED:
            new = re.sub(pat, rep, new)
        if new == k and not k.startswith(("generator.", "encoder.", "decoder.")):
            left.append(k)
        out[new] = v
    if left:
        raise UsageError(f"unexpected keys for The Annotated Transformer's layout: {', '.join(left[:4])}; "
                         f"triage the code itself with --model FILE.py:FACTORY")
    for need in ("src_embed.lut.weight", "tgt_embed.lut.weight", "generator.proj.weight"):
        if need not in out:
            raise UsageError(f"annotated layout without {need.replace('.lut', '.0.lut')}; "
                             f"triage the code itself with --model FILE.py:FACTORY")
    keys = list(out)
    sizes = _sizes(out, "src_embed.lut.weight", "tgt_embed.lut.weight",
                   "encoder.layers.0.ffn.w_1.weight", _count_layers(keys, "encoder"),
                   _count_layers(keys, "decoder"))
    sizes["ln_eps"] = 1e-6
    final = "encoder.norm.weight" in out
    sizes["norm"] = "pre"    # the sublayer applies norm first (x + dropout(f(norm(x))))
    if pe is not None:
        sizes["max_len"] = int(pe.reshape(-1, sizes["d_model"]).shape[0])
    conv = Conversion("annotated", out, sizes, final_norm=final, std_layer_norm=True, pe=pe,
                      pe_key=pe_key)
    conv.unknown["n_heads"] = head_candidates(sizes["d_model"])
    conv.renames = [(r"\.cross_attn\b", ".src_attn"), (r"\.ffn\b", ".feed_forward"),
                    (r"\.w_([qkvo])\b", lambda m: f".linears.{'qkvo'.index(m.group(1))}"),
                    (r"^(src|tgt)_embed\.lut\b", r"\1_embed.0.lut")]
    return conv


# -- torch.nn.Transformer --------------------------------------------------------------------
_TORCH = [
    (r"\.multihead_attn\.", ".cross_attn."),
    (r"\.out_proj\.", ".w_o."),
    (r"\.linear1\.", ".ffn.w_1."),
    (r"\.linear2\.", ".ffn.w_2."),
    (r"\.norm([123])\.", lambda m: f".sublayer.{int(m.group(1)) - 1}.norm."),
]
_SRC_WORDS = ("src", "source", "enc", "input", "inp")
_TGT_WORDS = ("tgt", "trg", "target", "dec", "output")


def _from_torch(sd):
    anchor = next(k for k in sd if re.search(r"encoder\.layers\.\d+\.self_attn\.in_proj_weight$", k))
    prefix = anchor[:anchor.index("encoder.layers.")]
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not k.startswith(prefix) or not re.match(r"(encoder|decoder)\.", k[len(prefix):]):
            rest[k] = v
            continue
        new = k[len(prefix):]
        for pat, rep in _TORCH:
            new = re.sub(pat, rep, new)
        m = re.search(r"\.in_proj_(weight|bias)$", new)
        if m:                                   # one [3d, d] projection -> W_Q, W_K, W_V
            for name, part in zip("qkv", v.chunk(3, dim=0)):
                out[f"{new[:m.start()]}.w_{name}.{m.group(1)}"] = part
            continue
        out[new] = v
    d = out["encoder.layers.0.self_attn.w_q.weight"].shape[1]
    src_key, tgt_key, gen_w, gen_b, pe, pe_key = _torch_outside(rest, d)
    out["src_embed.lut.weight"] = rest[src_key]
    out["tgt_embed.lut.weight"] = rest[tgt_key]
    out["generator.proj.weight"] = rest[gen_w]
    out["generator.proj.bias"] = rest[gen_b] if gen_b else torch.zeros(rest[gen_w].shape[0])
    keys = list(out)
    sizes = _sizes(out, "src_embed.lut.weight", "tgt_embed.lut.weight",
                   "encoder.layers.0.ffn.w_1.weight", _count_layers(keys, "encoder"),
                   _count_layers(keys, "decoder"))
    if pe is not None:
        sizes["max_len"] = int(pe.reshape(-1, d).shape[0])
    final = "encoder.norm.weight" in out
    conv = Conversion("torch", out, sizes, final_norm=final, pe=pe, pe_key=pe_key)
    conv.unknown["n_heads"] = head_candidates(d)
    conv.unknown["norm"] = ("post", "pre")          # norm_first is not in the weights
    conv.unknown["emb_scale"] = (True, False)       # x sqrt(d_model) or not: user code
    src_mod, tgt_mod, gen_mod = (k.rsplit(".", 1)[0] for k in (src_key, tgt_key, gen_w))
    P = prefix
    conv.renames = [
        (r"^(encoder|decoder)\.layers\.(\d+)\.sublayer\.(\d)\.norm\b",
         lambda m: f"{P}{m.group(1)}.layers.{m.group(2)}.norm{int(m.group(3)) + 1}"),
        (r"^(encoder|decoder)\.layers\.(\d+)\.sublayer\.\d\b", rf"{P}\1.layers.\2"),
        (r"^(encoder|decoder)\.layers\.(\d+)\.ffn\.w_1\b", rf"{P}\1.layers.\2.linear1"),
        (r"^(encoder|decoder)\.layers\.(\d+)\.ffn\.w_2\b", rf"{P}\1.layers.\2.linear2"),
        (r"^(encoder|decoder)\.layers\.(\d+)\.ffn\b", rf"{P}\1.layers.\2.linear1"),
        (r"^(encoder|decoder)\b(?!_)", rf"{P}\1"),
        (r"\.cross_attn\b", ".multihead_attn"),
        (r"\.w_o\b", ".out_proj"),
        (r"\.w_[qkv]\b", ""),
        (r"^src_embed(\.lut)?\b", src_mod),
        (r"^tgt_embed(\.lut)?\b", tgt_mod),
        (r"^generator(\.proj)?\b", gen_mod),
    ]
    return conv


def _torch_outside(rest: dict, d: int):
    """Find embeddings, generator and PE among the keys outside nn.Transformer."""
    pe, pe_key = None, ""
    mats = {}
    for k, v in rest.items():
        low = k.lower()
        if "pos" in low:
            if v.numel() % d == 0 and v.dim() >= 2 and v.shape[-1] == d:
                if not _pe_matches(v, d):
                    raise UsageError(
                        f"'{k}' is a learned or non-sinusoidal positional encoding, which "
                        f"tndebug's model cannot hold; triage the code itself with --model FILE.py:FACTORY")
                pe, pe_key = v, k
            continue
        if k.endswith("weight") and v.dim() == 2 and v.shape[1] == d:
            mats[k] = v
    embs = [k for k in mats if "emb" in k.lower()]
    gens = [k for k in mats if k not in embs]

    def pick(words, pool):
        hits = [k for k in pool if any(w in k.lower() for w in words)]
        return hits[0] if len(hits) == 1 else None

    if len(embs) == 1:
        src = tgt = embs[0]
    else:
        src, tgt = pick(_SRC_WORDS, embs), pick(_TGT_WORDS, embs)
    if len(gens) > 1:
        gens = [k for k in gens if any(w in k.lower() for w in
                                       ("generator", "out", "proj", "fc", "head", "classifier", "lm"))] or gens
    if not src or not tgt or len(gens) != 1:
        raise UsageError(
            f"torch.nn.Transformer layout, but its embeddings/generator could not be told apart "
            f"(2-D weights outside it: {', '.join(list(mats)[:5]) or 'none'}); "
            f"triage the code itself with --model FILE.py:FACTORY --adapter FILE.py:FUNCTION")
    gen_b = gens[0][: -len("weight")] + "bias"
    return src, tgt, gens[0], gen_b if gen_b in rest else "", pe, pe_key


# -- building -----------------------------------------------------------------------------------
def build_model(conv: Conversion, cfg):
    """tndebug's model for `cfg`, holding the checkpoint's weights; exact for the known layouts.

    Built on the meta device (no initialisation) and given the checkpoint's tensors themselves
    (`assign=True`: no copy), so trying several head counts costs neither time nor memory.
    """

    with torch.device("meta"):
        model = make_model(cfg)
    d = cfg.d_model
    for stack in (model.encoder, model.decoder):
        if conv.final_norm and stack.norm is None:      # nn.Transformer keeps it in Post-LN too
            stack.norm = nn.LayerNorm(d, eps=cfg.ln_eps)
    if conv.std_layer_norm:
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.LayerNorm):
                    setattr(module, child_name, StdLayerNorm(d, cfg.ln_eps))
    for module in model.modules():                      # non-persistent buffers: the PE tables
        if isinstance(module, Embeddings):
            module._buffers["pe"] = sinusoid_table(module.pe.shape[0], d)
    try:
        missing, unexpected = model.load_state_dict(conv.state_dict, strict=False, assign=True)
    except RuntimeError as e:
        raise UsageError(f"the checkpoint's shapes do not fit the inferred model: "
                         f"{_first_mismatch(str(e))}; pass --config or triage the code itself with "
                         f"--model FILE.py:FACTORY") from None
    if missing or unexpected:
        what = (f"missing {', '.join(conv.user_path(m.rsplit('.', 1)[0]) + '.' + m.rsplit('.', 1)[1] for m in missing[:3])}"
                if missing else f"unexpected {', '.join(unexpected[:3])}")
        raise UsageError(f"the {conv.layout} layout does not fit tndebug's model ({what}); "
                         f"triage the code itself with --model FILE.py:FACTORY")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left on the meta device: {left[:3]}"
    model.eval()
    return model


def _first_mismatch(msg: str) -> str:
    for line in msg.splitlines():
        if "size mismatch" in line:
            return line.strip().rstrip(".")
    return msg.strip().splitlines()[0] if msg.strip() else "shape mismatch"
