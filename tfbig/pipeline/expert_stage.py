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
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.layouts import expert_checkpoint, stage_checkpoint
from tfbig.layouts.tensor_layout import _held
from tfbig.pipeline.cross_rank import CrossRankPipeline
from tfbig.pipeline.stage_model import build_stage_model


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
