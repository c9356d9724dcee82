"""TensorBoard's attention image: matplotlib's viridis without importing matplotlib."""
import subprocess
import sys

import numpy as np
import torch

from tndebug.reporters.attention_image import VIRIDIS, attention_image, colour


def test_colour_is_matplotlibs_viridis_in_bytes():
    from matplotlib import colormaps
    cmap = colormaps["viridis"]
    assert np.array_equal(VIRIDIS, cmap(np.arange(256), bytes=True)[:, :3])
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x = np.concatenate([rng.random(4096), np.arange(257) / 256, [0.0, 1.0, np.nextafter(1, 0)],
                            1 - np.arange(1, 50) * 1e-7]).astype(dtype)
        assert np.array_equal(colour(x), cmap(x, bytes=True)[..., :3]), dtype


def test_attention_image_as_before():
    """Heads side by side with 2 white pixels between them, NaN in magenta; the pixels the
    matplotlib colormap gave."""
    from matplotlib import colormaps
    probs = torch.softmax(torch.randn(3, 5, 7), -1)
    probs[1, 2, 3] = float("nan")
    img = attention_image(probs)
    k = 96 // 7 + 1                                       # each cell upscaled to >= 96 px
    assert img.shape == (5 * k, 3 * 7 * k + 4, 3) and img.dtype == np.uint8
    want = colormaps["viridis"](np.nan_to_num(probs.numpy(), nan=0.0), bytes=True)[..., :3]
    for h in range(3):
        block = img[:, h * (7 * k + 2):h * (7 * k + 2) + 7 * k][::k, ::k]
        expect = want[h].copy()
        if h == 1:
            expect[2, 3] = (255, 0, 255)
        assert np.array_equal(block, expect), h
    assert (img[:, 7 * k:7 * k + 2] == 255).all()


def test_tensorboard_images_do_not_import_matplotlib(tmp_path):
    """A run that writes TensorBoard and draws no figure (`triage --no-figures`) does not pay the
    matplotlib import (~0.35 s): the images were coloured with its colormap."""
    code = f"""
import sys, torch
from tndebug.reporters.tensorboard import TensorBoardSink
from tndebug.capture.trace import AttentionRecord, Trace
att = {{"enc.0.attn": AttentionRecord("enc.0.attn", "enc_self", 0,
                                     probs=torch.softmax(torch.randn(2, 2, 4, 4), -1))}}
sink = TensorBoardSink({str(tmp_path)!r})
sink.on_trace(0, Trace(step=0, attention=att))
sink.close()
assert any(p.stat().st_size > 1000 for p in __import__("pathlib").Path({str(tmp_path)!r}).iterdir())
print(sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
