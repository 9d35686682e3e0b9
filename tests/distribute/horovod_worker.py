"""Runs under `horovodrun` for tests/distribute/test_horovod.py: train the runs of a plan with
--strategy=horovod and save what each rank ends with.

    horovodrun -np 2 -H localhost:2 --gloo python horovod_worker.py PLAN_JSON

PLAN_JSON is a list of runs: {"name", "config" (tfbig.config.to_dict), "out" (directory)} plus
optional keys:
    per_rank_model_dir  rank r trains in MODEL_DIR/rank{r} (hosts with local disks)
    interrupt_at        fit that many steps, then resume with a new Trainer
    poison_rank         that rank's loss is inf in the first step
    poison_gradient_rank  that rank's gradient of its first split variable (tensor parallelism:
                        its own slice; expert parallelism: its first expert weight) is
                        non-finite in the first step
    untied              GPT without tied embeddings (its own output projection)
    steps               fit this many steps only
    seed_by_rank        seed + rank: different initial weights before the broadcast
    sigterm             {"rank", "step"}: that rank sends itself SIGTERM after logging that step
    timeline            Horovod timeline file of the final fit
    first_gradients     save the averaged gradients of the first batch (gradients0..)
    widest_activation   save the largest last dimension of any rank-3 float tensor in the
                        traced forward/backward graph (nested graphs included)
    norm_rows           save the most sequence positions a LayerNorm of the traced forward
                        pass normalises
    mlm_argmax          save the task's argmax of the masked-LM logits on one batch and that
                        of the assembled single-device model (argmax_ours, argmax_full)
    expect_error        the Trainer must refuse the run: save its message (error) and whether
                        the model directory exists (model_dir_exists) instead of training
Each rank writes OUT/NAME.rank{R}.npz (trainable weights w0.., optimizer variables o0..,
per-step train losses, grad norms and fp16 loss scales, the learning rates of steps 0..3, final counters) and
OUT/NAME.rank{R}.pid. A run {"post_style": [DATA_DIR, MODEL_DIR, OUT_DIR]} runs
horovod_post_style.main instead. Runs share one launch: each start of TensorFlow costs seconds.
"""
import dataclasses
import json
import os
import signal
import sys
import time

STARTED = time.monotonic()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.distribute import horovod_keras
from tfbig.training.registry import get_strategy  # noqa: E402
from tfbig.training.logs import RunLogger  # noqa: E402
from tfbig.optim import learning_rate, loss_scale  # noqa: E402
from tfbig.tasks.gpt import GPTTask  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


class RecordingLogger(RunLogger):
    """RunLogger that also keeps every train loss, on every rank (the chief still writes)."""

    def __init__(self, *args, sigterm_at=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = {}
        self.loss_scales = {}  # mixed_float16 only: the scale each step's loss was scaled by
        self.sigterm_at = sigterm_at

    def scalars(self, split, step, values):
        if split == "train":
            self.losses[step] = (values["loss"], values["grad_norm"])
            if "loss_scale" in values:
                self.loss_scales[step] = values["loss_scale"]
            if step == self.sigterm_at:  # as a scheduler preempting this one process would
                os.kill(os.getpid(), signal.SIGTERM)
        super().scalars(split, step, values)


class Phases:
    """Seconds spent in each phase of one scenario; rank 0 prints them as one line of the
    launch's log ("seconds NAME: total T | trainer a | fit b ..."), to see where a launch
    spends its time."""

    def __init__(self, name):
        self.name, self.seconds = name, {}
        self.started = self.last = time.monotonic()

    def done(self, phase):
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def report(self):
        if hvd.rank() == 0:
            parts = " | ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
            print(f"seconds {self.name}: total {time.monotonic() - self.started:.1f} | {parts}",
                  flush=True)


class PoisonedTask(GPTTask):
    """GPT whose loss is multiplied by `poison` (inf on one rank forces a non-finite step)."""

    def __init__(self, train):
        super().__init__(train)
        self.poison = tf.Variable(1.0, trainable=False)

    def loss(self, model, batch, training=False):
        loss, metrics = super().loss(model, batch, training)
        return loss * self.poison, {k: v * self.poison for k, v in metrics.items()}


class UntiedTask(GPTTask):
    """GPT with its own output projection (tie_embeddings off): no CLI flag sets it."""

    def _model_config(self):
        return dataclasses.replace(super()._model_config(), tie_embeddings=False)


def poison_split_gradient(trainer):
    """A variable the gradient of the model's first tensor-split variable (its first expert
    weight under expert parallelism) is multiplied by after the forward/backward (inf: a
    non-finite value in this rank's slice only)."""
    poison = tf.Variable(1.0, trainable=False)
    split = getattr(trainer.strategy, "expert_paths", None) or trainer.strategy.splits
    index = next(i for i, v in enumerate(trainer.model.trainable_variables) if v.path in split)
    forward_backward = trainer.forward_backward

    def poisoned(batch):
        loss, grads, metrics = forward_backward(batch)
        grads = list(grads)
        grads[index] = grads[index] * tf.cast(poison, grads[index].dtype)
        return loss, grads, metrics

    trainer.forward_backward = poisoned
    trainer.replica_step = trainer.make_replica_step()  # the one built at start holds the old
    return poison


def make_trainer(run, cfg, strategy, logger):
    task = PoisonedTask(cfg.train) if run.get("poison_rank") is not None else None
    task = UntiedTask(cfg.train) if run.get("untied") else task
    return Trainer(cfg, strategy=strategy, task=task, logger=logger)


def train(run):
    phases = Phases(run["name"])
    cfg = config_lib.from_dict(run["config"])
    strategy = get_strategy("horovod", cfg)
    rank = hvd.rank()  # global: tensor-parallel peers share a data-parallel rank
    if run.get("per_rank_model_dir"):
        cfg.train.model_dir = os.path.join(cfg.train.model_dir, f"rank{rank}")
    if run.get("seed_by_rank"):  # different initial weights: only the broadcast equalises them
        cfg.train.seed += rank
    sigterm = run.get("sigterm") or {}
    sigterm_at = sigterm.get("step") if sigterm.get("rank") == rank else None
    logger = RecordingLogger(cfg.train.model_dir, strategy.is_chief, cfg.train.max_steps,
                             sigterm_at=sigterm_at)
    os.makedirs(run["out"], exist_ok=True)
    with open(os.path.join(run["out"], f"{run['name']}.rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))  # for tests that signal one rank
    if run.get("expect_error"):
        try:
            make_trainer(run, cfg, strategy, logger)
            error = ""
        except ValueError as e:
            error = str(e)
        np.savez(os.path.join(run["out"], f"{run['name']}.rank{rank}.npz"), error=error,
                 model_dir_exists=os.path.exists(cfg.train.model_dir))
        return
    trainer = make_trainer(run, cfg, strategy, logger)
    phases.done("trainer")
    extra = {"initial": full_values(trainer)}
    if run.get("first_gradients"):
        extra["gradients"] = first_gradients(trainer)
    if run.get("widest_activation"):
        extra["widest_activation"] = widest_activation(trainer)
    if run.get("norm_rows"):
        extra["norm_rows"] = norm_rows(trainer)
    if run.get("mlm_argmax"):
        extra["argmax_ours"], extra["argmax_full"] = mlm_argmax(trainer)
    phases.done("probes")
    if run.get("poison_gradient_rank") is not None:
        poison = poison_split_gradient(trainer)
        poison.assign(float("inf") if rank == run["poison_gradient_rank"] else 1.0)
        trainer.fit(steps=1)
        poison.assign(1.0)
        extra["after_poison"] = full_values(trainer)
        extra["scale_after_poison"] = float(loss_scale(trainer.optimizer))
    if run.get("poison_rank") is not None:
        if rank == run["poison_rank"]:
            trainer.task.poison.assign(float("inf"))
        trainer.fit(steps=1)
        trainer.task.poison.assign(1.0)
        extra["after_poison"] = full_values(trainer)
        extra["scale_after_poison"] = float(loss_scale(trainer.optimizer))
    if run.get("interrupt_at"):
        trainer.fit(steps=run["interrupt_at"])
        phases.done("fit")
        trainer = make_trainer(run, cfg, strategy, logger)  # resumes from the checkpoint
        extra["restored_step"] = int(trainer.step.numpy())
        phases.done("resume")
    if run.get("timeline"):
        hvd.start_timeline(run["timeline"])  # Horovod's own record of every collective
    summary = trainer.fit(steps=run.get("steps"))
    if run.get("timeline"):
        hvd.stop_timeline()
    phases.done("fit")
    save(run, rank, trainer, logger, summary, extra)
    phases.done("save")
    phases.report()


def full_values(trainer, values=None):
    """The model's trainable weights (or `values` for them) as single-device arrays: a
    tensor-parallel rank assembles its group's slices."""
    variables = trainer.model.trainable_variables
    gather = getattr(trainer.strategy, "gather_full", None)
    if gather is not None:
        return gather(variables, values)
    return [np.asarray(v) for v in (values if values is not None else variables)]


def first_gradients(trainer):
    """The averaged gradients of the first training batch (no update)."""
    batch = next(trainer._train_iterator())
    _, grads, _ = trainer.forward_backward(batch)
    return full_values(trainer, trainer.strategy.all_reduce_gradients(grads))


def widest_activation(trainer):
    """The largest last dimension of a rank-3 floating tensor the forward/backward traces."""
    batch = next(trainer._train_iterator())
    graphs, widest = [trainer.forward_backward.get_concrete_function(batch).graph], 0
    while graphs:
        graph = graphs.pop()
        for op in graph.get_operations():
            for t in op.outputs:
                if t.shape.rank == 3 and t.dtype.is_floating and t.shape[-1] is not None:
                    widest = max(widest, t.shape[-1])
        graphs.extend(f.graph for f in graph._functions.values() if hasattr(f, "graph"))
    return widest


def norm_rows(trainer):
    """The most sequence positions any LayerNorm of the traced forward pass normalises."""
    batch = next(trainer._train_iterator())
    graph = trainer.forward_backward.get_concrete_function(batch).graph
    rows = [t.shape[1] for op in graph.get_operations() if "gradient" not in op.name
            and any(f"/{n}" in op.name for n in ("ln_1", "ln_2", "final_norm"))
            for t in op.outputs if t.shape.rank == 3 and t.shape[1] is not None]
    return max(rows)


def mlm_argmax(trainer):
    """The task's (vocabulary-parallel) argmax of the masked-LM logits on one batch, and
    tf.argmax of the assembled single-device model's logits on it."""
    batch = {k: v[0] for k, v in next(trainer._train_iterator()).items()}  # one micro-batch
    ours = trainer.task.vocab_argmax(trainer.model(batch)["mlm_logits"], tf.int64)
    full = trainer.task.build_model()
    for v, value in zip(full.trainable_variables, full_values(trainer), strict=True):
        v.assign(value)
    return ours.numpy(), tf.argmax(full(batch)["mlm_logits"], -1).numpy()


def own_mask_states(trainer):
    """ids of the dropout generator states the tensor-parallel plan gives a mask per rank."""
    if not hasattr(trainer.strategy, "splits"):
        return set()
    from tfbig.layouts import tensor_layout

    return tensor_layout.own_mask_states(trainer.model, trainer.strategy.group)


def save(run, rank, trainer, logger, summary, extra):
    arrays = {f"w{i}": w for i, w in enumerate(full_values(trainer))}
    arrays.update({f"o{i}": np.asarray(v.numpy())
                   for i, v in enumerate(trainer.optimizer.variables)})
    for key in ("initial", "after_poison", "gradients"):
        arrays.update({f"{key}{i}": w for i, w in enumerate(extra.pop(key, []))})
    steps = sorted(logger.losses)
    arrays["loss_steps"] = np.array(steps)
    arrays["losses"] = np.array([logger.losses[s][0] for s in steps])
    arrays["grad_norms"] = np.array([logger.losses[s][1] for s in steps])
    arrays["loss_scales"] = np.array([logger.loss_scales.get(s, np.nan) for s in steps])
    arrays["learning_rates"] = np.array([float(learning_rate(trainer.optimizer, s))
                                         for s in range(4)])
    arrays["step"] = int(trainer.step.numpy())
    arrays["max_steps"] = (trainer.budget.max_steps if trainer.budget  # a time budget's estimate
                           else trainer.cfg.train.max_steps)  # or decided total, or given
    arrays["nonfinite_steps"] = int(trainer.nonfinite_steps.numpy())
    arrays["loss_scale"] = float(loss_scale(trainer.optimizer))
    arrays["num_replicas"] = trainer.strategy.num_replicas
    arrays["precision"] = trainer.cfg.train.precision
    seeds = [v for v in trainer.model.variables if "seed_generator" in v.path]
    arrays["seed_own"] = np.array([id(v) in own_mask_states(trainer) for v in seeds], bool)
    arrays.update({f"seed{i}": np.asarray(v.numpy()) for i, v in enumerate(seeds)})
    arrays["eval_loss"] = summary["eval"].get("loss", np.nan)
    arrays["eval_mlm_accuracy"] = summary["eval"].get("mlm_accuracy", np.nan)  # ALBERT
    arrays["preempted"] = bool(summary.get("preempted"))
    arrays["recomputed_layers"] = sum(bool(getattr(layer, "_tfbig_recompute", False))
                                      for layer in getattr(trainer.model, "model",  # a stage's
                                                           trainer.model)._flatten_layers())
    arrays.update({k: np.asarray(v) for k, v in extra.items()})
    # Linux scheduling policy of the threads Horovod started (--hvd_thread_policy) and ours.
    arrays["background_policies"] = np.array([
        os.sched_getscheduler(tid) for tid in horovod_keras.background_threads()
        if os.path.exists(f"/proc/self/task/{tid}")])
    arrays["main_policy"] = os.sched_getscheduler(0)
    if hasattr(trainer.strategy, "state_bytes"):  # ZeRO, TP: the model state this rank holds
        arrays.update({f"bytes_{k}": v for k, v in trainer.strategy.state_bytes().items()})
    os.makedirs(run["out"], exist_ok=True)
    np.savez(os.path.join(run["out"], f"{run['name']}.rank{rank}.npz"), **arrays)


def main(plan_path):
    if os.environ.get("HOROVOD_RANK") == "0":
        print(f"seconds to import TensorFlow and Horovod: {time.monotonic() - STARTED:.1f}",
              flush=True)
    with open(plan_path) as f:
        plan = json.load(f)
    for run in plan:
        if "post_style" in run:  # the user-style script, as its own program would run it
            import horovod_post_style

            horovod_post_style.main(*run["post_style"])
        else:
            train(run)
    # Horovod: wait for every rank; one that exits first shuts Horovod down under the others
    # while they still communicate in their own process sets.
    hvd.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
