"""The time-budget half of the loop (--max_steps=0): a warmup-stable-decay schedule in
--time_budget_minutes whose decay is decided from measured step times (tfbig.training.budget).

BudgetedLoop is a mixin of tfbig.training.trainer.Trainer: it reads the trainer's timer,
budget, strategy and logger."""
import contextlib
import time

import tensorflow as tf

from tfbig.optim import decide_schedule
from tfbig.training import budget as budget_lib
from tfbig.training import run_directory


class BudgetedLoop:
    """Trainer methods that time pauses and decide a time budget's decay."""

    def _pause(self, kind):
        """Time a checkpoint save or validation pass out of the budget's step time."""
        return self.timer.pause(kind) if self.timer else contextlib.nullcontext()

    def _estimate_budget(self, step):
        """At a mark of a budgeted run: estimate the total from the time left (the slowest
        process's figures); once the decay is due, fix it and the decay's start. Records the
        first estimate and the decision in config.json; True once decided."""
        timed = self.timer.seconds_per_step()
        if timed is None or step % budget_lib.ESTIMATE_EVERY:
            return False
        first = self.budget is None  # this process's first estimate
        if first:
            self._measure_pauses(step)
        rows = self.strategy.gather_over_processes(  # every process decides alike: the slowest
            [timed[0], self.timer.seconds["checkpoint"], self.timer.seconds["validation"],
             time.monotonic() - self.started])
        per_step, save_seconds, validation, elapsed = (max(column) for column in zip(*rows))
        self.budget = budget_lib.estimate(self.cfg.train, step, per_step, timed[1], elapsed,
                                          save_seconds, validation, first)
        self.logger.max_steps, self.logger.estimated = self.budget.max_steps, True
        if self.budget.decided:
            self._fix_schedule()
        if first or self.budget.decided:
            if self.strategy.is_chief:
                run_directory.save_config(self)
            self.logger.info(self.budget.describe())
        return self.budget.decided

    def _measure_pauses(self, step):
        """The run's first checkpoint, timed (the saves to come take as long), and a whole
        validation pass's time from a timed batch."""
        self._check_finite(step)
        with self._pause("checkpoint"), self.goodput.measure("checkpoint_save"):
            self.save()
        with self._pause("validation"), self.goodput.measure("evaluation"):
            whole_pass = self._time_validation()
        self.timer.seconds["validation"] = whole_pass  # not the two batches' time

    def _fix_schedule(self):
        """The decided decay: the step count, and the schedule's start and end of the decay
        (a variable the traced step reads: nothing is traced again)."""
        total = self.cfg.train.max_steps = self.logger.max_steps = self.budget.max_steps
        self.logger.estimated = False
        decide_schedule(self.optimizer, self.budget.decay_start, total)

    def _time_validation(self):
        """Seconds of a whole validation pass: a first batch compiles the forward, a second
        one is timed (0 without a validation split)."""
        if not self.eval_batches:
            return 0.0
        iterator = self._validation_batches()
        seconds = []
        for _ in range(min(2, self.eval_batches)):
            begin = time.monotonic()
            tf.nest.map_structure(lambda v: v.numpy(), self._eval_step(next(iterator)))
            seconds.append(time.monotonic() - begin)
        return self.eval_batches * seconds[-1]
