"""Tensor parallelism with ZeRO: `--tensor_parallel=T --zero_stage=1|2|3 [--shard_degree=N]`.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.tensor_zero).
"""
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.distribute import zero3
from tfbig.distribute.tensor_parallel import TensorParallelStrategy
from tfbig.distribute.zero import ZeroStrategy
from tfbig.layouts import zero_checkpoint
from tfbig.layouts.tensor_layout import LAYOUT_FILE as TENSOR_LAYOUT
from tfbig.layouts.tensor_layout import read_layout as read_tensor_layout


class TensorZeroStrategy(ZeroStrategy, TensorParallelStrategy):
    """ZeRO-1/2/3 over each tensor rank's partition group (see the module docstring).

    Method order: ZeroStrategy's, which reach TensorParallelStrategy's through super() (the
    split model, its forward/backward); the norms, gradient sync, gathering and checkpoints
    that need both are here."""

    # ---- norms: slices over the partition group, split variables over the tensor group too -
    def _is_split(self, variables):
        return [v.path in self.splits for v in variables]

    def _norm_options(self, variables):
        split = self._is_split(variables)
        return dict(sum_over_shards=lambda x: self._sum_split_squares(
            self._sum_over_partition(x)), replicated=[not s for s in split],
            sum_replicated=self._sum_over_partition)

    def global_norm(self, grads):
        split = self._is_split(self.model_variables)
        squares = [[tf.reduce_sum(tf.square(g)) for g, s in zip(grads, split) if s == kind]
                   for kind in (True, False)]
        sums = tf.stack([tf.add_n(s) if s else tf.constant(0.0) for s in squares])
        sums = self._sum_over_partition(sums)  # one all-reduce for both kinds
        return tf.sqrt(self._sum_split_squares(sums[0]) + sums[1])

    # ---- gradients -----------------------------------------------------------------------
    def all_reduce_gradients(self, grads):
        """--sequence_parallel's sums over the tensor group, then ZeRO's 2-hop sync (a
        non-finite slice reaches its partition and replica groups), then fp16's skip over the
        tensor group (TensorParallelStrategy._skip_everywhere)."""
        grads = ZeroStrategy.all_reduce_gradients(self, self._sequence_sums(grads))
        return self._skip_everywhere(grads)

    # ---- stage 3: the tensor rank's slices gathered per layer -----------------------------
    def _unmaterialised_model(self, task):
        """Stage 3: this tensor rank's split model, its values kept only to cut the slices."""
        return zero3.release_values(self._split_model(task))

    def gather_full(self, variables, values=None):
        """Full arrays of the model's variables (or of gradient slices `values`): the slices
        gathered over the partition group, then the tensor ranks' pieces joined."""
        if values is None and self.stage == 3:  # the model's variables hold no values
            values = [self._shard_of[id(v)] for v in variables]
        if values is not None:
            values = self.partition.gather(values, [v.shape for v in variables])
        return TensorParallelStrategy.gather_full(self, variables, values)

    # ---- checkpoints: one directory per (tensor rank, partition position) ---------------
    def _piece_dir(self, model_dir):
        return piece_dir(piece_dir(model_dir, "tensor", self.group.rank), "zero",
                         self.shard_index)

    def checkpoint_dir(self, model_dir):
        return self._piece_dir(model_dir) if self.replica_index == 0 else None

    def restore_dir(self, model_dir):
        self._check_saved(model_dir)
        return self._piece_dir(model_dir)

    def restore(self, trainer, path):
        return trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def _check_saved(self, model_dir):
        """Refuse a checkpoint of another layout (this backend does not re-shard)."""
        tensor = read_tensor_layout(model_dir)
        zero = zero_checkpoint.read_layout(model_dir)
        if tensor is None and zero is None:
            if tf.train.latest_checkpoint(model_dir):
                raise ValueError(self._other_layout(model_dir, "a checkpoint without "
                                                               "--tensor_parallel/--zero_stage"))
            return
        saved_tensor = tensor["tensor_parallel"] if tensor else 1
        saved_zero = (zero["zero_stage"], zero["shard_degree"]) if zero else (0, 1)
        if (saved_tensor, *saved_zero) != (self.group.size, self.stage, self.num_shards):
            raise ValueError(self._other_layout(
                model_dir, f"a checkpoint of --tensor_parallel={saved_tensor} --zero_stage="
                           f"{saved_zero[0]} --shard_degree={saved_zero[1]}"))

    def _other_layout(self, model_dir, saved):
        return (f"--model_dir={model_dir} holds {saved}; --tensor_parallel={self.group.size} "
                f"--zero_stage={self.stage} --shard_degree={self.num_shards} resumes only its "
                f"own layout "
                f"(re-sharding across tensor ranks is not built): use a new --model_dir or "
                f"the flags it was written with")

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, TENSOR_LAYOUT, TensorParallelStrategy._layout(self))
            write_layout(directory, zero_checkpoint.LAYOUT_FILE, ZeroStrategy._layout(self))

