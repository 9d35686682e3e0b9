"""Expert, tensor and ZeRO parallelism together: `--expert_parallel=N --tensor_parallel=T
--zero_stage=1|2 [--shard_degree=G]` (Megatron's MoE recipe: experts over an expert axis, the
attention split over tensor ranks, a distributed optimizer).

Each data replica is a tensor group of T ranks splitting the attention heads and the vocabulary
(tfbig.distribute.tensor_parallel); the expert groups are N data ranks of one tensor rank
(tfbig.distribute.expert_tensor); the other weights of a tensor rank (its tensor slices and
what it holds whole) have their optimizer state (stage 1: the float32 master copy and Adam's
moments; stage 2: the accumulated gradients too) sliced over the ZeRO partition groups, G data
ranks of one tensor rank (tfbig.distribute.tensor_zero). A rank's own experts keep their state
whole and are updated in place (tfbig.distribute.expert_zero). Norms sum each kind over its
own groups: the experts' squares over the expert group, a tensor slice's over the partition
and the tensor group, the rest's over the partition group. Checkpoints: the data ranks
0..lcm(G, N)-1 of each tensor rank write a piece each; a rank restores piece d mod lcm(G, N)
of its tensor rank; a run resumes only its own layout. Stage 3 is not built with this pair.
"""
import math

import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, write_layout
from tfbig.distribute.expert_tensor import ExpertTensorStrategy
from tfbig.distribute.tensor_parallel import TensorParallelStrategy
from tfbig.distribute.zero import ZeroStrategy
from tfbig.layouts import expert_checkpoint, tensor_layout, zero_checkpoint


class ExpertTensorZeroStrategy(ZeroStrategy, ExpertTensorStrategy):
    """ZeRO-1/2 over each tensor rank's non-expert weights of an expert- and tensor-parallel
    run (module doc). Method order: ZeroStrategy's, which reach ExpertTensorStrategy's (and
    through it ExpertParallelStrategy's and TensorParallelStrategy's) by super(); what needs
    the three is here."""

    whole_model = False  # each rank holds E/N experts and 1/T of the split weights

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)  # stage 3: composition.REFUSED
        self.pieces = math.lcm(self.num_shards, self.size)  # data ranks writing a piece each

    # ---- the optimizer's variables: slices of the non-expert weights, the experts whole ----
    def _sliced(self, variable):
        return variable.path not in self.expert_paths

    def _new_shard(self, variable, value=None):
        if variable.path in self.expert_paths:
            return variable
        return super()._new_shard(variable, value)

    def _own_slice(self, variable):
        if variable.path in self.expert_paths:
            return tf.convert_to_tensor(variable)
        return super()._own_slice(variable)

    def _sums(self):
        return {"expert": self._sum_expert_squares,
                "split": lambda x: self._sum_split_squares(self._sum_over_partition(x)),
                "whole": self._sum_over_partition}

    def _norm_options(self, variables):
        sums = self._sums()
        return dict(sum_for=[sums[kind] for kind in self._kinds(variables)])

    # ---- gradients -----------------------------------------------------------------------
    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        # Horovod ops have no XLA kernels: the all-to-alls sit inside the forward/backward.
        return super().make_forward_backward(loss_fn, variables, scale_loss, False)

    def _reduce_scatter(self, grads):
        """The non-expert gradients' slices (averaged over the partition group); the expert
        gradients whole."""
        expert = self._is_expert()
        dense = iter(self.partition.scatter(
            [g for g, e in zip(grads, expert) if not e],
            [v.shape for v, e in zip(self.model_variables, expert) if not e]))
        return [g if e else next(dense) for g, e in zip(grads, expert)]

    def all_reduce_gradients(self, grads):
        """Slices: ZeRO's 2-hop sync; experts: summed over the ranks holding the same ones;
        fp16: a non-finite value anywhere skips the step on every rank (ExpertTensor's
        skip set is the world)."""
        grads = self._reduce_scatter(grads) if self.stage == 1 else grads
        return self._sync_split(grads, self._sync_slices)

    def global_norm(self, grads):
        kinds = self._kinds(self.model_variables)
        total = tf.constant(0.0)
        for kind, add in self._sums().items():
            squares = [tf.reduce_sum(tf.square(g)) for g, k in zip(grads, kinds) if k == kind]
            if squares:
                total = total + add(tf.add_n(squares))
        return tf.sqrt(total)

    def apply_gradients(self, optimizer, grads, variables):
        optimizer.apply(grads, self.shards)  # an expert's shard is the expert variable
        expert = self._is_expert()
        self._assign_gathered([s for s, e in zip(self.shards, expert) if not e],
                              [v for v, e in zip(variables, expert) if not e])

    # ---- what a rank holds -----------------------------------------------------------------
    def state_bytes(self):
        """Bytes this rank holds: its parameters (experts, tensor slices, the rest), the master
        slices of the non-expert weights and the optimizer slots (the experts' whole)."""
        expert = self._is_expert()
        master = sum(math.prod(s.shape) * 4 for s, e in zip(self.shards, expert) if not e)
        return {**ExpertTensorStrategy.state_bytes(self), **super().state_bytes(),
                "master_slices": master}

    def gather_full(self, variables, values=None):
        """Full arrays of the model's variables (or of `values`: the non-expert slices gathered
        over the partition group first); experts over the expert group, tensor slices joined
        over the tensor group."""
        if values is not None:
            expert = [v.path in self.expert_paths for v in variables]
            dense = iter(self.partition.gather(
                [x for x, e in zip(values, expert) if not e],
                [v.shape for v, e in zip(variables, expert) if not e]))
            values = [x if e else next(dense) for x, e in zip(values, expert)]
        return ExpertTensorStrategy.gather_full(self, variables, values)

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

    def restore(self, trainer, path):
        return trainer.checkpoint.restore(path).assert_existing_objects_matched()

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
