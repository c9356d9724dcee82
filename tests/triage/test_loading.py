"""Safe loading: containers, prefixes, safetensors, and one clear error per bad file."""
from __future__ import annotations

import collections

import pytest
import torch
from safetensors.torch import save_file

from tndebug.errors import UsageError
from tndebug.triage.loading import UnsafeCheckpoint, load_checkpoint


class NotAllowed:   # a class outside torch's weights-only allowlist
    def __reduce__(self):
        return (print, ("this must never run",))


SD = {"encoder.w": torch.ones(2, 2), "decoder.b": torch.zeros(2)}


@pytest.mark.parametrize("container", ["bare", "model", "model_state_dict", "state_dict"])
def test_containers_unwrap(tmp_path, container):
    obj = SD if container == "bare" else {container: SD, "epoch": 3}
    torch.save(obj, tmp_path / "c.pt")
    ck = load_checkpoint(tmp_path / "c.pt")
    assert ck.container == container and set(ck.state_dict) == set(SD)


def test_ddp_and_compile_prefixes_are_stripped(tmp_path):
    torch.save({"model": collections.OrderedDict((f"module._orig_mod.{k}", v) for k, v in SD.items())},
               tmp_path / "ddp.pt")
    ck = load_checkpoint(tmp_path / "ddp.pt")
    assert set(ck.state_dict) == set(SD) and ck.stripped_prefix == "module._orig_mod."


def test_resume_state_is_read(tmp_path):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w])
    w.sum().backward()
    opt.step()
    torch.save({"model_state_dict": SD, "optimizer_state_dict": opt.state_dict(), "global_step": 7,
                "config": {"d_model": 2}}, tmp_path / "r.pt")
    ck = load_checkpoint(tmp_path / "r.pt")
    assert ck.has_optimizer_state and ck.step == 7 and ck.step_key == "global_step"
    assert ck.config == {"d_model": 2}


def test_step_from_optimizer_state(tmp_path):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w])
    for _ in range(3):
        w.sum().backward()
        opt.step()
    torch.save({"model": SD, "optimizer": opt.state_dict()}, tmp_path / "o.pt")
    assert load_checkpoint(tmp_path / "o.pt").step == 3


def test_safetensors_with_config_metadata(tmp_path):
    save_file(SD, str(tmp_path / "m.safetensors"), metadata={"config": '{"n_heads": 2}'})
    ck = load_checkpoint(tmp_path / "m.safetensors")
    assert ck.fmt == "safetensors" and ck.config == {"n_heads": 2} and set(ck.state_dict) == set(SD)


def test_unsafe_pickle_lists_globals_without_running_them(tmp_path, capsys):
    torch.save({"model": SD, "extra": NotAllowed()}, tmp_path / "u.pt")
    with pytest.raises(UnsafeCheckpoint) as e:
        load_checkpoint(tmp_path / "u.pt")
    assert "builtins.print" in e.value.globals
    assert "--trust-checkpoint" in str(e.value)
    assert "this must never run" not in capsys.readouterr().out


def test_trust_checkpoint_loads_a_pickled_module(tmp_path):
    torch.save(torch.nn.Linear(2, 3), tmp_path / "whole.pt")
    with pytest.raises(UnsafeCheckpoint):
        load_checkpoint(tmp_path / "whole.pt")
    ck = load_checkpoint(tmp_path / "whole.pt", trust=True)
    assert set(ck.state_dict) == {"weight", "bias"} and ck.trusted


@pytest.mark.parametrize("make, words", [
    (lambda p: None, "no such file"),
    (lambda p: p.write_bytes(b""), "empty"),
    (lambda p: p.write_text("hello, not a checkpoint\n"), "not a PyTorch checkpoint"),
    (lambda p: (torch.save(SD, p), p.write_bytes(p.read_bytes()[:300])), "truncated or corrupt"),
    (lambda p: torch.save({"epoch": 3, "loss": 0.5}, p), "has no state_dict"),
    (lambda p: torch.save([1, 2, 3], p), "not a state_dict"),
])
def test_bad_files_are_one_line_usage_errors(tmp_path, make, words):
    p = tmp_path / "x.pt"
    make(p)
    with pytest.raises(UsageError) as e:
        load_checkpoint(p)
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_truncated_safetensors(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(SD, str(p))
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(UsageError, match="not a readable .safetensors"):
        load_checkpoint(p)


def test_a_text_file_is_not_a_checkpoint_rather_than_unsafe_code(tmp_path):
    from tndebug.errors import UsageError
    from tndebug.triage.loading import load_checkpoint

    p = tmp_path / "notes.pt"
    p.write_text("these are my notes, not a checkpoint\n")
    with pytest.raises(UsageError, match="is not a PyTorch checkpoint"):
        load_checkpoint(p)
