"""Model configuration: a frozen dataclass with named presets and fault switches.

    cfg = ModelConfig.small().with_faults("no_scale")
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tndebug.faults import FAULTS, TABLE_FAULTS, check_faults

PRESETS = ("tiny", "small", "base")
NORMS = ("pre", "post")
ARCHS = ("seq2seq", "decoder")   # encoder-decoder (the paper), or one causal stack (GPT-style)
NORM_KINDS = ("layernorm", "rmsnorm")   # the paper's LayerNorm, or RMSNorm (Zhang & Sennrich 2019)
POSITIONS = ("sinusoidal", "rotary", "learned")   # the paper's table added at the input, RoPE (Su
#   et al. 2021) applied to q and k inside self-attention, or a learned table added at the input
#   (GPT-2's wpe, BERT's position embeddings)


@dataclass(frozen=True)
class ModelConfig:
    src_vocab: int = 11          # copy task: 0 pad, 1 start symbol, 2..10 content
    tgt_vocab: int = 11
    d_model: int = 128           # model width
    n_heads: int = 4             # h; d_k = d_v = d_model / n_heads
    n_layers: int = 3            # N, for the encoder and the decoder alike
    d_ff: int = 512              # position-wise feed-forward width
    dropout: float = 0.1         # P_drop of the paper
    max_len: int = 256           # rows of the sinusoidal table; longer inputs raise
    norm: str = "pre"            # "post": norm(x + f(x)) (paper); "pre": x + f(norm(x)) + final norm
    ln_eps: float = 1e-5
    pad_id: int = 0
    tie_embeddings: bool = False  # share target embedding and generator weights (paper §3.4)
    arch: str = "seq2seq"        # "decoder": one causal stack over prompt + continuation
    norm_kind: str = "layernorm"  # "rmsnorm": x / rms(x) * g, no centring, no bias (eps = ln_eps)
    pos: str = "sinusoidal"      # "rotary": nothing added at the embedding; q, k rotated by position;
    #                              "learned": a trained [max_len, d_model] table added instead
    faults: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r}; expected one of {NORMS}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}; expected one of {ARCHS}")
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind={self.norm_kind!r}; expected one of {NORM_KINDS}")
        if self.pos not in POSITIONS:
            raise ValueError(f"pos={self.pos!r}; expected one of {POSITIONS}")
        if self.pos == "rotary" and self.arch != "decoder":
            # the encoder-decoder would need a rule for cross-attention (queries and keys from
            # two sequences); not built
            raise ValueError("pos='rotary' is built for arch='decoder' only (self-attention over "
                             "one sequence); use arch='decoder' or pos='sinusoidal'")
        if self.arch == "decoder" and self.src_vocab != self.tgt_vocab:
            raise ValueError("arch='decoder' reads prompt and continuation with one vocabulary: "
                             "src_vocab must equal tgt_vocab")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must lie in [0, 1)")
        if self.tie_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError("tie_embeddings needs src_vocab == tgt_vocab")
        check_faults(self.faults)
        other = [f for f in self.faults if FAULTS[f].arch not in ("", self.arch)]
        if other:
            raise ValueError(f"fault {other[0]!r} exists only in a {FAULTS[other[0]].arch} model, "
                             f"not arch={self.arch!r}")
        for f in self.faults:
            if FAULTS[f].needs == "rotary" and self.pos != "rotary":
                raise ValueError(f"fault {f!r} is a bug of rotary positions: it needs pos='rotary'")
            if f in TABLE_FAULTS and self.pos != "sinusoidal":
                raise ValueError(f"fault {f!r} is a bug of the sinusoidal table, which "
                                 f"pos={self.pos!r} does not add: use pos='sinusoidal'")

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    # -- presets -----------------------------------------------------------------
    @classmethod
    def tiny(cls, **kw) -> "ModelConfig":
        """Tests: seconds on CPU."""
        return cls(**{**dict(d_model=64, n_heads=4, n_layers=2, d_ff=128), **kw})

    @classmethod
    def small(cls, **kw) -> "ModelConfig":
        """The CPU default (`tndebug run`): learns copy to >= 99% exact match in 400 steps, Pre-LN
        and Post-LN, in ~14 s of one CPU thread. Until issue 14 it was d_model 128, N=3, d_ff 512:
        3.1x the cost of a step, and Post-LN still at 71-85% after 300 steps (bench/default_run.py)."""
        return cls(**{**dict(d_model=64, n_heads=4, n_layers=2, d_ff=256), **kw})

    @classmethod
    def base(cls, **kw) -> "ModelConfig":
        """The paper's base model (Vaswani et al., Table 3)."""
        return cls(**{**dict(d_model=512, n_heads=8, n_layers=6, d_ff=2048, dropout=0.1), **kw})

    @classmethod
    def preset(cls, name: str, **kw) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        return getattr(cls, name)(**kw)

    # -- derivation --------------------------------------------------------------
    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def with_faults(self, *names: str) -> "ModelConfig":
        merged = tuple(dict.fromkeys(self.faults + tuple(names)))
        return self.replace(faults=merged)

    def has(self, fault: str) -> bool:
        """Model code asks this; probes never do."""
        assert fault in FAULTS, fault
        return fault in self.faults

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["faults"] = list(self.faults)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        d = dict(d)
        if "faults" in d:
            d["faults"] = tuple(d["faults"])
        return cls(**d)
