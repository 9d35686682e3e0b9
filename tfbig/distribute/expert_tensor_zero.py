"""Expert, tensor and ZeRO parallelism together: `--expert_parallel=N --tensor_parallel=T
--zero_stage=1|2 [--shard_degree=G]` (Megatron's MoE recipe: experts over an expert axis, the
attention split over tensor ranks, a distributed optimizer).

Each data replica is a tensor group of T ranks splitting the attention heads and the vocabulary
(tfbig.distribute.tensor_parallel); the expert groups are N data ranks of one tensor rank
(tfbig.distribute.expert_tensor); the other weights of a tensor rank (its tensor slices and
what it holds whole) have their optimizer state (stage 1: the float32 master copy and Adam's
moments; stage 2: the accumulated gradients too) sliced over the ZeRO partition groups, G data
ranks of one tensor rank, and a rank's own experts keep theirs whole, as
tfbig.distribute.expert_zero does without tensor parallelism (its methods, reaching
ExpertTensorStrategy's by super()). Norms sum each kind over its own groups: the experts'
squares over the expert group, a tensor slice's over the partition and the tensor group, the
rest's over the partition group. Checkpoints: the data ranks 0..lcm(G, N)-1 of each tensor
rank write a piece each; a rank restores piece d mod lcm(G, N) of its tensor rank; a run
resumes only its own layout. Stage 3 is not built with this pair (composition.REFUSED).
"""
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, write_layout
from tfbig.distribute.expert_tensor import ExpertTensorStrategy
from tfbig.distribute.expert_zero import ExpertZeroStrategy
from tfbig.distribute.tensor_parallel import TensorParallelStrategy
from tfbig.distribute.zero import ZeroStrategy
from tfbig.layouts import expert_checkpoint, tensor_layout, zero_checkpoint


class ExpertTensorZeroStrategy(ExpertZeroStrategy, ExpertTensorStrategy):
    """ZeRO-1/2 over each tensor rank's non-expert weights of an expert- and tensor-parallel
    run (module doc). Method order: ExpertZeroStrategy's and ZeroStrategy's, which reach
    ExpertTensorStrategy's (and through it ExpertParallelStrategy's and
    TensorParallelStrategy's) by super(); the norms and checkpoints that need all three are
    here."""

    # ---- norms: three kinds of variable, each over its own groups --------------------------
    def _sums(self):
        return {"expert": self._sum_expert_squares,
                "split": lambda x: self._sum_split_squares(self._sum_over_partition(x)),
                "whole": self._sum_over_partition}

    def _norm_options(self, variables):
        sums = self._sums()
        return dict(sum_for=[sums[kind] for kind in self._kinds(variables)])

    global_norm = ExpertTensorStrategy.global_norm  # with these sums

    # ---- checkpoints: per tensor rank, data ranks 0..L-1 write a piece each ---------------
    @property
    def checkpoint_pieces(self):
        return self.pieces * self.group.size

    def _piece_dir(self, model_dir, data_rank=None):
        data_rank = self.mesh.coords["data"] if data_rank is None else data_rank
        return piece_dir(piece_dir(model_dir, "tensor", self.group.rank), "expert", data_rank)

    def checkpoint_dir(self, model_dir):
        return self._piece_dir(model_dir) if self.mesh.coords["data"] < self.pieces else None

    def restore_dir(self, model_dir):
        self._check_saved(model_dir)
        return self._piece_dir(model_dir, self.mesh.coords["data"] % self.pieces)

    def _layout(self):
        return {**ZeroStrategy._layout(self), "expert_parallel": self.size,
                "tensor_parallel": self.group.size}

    def _check_saved(self, model_dir):
        """Refuse a checkpoint of another layout before anything is restored."""
        zero = zero_checkpoint.read_layout(model_dir)
        if zero is None and read_layout(model_dir, tensor_layout.LAYOUT_FILE) is None \
                and not tf.train.latest_checkpoint(model_dir):
            return  # a fresh run
        ours = self._layout()
        keys = ("expert_parallel", "tensor_parallel", "shard_degree")
        if zero is None or any(zero.get(k) != ours[k] for k in keys) \
                or zero["zero_stage"] not in (1, 2):
            saved = ", ".join(f"--{k}={zero.get(k)}" for k in ("zero_stage", *keys)) \
                if zero else "another layout"
            raise ValueError(
                f"--model_dir={model_dir} holds a checkpoint of {saved}; --expert_parallel="
                f"{self.size} --tensor_parallel={self.group.size} --zero_stage={self.stage} "
                f"--shard_degree={self.num_shards} resumes only its own layout (stages 1 and "
                f"2 save the same pieces): use a new --model_dir or the flags it was written "
                f"with")

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, tensor_layout.LAYOUT_FILE,
                         TensorParallelStrategy._layout(self))
            write_layout(directory, expert_checkpoint.LAYOUT_FILE, {
                "expert_parallel": self.size, "expert_variables": sorted(self.expert_paths)})
            write_layout(directory, zero_checkpoint.LAYOUT_FILE, self._layout())
