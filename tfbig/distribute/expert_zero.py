"""Expert parallelism with ZeRO over the other weights: `--expert_parallel=N
--zero_stage=1|2|3 [--shard_degree=G]`.

Each MoE layer's experts are split over the expert groups as tfbig.distribute.expert_parallel
does; every other weight (attention, norms, routers, embeddings) is replicated over the data
axis and its optimizer state (stage 1: the float32 master copy and Adam/LAMB's moments; stage
2: the accumulated gradients too; stage 3: the weights themselves, gathered per layer by
tfbig.distribute.zero3) sliced over the ZeRO partition groups as tfbig.distribute.zero does.
A rank's own experts keep their state whole and are updated in place (stage 3 reads them as
they are inside the gathered layer, the all-to-alls recomputed with it). The clipping norm and
LAMB's trust ratios sum the slices' squares over the partition group and the experts' over the
expert group. Ranks 0..lcm(G, N)-1 write one checkpoint piece each; rank r restores piece
r mod lcm(G, N); a run resumes only its own layout.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.expert_zero).
"""
import math

import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, write_layout
from tfbig.distribute import zero3
from tfbig.distribute.expert_parallel import ExpertParallelStrategy
from tfbig.distribute.zero import ZeroStrategy
from tfbig.layouts import expert_checkpoint, zero_checkpoint


class ExpertZeroStrategy(ZeroStrategy, ExpertParallelStrategy):
    """ZeRO-1/2/3 over the non-expert weights of an expert-parallel run (module docstring).

    Method order: ZeroStrategy's, which reach ExpertParallelStrategy's through super() (the
    model with its experts split, the broadcast of each rank's experts); what needs both is
    here."""

    whole_model = False  # each rank holds E/N experts

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.pieces = math.lcm(self.num_shards, self.size)  # ranks writing a piece each

    # ---- stage 3: the replicated weights' slices gathered per layer, the experts whole ------
    def _unmaterialised_model(self, task):
        """Stage 3: the model with this rank's experts (held, whole), the other weights'
        values kept only to cut the slices."""
        model = ExpertParallelStrategy.build_model(self, task)
        return zero3.release_values(model, keep=lambda v: v.path in self.expert_paths)

    def _sliced(self, variable):
        return variable.path not in self.expert_paths

    # ---- the optimizer's variables: slices of the replicated weights, the experts whole ----
    def _new_shard(self, variable, value=None):
        if variable.path in self.expert_paths:
            return variable
        return super()._new_shard(variable, value)

    def _own_slice(self, variable):
        if variable.path in self.expert_paths:
            return tf.convert_to_tensor(variable)
        return super()._own_slice(variable)

    def _norm_options(self, variables):
        return dict(sum_over_shards=self._sum_over_partition,
                    replicated=[v.path in self.expert_paths for v in variables],
                    sum_replicated=self._sum_expert_squares)

    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        # Horovod ops have no XLA kernels: the all-to-alls sit inside the forward/backward.
        return super().make_forward_backward(loss_fn, variables, scale_loss, False)

    # ---- gradients -----------------------------------------------------------------------
    def _reduce_scatter(self, grads):
        """The non-expert gradients' slices (averaged over the partition group); the
        expert gradients whole."""
        expert = self._is_expert()
        dense = iter(self.partition.scatter(
            [g for g, e in zip(grads, expert) if not e],
            [v.shape for v, e in zip(self.model_variables, expert) if not e]))
        return [g if e else next(dense) for g, e in zip(grads, expert)]

    def all_reduce_gradients(self, grads):
        """Slices: ZeRO's 2-hop sync; experts: summed over the ranks holding the same ones."""
        grads = self._reduce_scatter(grads) if self.stage == 1 else grads
        return self._sync_split(grads, self._sync_slices)

    def global_norm(self, grads):
        expert = self._is_expert()
        squares = [tf.add_n([tf.reduce_sum(tf.square(g)) for g, e in zip(grads, expert)
                             if e == kind] or [tf.constant(0.0)]) for kind in (False, True)]
        return tf.sqrt(self._sum_over_partition(squares[0])
                       + self._sum_expert_squares(squares[1]))

    def apply_gradients(self, optimizer, grads, variables):
        optimizer.apply(grads, self.shards)  # an expert's shard is the expert variable
        if self.stage == 3:
            return  # the parameters are the slices (and the experts): gathered per layer
        expert = self._is_expert()
        self._assign_gathered([s for s, e in zip(self.shards, expert) if not e],
                              [v for v, e in zip(variables, expert) if not e])

    # ---- what a rank holds -----------------------------------------------------------------
    def state_bytes(self):
        """Bytes this rank holds: its parameters (experts and the replicated rest; stage 3: the
        experts only), the master slices of the replicated weights (stage 3: the weights) and
        the optimizer slots (the experts' whole)."""
        expert = self._is_expert()
        master = sum(math.prod(s.shape) * 4 for s, e in zip(self.shards, expert) if not e)
        # the parameters as the expert backend counts them (expert_tensor: its tensor slices
        # too), then ZeRO's slots and slices
        held = {**super(ZeroStrategy, self).state_bytes(), **super().state_bytes(),
                "master_slices": master}
        if self.stage == 3:  # the replicated weights are held as their slices only
            held["replicated_parameters"] = 0
        return held

    def gather_full(self, variables, values=None):
        """Full arrays of the model's variables (or of `values`: the non-expert ones' slices
        gathered over the partition group, the experts' over the expert group); stage 3's
        model variables hold no values: their slices are gathered."""
        if values is None and self.stage == 3:
            values = [self._shard_of[id(v)] for v in variables]
        if values is not None:
            expert = [v.path in self.expert_paths for v in variables]
            dense = iter(self.partition.gather(
                [x for x, e in zip(values, expert) if not e],
                [v.shape for v, e in zip(variables, expert) if not e]))
            values = [x if e else next(dense) for x, e in zip(values, expert)]
        # the expert backend's gather (expert_tensor: the tensor slices joined too)
        return super(ZeroStrategy, self).gather_full(variables, values)

    # ---- checkpoints: ranks 0..L-1 write a piece each; rank r restores piece r mod L --------
    @property
    def checkpoint_pieces(self):
        return self.pieces

    def checkpoint_dir(self, model_dir):
        return piece_dir(model_dir, "expert", self.rank) if self.rank < self.pieces else None

    def restore_dir(self, model_dir):
        self._check_saved(model_dir)
        return piece_dir(model_dir, "expert", self.rank % self.pieces)

    def restore(self, trainer, path):
        return trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def _layout(self):
        return {**super()._layout(), "expert_parallel": self.size}

    def _check_saved(self, model_dir):
        """Refuse a checkpoint of another layout before anything is restored."""
        experts = read_layout(model_dir, expert_checkpoint.LAYOUT_FILE)
        zero = zero_checkpoint.read_layout(model_dir)
        if experts is None and zero is None and not tf.train.latest_checkpoint(model_dir):
            return  # a fresh run
        saved = (experts["expert_parallel"] if experts else 1,
                 zero["shard_degree"] if zero else 1, zero["zero_stage"] if zero else 0)
        if saved[:2] != (self.size, self.num_shards) or (saved[2] == 3) != (self.stage == 3) \
                or saved[2] not in (1, 2, 3):
            raise ValueError(
                f"--model_dir={model_dir} holds a checkpoint of --expert_parallel={saved[0]} "
                f"--zero_stage={saved[2]} --shard_degree={saved[1]}; --expert_parallel="
                f"{self.size} --zero_stage={self.stage} --shard_degree={self.num_shards} "
                f"resumes only its own layout (the same expert groups and partition groups; "
                f"stages 1 and 2 save the same pieces): use a new --model_dir or the flags it "
                f"was written with")

    def after_checkpoint(self, directory):
        ExpertParallelStrategy.after_checkpoint(self, directory)  # expert.json
        if self.is_chief:
            write_layout(directory, zero_checkpoint.LAYOUT_FILE, self._layout())
