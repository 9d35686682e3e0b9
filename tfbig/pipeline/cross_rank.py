"""Pipeline stages on different Horovod ranks: `--strategy=horovod --pipeline_stages=K`.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.cross_rank).
"""
import math

import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.config import pipeline_stages
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.mesh import HorovodMesh, Mesh, launcher_world_size
from tfbig.layouts import composition, stage_checkpoint
from tfbig.layouts import partition as partition_lib
from tfbig.pipeline import schedules
from tfbig.pipeline.schedules import run_stage
from tfbig.pipeline.stage_model import build_stage_model, every_weight
from tfbig.pipeline.stages import Stage
from tfbig.pipeline.strategy import (microbatch_size, split_microbatches, stage_memory,
                                     task_layer_specs)
from tfbig.pipeline.transport import StageLink, boundary_specs, runtime_zero, unfoldable

def pipeline_mesh(cfg, world_size):
    """The data x pipeline x context x tensor grid of a cross-rank pipeline run (stages split
    over T tensor ranks: tfbig.pipeline.tensor_stage; their optimizer state over their data
    ranks: tfbig.pipeline.zero_stage; their sequences over C context ranks); refuses what is
    not built."""
    stages = pipeline_stages(cfg)
    composition.check(composition.values_of(cfg))  # the pairs that do not compose
    if cfg.pipeline.offload_activations:
        raise ValueError(f"--pipeline_stages={stages} with --offload_activations is not "
                         f"supported by --strategy=horovod yet (stages on different ranks "
                         f"keep their activations on the device); drop one of the two")
    parallel = cfg.parallel
    if parallel.sequence_parallel and parallel.tensor_parallel < 2:
        raise ValueError(f"--pipeline_stages={stages} with --sequence_parallel=True needs "
                         f"--tensor_parallel >= 2 (each stage's LayerNorm and dropout regions "
                         f"split along the sequence over its tensor group); this run has "
                         f"--tensor_parallel={parallel.tensor_parallel}: drop "
                         f"--sequence_parallel or set --tensor_parallel")
    if cfg.pipeline.num_microbatches < 1:
        raise ValueError(f"--num_microbatches={cfg.pipeline.num_microbatches}: expected >= 1")
    if parallel.shard_degree and not parallel.zero_stage:
        raise ValueError(f"--shard_degree={parallel.shard_degree} needs --zero_stage=1 (the "
                         f"size of the groups sharding a stage's optimizer state)")
    return Mesh.build(world_size, tensor=parallel.tensor_parallel, pipeline=stages,
                      shard_degree=parallel.shard_degree, placement=parallel.placement,
                      context=parallel.context_parallel, expert=parallel.expert_parallel)


def stage_plan(task, pipeline, num_stages):
    """(LayerSpecs, StagePlans) of `task`'s model cut into `num_stages` (errors name flags)."""
    specs = task_layer_specs(task)  # a fine-tuning head's own, like --strategy=pipeline's
    return specs, partition_lib.partition(specs, num_stages, pipeline.stage_boundaries,
                                          pipeline.pipeline_balance)


def clipping_class(cls, sum_over_stages, counted, more_squares=None):
    """`cls` whose global-norm clipping sums the squares of the weights each stage owns
    (`counted`, in the optimizer's variable order) over the stages; `more_squares(grads)`
    adds those of the weights counted another way (an expert-parallel stage's experts, summed
    over their expert group)."""
    class PipelineStage(cls):
        def _clip_gradients(self, grads):
            if not (self.global_clipnorm and self.global_clipnorm > 0):
                return super()._clip_gradients(grads)
            squares = [tf.reduce_sum(tf.square(g)) for g, c in zip(grads, counted) if c]
            local = tf.add_n(squares) if squares else tf.constant(0.0)
            if more_squares is not None:
                local = local + more_squares(grads)
            norm = tf.sqrt(sum_over_stages(local))  # keras' clip_by_global_norm formula
            scale = self.global_clipnorm * tf.minimum(1.0 / norm, 1.0 / self.global_clipnorm)
            return [g * (scale + (norm - norm)) for g in grads]

    PipelineStage.__name__ = f"PipelineStage{cls.__name__}"
    return PipelineStage


class CrossRankPipeline(HorovodStrategy):
    """Data parallel x pipeline, one stage per Horovod rank (see the module docstring)."""

    name = "horovod"
    compiled_step = None  # the global norm sums over the stages (Horovod ops)
    whole_model = False  # each rank holds one stage: no text sample at the end

    def __init__(self, cfg, mesh=None):
        size = hvd.size() if hvd.is_initialized() else launcher_world_size()
        mesh = mesh or HorovodMesh(pipeline_mesh(cfg, size),  # Horovod: init with the sets
                                   thread_policy=cfg.horovod.hvd_thread_policy)
        super().__init__(cfg, mesh)
        self.pipeline = cfg.pipeline
        self.num_stages = self.mesh.mesh.pipeline
        self.stage_index = self.mesh.coords["pipeline"]
        self.pipeline_set = self.mesh.process_set("pipeline")
        self.model_set = self.mesh.process_set("model")  # global norms: pipeline x tensor
        self.ops = schedules.get_schedule(self.pipeline.schedule)(
            self.num_stages, self.pipeline.num_microbatches)[self.stage_index]
        self.device = "/GPU:0" if tf.config.list_physical_devices("GPU") else "/device:CPU:0"
        self.built = self.plan = self.specs = self.task = None
        self._norm = None

    @property
    def num_devices(self):
        return self.mesh.mesh.size

    # ---- model ---------------------------------------------------------------------------
    def build_model(self, task):
        """This rank's stage of `task`'s model (the others' weights are placeholders)."""
        self.specs, self.plan = stage_plan(task, self.pipeline, self.num_stages)
        micro = microbatch_size(self.cfg.train.batch_size // self.num_replicas,
                                self.pipeline.num_microbatches)
        self.built = self.build_stage(task)
        self.task = task
        if self.is_chief:
            print(self.describe(micro * task.seq_length), flush=True)
        return self.built.model

    def build_stage(self, task):
        """BuiltStage of this rank's stage (the placeholders and ownership of its weights)."""
        return build_stage_model(task, self.plan, self.specs, self.stage_index, self.device)

    def describe(self, micro_batch_tokens):
        """The rank grid, the schedule and which ranks hold which layers."""
        p = self.pipeline
        memory = stage_memory(self.task, self.plan, p, micro_batch_tokens,
                              self.cfg.train.precision)
        grid = self.mesh.mesh
        holders = [",".join(str(r) for r in range(grid.size)
                            if grid.coords(r)["pipeline"] == s.index) for s in self.plan]
        return (f"{self.mesh.mesh.describe()}\n"
                f"pipeline across ranks: {self.num_stages} stages, --schedule={p.schedule}, "
                f"{p.num_microbatches} micro-batches of {micro_batch_tokens} tokens, "
                f"{self.num_replicas} data-parallel replica(s); device = ranks holding it\n"
                + partition_lib.format_plan(self.plan, [f"ranks {h}" for h in holders], memory))

    def make_stage(self, jit_compile):
        s = self.plan[self.stage_index]
        return Stage(s.index, self.built.stage_layers, self.device, self.task, s.index == 0,
                     s.index == self.num_stages - 1, self.pipeline.activation_checkpointing,
                     jit_compile)

    def _specs(self, micro_batch):
        specs, metric_spec = boundary_specs(self.built.layers, self.plan, self.task, micro_batch)
        self.sent = specs  # for inspection: what stage k < K-1 sends (a chunk with SP or CP)
        return specs, metric_spec

    # ---- steps ---------------------------------------------------------------------------
    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        """batch -> (mean loss, this stage's gradients, mean metrics), the stages exchanging
        activations and gradients; `loss_fn` is not called (the last stage has the loss)."""
        return self._forward_backward(variables, scale_loss, jit_compile, timed=False)

    def make_timed_forward_backward(self, variables, scale_loss):
        """As make_forward_backward, the function also returning a (num_ops, 2) tensor of
        each op's wall-clock [start, end] on this rank (benchmarks/pipeline_cross_rank.py)."""
        return self._forward_backward(variables, scale_loss, False, timed=True)

    def _forward_backward(self, variables, scale_loss, jit_compile, timed):
        self._scale_loss = scale_loss
        self._counted = [self.counts(v) for v in variables]
        stage, link = self.make_stage(jit_compile), StageLink(
            self.mesh, self.stage_index, self.num_stages, "train")
        self.stage_ops = stage  # for inspection: peak_live
        num_micro = self.pipeline.num_microbatches

        def forward_backward(batch):
            micro_batches = split_microbatches(batch, num_micro, batch_axes=2)
            stage.begin_step(scale_loss, num_micro)
            link.begin(runtime_zero(micro_batches[0]))
            specs, metric_spec = self._specs(micro_batches[0])
            stamps = [] if timed else None
            results = run_stage(self.ops, stage, link, micro_batches, specs, stamps)
            grads = [stage.gradient_sums.get(id(v), tf.zeros(v.shape, tf.float32))
                     for v in variables]
            grads, summed = self._sum_shared(stage, variables, grads, link.zero)
            loss, metrics = self._share_metrics(results, metric_spec, link, summed)
            out = loss, grads, metrics
            return out + (tf.stack(stamps),) if timed else out

        return tf.function(forward_backward, autograph=False)

    def _share_metrics(self, results, metric_spec, link, summed):
        """The last stage's mean (loss, metrics) on every stage of the replica. The metrics,
        which the trainer reads, carry the zeros (`link.exchanges_done()`, `summed`) that make
        every exchange and the shared-gradient sum run on every rank."""
        if results:
            scale = 1.0 / len(results)
            ordered = [results[m] for m in sorted(results)]
            loss = tf.add_n([loss for loss, _ in ordered]) * scale
            metrics = {k: tf.add_n([m[k] for _, m in ordered]) * scale for k in metric_spec}
        else:  # zeros: the sum over the pipeline group is the last stage's
            loss = tf.constant(0.0)
            metrics = {k: tf.zeros(s.shape, tf.float32) for k, s in metric_spec.items()}
        keys = sorted(metrics)
        flat = tf.stack([tf.cast(loss, tf.float32)] + [tf.cast(metrics[k], tf.float32)
                                                       for k in keys])
        flat = flat + link.exchanges_done() + summed
        # Horovod: the last stage's values to every stage (the others add zeros).
        total = hvd.allreduce(unfoldable(flat, link.zero), op=hvd.Sum,
                              process_set=self.pipeline_set,
                              name="pipeline.train.metrics", ignore_name_scope=True)
        return total[0], {k: total[i + 1] for i, k in enumerate(keys)}

    def _sum_shared(self, stage, variables, grads, zero):
        """(gradients with those of weights used by several stages summed over the stages,
        a float32 zero computed from the sums: a rank holding none of them must still feed
        the all-reduce's result into an output, or Grappler drops it there)."""
        shared = self.built.shared
        if not shared:
            return grads, 0.0
        parts = [unfoldable(stage.gradient_sums.get(id(v), tf.zeros(v.shape, tf.float32)),
                            zero) for v in shared]
        # Horovod: one grouped all-reduce over the pipeline group (zeros from non-users).
        summed = hvd.grouped_allreduce(parts, op=hvd.Sum, process_set=self.pipeline_set,
                                       name="pipeline.train.shared", ignore_name_scope=True)
        by_id = {id(v): g for v, g in zip(shared, summed)}
        used = tf.add_n([tf.cast(tf.abs(tf.reshape(g, [-1])[0]) < -1.0, tf.float32)
                         for g in summed])
        return [by_id.get(id(v), g) for v, g in zip(variables, grads)], used

    def make_validation_step(self, task, model, jit_compile):
        """batch -> per-example validation outputs, computed on the last stage and summed
        over the pipeline group (the other stages add zeros), so every stage holds them."""
        stage, link = self.make_stage(jit_compile), StageLink(
            self.mesh, self.stage_index, self.num_stages, "validation")

        def validation_step(batch):
            size = tf.nest.flatten(batch)[0].shape[0]
            num_micro = math.gcd(self.pipeline.num_microbatches, size) if size else 1
            micro_batches = split_microbatches(batch, num_micro)
            stage.begin_step(None, num_micro)
            link.begin(runtime_zero(micro_batches[0]))
            specs, _ = self._specs(micro_batches[0])
            _, spec = boundary_specs(self.built.layers, self.plan, task, micro_batches[0],
                                     head=task.validation_outputs)
            parts = []
            for m, micro in enumerate(micro_batches):
                x = micro if stage.is_first else link.receive_forward(m, specs[stage.index - 1])
                out = stage.infer(x, micro)
                if stage.is_last:
                    parts.append(task.validation_outputs(out[0], micro))
                else:
                    link.send_forward(m, out)
            if parts:
                mine = tf.nest.map_structure(lambda *p: tf.concat(p, 0), *parts)
            else:
                mine = tf.nest.map_structure(
                    lambda s: tf.zeros([s.shape[0] * num_micro, *s.shape[1:]], s.dtype), spec)
            flat = [unfoldable(tf.cast(t, tf.float32), link.exchanges_done(), i + 1)
                    for i, t in enumerate(tf.nest.flatten(mine))]
            # Horovod: the last stage's outputs to every stage (the others add zeros).
            total = hvd.grouped_allreduce(flat, op=hvd.Sum, process_set=self.pipeline_set,
                                          name="pipeline.validation.outputs",
                                          ignore_name_scope=True)
            return tf.nest.pack_sequence_as(mine, total)

        return tf.function(validation_step, autograph=False)

    def all_reduce_gradients(self, grads):
        """Average over the stage's data group, then agree across stages on the norm,
        non-finite gradients and stop requests (one all-reduce of three scalars)."""
        return self._agree_over_stages(super().all_reduce_gradients(self._before_sync(grads)))

    def _before_sync(self, grads):  # a tensor-parallel stage's sequence-parallel sums
        return grads

    def _over_slices(self, x):  # ZeRO-1: summed over the partition group's slices
        return x

    def _local_norm(self, grads):
        """[squares of the counted gradients, non-finite values, stop request] of this rank."""
        squares = [tf.reduce_sum(tf.square(g)) for g, c in zip(grads, self._counted) if c]
        bad = [tf.reduce_sum(tf.cast(~tf.math.is_finite(g), tf.float32)) for g in grads]
        return tf.stack([tf.add_n(squares) if squares else tf.constant(0.0),
                         tf.add_n(bad) if bad else tf.constant(0.0),
                         self._stop_agreed.read_value()])

    def _agree_over_stages(self, grads):
        local = self._over_slices(self._local_norm(grads))
        total = hvd.allreduce(local, op=hvd.Sum, process_set=self.model_set,
                              name="pipeline.train.norm", ignore_name_scope=True)
        self._stop_agreed.assign(total[2])
        poison = tf.where(total[1] > 0, float("nan"), 0.0)  # every stage skips, or none
        self._norm = tf.sqrt(total[0]) + poison
        return [g + poison for g in grads]

    def counts(self, variable):  # in global norms: on its owner stage only (no tied copies)
        return id(variable) in self.built.owned

    def global_norm(self, grads):
        return self._norm  # from all_reduce_gradients: the whole model's, every stage

    def build_optimizer(self, train, variables):
        from tfbig.optim import build_optimizer

        return self._prepare_optimizer(build_optimizer(
            train, variables, adapt=self.clipping(variables), **self.norm_options(variables)))

    def clipping(self, variables, more_squares=None):
        """build_optimizer's `adapt`: global-norm clipping over the weights each stage owns
        (`variables` in the optimizer's order), their squares summed over the stages
        (`more_squares`: clipping_class's)."""
        counted = [self.counts(v) for v in variables]
        return lambda cls: clipping_class(cls, self._sum_over_stages, counted, more_squares)

    def _sum_over_stages(self, x):  # Horovod: the clipping norm's squares over the stages
        return hvd.allreduce(self._over_slices(x), op=hvd.Sum, process_set=self.model_set,
                             name="pipeline.train.clip", ignore_name_scope=True)

    def norm_options(self, variables):  # LAMB's per-variable norms: whole weights here
        return {}  # (a tensor-parallel stage sums its slices')

    # ---- checkpoints: each stage rank of data replica 0 writes its stage -------------------
    @property
    def restores_checkpoint(self):
        return self.rank == 0  # replica 0's stage ranks; the broadcast gives it to the rest

    def weight_pieces(self, model):  # and the other stages' weights, held by other ranks
        return every_weight(super().weight_pieces(model), model)

    def _stage_dir(self, model_dir):
        return piece_dir(model_dir, "pipeline", self.stage_index)

    def restore_dir(self, model_dir):
        stage_checkpoint.check_resume(model_dir, self.num_stages, zero=self.zero_layout)
        return self._stage_dir(model_dir)

    zero_layout = (0, 1)  # (--zero_stage, partition group size): the slots whole

    def checkpoint_dir(self, model_dir):
        return self._stage_dir(model_dir) if self.rank == 0 else None

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, stage_checkpoint.LAYOUT_FILE,
                         stage_checkpoint.layout(self.built.layers, self.plan))
