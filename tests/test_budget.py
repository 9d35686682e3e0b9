"""--max_steps=0: as many steps as fit in --time_budget_minutes (tfbig.training.budget)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfbig.training import budget
from tfbig.config import ExperimentConfig, check_applicable
from tfbig.optim import WarmupDecay, learning_rate
from tfbig.training.trainer import Trainer

from test_trainer import make_cfg, weights


def test_steps_within_counts_what_is_left_after_the_finish():
    # 60 s budget, 20 s spent, 10 s for the end: 30 s left at 0.5 s/step -> 60 more steps.
    assert budget.steps_within(60.0, 20.0, 0.5, 10.0, done=8) == 68
    assert budget.steps_within(60.0, 20.0, 0.7, 10.0, done=8) == 8 + 42  # floor(30 / 0.7)
    with pytest.raises(ValueError, match=r"--time_budget_minutes=1 is used up: 55 s went to "
                                         r"preparation, compilation and 8 steps"):
        budget.steps_within(60.0, 55.0, 0.5, 10.0, done=8)


def test_the_timed_steps_end_late_in_a_long_warmup_and_skip_the_first_ones():
    assert budget.calibration_window(0, warmup_steps=10) == (2, 10)  # steps 3..10
    assert budget.calibration_window(0, warmup_steps=8) == (2, 8)
    assert budget.calibration_window(0, warmup_steps=30) == (2, 30)  # steps 3..30
    assert budget.calibration_window(0, warmup_steps=60) == (16, 48)  # the recipe: 17..48
    assert budget.calibration_window(0, warmup_steps=2000) == (16, 48)
    assert budget.calibration_window(100, warmup_steps=2000) == (116, 148)  # a resumed run


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
    (dict(warmup_steps=4), "needs --warmup_steps >= 8 (got 4)"),
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


def test_budgeted_run_fixes_its_steps_and_equals_an_explicit_run_of_that_count(gpt_data, tmp_path):
    # The budget's count is whatever this machine's speed gives; the run must then be the
    # run --max_steps=<count> would be: the same rates, the same weights, step for step.
    cfg = make_cfg(gpt_data, tmp_path / "budget", max_steps=0, time_budget_minutes=5.0,
                   warmup_steps=10, log_every=1000)
    trainer = Trainer(cfg)
    trainer.fit(steps=12)  # fixed at step 10, the warmup's end
    with open(tmp_path / "budget" / "config.json") as f:
        saved = json.load(f)
    total = saved["budget"]["max_steps"]
    assert total > 12 and saved["train"]["max_steps"] == total == trainer.cfg.train.max_steps
    record = budget.Budget(**saved["budget"])
    assert total == budget.steps_within(
        300.0, record.elapsed_seconds, record.seconds_per_step, record.finish_seconds,
        budget.calibration_window(0, warmup_steps=10)[1],
        pauses=[(record.checkpoint_seconds, cfg.train.checkpoint_every)])
    # measured at step 10: a save (the run's first checkpoint) and a validation pass
    assert record.checkpoint_seconds > 0 and record.validation_seconds > 0
    assert record.finish_seconds == pytest.approx(budget.finish_seconds(
        record.checkpoint_seconds, record.validation_seconds))
    assert os.path.exists(tmp_path / "budget" / "ckpt-10.index")
    schedule = WarmupDecay(3e-3, 10, total)
    for step in (0, 9, 11, total // 2, total - 1):
        assert float(learning_rate(trainer.optimizer, step)) == pytest.approx(
            float(schedule(step)), rel=1e-6)

    explicit = Trainer(make_cfg(gpt_data, tmp_path / "explicit", max_steps=total,
                                warmup_steps=10, log_every=1000))
    explicit.fit(steps=12)
    for a, b in zip(weights(trainer), weights(explicit)):
        np.testing.assert_array_equal(a, b)

    # A new process on the same directory continues the recorded count (no new measurement),
    # even when this machine is now much slower than the budget assumed.
    resumed = Trainer(make_cfg(gpt_data, tmp_path / "budget", max_steps=0,
                               time_budget_minutes=5.0, warmup_steps=10, log_every=1000),
                      started=0.0)
    assert resumed.cfg.train.max_steps == total and int(resumed.step.numpy()) == 12
    assert resumed.fit(steps=2)["step"] == 14
    assert os.path.exists(tmp_path / "budget" / "ckpt-14.index")


def test_tf_distribute_agrees_through_its_all_workers_collective():
    # MultiWorker and Mirrored share the collective; here one process, all of its replicas.
    from tfbig.training.registry import get_strategy

    cfg = ExperimentConfig()
    cfg.train.strategy = "mirrored"
    strategy = get_strategy("mirrored", cfg)
    assert strategy.max_over_processes([0.25, 41.5]) == [0.25, 41.5]


def test_a_record_written_before_pauses_were_measured_still_resumes(tmp_path):
    # config.json of a budgeted run of an earlier version: no checkpoint/validation seconds
    record = {"minutes": 9.0, "max_steps": 1304, "seconds_per_step": 0.4,
              "elapsed_seconds": 18.0, "finish_seconds": 9.0}
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"budget": record}, f)
    saved = budget.saved(str(tmp_path), 9.0)
    assert saved.max_steps == 1304 and saved.checkpoint_seconds == saved.validation_seconds == 0
    assert budget.saved(str(tmp_path), 10.0) is None  # another budget: measured anew


def test_the_budget_counts_from_the_process_start(tmp_path):
    # the interpreter's start and the imports before tfbig-train's main are part of the
    # command's wall time: a process 1.5 s old says so
    code = ("import time; time.sleep(1.5); from tfbig import budget; "
            "print(time.monotonic() - budget.command_start())")
    age = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                               text=True, cwd=tmp_path).stdout)
    assert 1.5 <= age < 30
