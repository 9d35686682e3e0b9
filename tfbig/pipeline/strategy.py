"""`--strategy=pipeline`: the model cut into stages on several devices, fed micro-batches.

The backend implements the one Strategy surface. `build_model` partitions the model (printing
the plan) and creates each stage's variables on its device; `make_forward_backward` returns a
function that splits the batch into micro-batches, runs the chosen schedule (GPipe or 1F1B) over
the stages and returns the mean loss and the gradients summed inside each stage, so the
trainer's one optimizer update per batch is unchanged. Under horovodrun, processes are
data-parallel replicas of the whole pipeline (see data_parallel.py).

Example:
    tfbig-train --strategy=pipeline --pipeline_stages=2 --num_microbatches=8 --schedule=1f1b
"""
import contextlib
import dataclasses
import math

import tensorflow as tf

from tfbig.config import HorovodConfig, PipelineConfig
from tfbig.distribute.base import Strategy
from tfbig.layouts import partition as partition_lib
from tfbig.models import shapes as plan_models
from tfbig.models.shapes import layer_specs
from tfbig.pipeline import schedules
from tfbig.pipeline.data_parallel import HorovodGrid, launched_by_horovod
from tfbig.pipeline.devices import same_device, stage_devices
from tfbig.pipeline.layers import layer_sequence
from tfbig.pipeline.stages import Stage
from tfbig.plan import estimate


def microbatch_size(total, num_microbatches):
    """Sequences per micro-batch when a replica's batch of `total` splits into M equal parts."""
    if total % num_microbatches:
        raise ValueError(f"a batch of {total} sequences per replica does not split into "
                         f"--num_microbatches={num_microbatches} equal micro-batches; choose a "
                         f"--num_microbatches that divides {total} (or change --batch_size)")
    return total // num_microbatches


def split_microbatches(batch, num_microbatches, batch_axes=1):
    """A batch whose first `batch_axes` axes index sequences ((accum, micro, ...) from the
    trainer: 2) -> a list of `num_microbatches` equal micro-batches, in order."""
    if num_microbatches == 1 and batch_axes == 1:
        return [batch]  # nothing to split (an evaluation batch may have no static size)
    flat = tf.nest.flatten(batch)
    leading = flat[0].shape[:batch_axes]
    if None in leading:
        raise ValueError(f"the pipeline needs batches of a fixed size (drop_remainder=True); "
                         f"got shape {flat[0].shape} with --num_microbatches={num_microbatches}")
    total = math.prod(leading)
    size = microbatch_size(total, num_microbatches)

    def reshape(t):
        rows = tf.reshape(t, [total] + t.shape[len(leading):].as_list())
        return tf.reshape(rows, [num_microbatches, size] + rows.shape[1:].as_list())

    split = tf.nest.map_structure(reshape, batch)
    return [tf.nest.map_structure(lambda t: t[i], split) for i in range(num_microbatches)]


def stage_memory(task, plan, options, micro_batch_tokens, precision="fp32"):
    """Per stage of `plan`, tfbig-plan's bytes ({"state", "activations"}: estimate.stage_table)
    of `task`'s model under the pipeline `options` with micro-batches of `micro_batch_tokens`.
    A user task's (declared pipe_layers): the fp32 state of its counted weights (weights,
    gradients, Adam's two slots: 16 bytes each), activations unknown (None)."""
    if getattr(task, "pipe_layers", None) is not None:  # a user model: no activation model
        return [{"state": 16 * stage.params, "activations": None} for stage in plan]
    masked = getattr(task, "max_predictions_per_seq", None)
    config = task.model_config
    shape = plan_models.shape_of(config, plan_models.family_of(config), task.seq_length, masked)
    if getattr(task, "layer_specs", None) is not None:  # a fine-tuning head, not pretraining's
        specs = tuple(task_layer_specs(task))
        shape = dataclasses.replace(shape, pipe_layers=specs, last_params=specs[-1].params)
    layout = estimate.Layout(pipeline=len(plan), num_microbatches=options.num_microbatches,
                             schedule=options.schedule,
                             activation_checkpointing=options.activation_checkpointing,
                             stage_layers=estimate.stage_layer_counts(plan))
    return estimate.stage_table(shape, layout, micro_batch_tokens // task.seq_length, precision)


def task_layer_specs(task):
    """The LayerSpecs `task`'s model is cut by: the task's own when it has them (a fine-tuning
    head: tfbig.tasks.classify, tfbig.tasks.squad), else its model config's (pretraining)."""
    own = getattr(task, "layer_specs", None)
    if own is not None:
        return own()
    return layer_specs(task.model_config, task.seq_length,
                       getattr(task, "max_predictions_per_seq", None))


def place_variables(plan, specs, devices, task=None):
    """A context creating each layer's variables on the device of its stage: matched by Keras
    name scope, or by weight path where the task places them itself (`task.placed`: a user
    task, whose build creates its weights in a name scope of its own)."""
    owner = {scope: devices[stage.index] for stage in plan
             for spec in specs[stage.start:stage.stop] for scope in spec.scopes}
    placed = getattr(task, "placed", None)
    return placed(owner) if placed is not None else _placed_by_scope(owner)


@contextlib.contextmanager
def _placed_by_scope(owner):

    def creator(next_creator, **kwargs):
        parts = tf.get_current_name_scope().split("/")
        device = next((owner[p] for p in parts if p in owner), None)
        if device is None:  # e.g. dropout seed states: created before any layer scope
            return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


class PipelineStrategy(Strategy):
    """K stages on K devices of this process, M micro-batches per step, GPipe or 1F1B."""

    name = "pipeline"
    compiled_step = None  # the variables live on several devices; one XLA program is on one

    def __init__(self, cfg=None):
        super().__init__(cfg)
        o = getattr(cfg, "pipeline", None) or PipelineConfig()
        self.options = o = dataclasses.replace(o, pipeline_stages=o.pipeline_stages or 2)
        if o.pipeline_stages < 1 or o.num_microbatches < 1:
            raise ValueError(f"--pipeline_stages={o.pipeline_stages} and --num_microbatches="
                             f"{o.num_microbatches} must both be at least 1")
        self.ops = schedules.get_schedule(o.schedule)(o.pipeline_stages, o.num_microbatches)
        horovod = getattr(cfg, "horovod", None) or HorovodConfig()
        self.grid = (HorovodGrid(o.pipeline_stages, horovod.hvd_fp16_allreduce,
                                 horovod.hvd_thread_policy) if launched_by_horovod() else None)
        first = self.grid.local_rank * o.pipeline_stages if self.grid else 0
        self.devices = stage_devices(o.pipeline_stages, first)
        self.model = self.task = self.plan = self.layers = self.stages = None
        self._scale_loss = None

    # ---- who is who --------------------------------------------------------------------------
    @property
    def num_replicas(self):
        return self.grid.size if self.grid else 1

    @property
    def num_devices(self):
        return self.num_replicas * self.options.pipeline_stages

    @property
    def rank(self):
        return self.grid.rank if self.grid else 0

    @property
    def is_chief(self):
        return self.rank == 0

    # ---- model -------------------------------------------------------------------------------
    def build_model(self, task):
        """Partition `task`'s model, print the plan, build it with each stage on its device."""
        o = self.options
        specs = task_layer_specs(task)
        self.plan = partition_lib.partition(specs, o.pipeline_stages, o.stage_boundaries,
                                            o.pipeline_balance)
        with place_variables(self.plan, specs, self.devices, task):
            model = task.build_model()
        self.layers = layer_sequence(model, task)
        names = [layer.name for layer in self.layers]
        if names != [spec.name for spec in specs]:
            raise ValueError(f"tfbig/pipeline/layers.py: layer names {names} differ from the "
                             f"cost model's {[spec.name for spec in specs]}")
        self._check_placement(task)
        self.model, self.task = model, task
        if self.cfg is not None:  # fail before any graph is built; print the plan
            micro = microbatch_size(self.cfg.train.batch_size // self.num_replicas,
                                    o.num_microbatches)
            if self.is_chief:
                print(self.describe(micro * task.seq_length), flush=True)
        return model

    def _check_placement(self, task):
        for stage in self.plan:
            for layer in self.layers[stage.start:stage.stop]:
                for v in (v for m in layer.modules for v in m.trainable_variables):
                    if not same_device(v.value.device, self.devices[stage.index]):
                        why = ("the task's build_model created its weights in another order "
                               "than its first build (it must build the same model each "
                               "time)" if getattr(task, "placed", None) else
                               "its layer's name scopes in tfbig/pipeline/layers.py do not "
                               "match the model's")
                        raise RuntimeError(
                            f"{v.path} of stage {stage.index} was created on {v.value.device}, "
                            f"not {self.devices[stage.index]}: {why}")

    def describe(self, micro_batch_tokens):
        """The plan as a table (layers, parameters, est. memory per stage)."""
        o = self.options
        memory = stage_memory(self.task, self.plan, o, micro_batch_tokens, self._precision())
        header = (f"pipeline: {o.pipeline_stages} stages, --schedule={o.schedule}, "
                  f"{o.num_microbatches} micro-batches of {micro_batch_tokens} tokens, "
                  f"activation checkpointing {'on' if o.activation_checkpointing else 'off'}, "
                  f"{self.num_replicas} data-parallel replica(s)")
        return header + "\n" + partition_lib.format_plan(self.plan, self.devices, memory)

    def _precision(self):
        return getattr(getattr(self.cfg, "train", None), "precision", "fp32")

    def make_stages(self, jit_compile):
        """Fresh Stage objects over the model's layers (one set per compiled function)."""
        if self.model is None:
            raise RuntimeError("the pipeline strategy builds the model: call build_model(task) "
                               "before make_forward_backward / make_forward")
        last = len(self.plan) - 1
        return [Stage(s.index, self.layers[s.start:s.stop], self.devices[s.index], self.task,
                      s.index == 0, s.index == last, self.options.activation_checkpointing,
                      jit_compile) for s in self.plan]

    # ---- steps -------------------------------------------------------------------------------
    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        """batch -> (mean loss, gradients of `variables`, mean metrics) through the schedule.

        `loss_fn` is not called: the stages compute the task's loss on the last device. With
        `jit_compile` each stage's computation is XLA-compiled on its own device.
        """
        self._scale_loss = scale_loss
        if jit_compile and "CPU" in self.devices[-1] and len(self.devices) > 1 and self.is_chief:
            print("pipeline: XLA-compiled stages on CPU devices run one at a time (XLA's CPU "
                  "runtime); use --noxla for stages that overlap", flush=True)
        stages = self.make_stages(jit_compile)
        self.stages = stages  # for inspection: peak_live, gradient_sums of the last trace
        num_micro = self.options.num_microbatches
        self._owner = self._owner_stages(variables, stages)

        def forward_backward(batch):
            micro_batches = split_microbatches(batch, num_micro, batch_axes=2)
            for stage in stages:
                stage.begin_step(scale_loss, num_micro)
            loss, metrics = schedules.run(self.ops, stages, micro_batches)
            grads = []
            for v in variables:  # a shared variable (tied embedding) sums its stages' parts
                parts = [s.gradient_sums[id(v)] for s in stages if id(v) in s.gradient_sums]
                grads.append(tf.add_n(parts))
            return loss, grads, metrics

        return tf.function(forward_backward, autograph=False)  # plain Python schedule

    def _owner_stages(self, variables, stages):
        """For each variable, the stage whose device holds it (where its gradient is averaged)."""
        owner = {id(v): s.index for s, plan in zip(stages, self.plan)
                 for layer in self.layers[plan.start:plan.stop]
                 for m in layer.modules for v in m.trainable_variables}
        missing = [v.path for v in variables if id(v) not in owner]
        if missing:
            raise ValueError(f"variables {missing} belong to no pipeline stage; "
                             f"tfbig/pipeline/layers.py must list their modules")
        return [owner[id(v)] for v in variables]

    def make_validation_step(self, task, model, jit_compile):
        """batch -> the task's per-example validation outputs of the last stage's outputs."""
        stages = self.make_stages(jit_compile)

        def validation_step(batch):
            size = tf.nest.flatten(batch)[0].shape[0]
            num_micro = math.gcd(self.options.num_microbatches, size) if size else 1
            outputs, _ = schedules.run_forward(stages, split_microbatches(batch, num_micro))
            with tf.device(self.devices[-1]):
                return task.validation_outputs(outputs, batch)

        return tf.function(validation_step, autograph=False)

    def predict(self, inputs_batch, jit_compile=False):
        """(merged outputs, mean loss, mean metrics) of a batch run through the stages."""
        stages = self.make_stages(jit_compile)
        size = tf.nest.flatten(inputs_batch)[0].shape[0]
        num_micro = math.gcd(self.options.num_microbatches, size)
        outputs, (loss, metrics) = schedules.run_forward(
            stages, split_microbatches(inputs_batch, num_micro))
        return outputs, loss, metrics

    # ---- data parallel -----------------------------------------------------------------------
    def all_reduce_gradients(self, grads):
        """Average each stage's gradients over the replicas holding that stage."""
        if self.grid is None:
            return grads
        scale = self._loss_scale()
        if scale is not None:  # average unscaled values (float16 on the wire cannot hold them)
            grads = [g / tf.cast(scale, g.dtype) for g in grads]
        out = list(grads)
        for stage in range(len(self.plan)):
            index = [i for i, owner in enumerate(self._owner) if owner == stage]
            if index:
                with tf.device(self.devices[stage]):
                    averaged = self.grid.average_stage_gradients(stage, [grads[i] for i in index])
                for i, g in zip(index, averaged):
                    out[i] = g
        if scale is not None:
            out = [g * tf.cast(scale, g.dtype) for g in out]
        return out

    def _loss_scale(self):
        if self._scale_loss is None:
            return None
        one = tf.constant(1.0)
        scale = tf.convert_to_tensor(self._scale_loss(one))
        return None if scale is one or tf.get_static_value(scale) == 1.0 else scale

    def all_reduce_mean(self, values):
        return self.grid.average_values(values) if self.grid else values

    def all_gather(self, values):
        return self.grid.gather_values(values) if self.grid else values

    def broadcast_variables(self, variables):
        if self.grid is not None:
            self.grid.broadcast(variables)
