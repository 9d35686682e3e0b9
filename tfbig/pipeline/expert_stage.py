"""Expert parallelism inside pipeline stages on different ranks: `--strategy=horovod
--pipeline_stages=K --expert_parallel=N`.

Each stage's data ranks form expert groups of N (tfbig.distribute.mesh: consecutive data ranks
of one stage); rank (d, k) holds stage k's layers with e*E/N.. of the experts of each of its MoE
layers, e its place in its group, and sends its tokens to the ranks (d', k) of that group. The
routers' losses travel with the hidden states between stages (tfbig.pipeline.layers).

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.expert_stage).
"""
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, write_layout
from tfbig.distribute.expert_parallel import (ExpertParallelStrategy, moe_layers,
                                              split_experts)
from tfbig.distribute.expert_zero import ExpertZeroStrategy
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.layouts import expert_checkpoint, stage_checkpoint
from tfbig.layouts.tensor_layout import _held
from tfbig.pipeline.cross_rank import CrossRankPipeline, clipping_class
from tfbig.pipeline.stage_model import build_stage_model
from tfbig.pipeline.zero_stage import ZeroStages


class ExpertPipeline(ExpertParallelStrategy, CrossRankPipeline):
    """Data x pipeline with each stage's experts split over expert groups of its data ranks.

    Method order: ExpertParallelStrategy's (the expert groups, the expert gradients' sums, the
    experts' broadcast), then CrossRankPipeline's (the stage model, its schedule, the norm
    agreed over the stages); what needs both is here."""

    # ---- model ---------------------------------------------------------------------------
    def build_model(self, task):
        return CrossRankPipeline.build_model(self, task)

    def build_stage(self, task):
        """This stage's model, its MoE layers holding this rank's experts."""
        def build():
            model = task.build_model()
            # every stage's expert variables (expert.json lists them for the readers)
            self.every_expert_path = {v.path for layer in moe_layers(model, "--expert_parallel")
                                      for v in (layer.experts.gate, layer.experts.up,
                                                layer.experts.down)}
            self.expert_paths = split_experts(
                model, self.size, self.expert_rank, self.expert_set,
                held=lambda layer: _held(layer.experts.gate))
            return model

        built = build_stage_model(task, self.plan, self.specs, self.stage_index, self.device,
                                  build=build)
        self._model = built.model
        return built

    def describe(self, micro_batch_tokens):
        return (CrossRankPipeline.describe(self, micro_batch_tokens) + "\n"
                + self._describe_experts(self._model) + " of its stage")

    # ---- gradients and norms ---------------------------------------------------------------
    def all_reduce_gradients(self, grads):
        """The replicated weights' averaged over the stage's data ranks, the experts' summed
        over their expert-replica group (/ D); then the norm, non-finite gradients and stop
        requests agreed over the stages (the experts' over their expert group too)."""
        grads = self._sync_split(grads, lambda dense: HorovodStrategy.all_reduce_gradients(
            self, dense))
        return self._agree_over_stages(grads)

    def counts(self, variable):
        """The owner stage counts a weight in global norms once; its experts are counted
        apart, summed over their expert group first."""
        return (CrossRankPipeline.counts(self, variable)
                and variable.path not in self.expert_paths)

    def _local_norm(self, grads):
        """CrossRankPipeline's, with the experts' squares and every non-finite count summed
        over the expert group (its ranks hold the stage's other experts)."""
        local = CrossRankPipeline._local_norm(self, grads)
        group = self._sum_expert_squares(tf.stack([self._expert_squares(grads), local[1]]))
        return tf.stack([local[0] + group[0], group[1], local[2]])

    def _expert_squares(self, grads):
        """This rank's experts' squares (those of its stage), not yet summed over the group."""
        mine = [tf.reduce_sum(tf.square(g)) for g, e in zip(grads, self._is_expert()) if e]
        return tf.add_n(mine) if mine else tf.constant(0.0)

    def global_norm(self, grads):
        return CrossRankPipeline.global_norm(self, grads)

    def build_optimizer(self, train, variables):
        """LAMB's norms of an expert variable summed over its expert group; clipping over the
        stages, the experts' squares over their group first."""
        from tfbig.optim import build_optimizer

        replicated = [v.path not in self.expert_paths for v in variables]
        self._optimizer = self._prepare_optimizer(build_optimizer(
            train, variables, sum_over_shards=self._sum_expert_squares, replicated=replicated,
            adapt=self.clipping(variables, more_squares=lambda grads: self._sum_expert_squares(
                self._expert_squares(grads)))))
        return self._optimizer

    # ---- checkpoints: stage k, expert rank e of the first expert group writes its piece ---
    def _stage_dir(self, model_dir):
        return piece_dir(CrossRankPipeline._stage_dir(self, model_dir), "expert",
                         self.expert_rank)

    _piece_dir = _stage_dir

    def restore_dir(self, model_dir):
        stage_checkpoint.check_resume(model_dir, self.num_stages, zero=self.zero_layout)
        saved = read_layout(model_dir, expert_checkpoint.LAYOUT_FILE)
        if stage_checkpoint.read_layout(model_dir) is not None and (
                saved or {}).get("expert_parallel") != self.size:
            raise ValueError(f"--model_dir={model_dir} was written with --expert_parallel="
                             f"{(saved or {}).get('expert_parallel', 1)}; this run has "
                             f"{self.size}: resume with the flags it was written with")
        return self._stage_dir(model_dir)

    def restore(self, trainer, path):
        trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def after_checkpoint(self, directory):
        CrossRankPipeline.after_checkpoint(self, directory)
        if self.is_chief:
            write_layout(directory, expert_checkpoint.LAYOUT_FILE, {
                "expert_parallel": self.size,
                "expert_variables": sorted(self.every_expert_path)})


class ExpertZeroPipeline(ZeroStages, ExpertZeroStrategy, ExpertPipeline):
    """`--pipeline_stages=K --expert_parallel=N --zero_stage=1`: each stage's experts split
    over expert groups of its data ranks (ExpertPipeline), its other weights' optimizer state
    sharded over its partition groups (ExpertZeroStrategy: a rank's experts keep theirs whole).

    Method order: ZeroStages' (ZeRO-1 only, the norm agreed over the stages),
    ExpertZeroStrategy's (the slices of the non-expert weights, the experts' own sync),
    ExpertPipeline's (the stage model and its experts). Here: the norms, whose two kinds of
    squares sum over different groups (the slices over the partition group, the experts over
    the expert group) before the stages, and the pieces (one per data rank 0..L-1 of a
    stage, L = lcm(G, N), so that the first N are the expert readers' pieces)."""

    def all_reduce_gradients(self, grads):
        """ExpertZeroStrategy's sync (slices and experts), then the norm, non-finite gradients
        and stop requests agreed over the stages."""
        return self._agree_over_stages(
            ExpertZeroStrategy.all_reduce_gradients(self, self._before_sync(grads)))

    def _over_slices(self, x):  # each kind of squares is summed over its own group below
        return x

    def _local_norm(self, grads):
        """[the slices' squares over the partition group + the experts' over the expert group,
        non-finite values and stop requests over the partition group]."""
        local = self._sum_over_partition(CrossRankPipeline._local_norm(self, grads))
        experts = self._sum_expert_squares(self._expert_squares(grads))
        return tf.stack([local[0] + experts, local[1], local[2]])

    def clipping(self, variables, more_squares=None):
        """Global-norm clipping: the owned slices' squares summed over the partition group,
        the experts' over the expert group, then both over the stages."""
        counted = [self.counts(v) for v in variables]

        def squares(grads):
            owned = [tf.reduce_sum(tf.square(g)) for g, c in zip(grads, counted) if c]
            return (self._sum_over_partition(tf.add_n(owned) if owned else tf.constant(0.0))
                    + self._sum_expert_squares(self._expert_squares(grads)))

        return lambda cls: clipping_class(cls, self._sum_over_stages, [False] * len(variables),
                                          squares)

    # ---- checkpoints: data ranks 0..L-1 of each stage write a piece each (L = lcm(G, N)) --
    def _piece_dir(self, model_dir):
        """Stage k's piece d mod L (pipeline/stage-k/expert/rank-d): its experts, those of
        expert rank d mod N, and its slices, partition position d mod G (as
        ExpertZeroStrategy's pieces, per stage: the expert readers find pieces 0..N-1)."""
        return piece_dir(CrossRankPipeline._stage_dir(self, model_dir), "expert",
                         self.mesh.coords["data"] % self.pieces)

    def checkpoint_dir(self, model_dir):
        return self._piece_dir(model_dir) if self.mesh.coords["data"] < self.pieces else None

    def restore_dir(self, model_dir):
        ExpertPipeline.restore_dir(self, model_dir)  # the stages' and the experts' layouts
        return self._piece_dir(model_dir)
