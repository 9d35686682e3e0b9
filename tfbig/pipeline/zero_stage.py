"""ZeRO-1 inside pipeline stages on different ranks: `--strategy=horovod --pipeline_stages=K
--zero_stage=1 [--shard_degree=N] [--tensor_parallel=T]`, the optimizer state of each stage
(of each tensor slice of it) sharded over the stage's data ranks, in MiCS partition groups
of --shard_degree. The layout Megatron-LM trains its largest models with (its distributed
optimizer under pipeline and tensor parallelism), and the one tfbig-plan estimates for 175B.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.zero_stage).
"""
from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.distribute.zero import ZeroStrategy
from tfbig.layouts import zero_checkpoint

_CLASSES = {}


class ZeroStages:
    """Mixed in before ZeroStrategy and a cross-rank pipeline class by `with_zero`.

    Method order: ZeroStrategy's (the slices, their optimizer, the reduce-scatter and the
    all-gather of the update), which reach the pipeline's through super() (the stage model,
    its schedule); what needs both is here: the norms and the skip agreed over the stages,
    the clipping over slices and stages, the checkpoints per (stage, tensor rank, partition
    position)."""

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        if self.stage != 1:  # tfbig.layouts.composition refuses 2 and 3 first
            raise ValueError(f"--pipeline_stages with --zero_stage={self.stage}: expected 1")

    def describe(self, micro_batch_tokens):
        return (super().describe(micro_batch_tokens) + "\n"
                f"ZeRO-1 inside each stage: its optimizer slots and float32 master slices "
                f"sharded over partition groups of {self.num_shards} data rank(s) "
                f"{self.mesh.mesh.groups('partition')}; each rank holds 1/{self.num_shards} "
                f"of its stage's (tensor slice's) optimizer state")

    # ---- gradients and norms: the slices', summed over the partition group and the stages --
    def all_reduce_gradients(self, grads):
        """The pipeline's pre-sync sums, ZeRO's reduce-scatter and replica average, then the
        norm, the non-finite skip and the stop request agreed over the stages."""
        slices = ZeroStrategy.all_reduce_gradients(self, self._before_sync(grads))
        return self._agree_over_stages(slices)

    def _over_slices(self, x):
        return self._sum_over_partition(x)

    def global_norm(self, grads):
        return self._norm  # from all_reduce_gradients: over the slices and the stages

    def _norm_options(self, variables):
        """LAMB's per-variable norms over the partition group's slices (and a tensor-split
        weight's over its tensor group); global-norm clipping over the stages too."""
        pipeline = self.norm_options(variables)
        whole = pipeline.get("sum_over_shards", lambda x: x)
        return dict(sum_over_shards=lambda x: whole(self._sum_over_partition(x)),
                    replicated=pipeline.get("replicated"),
                    sum_replicated=self._sum_over_partition, adapt=self.clipping(variables))

    # ---- checkpoints: one directory per (stage, tensor rank, partition position) ----------
    @property
    def zero_layout(self):
        return self.stage, self.num_shards

    def _piece_dir(self, model_dir):
        return piece_dir(self._stage_dir(model_dir), "zero", self.shard_index)

    def checkpoint_dir(self, model_dir):  # replica group 0's ranks (MiCS: one copy a slice)
        return self._piece_dir(model_dir) if self.replica_index == 0 else None

    def restore_dir(self, model_dir):
        super(ZeroStrategy, self).restore_dir(model_dir)  # the pipeline's layout checks
        return self._piece_dir(model_dir)

    def restore(self, trainer, path):
        return trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def after_checkpoint(self, directory):
        super(ZeroStrategy, self).after_checkpoint(directory)  # the stages' layout
        if self.is_chief:
            write_layout(directory, zero_checkpoint.LAYOUT_FILE, ZeroStrategy._layout(self))


def with_zero(pipeline):
    """`pipeline` (CrossRankPipeline or TensorPipeline) with ZeRO-1 over each stage's data
    ranks (one class per pipeline class, made once)."""
    if pipeline not in _CLASSES:
        _CLASSES[pipeline] = type(f"Zero{pipeline.__name__}", (ZeroStages, ZeroStrategy,
                                                               pipeline),
                                  {"__doc__": f"{pipeline.__name__} with --zero_stage=1."})
    return _CLASSES[pipeline]
