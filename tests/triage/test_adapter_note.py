"""A built-in adapter never hides the user's code: when it had to build the masks itself, the
report says so (run.adapter_note and an info finding); when the model's module defines its own
mask function, that function is what runs, and there is no note."""
from __future__ import annotations

import re

import pytest
import torch

from tndebug.triage import TriageOptions, triage

from conftest import TINY, ZOO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("own_masks", [True, False])
def test_the_report_says_who_built_the_masks(tmp_path, own_masks):
    src = (ZOO / "annotated.py").read_text()
    if not own_masks:       # the same model with its mask helpers (and the adapter using them) cut
        src = src[:src.index("def subsequent_mask")]
    (tmp_path / "mymodel.py").write_text(src)
    import importlib.util
    spec = importlib.util.spec_from_file_location("mymodel_note", tmp_path / "mymodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    config = {"src_vocab": 11, "tgt_vocab": 11, **TINY}
    torch.save({"model": mod.make_model(**config).state_dict(), "config": config}, tmp_path / "m.pt")
    report = triage(TriageOptions(str(tmp_path / "m.pt"), model=f"{tmp_path / 'mymodel.py'}:make_model",
                                  adapter="annotated", probes="mask-broadcast"))
    notes = [f for f in report.findings if f.probe == "mask-broadcast" and f.severity == "info"]
    if own_masks:
        assert "adapter_note" not in report.run and not notes
    else:
        assert re.search("masks built by tndebug", report.run["adapter_note"])
        assert len(notes) == 1 and "not yours" in notes[0].message
