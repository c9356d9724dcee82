import pytest

from tndebug.train import TrainConfig, model_config, run_training
from tndebug.train.schedule import constant, noam, peak

from _train_helpers import Spy, tiny_run


def test_noam_values():
    lr = noam(512, 4000)
    step, top = peak(lr, 8000)
    assert step == 3999 and top == pytest.approx(6.9877e-4, rel=1e-4)    # the notes' 6.99e-4
    assert lr(0) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert lr(99) == pytest.approx(512 ** -0.5 * 100 * 4000 ** -1.5)       # linear warmup
    assert lr(15999) == pytest.approx(512 ** -0.5 * 16000 ** -0.5)         # 1/sqrt decay
    assert noam(128, 20, factor=0.5)(5) == pytest.approx(0.5 * noam(128, 20)(5))
    assert constant(1e-3)(0) == constant(1e-3)(10 ** 6) == 1e-3


def test_run_follows_the_declared_schedule():
    result = tiny_run(steps=6)
    lr = noam(64, TrainConfig.warmup, TrainConfig.lr_factor)
    assert result.report.history["lr"] == pytest.approx([lr(s) for s in range(6)])


def test_resume_continues_the_schedule(tmp_path):
    first = tiny_run(steps=4, out_dir=tmp_path)
    second = tiny_run(steps=3, out_dir=tmp_path, resume=tmp_path)
    lr = noam(64, TrainConfig.warmup, TrainConfig.lr_factor)
    assert first.report.history["lr"] + second.report.history["lr"] == pytest.approx(
        [lr(s) for s in range(7)])
    assert second.report.history["step"] == [4, 5, 6]


def test_warmup_restart_on_resume_makes_lr_jump(tmp_path):
    tiny_run(steps=30, out_dir=tmp_path)
    spy = Spy()
    cfg = model_config("copy", "tiny", faults=("warmup_restart_on_resume",))
    resumed = run_training(cfg, TrainConfig(steps=3, device="cpu", eval_size=8), probes=[spy],
                           resume=tmp_path)
    lr = noam(64, TrainConfig.warmup, TrainConfig.lr_factor)
    info = spy.resumed
    assert info.step == 30 and info.lr_before == pytest.approx(lr(29))
    assert info.had_optimizer_state is False            # Adam's moments were dropped
    first_after = resumed.report.history["lr"][0]
    assert first_after == pytest.approx(lr(0))          # warmup starts over
    assert abs(first_after / info.lr_before - 1) > 0.5
    healthy = Spy()
    run_training(model_config("copy", "tiny"), TrainConfig(steps=1, device="cpu", eval_size=8),
                 probes=[healthy], resume=tmp_path)
    assert healthy.resumed.had_optimizer_state is True and healthy.lrs[0] == pytest.approx(lr(30))


def test_no_warmup_high_lr_is_constant():
    result = tiny_run(steps=5, faults=("no_warmup_high_lr",))
    assert result.report.history["lr"] == [result.report.history["lr"][0]] * 5


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
def test_no_warmup_high_lr_means_the_same_in_every_preset(preset):
    """Issue 12: 5x the preset's own Noam peak, from step 0, and --lr-factor scales it."""
    from tndebug.train.loop import HIGH_LR_X, declared_schedule
    mcfg = model_config("copy", preset, "post", ("no_warmup_high_lr",))
    for factor in (0.2, 1.0):
        tcfg = TrainConfig(lr_factor=factor)
        peak = max(map(noam(mcfg.d_model, tcfg.warmup, factor), range(200)))
        lr = declared_schedule(mcfg, tcfg)
        assert lr(0) == lr(1000) == pytest.approx(HIGH_LR_X * peak)
