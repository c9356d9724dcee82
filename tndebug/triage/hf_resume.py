"""The resume state of a Trainer checkpoint directory, for `tndebug triage DIR`. The fixes in
Hugging Face terms that every front-end uses are tndebug/hf/wording.py."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tndebug.findings import Finding
from tndebug.triage import hygiene
from tndebug.triage.loading import Checkpoint


def resume_state(folder: Path) -> list[Finding]:
    """A Trainer checkpoint (checkpoint-N/) has optimizer.pt, scheduler.pt, trainer_state.json."""
    step = None
    try:
        step = int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ckpt = Checkpoint(folder, {}, container="save_pretrained", step=step,
                      optimizer={"state": {0: "optimizer.pt"}} if (folder / "optimizer.pt").is_file() else None,
                      has_scheduler=(folder / "scheduler.pt").is_file(),
                      top_keys=sorted(p.name for p in folder.iterdir()))
    return [replace(f, fix=FIX_RESUME_HF) for f in hygiene.resume_state(ckpt)]


FIX_RESUME_HF = ("save_pretrained keeps the weights only: to resume, train with Trainer and resume from "
                 "its checkpoint-N/ directory (optimizer.pt, scheduler.pt, trainer_state.json): "
                 "trainer.train(resume_from_checkpoint=DIR)")
