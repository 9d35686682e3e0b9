"""The public way in for your own Keras model: `tfbig.train`, `tfbig.evaluate`, `tfbig.predict`.

Each takes a `tfbig.Task` (tfbig.tasks.user: build the model, read one replica's batches, the
loss) or, for the common case, three functions, and the run's settings as an ExperimentConfig
and/or tfbig-train's flag names as keywords:

    def model_fn():                      # called inside the backend's scope
        model = MyModel(); model.build((None, 64)); return model
    def loss_fn(targets, outputs):       # a float scalar
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            targets, outputs, from_logits=True))
    def dataset_fn(shard):               # this replica's (inputs, targets) batches
        return examples.shard(shard.count, shard.index).repeat().batch(shard.batch_size)

    run = tfbig.train(model_fn, loss_fn, dataset_fn, max_steps=100, batch_size=16,
                      model_dir="runs/mine", strategy="horovod")   # under horovodrun
    run.losses, run.model, run.summary["checkpoint"]

Everything tfbig-train's Trainer does applies: --strategy single | horovod (ZeRO 1-3,
MiCS groups; or --elastic: ranks may die and join) | multiworker | mirrored, checkpoints and
exact resume (run it again), SIGTERM preemption, --precision and loss scaling,
--grad_accum_steps, --grad_clip_norm, profiling, TensorBoard and the time budget, and
--tensor_parallel for a task that declares its `tensor_layout` (which Dense layers are
column- or row-split, which attention layers split their heads, which embedding and output
layer their vocabulary), --strategy=pipeline and --pipeline_stages=K under horovod for a task
that declares its `pipeline_layers` (the layers whose composition is its forward:
tfbig.tasks.user_pipeline; with --tensor_parallel its declared layout inside each stage),
--context_parallel for a task that declares its `context_layout` (its token and position
embeddings, attentions and output). --plan_only builds the model,
counts its variables and returns the plan (tfbig.plan.user: the state per rank, under
--tensor_parallel counted on a rank's slices of the declared layout; activations and step time
when the task declares its `transformer_shape`, with --tensor_parallel and --context_parallel
by the planner's closed forms and with --calibration beside the spec figures) instead of
training. `consolidate_run` writes a ZeRO or tensor-parallel run of a task as one
single-device checkpoint. Refused by name for a user task (USER_TASK_REFUSED): tensor
parallelism without a declared layout, pipeline parallelism without declared pipeline_layers,
--init_checkpoint, and --context_parallel without a declared context_layout; with --plan_only
and no transformer_shape (PLAN_REFUSED) --context_parallel.
"""
import atexit
import copy
import dataclasses

from tfbig.config import ExperimentConfig
from tfbig.errors import UsageError
from tfbig.layouts import composition
from tfbig.tasks.user import DataShard, FunctionTask, Task
from tfbig.tasks.layout_map import device_mesh
from tfbig.tasks.user_adapter import UserTask
from tfbig.training.finetune import LossRecorder
from tfbig.training.precision import precision_policy
from tfbig.training.trainer import Trainer

__all__ = ["DataShard", "Run", "Task", "config_from_flags", "configure", "consolidate_run",
           "define_flags", "device_mesh", "evaluate", "predict", "train"]

# flag -> (its value when unused, why a user task refuses it)
USER_TASK_REFUSED = {
    "tensor_parallel": (1, "tensor parallelism splits the layers a task declares in its "
                           "tensor_layout ({layer path: 'column' | 'row' | 'heads' | "
                           "'vocab'}, Task docs); this task declares none"),
    "pipeline_stages": (0, "pipeline stages are cut between the layers a task declares in "
                           "its pipeline_layers (attribute paths whose composition is the "
                           "forward, Task docs); this task declares none"),
    "init_checkpoint": ("", "it loads tfbig-convert / tfbig-train runs of tfbig's own models; "
                            "load your weights in build_model"),
}

# flag -> (its value when unused, why --plan_only of a task without a transformer_shape
# refuses it)
PLAN_REFUSED = {
    "context_parallel": (1, "context parallelism changes the activations and the step time, "
                            "which the plan derives only from the task's transformer_shape "
                            "(the state per rank is the same as without it); this task "
                            "declares none"),
}


def configure(config=None, **flags):
    """An ExperimentConfig: `config` (copied, or a fresh one) with tfbig-train flags set by
    name, e.g. configure(max_steps=100, strategy="horovod", zero_stage=3)."""
    config = copy.deepcopy(config) if config else ExperimentConfig()
    sections = [getattr(config, f.name) for f in dataclasses.fields(config)]
    for name, value in flags.items():
        section = next((s for s in sections if name in {f.name for f in
                                                        dataclasses.fields(s)}), None)
        if section is None:
            raise UsageError(f"{name}={value!r}: not a tfbig-train flag (tfbig-train --help "
                             "lists them)")
        setattr(section, name, value)
    check_user_flags(config)
    return config


def define_flags(**defaults):
    """Define tfbig-train's flags (absl) for a script of your own, with your `defaults`:
    define_flags(max_steps=50, batch_size=16); then config_from_flags() after parsing."""
    from absl import flags

    from tfbig import config

    config.define_flags()
    for name, value in defaults.items():
        flags.FLAGS.set_default(name, value)


def config_from_flags(flag_values=None):
    """The ExperimentConfig of the parsed flags (define_flags first)."""
    from tfbig import config

    return configure(config.from_flags(flag_values))


# flag -> (the values it may take, why --tensor_parallel with a declared layout refuses others)
TENSOR_LAYOUT_REFUSED = {
    "sequence_parallel": ((False,), "a declared tensor_layout splits layers along their width, "
                                    "not the sequence"),
}


def check_user_flags(config, task=None):
    """Refuse, by flag, what a user task cannot run (USER_TASK_REFUSED); once the `task` is
    known, --tensor_parallel unless it declares a tensor_layout (and then the flags of
    TENSOR_LAYOUT_REFUSED with it), a pipeline unless it declares pipeline_layers, and with
    --plan_only PLAN_REFUSED unless it declares a transformer_shape."""
    values = {f.name: getattr(getattr(config, s.name), f.name)
              for s in dataclasses.fields(config)
              for f in dataclasses.fields(getattr(config, s.name))}
    composition.check(composition.values_of(config))  # the pairs no model composes
    declared = bool(task is None or getattr(task, "tensor_layout", None))
    cut = bool(task is None or getattr(task, "pipeline_layers", None))
    if config.train.strategy == "pipeline" and not cut:
        raise UsageError("--strategy=pipeline: " + USER_TASK_REFUSED["pipeline_stages"][1]
                         + "; use single, horovod, multiworker or mirrored")
    for flag, (unused, why) in USER_TASK_REFUSED.items():
        if flag == "pipeline_stages" and (values[flag] == 1 or cut):
            continue  # one stage: no pipeline; declared layers: user_pipeline
        if flag == "tensor_parallel" and declared:
            continue  # a declared layout: tensor_layout.split_declared_model
        if values[flag] != unused:
            raise UsageError(f"--{flag}={values[flag]!r} is refused for a user task: {why}")
    if values["context_parallel"] != 1 and not values["plan_only"] and task is not None \
            and not getattr(task, "context_layout", None):
        raise UsageError(f"--context_parallel={values['context_parallel']} is refused for a "
                         "user task: context parallelism cuts the layers a task declares in "
                         "its context_layout ({layer path: 'tokens' | 'positions' | "
                         "'attention' | 'output'}, Task docs); this task declares none")
    if values["plan_only"] and task is not None and \
            getattr(task, "transformer_shape", None) is None:
        for flag, (unused, why) in PLAN_REFUSED.items():
            if values[flag] != unused:
                raise UsageError(f"--{flag}={values[flag]!r} with --plan_only is refused for "
                                 f"a user task: {why}")
    if values["tensor_parallel"] == 1:
        return
    for flag, (allowed, why) in TENSOR_LAYOUT_REFUSED.items():
        if values[flag] not in allowed:
            raise UsageError(f"--{flag}={values[flag]!r} with --tensor_parallel="
                             f"{values['tensor_parallel']} is refused for a user task: {why}")


def _task(task_or_model_fn, loss_fn, dataset_fn, task_options):
    if isinstance(task_or_model_fn, Task):
        if loss_fn or dataset_fn or task_options:
            raise UsageError("train(task, ...): a Task carries its own loss, dataset and "
                             "options; give functions only with a model_fn")
        return task_or_model_fn
    if not callable(task_or_model_fn) or dataset_fn is None:
        raise UsageError("give a tfbig.Task, or model_fn, loss_fn and dataset_fn")
    return FunctionTask(task_or_model_fn, loss_fn, dataset_fn, **task_options)


TASK_OPTIONS = ("name", "tokens_per_example", "checkpoint_layers", "metrics_fn",
                "tensor_layout", "transformer_shape", "pipeline_layers", "context_layout")


def _split(kwargs):
    """(Task options, tfbig-train flags) of train()'s keyword arguments."""
    return ({k: v for k, v in kwargs.items() if k in TASK_OPTIONS},
            {k: v for k, v in kwargs.items() if k not in TASK_OPTIONS})


@dataclasses.dataclass
class Run:
    """What `train` returns: the Trainer (its model, strategy, optimizer), the summary
    ({"step", "train", "checkpoint", "eval"}) and each logged step's loss."""

    trainer: Trainer
    summary: dict
    losses: list

    @property
    def model(self):
        return self.trainer.model

    def close(self):
        """Wait for every process and release the backend (Horovod: hvd.join, hvd.shutdown).
        Called at exit if not before; call it yourself before a process ends early."""
        if not getattr(self, "_closed", False):
            self._closed = True
            self.trainer.strategy.shutdown()


def _trainer(task, config, recorder=False, predicting=False):
    """A Trainer of `task` (its newest checkpoint in model_dir restored); with `recorder` its
    logger keeps each logged loss."""
    from tfbig.training.registry import get_strategy

    strategy = get_strategy(config.train.strategy, config)
    logger = LossRecorder(config.train.model_dir, strategy.is_chief, config.train.max_steps) \
        if recorder else None
    return Trainer(config, strategy=strategy, logger=logger, task=UserTask(
        task, predicting, model_losses_refused=composition.model_losses_refused(config)))


def _task_and_config(task_or_model_fn, loss_fn, dataset_fn, config, kwargs):
    """(task, config) of a train/evaluate/predict call: the Task (or one made of the three
    functions and the Task options among kwargs), the config with the flags among kwargs, and
    the flags a user task cannot run refused by name."""
    task_options, flags = _split(kwargs)
    task = _task(task_or_model_fn, loss_fn, dataset_fn, task_options)
    config = configure(config, **flags)
    check_user_flags(config, task)
    return task, config


def train(task_or_model_fn, loss_fn=None, dataset_fn=None, config=None, **kwargs):
    """Train a `tfbig.Task` (or model_fn, loss_fn, dataset_fn) on the backend of the config.

    Args:
        task_or_model_fn: a tfbig.Task, or a function returning a built Keras model.
        loss_fn: (targets, outputs) -> float scalar, with a model_fn.
        dataset_fn: DataShard -> tf.data.Dataset of (inputs, targets) batches, with a model_fn.
        config: an ExperimentConfig (default: tfbig-train's defaults).
        **kwargs: tfbig-train flags by name (max_steps=100, strategy="horovod", ...), and with
            a model_fn the Task options name, tokens_per_example, checkpoint_layers, metrics_fn,
            tensor_layout, transformer_shape, pipeline_layers, context_layout (Task docs).
    Returns a Run; training again with the same model_dir resumes from its checkpoint. With
    plan_only=True nothing trains: the plan is printed and its UserPlan returned.
    """
    if isinstance(loss_fn, ExperimentConfig) and config is None:  # train(task, config)
        loss_fn, config = None, loss_fn
    task, config = _task_and_config(task_or_model_fn, loss_fn, dataset_fn, config, kwargs)
    if config.train.plan_only:
        from tfbig.training.local_plan import first_process

        found = plan(task, config)
        if first_process():  # one copy per job, not one per rank
            print(found.text)
        return found
    with precision_policy(config.train.precision):
        trainer = _trainer(task, config, recorder=True)
        summary = trainer.fit()
    run = Run(trainer, summary, trainer.logger.losses)
    atexit.register(run.close)
    return run


def plan(task, config, device=None, world_size=None):
    """The UserPlan (tfbig.plan.user) of `task` under `config`: its model built here (no
    backend, nothing written), its variables counted; on `device` (default: this machine's,
    probed as tfbig-train --plan_only does) and `world_size` ranks (default: the launcher's)."""
    from tfbig.plan import calibration, user
    from tfbig.training import local_plan as local

    check_user_flags(config, task)
    shape = getattr(task, "transformer_shape", None)
    if shape is not None:  # checked before the build and the device probe
        _planner_refusals(lambda: user.check_shape(task.name, shape))
    if config.train.calibration:
        _planner_refusals(lambda: calibration.load(config.train.calibration))
    with precision_policy(config.train.precision):
        counts, held = _planner_refusals(lambda: _counted(task, config.parallel.tensor_parallel))
    device = device or local.local_device(config.train.precision, config.profile.peak_tflops)
    return _planner_refusals(lambda: user.user_plan(
        task.name, counts, shape, config, device, world_size or local.processes(), held))


def _counted(task, tensor):
    """((trainable, other) values of the task's model, trainable values one rank holds):
    under --tensor_parallel counted on tensor rank 0's model, split as training splits it."""
    from tfbig.layouts.tensor_layout import split_declared_model
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.plan import user

    if tensor == 1:
        counts = user.count_variables(UserTask(task).build_model())
        return counts, counts[0]
    model, splits = split_declared_model(UserTask(task), TensorGroup(None, 0, tensor))
    return user.count_split(model, splits, tensor)


def _planner_refusals(call):
    """call(), the planner's ValueErrors (a transformer_shape or layout it refuses) raised as
    the UsageErrors they are."""
    try:
        return call()
    except ValueError as error:
        raise UsageError(str(error)) from error


def consolidate_run(task_or_model_fn, model_dir, output_dir, **task_options):
    """Write the newest checkpoint of a sharded run of your model (--zero_stage 1-3, MiCS
    groups included, or --tensor_parallel with the task's tensor_layout) in `model_dir` as one
    single-device checkpoint in `output_dir`: weights, optimizer slots, step and input
    position, which train/evaluate/predict then resume or read under any layout (and
    `python -m tfbig.commands.consolidate` refuses, having no way to build your model).

    Args:
        task_or_model_fn: the tfbig.Task the run trained, or its model_fn.
        model_dir: the run's directory (only read).
        output_dir: an empty or new directory.
        **task_options: with a model_fn, the Task options it was trained with: name (the
            run's config.json must name the same task) and, for a tensor-parallel run,
            tensor_layout.
    Returns the path of the checkpoint written. Its data is not read: nothing but the model
    is built.

        tfbig.consolidate_run(model_fn, "runs/zero3", "runs/zero3-single", name="own_model")
    """
    from tfbig.training import consolidate

    if isinstance(task_or_model_fn, Task):
        if task_options:
            raise UsageError("consolidate_run(task, ...): a Task carries its own options; give "
                             "them only with a model_fn")
        task_or_model_fn, task_options = task_or_model_fn.build_model, _options_of(
            task_or_model_fn)
    elif not callable(task_or_model_fn):
        raise UsageError("consolidate_run: give the tfbig.Task the run trained, or its model_fn")
    unknown = set(task_options) - set(TASK_OPTIONS)
    if unknown:
        raise UsageError(f"consolidate_run: {', '.join(sorted(unknown))}: not a Task option "
                         f"(they are {', '.join(TASK_OPTIONS)})")
    model_only = FunctionTask(task_or_model_fn, dataset_fn=lambda shard: None, **task_options)
    with precision_policy(_saved_precision(model_dir)):
        return consolidate.consolidate(model_dir, output_dir,
                                       task=UserTask(model_only, predicting=True))


def _options_of(task):
    """The Task options of a Task (what consolidation rebuilds its model with)."""
    return {"name": task.name, "tokens_per_example": task.tokens_per_example,
            "checkpoint_layers": task.checkpoint_layers,
            "tensor_layout": dict(task.tensor_layout or {})}


def _saved_precision(model_dir):
    """--precision of the run in `model_dir` (its config.json)."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise UsageError(f"{model_dir} has no config.json: it is not a tfbig run directory")
    with open(path) as f:
        return json.load(f).get("train", {}).get("precision", "fp32")


def evaluate(task_or_model_fn, loss_fn=None, dataset_fn=None, config=None, **kwargs):
    """The task's validation metrics ({name: float}) of the run in the config's model_dir
    (its newest checkpoint; give the config it was trained with), computed once over the
    outputs every replica gathered."""
    if isinstance(loss_fn, ExperimentConfig) and config is None:  # evaluate(task, config)
        loss_fn, config = None, loss_fn
    task, config = _task_and_config(task_or_model_fn, loss_fn, dataset_fn, config, kwargs)
    with precision_policy(config.train.precision):
        trainer = _trainer(task, config)
        if not trainer.restored_from:
            raise UsageError(f"--model_dir={config.train.model_dir}: no checkpoint to evaluate")
        return trainer.evaluate()


def predict(task_or_model_fn, dataset_fn=None, config=None, split="validation", **kwargs):
    """{name: numpy array} of the model's outputs ("outputs", or the model's own dict keys)
    on every example of `split` in order, from the config's model_dir's newest checkpoint;
    every replica predicts its rows, gathered in dataset order."""
    if isinstance(dataset_fn, ExperimentConfig) and config is None:  # predict(task, config)
        dataset_fn, config = None, dataset_fn
    task, config = _task_and_config(task_or_model_fn, None, dataset_fn, config, kwargs)
    with precision_policy(config.train.precision):
        trainer = _trainer(task, config, predicting=True)
        if not trainer.restored_from:
            raise UsageError(f"--model_dir={config.train.model_dir}: no checkpoint to predict "
                             "with")
        return trainer.predict(split)
