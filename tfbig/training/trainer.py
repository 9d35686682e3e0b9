"""The one training loop. Every backend plugs in through tfbig.distribute.base.Strategy.

One optimizer step = `grad_accum_steps` micro-batches per data-parallel replica:
    forward/backward (XLA-compiled, loss-scaled for fp16)  -> strategy.make_forward_backward
    average gradients over replicas (once per step)        -> strategy.all_reduce_gradients
    unscale, clip by global norm, apply (skip if not finite) -> optimizer.apply
(tfbig.training.step: with --xla, as one XLA program where the backend allows it.)
"""
import dataclasses
import math
import time

import keras
import tensorflow as tf
from tensorflow.python.framework import config as op_config

from tfbig import config as config_lib
from tfbig import data
from tfbig.checkpoints import integrity
from tfbig.checkpoints.async_write import CheckpointWriter, host_copier
from tfbig.checkpoints.checkpoint import rng_variables
from tfbig.convert import init_checkpoint
from tfbig.errors import TrainingStoppedError
from tfbig.optim import decide_schedule, learning_rate
from tfbig.profiling.profiler import RunProfiler
from tfbig.tasks import get_task
from tfbig.training import budget as budget_lib
from tfbig.training.budget_loop import BudgetedLoop
from tfbig.training.goodput import GoodputClock
from tfbig.training.stragglers import StragglerWatch
from tfbig.training import evaluation, preflight, run_directory
from tfbig.training import step as step_lib
from tfbig.training.logs import RunLogger
from tfbig.training.precision import set_precision
from tfbig.training.registry import get_strategy


class NonFiniteLossError(TrainingStoppedError):
    """Training produced a NaN/inf loss where no loss scaling can explain it."""


class Trainer(BudgetedLoop):
    """Builds model, optimizer, data and checkpoint for an ExperimentConfig and trains it.

    Example:
        cfg = ExperimentConfig(); cfg.train.max_steps = 100
        summary = Trainer(cfg).fit()   # {"step": 100, "loss": ..., "eval": {...}}
    """

    def __init__(self, cfg, strategy=None, task=None, logger=None, started=None):
        self.cfg = cfg
        t = cfg.train
        # --max_steps=0: the time budget counts from `started` (time.monotonic(); the
        # command's start) or from here; fit decides when the decay starts (tfbig.training.budget).
        self.started = time.monotonic() if started is None else started
        config_lib.check_applicable(cfg)
        budget_lib.check(cfg)
        # A budgeted run whose decay was decided continues that schedule.
        budgeted = not t.max_steps
        self.budget = budget_lib.saved(t.model_dir, t.time_budget_minutes) if budgeted else None
        if self.budget:
            t.max_steps = self.budget.max_steps
        self.timer = None if t.max_steps else budget_lib.StepTimer()  # until the decay
        set_precision(t.precision)
        keras.utils.set_random_seed(t.seed)
        # Process-wide: set it both ways so a deterministic run does not leak into the next.
        if t.deterministic:
            tf.config.experimental.enable_op_determinism()
        else:
            op_config.disable_op_determinism()  # TF exposes only the enabling half publicly
        self.strategy = strategy or get_strategy(t.strategy, cfg)
        if self.strategy.learning_rate_scale != 1.0:  # e.g. Horovod --scale_lr
            t = dataclasses.replace(
                t, learning_rate=t.learning_rate * self.strategy.learning_rate_scale)
        # with the family's section (e.g. --num_groups); --init_checkpoint: sizes its own
        self.task = task or get_task(*init_checkpoint.task_inputs(t, cfg))
        init_checkpoint.apply(self.task, cfg)  # --init_checkpoint: its architecture, checked
        self.micro_batch = step_lib.micro_batch_size(
            t.batch_size, self.strategy.num_replicas, t.grad_accum_steps)
        self.logger = logger or RunLogger(t.model_dir, self.strategy.is_chief, t.max_steps)
        self.profiler = RunProfiler(  # throughput, MFU, step-time breakdown, system monitor
            cfg.profile, t.model_dir, enabled=self.strategy.is_chief,
            tokens_per_step=t.batch_size * self.task.seq_length, sequences_per_step=t.batch_size,
            flops_per_token=getattr(self.task, "flops_per_token", lambda: None)(),
            precision=t.precision, num_devices=self.strategy.num_devices)
        with self.strategy.scope():
            self.model = self.strategy.build_model(self.task)
            # a time budget's schedule is warmup-stable-decay, its decay decided in fit
            self.optimizer = self.strategy.build_optimizer(
                dataclasses.replace(t, max_steps=0) if budgeted else t,
                self.model.trainable_variables)
            if self.budget:
                decide_schedule(self.optimizer, self.budget.decay_start, self.budget.max_steps)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            # Global batches of --batch_size examples read: the input position, the same on
            # any layout (tfbig.data.order), so a resume on another one continues exactly.
            self.batches_consumed = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                name="batches_consumed")
            self.nonfinite_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                               name="nonfinite_steps")
        self._preflight()  # a user task's checks: nothing is written before they pass
        run_directory.check(self)
        self.checkpoint = tf.train.Checkpoint(
            model=self.strategy.checkpoint_model(self.model), rng_state=rng_variables(self.model),
            optimizer=self.optimizer, step=self.step, batches_consumed=self.batches_consumed,
            nonfinite_steps=self.nonfinite_steps)
        self.stragglers = StragglerWatch(self.strategy, t.straggler_every, self.logger.info)
        self.goodput = GoodputClock(  # from this process's start (tfbig.training.goodput)
            t.model_dir, time.time() - (time.monotonic() - self.started), self.strategy.is_chief)
        self._managers = {}  # {directory: CheckpointWriter}
        self.async_checkpoint = t.async_checkpoint == "on" or (
            t.async_checkpoint == "auto" and self.strategy.checkpoint_pieces == 1)
        if self.async_checkpoint:  # the copy's trace: start-up, not the first save
            host_copier(self.checkpoint)
        with self.goodput.measure("checkpoint_restore"):
            self.restored_from = self._restore()
        init_checkpoint.initialise(self)  # a fresh run takes --init_checkpoint's weights
        # Weights, optimizer slots, dropout RNG states and the step/input counters: a rank that
        # found no checkpoint (local disks) continues where the chief's restore left off.
        self.strategy.broadcast_variables(self.model.variables + self.optimizer.variables + [
            self.step, self.batches_consumed, self.nonfinite_steps])
        self.goodput.resumed(int(self.step.numpy()))  # steps after it are trained again
        self._build_step()
        self.eval_batches = preflight.validation_batches(  # 0: no validation split
            self.task, self.micro_batch, self.strategy.num_replicas, t.eval_steps,
            self.logger.info)

    # ---- single-replica pieces -------------------------------------------------------------
    def _updated_ids(self):
        """ids of the variables the step updates (elastic ZeRO makes new slices in a new
        world, which a step traced before does not update)."""
        held = list(self.strategy.checkpoint_model(self.model).values())  # ZeRO-3: slices
        return [id(v) for v in held + self.optimizer.variables]

    def _build_step(self, again=False):
        """The step's functions, traced on first use (`again`: for new variables)."""
        self._built_for = self._updated_ids()
        self.forward_backward = self.strategy.make_forward_backward(
            self._loss_fn, self.model.trainable_variables, self._scale_loss, self.cfg.train.xla)
        self.replica_step = self.make_replica_step()
        # No autograph (as Keras 3's fit, and every tf.function of tfbig): plain Python over
        # tensors; converting took about a quarter of a tiny run's wall time.
        self._train_step = tf.function(self._global_step, autograph=False)
        self.validation_step = self.strategy.make_validation_step(
            self.task, self.model, self.cfg.train.xla)
        self._eval_step = tf.function(self._gathered_validation, autograph=False)
        if again:  # ZeRO-3: the checkpoint's model entries are the new slices
            self.checkpoint.model.update(self.strategy.checkpoint_model(self.model))
        if again and self.async_checkpoint:  # its copy reads the variables too
            host_copier(self.checkpoint, again=True)

    def make_replica_step(self):
        """One optimizer step of this replica around `self.forward_backward` (built again by
        whoever replaces that), one XLA program where it can be (tfbig.training.step)."""
        t = self.cfg.train
        return step_lib.make_replica_step(
            self.strategy, self.forward_backward, self.optimizer, self.model.trainable_variables,
            step_lib.compiled_parts(self.strategy, t.xla, t.compile_update))

    def _loss_fn(self, batch, training=False):
        return self.task.loss(self.model, batch, training=training)

    def _scale_loss(self, loss):
        scale = getattr(self.optimizer, "scale_loss", None)
        return scale(loss) if scale else loss

    def _global_step(self, batch):  # self._train_step: this, traced
        out = self.strategy.local_result(self.strategy.run(self.replica_step, (batch,)))
        finite = tf.math.is_finite(out["loss"]) & tf.math.is_finite(out["grad_norm"])
        self.nonfinite_steps.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
        self.step.assign_add(1)
        self.batches_consumed.assign_add(1)  # one global batch per optimizer step
        return out

    def _replica_validation(self, batch):
        rows = {k: v for k, v in batch.items() if k != evaluation.VALID}
        return self.strategy.all_gather({**self.validation_step(rows),
                                         evaluation.VALID: batch[evaluation.VALID]})

    def _gathered_validation(self, batch):  # self._eval_step: this, traced
        """This replica's validation outputs, gathered from every replica in dataset order."""
        return self.strategy.local_result(self.strategy.run(self._replica_validation, (batch,)))

    def _preflight(self):
        """A task's own checks of its model, batches and loss (tfbig.tasks.user), if any."""
        check = getattr(self.task, "preflight", None)
        if check:
            check(self.model, self.micro_batch, self.cfg.train.grad_accum_steps,
                  self.strategy.input_context(), self.cfg.train.seed)

    # ---- checkpoints -------------------------------------------------------------------------
    def _restore(self):
        """Restore the newest intact checkpoint (tfbig.checkpoints.integrity); damaged ones
        are named."""
        if not self.strategy.restores_checkpoint:  # it follows the chief's broadcast
            return None
        latest, _ = integrity.newest_intact(self.strategy.restore_dir(self.cfg.train.model_dir),
                                            self.logger.info, keep_damaged=self.strategy.is_chief)
        if latest:
            self.strategy.restore(self, latest)
            self.logger.info(f"resumed from {latest} at step {int(self.step.numpy())}")
        return latest

    def save(self):
        """Save model, optimizer slots, step, loss scale and input position."""
        directory = self.strategy.checkpoint_dir(self.cfg.train.model_dir)
        if directory is None:
            return None
        if directory not in self._managers:  # --async_checkpoint: written beside training
            self._managers[directory] = CheckpointWriter(
                self.checkpoint, directory, self.cfg.train.keep_checkpoints,
                self.async_checkpoint, finish=self.strategy.after_checkpoint)
        return self._managers[directory].save(int(self.step.numpy()))

    def _save_and_wait(self):
        """The final (or preempted) save: the process may end once it returns."""
        path = self.save()
        self.wait_for_checkpoint()
        return path

    def wait_for_checkpoint(self):
        """Until a checkpoint being written beside training is complete (raises its error)."""
        for writer in self._managers.values():
            writer.wait()

    # ---- data --------------------------------------------------------------------------------
    def _train_iterator(self):
        t = self.cfg.train
        return self.strategy.train_batches(  # (accum, micro, ...) batches
            self.task, self.micro_batch, t.grad_accum_steps, t.seed,
            int(self.batches_consumed.numpy()) * t.batch_size)  # global examples consumed

    def _validation_batches(self, split="validation", num_batches=None):
        global_batch = self.micro_batch * self.strategy.num_replicas
        records = lambda: self.task.dataset(  # noqa: E731 - every record once, in order
            split, global_batch, None, shuffle=False, repeat=False, drop_remainder=False)
        return iter(self.strategy.distribute_dataset(evaluation.padded_batches(
            records, global_batch, num_batches or self.eval_batches)))

    def predict(self, split="validation", num_batches=0):
        """{name: numpy array} of the task's validation outputs on `split` (its first
        `num_batches` global batches; 0: all): every replica computes its rows, all are
        gathered in dataset order, the padding dropped. Every process calls it."""
        num_batches = evaluation.num_batches(
            self.task.manifest.splits[split].records,
            self.micro_batch * self.strategy.num_replicas, num_batches)
        batches = self._validation_batches(split, num_batches)
        gathered = []
        for _ in range(num_batches):
            gathered.append({k: v.numpy() for k, v in self._eval_step(next(batches)).items()})
        return evaluation.drop_padding(gathered)

    def evaluate(self):
        """The task's validation metrics over the split (or --eval_steps global batches):
        every replica evaluates its share, the metric runs once over the gathered outputs
        (kept in `self.predictions`)."""
        if not self.eval_batches:
            return {}
        self.predictions = self.predict("validation", self.eval_batches)
        return self.task.reduce_aggregated_logs(self.predictions)

    # ---- the loop ----------------------------------------------------------------------------
    def _check_finite(self, step):
        bad = int(self.nonfinite_steps.numpy())
        if bad and self.cfg.train.precision != "mixed_float16":
            raise NonFiniteLossError(
                f"non-finite loss or gradient at or before step {step} ({bad} step(s)) with "
                f"--precision={self.cfg.train.precision}; the last good checkpoint in "
                f"{self.cfg.train.model_dir} is kept. Lower --learning_rate or check the data.")

    def _log_train(self, step, out, perf):
        values = {k: float(v) for k, v in out.items()}
        values.update(learning_rate=float(learning_rate(self.optimizer, step - 1)),
                      **perf,  # tokens/s, MFU, step-time breakdown (tfbig.profiling)
                      skipped_steps=float(self.nonfinite_steps.numpy()))
        values.update(data.source_tokens(  # per-source tokens of a --data_dir mixture, or {}
            getattr(self.task, "data_dir", ""), self.cfg.train.seed,
            int(self.batches_consumed.numpy()) * self.cfg.train.batch_size))
        if self.cfg.train.precision != "mixed_float16":
            values.pop("loss_scale")
        values.update(self.goodput.scalars())  # goodput, badput/<cause>: shares of the wall time
        self.goodput.write()  # a process killed from here on loses at most the time since
        self.logger.progress(step, values)
        self.logger.scalars("train", step, values)
        return values

    def fit(self, steps=None):
        """Train to --max_steps, resuming where a checkpoint left off; returns a summary.

        `steps` stops after that many steps instead (a checkpoint is saved), as an
        interrupted run would, so the schedule still runs to --max_steps on the next call.
        A SIGTERM (preemption) saves a checkpoint after the current step and returns with
        summary["preempted"] True; the next start resumes there.
        """
        def loop():  # again after elastic Horovod changed the world: new ZeRO slices?
            if self._updated_ids() != self._built_for:
                self._build_step(again=True)
            preflight.check_same_step(self.strategy, int(self.step.numpy()),
                                      self.cfg.train.model_dir)
            return self._fit(steps)

        with self.strategy.watch_preemption(), self.profiler.session(int(self.step.numpy())):
            return self.strategy.run_training(loop)

    def _fit(self, steps):
        t = self.cfg.train
        # The world may have changed since __init__ (elastic Horovod); the global batch did not.
        self.micro_batch = step_lib.micro_batch_size(
            t.batch_size, self.strategy.num_replicas, t.grad_accum_steps)
        iterator = self._train_iterator()
        step = int(self.step.numpy())
        limit = math.inf if steps is None else step + steps
        timer = None if t.max_steps else self.timer  # a budget before its decay is decided
        if timer:
            timer.start(step)
        end = min(limit, t.max_steps or math.inf)
        last = {}
        self.goodput.loop_started()
        while step < end:
            with self.goodput.step():
                step, last, end, timer, stop = self._iteration(iterator, step, last, end, limit,
                                                               timer)
            if stop:  # SIGTERM on any process: all save, then stop
                return self._stop_preempted(step, last)
        self._check_finite(step)
        with self.goodput.measure("checkpoint_save"):
            path = self._save_and_wait()
        with self.goodput.measure("evaluation"):
            summary = {"step": step, "train": last, "checkpoint": path,
                       "eval": self._report_eval(step)}
        if self.budget and step == t.max_steps:  # the budgeted run's end, in its accounting
            self.budget.ended_seconds = time.monotonic() - self.started
            if self.strategy.is_chief:
                run_directory.save_config(self)
        summary["goodput"] = self.goodput.summary()
        summary["stragglers"] = self.stragglers.found
        self.goodput.write(finished=True)
        self.logger.info(self.goodput.describe())
        if self.stragglers.found:
            self.logger.info(self.stragglers.describe())
        self.logger.flush()
        return summary

    def _iteration(self, iterator, step, last, end, limit, timer):
        """One step of the loop, with its logging, evaluation and checkpoint."""
        t = self.cfg.train
        begin = time.time()
        self.stragglers.step_started()
        with self.profiler.phase("input"), self.goodput.measure("input_wait"):
            batch = next(iterator)
        step += 1
        log = step % t.log_every == 0 or step == end
        mark = timer is not None and timer.due(step)
        with self.profiler.phase("compute"):
            out = self._train_step(batch)
            if log or mark:  # wait for device work queued (GPUs run ahead)
                out = {k: v.numpy() for k, v in out.items()}
        if mark:
            timer.mark(step)
            if self._estimate_budget(step):  # the decay starts: the count is fixed
                timer, end = None, min(limit, t.max_steps)
        communication = out.pop("communication_seconds")
        self.profiler.step_done(step, communication)
        self.stragglers.step_done(time.time() - begin, communication)
        if log:
            self._check_finite(step)
            last = self._log_train(step, out, self.profiler.interval())
        if self.stragglers.due(step):  # every process: a gather
            self.stragglers.check(step)
        if t.eval_every and step % t.eval_every == 0 and step < end:
            with self._pause("validation"), self.goodput.measure("evaluation"):
                self._report_eval(step)
        if step % t.checkpoint_every == 0 and step < end:
            self._check_finite(step)
            with self.profiler.phase("checkpoint"), self._pause("checkpoint"), \
                    self.goodput.measure("checkpoint_save"):
                self.save()
            self.goodput.checkpoint_saved(step)
        self.strategy.after_step(step)
        return step, last, end, timer, self.strategy.should_stop()

    def _stop_preempted(self, step, last):
        self._check_finite(step)
        with self.goodput.measure("checkpoint_save"):
            path = self._save_and_wait()
        self.goodput.write()
        self.logger.info(f"preempted (SIGTERM) after step {step}: saved {path}; "
                         "start the same command again to resume")
        self.logger.flush()
        return {"step": step, "train": last, "checkpoint": path, "eval": {}, "preempted": True}

    def _report_eval(self, step):
        summary = self.evaluate()
        if not summary:  # no validation split (said at start)
            return summary
        self.logger.scalars("validation", step, summary)
        self.logger.info("eval @ step {}: ".format(step) + " | ".join(
            f"{k} {v:.4f}" for k, v in summary.items() if isinstance(v, float)
            and math.isfinite(v)))
        return summary
