"""Expert parallelism with tensor parallelism of the attention: `--expert_parallel=N
--tensor_parallel=T`.

Each data replica is a tensor group of T ranks splitting the attention heads and the vocabulary
(tfbig.distribute.tensor_parallel); an MoE model's MoE MLPs stay whole on the tensor ranks. The
expert groups are N data ranks of one tensor rank (tfbig.distribute.mesh): rank (d, t) holds
experts e*E/N.. of every MoE layer, e its place in its group, and exchanges the replica's tokens
with the ranks (d', t) of that group. Gradients: tensor slices and replicated weights as under
tensor parallelism, experts as under expert parallelism; norms sum each kind over its own
group; an fp16 overflow anywhere skips the step everywhere. Checkpoints: a piece per (tensor
rank, expert rank); a run resumes with the same degrees or starts from a single-device one.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.expert_tensor).
"""
import math
import types

import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, write_layout
from tfbig.distribute.expert_parallel import ExpertParallelStrategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.mesh import hvd_global_set
from tfbig.distribute.tensor_parallel import TensorParallelStrategy, restore_from_single_device
from tfbig.layouts import expert_checkpoint, stage_checkpoint, tensor_layout, zero_checkpoint
from tfbig.layouts.tensor_layout import join_slices


class ExpertTensorStrategy(ExpertParallelStrategy, TensorParallelStrategy):
    """Tensor groups splitting the attention, expert groups of one tensor rank each splitting
    the experts (see the module docstring). Method order: ExpertParallelStrategy's, which
    reach TensorParallelStrategy's through super() (the split model, its collectives, the
    data all-reduce); what needs both is here."""

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.skip_set = hvd_global_set() if self.mesh.mesh.size > 1 else None

    def describe(self, what):
        """TensorParallelStrategy's lines for the split model's config; the experts' line for
        the built model (each printed once, by the chief)."""
        if hasattr(what, "trainable_variables"):
            return self._describe_experts(what)
        return TensorParallelStrategy.describe(self, what)

    def _kinds(self, variables):
        """Per variable: 'expert', 'split' (a tensor slice) or 'whole'."""
        return ["expert" if v.path in self.expert_paths else
                "split" if v.path in self.splits else "whole" for v in variables]

    def _sums(self):
        return {"expert": self._sum_expert_squares, "split": self._sum_split_squares,
                "whole": lambda x: x}

    def build_optimizer(self, train, variables):
        from tfbig.optim import build_optimizer

        sums = self._sums()
        self._optimizer = self._prepare_optimizer(build_optimizer(
            train, variables, sum_for=[sums[k] for k in self._kinds(variables)]))
        return self._optimizer

    def global_norm(self, grads):
        """The whole model's gradient norm: each kind's squares summed over its own group."""
        kinds = self._kinds(self._model.trainable_variables)
        total = tf.constant(0.0)
        for kind, add in self._sums().items():
            squares = [tf.reduce_sum(tf.square(g)) for g, k in zip(grads, kinds) if k == kind]
            if squares:
                total = total + add(tf.add_n(squares))
        return tf.sqrt(total)

    def state_bytes(self):
        """Bytes of parameters this rank holds: its experts, its tensor slices, the rest."""
        nbytes = lambda v: math.prod(v.shape) * np.dtype(v.dtype).itemsize  # noqa: E731
        variables = self._model.trainable_variables
        held = {kind: 0 for kind in ("expert", "split", "whole")}
        for v, kind in zip(variables, self._kinds(variables)):
            held[kind] += nbytes(v)
        return {"parameters": sum(held.values()), "expert_parameters": held["expert"],
                "split_parameters": held["split"], "replicated_parameters": held["whole"]}

    def gather_full(self, variables, values=None):
        """[full numpy array] of each variable (or of `values`): experts gathered over the
        expert group, tensor slices joined over the tensor group; a collective."""
        out = []
        for i, (v, kind) in enumerate(zip(variables, self._kinds(variables))):
            value = tf.convert_to_tensor(v if values is None else values[i])
            if kind == "expert" and self.expert_set is not None:
                value = hvd.allgather(value, process_set=self.expert_set)  # Horovod
            elif kind == "split" and self.group.size > 1:
                parts = hvd.allgather(value[None], process_set=self.group.process_set)
                value = join_slices(list(parts.numpy()), *self.splits[v.path])
            out.append(np.asarray(value))
        return out

    # ---- checkpoints: one piece per (tensor rank, expert rank) --------------------------------
    def _piece_dir(self, model_dir):
        return piece_dir(piece_dir(model_dir, "tensor", self.group.rank), "expert",
                         self.expert_rank)

    def restore_dir(self, model_dir):
        """This rank's piece; `model_dir` itself for a single-device checkpoint."""
        saved = read_layout(model_dir, tensor_layout.LAYOUT_FILE)
        if saved is None:
            self._refuse_pieces(model_dir, (
                (expert_checkpoint, "--expert_parallel"), (zero_checkpoint, "--zero_stage"),
                (stage_checkpoint, "--pipeline_stages")))
            return model_dir if tf.train.latest_checkpoint(model_dir) else self._piece_dir(
                model_dir)
        experts = read_layout(model_dir, expert_checkpoint.LAYOUT_FILE)
        written = (saved["tensor_parallel"], experts["expert_parallel"] if experts else 1)
        sharded = zero_checkpoint.read_layout(model_dir) is not None
        if written != (self.group.size, self.size) or sharded:
            raise ValueError(
                f"--model_dir={model_dir} was written with --tensor_parallel={written[0]} "
                f"--expert_parallel={written[1]}" + (" --zero_stage" if sharded else "")
                + f"; this run has --tensor_parallel={self.group.size} --expert_parallel="
                  f"{self.size}: resume with the flags it was written with")
        return self._piece_dir(model_dir)

    def _refuse_pieces(self, model_dir, layouts):
        for layout, flag in layouts:
            if layout.read_layout(model_dir) is not None:
                raise ValueError(
                    f"--model_dir={model_dir} was written with {flag} ({layout.LAYOUT_FILE}) "
                    f"alone: --tensor_parallel={self.group.size} --expert_parallel={self.size}"
                    f" resumes its own pieces or starts from a single-device checkpoint; "
                    f"resume it with its own flags")

    def restore(self, trainer, path):
        """This rank's piece, or its tensor slices and experts (with their optimizer slots)
        cut from a single-device checkpoint."""
        if read_layout(trainer.cfg.train.model_dir, tensor_layout.LAYOUT_FILE) is not None:
            return trainer.checkpoint.restore(path).assert_existing_objects_matched()
        experts = types.SimpleNamespace(rank=self.expert_rank, size=self.size)
        splits = {**self.splits, **{p: (0, 1, experts) for p in self.expert_paths}}
        restore_from_single_device(trainer, path, self.group, splits)

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, tensor_layout.LAYOUT_FILE, self._layout())
            write_layout(directory, expert_checkpoint.LAYOUT_FILE, {
                "expert_parallel": self.size, "expert_variables": sorted(self.expert_paths)})

