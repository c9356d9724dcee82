"""capture/origins.py: the lines that made the tensors of a probed pass (issue 48). The notes
are taken only while a recording with a Trace runs, so a watched loop's unprobed steps pay
nothing; a mask is followed back to the line that built it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

import tndebug
from tndebug.capture.origins import Origins, attribute_line

from nanogpt_text import load, model_file


def _noting() -> bool:
    return any(isinstance(m, Origins) for m in _get_current_function_mode_stack())


def test_the_notes_run_on_probed_steps_only(tmp_path):
    """A watched loop of 40 steps: the user's forward runs under the notes only on the steps
    the probes record (a handful, log-spaced), never on the others."""
    path, _ = model_file(tmp_path, "healthy")
    model = load(path).build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    noted = []

    def forward(m, src, tgt, pad_id):
        noted.append(_noting())
        return m(tgt)

    steps = 40
    with tndebug.watch(model, opt, forward=forward, quiet=True, total_steps=steps, pad_id=None):
        for _ in range(steps):
            idx = torch.randint(0, 64, (4, 16), generator=g)
            noted.append(_noting())                        # the loop's own forward
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not _noting()                                   # nothing left behind
    assert sum(noted) < len(noted) / 2, noted              # unprobed steps: no notes


def test_a_mask_is_followed_to_the_line_that_built_it(tmp_path):
    """The causal mask read as `self.bias[..., :T, :T] == 0` in forward comes from the buffer
    registered in __init__: its line; a mask transposed where it is used is placed there."""
    path, lines = model_file(tmp_path, "healthy")
    model = load(path).build()
    text = path.read_text().splitlines()
    loc = attribute_line(model, model.transformer.h[0].attn.bias)
    assert loc["line"] == next(n for n, t in enumerate(text, 1) if 'register_buffer("bias"' in t)
    assert loc["function"] == "CausalSelfAttention.__init__"
    path, lines = model_file(tmp_path, "mask_transposed", name="transposed.py")
    report = tndebug.check(load(path).build(), arch="decoder", pad_id=None, probes="mask-broadcast")
    (f,) = [f for f in report.findings if f.code == "mask-broadcast/causal-transposed"]
    assert f.source["line"] == lines["mask"]                # the transpose, where the mask is used
