"""TensorBoard's image of one attention site, coloured without matplotlib: its import (~0.35 s
of CPU) is paid only by the figures, not by a run that writes TensorBoard and draws none
(`tndebug triage --no-figures`, `tndebug.check(figures=False)`).

VIRIDIS is matplotlib's viridis as bytes (`colormaps["viridis"](range(256), bytes=True)`), and
`colour` indexes it as matplotlib does (tests/reporters/test_attention_image.py compares both).
"""
from __future__ import annotations

import math

import numpy as np
import torch

VIRIDIS = np.frombuffer(bytes.fromhex(
    "44015444025544035745055845065a45085b46095c460b5e460c5f460e61470f62471163471265471466471567471669"
    "47186a48196b481a6c481c6e481d6f481e70482071482172482273482374472575472676472777472878472a79472b7a"
    "472c7b462d7c462f7c46307d46317e45327f45347f453580453681443781443982433a83433b83433c84423d84423e85"
    "4240854141864142864043874044873f45873f47883e48883e49893d4a893d4b893d4c893c4d8a3c4e8a3b508a3b518a"
    "3a528b3a538b39548b39558b38568b38578c37588c37598c365a8c365b8c355c8c355d8c345e8d345f8d33608d33618d"
    "32628d32638d31648d31658d31668d30678d30688d2f698d2f6a8d2e6b8e2e6c8e2e6d8e2d6e8e2d6f8e2c708e2c718e"
    "2c728e2b738e2b748e2a758e2a768e2a778e29788e29798e287a8e287a8e287b8e277c8e277d8e277e8e267f8e26808e"
    "26818e25828e25838d24848d24858d24868d23878d23888d23898d22898d228a8d228b8d218c8d218d8c218e8c208f8c"
    "20908c20918c1f928c1f938b1f948b1f958b1f968b1e978a1e988a1e998a1e998a1e9a891e9b891e9c891e9d881e9e88"
    "1e9f881ea0871fa1871fa2861fa38620a48520a58521a68521a78422a78423a88323a98224aa8225ab8126ac8127ad80"
    "28ae7f29af7f2ab07e2bb17d2cb17d2eb27c2fb37b30b47a32b57a33b67935b77836b87738b97639b9763bba753dbb74"
    "3ebc7340bd7242be7144be7045bf6f47c06e49c16d4bc26c4dc26b4fc36951c46853c56755c66657c66559c7645bc862"
    "5ec96160c96062ca5f64cb5d67cc5c69cc5b6bcd596dce5870ce5672cf5574d05477d05279d1517cd24f7ed24e81d34c"
    "83d34b86d44988d5478bd5468dd64490d64392d74195d73f97d83e9ad83c9dd93a9fd938a2da37a5da35a7db33aadb32"
    "addc30afdc2eb2dd2cb5dd2bb7dd29bade27bdde26bfdf24c2df22c5df21c7e01fcae01ecde01dcfe11cd2e11bd4e11a"
    "d7e219dae218dce218dfe318e1e318e4e318e7e419e9e419ece41aeee51bf1e51cf3e51ef6e61ff8e621fae622fde724"
), dtype=np.uint8).reshape(256, 3)


def colour(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] as viridis bytes, the index as matplotlib computes it (x * 256 in x's
    float type, 1.0 in the last colour).  [...] -> [..., 3] uint8"""
    xa = x * np.asarray(len(VIRIDIS), dtype=x.dtype)
    xa[xa == len(VIRIDIS)] = len(VIRIDIS) - 1
    return VIRIDIS.take(xa.astype(int), axis=0, mode="clip")


def attention_image(probs: torch.Tensor, min_cell: int = 96) -> np.ndarray:
    """Heads side by side, viridis, upscaled; NaN in magenta.  probs [h, T, S] -> [H, W, 3] uint8

    Coloured at [h, T, S] and upscaled as bytes, not as floats (an image per attention site
    at every snapshot step of a training run)."""
    p = probs.detach().float().cpu().numpy()
    h, T, S = p.shape
    k = max(1, math.ceil(min_cell / max(T, S, 1)))
    rgb = colour(np.clip(np.nan_to_num(p, nan=0.0), 0, 1))
    rgb[~np.isfinite(p)] = (255, 0, 255)
    rgb = rgb.repeat(k, axis=1).repeat(k, axis=2)                                  # [h, kT, kS, 3]
    out = np.full((T * k, h * S * k + 2 * (h - 1), 3), 255, dtype=np.uint8)       # 2 px white gaps
    for i in range(h):
        x = i * (S * k + 2)
        out[:, x:x + S * k] = rgb[i]
    return out
