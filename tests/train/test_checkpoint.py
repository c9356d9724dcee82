import pytest
import torch

from tndebug.errors import UsageError
from tndebug.train import TrainConfig
from tndebug.train.checkpoint import load_checkpoint, save_checkpoint

from _train_helpers import tiny_run


class _Evil:
    pass


def test_round_trip_weights_only(tmp_path):
    result = tiny_run(steps=3, out_dir=tmp_path)
    path = tmp_path / "checkpoint.pt"
    assert result.checkpoint == path and path.is_file()
    assert not list(tmp_path.glob("*.tmp"))                      # written atomically
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == state["schedule_step"] == 3
    assert state["last_lr"] == pytest.approx(result.report.history["lr"][-1])
    assert state["model_config"]["d_model"] == 64 and state["train_config"]["steps"] == 3
    assert isinstance(state["model_config"]["faults"], list)
    assert set(state["rng"]) >= {"torch", "data"}
    assert all(state["optimizer"]["state"][0][k] is not None for k in ("exp_avg", "exp_avg_sq"))
    model = result.model
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state["model"].items())
    assert TrainConfig.from_dict(state["train_config"]) == TrainConfig(steps=3, device="cpu",
                                                                       eval_size=16, batch_size=16)


def test_resume_equals_uninterrupted_training(tmp_path):
    """2N steps in one go == N steps, checkpoint, N more: same lr, same losses, same weights."""
    whole = tiny_run(steps=6)
    tiny_run(steps=3, out_dir=tmp_path)
    rest = tiny_run(steps=3, resume=tmp_path / "checkpoint.pt")
    first = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert first["global_step"] == 3
    h = whole.report.history
    assert h["lr"][3:] == rest.report.history["lr"]
    assert h["loss"][3:] == pytest.approx(rest.report.history["loss"], rel=1e-5, abs=1e-6)
    for (k, a), b in zip(whole.model.state_dict().items(), rest.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert rest.report.run["resumed_from_step"] == 3 and rest.report.run["stopped_at_step"] == 6


def test_unsafe_or_foreign_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="neither a zip archive .* nor a pickle"):
        load_checkpoint(tmp_path / "garbage.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(UsageError, match="not a tndebug training checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")     # any pickled class is refused
    with pytest.raises(UsageError, match=r"holds pickled code \(.*_Evil\)") as e:
        load_checkpoint(tmp_path / "evil.pt")
    assert "weights_only=False" not in str(e.value)     # its globals, not torch's advice


def test_save_replaces_atomically(tmp_path):
    p = save_checkpoint(tmp_path / "c.pt", {"global_step": 1})
    save_checkpoint(p, {"global_step": 2})
    assert load_checkpoint(p)["global_step"] == 2
    assert [q.name for q in tmp_path.iterdir()] == ["c.pt"]
