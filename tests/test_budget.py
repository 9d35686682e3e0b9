"""--max_steps=0: a warmup-stable-decay schedule in --time_budget_minutes (tfbig.training.budget)."""
import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tfbig.training import budget
from tfbig.config import ExperimentConfig, check_applicable
from tfbig.training.logs import RunLogger
from tfbig.optim import WarmupDecay, WarmupStableDecay
from tfbig.training.trainer import Trainer

from test_trainer import make_cfg, weights


def test_steps_within_counts_what_is_left_after_the_finish():
    # 60 s budget, 20 s spent, 10 s for the end: 30 s left at 0.5 s/step -> 60 more steps.
    assert budget.steps_within(60.0, 20.0, 0.5, 10.0, done=8) == 68
    assert budget.steps_within(60.0, 20.0, 0.7, 10.0, done=8) == 8 + 42  # floor(30 / 0.7)
    with pytest.raises(ValueError, match=r"--time_budget_minutes=1 is used up: 55 s went to "
                                         r"preparation, compilation and 8 steps"):
        budget.steps_within(60.0, 55.0, 0.5, 10.0, done=8)


def test_the_step_time_is_the_median_of_the_recent_intervals_without_pauses(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock[0])
    timer = budget.StepTimer()
    timer.start(0)  # the process's first fit: steps 1-2 compile, the timing starts at step 2
    assert [s for s in range(1, 31) if timer.due(s)] == [2, 10, 20, 30]
    timer.mark(2)
    clock[0] += 8 * 1.0  # steps 3-10: slow (1 s)
    timer.mark(10)
    assert timer.seconds_per_step() == (1.0, (2, 10))
    clock[0] += 10 * 0.25  # steps 11-20: 0.25 s, and a 3 s checkpoint save after step 15
    with timer.pause("checkpoint"):
        clock[0] += 3.0
    timer.mark(20)
    assert timer.seconds_per_step() == (0.25, (10, 20))  # fewer than 3 intervals: the last
    assert timer.seconds["checkpoint"] == 3.0
    clock[0] += 10 * 0.5  # steps 21-30: 0.5 s
    timer.mark(30)
    assert timer.seconds_per_step() == (0.5, (2, 30))  # median of 1.0, 0.25, 0.5
    clock[0] += 10 * 0.25
    timer.mark(40)
    assert timer.seconds_per_step() == (0.25, (10, 40))  # the slow steps 3-10 are out
    timer.start(40)  # a later fit() in the same process: timed from its first step
    assert timer.marks == [(40, clock[0], 3.0)]
    assert not timer.due(41) and timer.due(50)


def test_the_decay_starts_when_the_steps_left_are_its_share_of_the_total():
    train = ExperimentConfig().train  # the main job's checkpoint_every=200, eval_every=0
    train.time_budget_minutes, train.warmup_steps = 9.0, 60
    # 540 - 430 - 12 (a validation pass, a save, the sample) = 98 s at 0.495 s a step (a 1 s
    # save every 200 steps): 197 more steps, 18% of 1097 -> the decay starts after step 900
    record = budget.estimate(train, 900, 0.49, (870, 900), 430.0, 1.0, 6.0)
    assert (record.decay_start, record.max_steps) == (900, 1097) and record.decided
    share = budget.step_share(0.49, [(1.0, 200)])
    assert record.predicted_end_seconds == pytest.approx(430.0 + 12.0 + 197 * share)
    assert 540 - share < record.predicted_end_seconds <= 540  # one more step would pass it
    # 40 s earlier: 138 s left fit 278 steps, 24% of 1178 -> the rate stays at its peak
    early = budget.estimate(train, 900, 0.49, (870, 900), 390.0, 1.0, 6.0)
    assert early.decay_start is None and early.max_steps == 900 + 278 and not early.decided
    assert "about 1178 steps at 0.490 s/step (steps 870-900)" in early.describe()
    assert "decay from step 900 to step 1097" in record.describe()
    # never inside the warmup: at step 50 of a 60-step warmup the rate keeps rising
    assert not budget.decay_due(50, 55, warmup_steps=60) and budget.decay_due(60, 70, 60)
    # the budget ran out between two estimates: a decay of one step
    late = budget.estimate(train, 1200, 0.49, (1170, 1200), 540.0, 1.0, 6.0)
    assert (late.decay_start, late.max_steps) == (1200, 1201)


def test_a_budget_too_short_for_the_run_is_refused_naming_the_flags():
    train = ExperimentConfig().train
    train.time_budget_minutes, train.warmup_steps = 1.0, 60
    # 60 - 30 - 10 (the finish) = 20 s: 39 steps of 0.505 s after the 20 done; 80% of 59 < 60
    with pytest.raises(ValueError, match=r"--time_budget_minutes=1 fits about 59 steps at "
                                         r"0.500 s/step, too few for --warmup_steps=60"):
        budget.estimate(train, 20, 0.5, (10, 20), 30.0, 1.0, 4.0)
    # ... but not from a process's first estimate, timed over the slow steps after compiling
    assert budget.estimate(train, 10, 0.5, (2, 10), 20.0, 1.0, 4.0, first=True).max_steps == 69
    with pytest.raises(ValueError, match=r"--time_budget_minutes=1 is used up"):
        budget.estimate(train, 10, 0.5, (2, 10), 55.0, 1.0, 4.0, first=True)


def test_the_schedule_holds_its_peak_until_the_decided_decay():
    wsd = WarmupStableDecay(1.0, 10, "linear", min_ratio=0.1)
    undecided = np.array([float(wsd(s)) for s in [*range(20), 1000, 10 ** 6]])
    np.testing.assert_allclose(undecided[:10], np.arange(1, 11) / 10)
    assert (undecided[10:] == 1.0).all()  # a budget before its decay is decided
    wsd.decide(80, 100)
    rates = np.array([float(wsd(s)) for s in range(100)])
    np.testing.assert_allclose(rates[:10], np.arange(1, 11) / 10)  # warmup
    assert (rates[10:81] == 1.0).all()  # constant until the decay starts after update 80
    np.testing.assert_allclose(rates[81:], 0.1 + 0.9 * (1 - np.arange(1, 20) / 20), rtol=1e-6)
    # decay_start 0 (and any start inside the warmup: an earlier version's record) is the
    # schedule --max_steps=N has, bit for bit: the decay begins at the warmup's end
    expected = WarmupDecay(1.0, 10, 100)
    steps = np.arange(100)
    closed_form = np.where(steps < 10, (steps + 1) / 10,
                           0.1 + 0.45 * (1 + np.cos(np.pi * (steps - 10) / 90)))
    np.testing.assert_allclose([float(expected(s)) for s in steps], closed_form, rtol=1e-6)
    for start in (0, 10):
        wsd = WarmupStableDecay(1.0, 10, decay_start=start, total_steps=100)
        assert [float(wsd(s)) for s in range(100)] == [float(expected(s)) for s in range(100)]


def test_checkpoints_and_validation_passes_take_their_share_of_each_step():
    # 30 s left; 0.5 s/step, a 2 s save every 20 steps (+0.1), a 6 s pass every 60 (+0.1).
    pauses = [(2.0, 20), (6.0, 60)]
    assert budget.steps_within(60.0, 20.0, 0.5, 10.0, done=8, pauses=pauses) == 8 + 42
    # --eval_every=0: validation only at the end (in `finish`), no share of the steps
    assert budget.steps_within(60.0, 20.0, 0.5, 10.0, done=8, pauses=[(2.0, 20), (6.0, 0)]) \
        == 8 + 50
    # the end of the run: a validation pass, the last checkpoint, the sample and the summary
    assert budget.finish_seconds(2.0, 6.0) == pytest.approx(8.0 + budget.FINISH_SECONDS)


@pytest.mark.parametrize("change, message", [
    (dict(time_budget_minutes=0.0), "--max_steps=0 trains for --time_budget_minutes, which is 0"),
    (dict(max_steps=-1), "--max_steps=-1: expected a step count"),
])
def test_refused_budgets_name_the_flag(change, message):
    cfg = ExperimentConfig()
    for key, value in change.items():
        setattr(cfg.train, key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        budget.check(cfg)


def test_refused_with_elastic_and_beside_a_step_count():
    cfg = ExperimentConfig()
    cfg.train.strategy, cfg.horovod.elastic = "horovod", True
    with pytest.raises(ValueError, match="--max_steps=0 \\(time budget\\) with --elastic"):
        budget.check(cfg)
    cfg = ExperimentConfig()
    cfg.train.max_steps, cfg.train.time_budget_minutes = 100, 5.0
    with pytest.raises(ValueError, match="--time_budget_minutes=5 has no effect with "
                                         "--max_steps=100"):
        check_applicable(cfg)


def test_tf_distribute_agrees_through_its_all_workers_collective():
    # MultiWorker and Mirrored share the collective; here one process, all of its replicas.
    from tfbig.training.registry import get_strategy

    cfg = ExperimentConfig()
    cfg.train.strategy = "mirrored"
    strategy = get_strategy("mirrored", cfg)
    assert strategy.gather_over_processes([0.25, 41.5]) == [[0.25, 41.5]]


def test_a_record_written_before_pauses_were_measured_still_resumes(tmp_path):
    # config.json of a budgeted run of an earlier version: no checkpoint/validation seconds,
    # a count fixed once, the decay from the warmup's end (decay_start 0: that schedule)
    record = {"minutes": 9.0, "max_steps": 1304, "seconds_per_step": 0.4,
              "elapsed_seconds": 18.0, "finish_seconds": 9.0}
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"budget": record}, f)
    saved = budget.saved(str(tmp_path), 9.0)
    assert saved.max_steps == 1304 and saved.checkpoint_seconds == saved.validation_seconds == 0
    assert saved.decided and saved.decay_start == 0
    assert budget.saved(str(tmp_path), 10.0) is None  # another budget: measured anew
    # a record of a decay not decided yet (the first estimate): the resumed run decides anew
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"budget": {**record, "decay_start": None}}, f)
    assert budget.saved(str(tmp_path), 9.0) is None


def test_the_budget_counts_from_the_process_start(tmp_path):
    # the interpreter's start and the imports before tfbig-train's main are part of the
    # command's wall time: a process 1.5 s old says so
    code = ("import time; time.sleep(1.5); from tfbig import budget; "
            "print(time.monotonic() - budget.command_start())")
    age = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                               text=True, cwd=tmp_path).stdout)
    assert 1.5 <= age < 30


class StepRecorder(RunLogger):
    """Console progress as before, and each logged step's values kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.values = {}

    def progress(self, step, values):
        self.values[step] = dict(values)
        super().progress(step, values)


def slow_first_steps(trainer, steps, seconds):
    """Test hook: the first `steps` training steps of `trainer` each take `seconds` longer, as
    the main job's first steps do on some machines."""
    train_step, calls = trainer._train_step, []

    def slowed(batch):
        calls.append(None)
        if len(calls) <= steps:
            time.sleep(seconds)
        return train_step(batch)

    trainer._train_step = slowed


SLOW_STEPS, SLOW_SECONDS = 6, 1.0
BUDGET_MINUTES = 0.5  # 30 s: compilation, 6 slow steps and a few hundred tiny ones


@pytest.mark.slow  # a real 30 s budget: on a loaded machine compilation and the slow steps use it up; the estimate, decay and record are checked on a fake clock above
def test_slow_first_steps_do_not_shorten_the_run_and_a_resume_continues_its_schedule(
        gpt_data, tmp_path):
    flags = dict(max_steps=0, time_budget_minutes=BUDGET_MINUTES, warmup_steps=10, log_every=1,
                 checkpoint_every=10, keep_checkpoints=1000)
    cfg = make_cfg(gpt_data, tmp_path / "run", **flags)
    trainer = Trainer(cfg, logger=StepRecorder(cfg.train.model_dir, True, 0))
    # the budget counts from here: building the model (slow on a busy machine) is left out
    trainer.started = time.monotonic()
    slow_first_steps(trainer, SLOW_STEPS, SLOW_SECONDS)
    summary = trainer.fit()
    with open(tmp_path / "run" / "config.json") as f:
        saved = json.load(f)
    record = budget.Budget(**saved["budget"])
    total, start = record.max_steps, record.decay_start
    print(f"budget {BUDGET_MINUTES * 60:.0f} s: decay from step {start} to {total}, "
          f"{record.seconds_per_step:.4f} s/step over steps {record.timed_steps}, end "
          f"predicted at {record.predicted_end_seconds:.1f} s, fit ended at "
          f"{record.ended_seconds:.1f} s (+{budget.FINISH_SECONDS:.0f} s kept for the sample)")
    assert summary["step"] == total == saved["train"]["max_steps"] and record.decided
    # The decision timed steps after the slow ones: an estimate from the first steps (1 s
    # each) would have fixed a count for 1 s steps and ended the run early.
    assert record.timed_steps[0] >= SLOW_STEPS and record.seconds_per_step < SLOW_SECONDS / 2
    # What the code controls: the last step is the last one whose predicted end leaves the
    # finish inside the budget, and a step's share is a small part of the budget, so the
    # predicted end of the run is within 5% of it.
    budget_seconds = BUDGET_MINUTES * 60
    share = budget.step_share(record.seconds_per_step,
                              [(record.checkpoint_seconds, cfg.train.checkpoint_every)])
    assert budget_seconds - share < record.predicted_end_seconds <= budget_seconds
    assert record.predicted_end_seconds >= 0.95 * budget_seconds
    assert record.ended_seconds > record.elapsed_seconds  # recorded at the end, for the user
    # Warmup over 10 steps, the peak until the decay, then the decay over at most its share.
    assert cfg.train.warmup_steps < start and total - start <= budget.DECAY_FRACTION * total
    rates = np.array([trainer.logger.values[s]["learning_rate"] for s in range(1, total + 1)])
    schedule = WarmupStableDecay(3e-3, 10, decay_start=start, total_steps=total)
    np.testing.assert_array_equal(rates, [float(schedule(s)) for s in range(total)])
    assert (rates[10:start + 1] == np.float32(3e-3)).all() and rates[-1] < rates[start] / 2

    # A resume from the checkpoint of the step that decided continues the recorded schedule
    # bit for bit, on a clock that says the budget is long used up (no estimate again).
    resumed_at = start  # decisions fall on multiples of 10, where a checkpoint was saved
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    tf.compat.v1.train.update_checkpoint_state(
        str(tmp_path / "resumed"), str(tmp_path / "resumed" / f"ckpt-{resumed_at}"),
        [str(tmp_path / "resumed" / f"ckpt-{s}") for s in range(10, resumed_at + 1, 10)])
    cfg = make_cfg(gpt_data, tmp_path / "resumed", **flags)
    resumed = Trainer(cfg, logger=StepRecorder(cfg.train.model_dir, True, 0), started=0.0)
    assert int(resumed.step.numpy()) == resumed_at and resumed.cfg.train.max_steps == total
    assert resumed.fit()["step"] == total
    for key in ("loss", "learning_rate", "grad_norm"):
        np.testing.assert_array_equal(
            [resumed.logger.values[s][key] for s in range(resumed_at + 1, total + 1)],
            [trainer.logger.values[s][key] for s in range(resumed_at + 1, total + 1)])
    for a, b in zip(weights(trainer), weights(resumed)):
        np.testing.assert_array_equal(a, b)
