"""capture/origins.py: the lines that made the tensors of a probed pass (issue 48). The notes
are taken only while a recording with a Trace runs, so a watched loop's unprobed steps pay
nothing; a mask is followed back to the line that built it."""
from __future__ import annotations

import importlib.util
import sys

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

import tndebug
from tndebug.capture.assignments import attribute_line, table_line
from tndebug.capture.origins import Origins

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


PE_FILE = '''\
import math
import torch
from torch import nn


def sinusoids(length, d):
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    div = 1.0 / torch.pow(10000.0, (torch.arange(0, d, 2) // d).float())
    pe = torch.zeros(length, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


class Embed(nn.Module):
    def __init__(self, vocab=20, d=16, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.register_buffer("pe", sinusoids(max_len, d))
        self.other = torch.randn(max_len, d)

    def forward(self, ids):
        return self.tok(ids) * math.sqrt(self.tok.embedding_dim) + self.pe[:ids.shape[1]]
'''


def test_a_table_built_in_init_is_found_by_its_values_and_read_to_its_base(tmp_path):
    """A sinusoidal table made in __init__ (no probed forward sees it made): the buffer whose
    rows are the embedding's position part, its register_buffer line, then the statement of
    the function it calls that holds the base 10000, marked as read from the source."""
    path = tmp_path / "pe_user.py"
    path.write_text(PE_FILE)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod                          # inspect finds a class's file there
    spec.loader.exec_module(mod)
    m = mod.Embed().eval()
    with torch.no_grad():
        rows = m(torch.full((1, 40), 3))[0]                        # one token at every position
    loc = table_line(m, rows)
    assert (loc["function"], loc["code"], loc["read"]) == (
        "sinusoids", "div = 1.0 / torch.pow(10000.0, (torch.arange(0, d, 2) // d).float())", True)
    assert table_line(m, torch.randn(40, 16)) is None                # no tensor of the model
