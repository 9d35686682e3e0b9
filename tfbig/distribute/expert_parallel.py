"""Expert parallelism on Horovod (`--expert_parallel=N`): each MoE layer's E experts split over
N data-parallel ranks, tokens sent to their experts and back by all-to-all, applied from outside.

The model declares its MoE layers (`layout().experts`, tfbig.models.layout; a user's model's
SparseMoE layers are found by type); this backend slices
each layer's expert weights to the E/N experts of this rank's place in its expert group and
replaces the layer's `dispatch` (tfbig.models.moe.SparseMoE) with `all_to_all_dispatch`. The
expert groups are consecutive data ranks (EP inside DP, tfbig.distribute.mesh): every rank
still reads its own slice of the batch and routes its own tokens; only the expert MLPs see rows
of the whole group.

Gradients (a data-parallel replica's loss is the mean of its own tokens; the step's loss is the
mean of the D replicas' losses):
    non-expert weights: averaged over the data axis, as HorovodStrategy;
    expert weights: the backward all-to-all already sums, on the rank holding an expert, the
        gradients of every loss of its expert group; summed over the expert-replica group and
        divided by D (= averaged over the replicas, divided by N).
The clipping norm sums the expert slices' squares over the expert group. Checkpoints: each rank
of the first expert group writes its experts (piece_dir(..., "expert", rank)); a run resumes
with the same --expert_parallel, or starts from a single-device checkpoint (a converted
Mixtral's, a consolidated run's), each rank cutting its experts and their slots from it.
"""
import math
import types

import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, read_layout, slot_owners, write_layout
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.tensor_collectives import all_reduce_sum
from tfbig.distribute.tensor_parallel import restore_from_single_device, skip_everywhere
from tfbig.layouts.tensor_layout import cut_pieces, replace_variable
from tfbig.layouts.tensor_plan import resolve_plan_layers
from tfbig.models.layout import layout_of
from tfbig.models.moe import SparseMoE

from tfbig.layouts import stage_checkpoint, tensor_layout, zero_checkpoint
from tfbig.layouts.expert_checkpoint import LAYOUT_FILE


def moe_layers(model, flag):
    """The MoE layers `model` declares (`layout().experts`), or, in a model that declares none
    (a user's Keras model), every tfbig.models.moe.SparseMoE layer it holds; refused by name
    when there are none."""
    paths = layout_of(model).experts
    layers = [layer for path in paths for layer in resolve_plan_layers(model, path)]
    if not paths:
        layers = [layer for layer in model._flatten_layers() if isinstance(layer, SparseMoE)]
    if not layers:
        raise ValueError(f"{flag}: {type(model).__name__} has no MoE layers (no "
                         f"tfbig.models.moe.SparseMoE layer, nor layout().experts); use "
                         f"--model=llama with --num_experts=E, an MoE preset (tiny-moe, "
                         f"mixtral-8x7b), or SparseMoE layers in your model")
    return layers


def all_to_all_dispatch(layer, process_set, size):
    """A `dispatch(rows, counts)` for MoE `layer` whose experts are split over an expert group
    of `size` ranks (rank r holds experts r*E/size..): rows grouped by expert go to the rank
    holding their expert, through its experts, and back in their order."""
    num_experts, local = layer.num_experts, layer.num_experts // size

    def dispatch(rows, counts):  # rows (M, C) grouped by expert; counts (E,)
        counts = tf.reshape(counts, (size, local))  # [destination rank, its expert]
        # Horovod: each rank's rows to the rank holding their expert; the counts with them
        received, received_splits = hvd.alltoall(rows, splits=tf.reduce_sum(counts, axis=1),
                                                 process_set=process_set)
        counts_in = hvd.alltoall(counts, process_set=process_set)  # [source rank, my expert]
        # Received rows are source-major; the experts take them grouped by expert.
        expert_of_row = tf.repeat(tf.tile(tf.range(local), [size]),
                                  tf.reshape(counts_in, [-1]))
        order = tf.argsort(expert_of_row, stable=True)
        out = layer.experts(tf.gather(received, order), tf.reduce_sum(counts_in, axis=0))
        out = tf.gather(out, tf.math.invert_permutation(order))
        back, _ = hvd.alltoall(out, splits=received_splits, process_set=process_set)
        return back  # Horovod: the outputs home again, in the order the rows left

    assert num_experts == local * size
    return dispatch


def split_experts(model, size, expert_rank, process_set, held=lambda layer: True):
    """Cut each MoE layer of `model` (those `held(layer)` says this rank holds: a pipeline
    stage's) to expert rank `expert_rank`'s E/size experts, dispatching through the expert
    group `process_set`; the paths of the cut variables."""
    flag, paths = f"--expert_parallel={size}", set()
    for layer in moe_layers(model, flag):
        if layer.num_experts % size:
            raise ValueError(f"{flag}: the {layer.num_experts} experts of {layer.path} do "
                             f"not split over {size} ranks; choose a divisor of "
                             f"{layer.num_experts}")
        if not held(layer):
            continue
        local = layer.num_experts // size
        first = expert_rank * local
        bank = layer.experts
        for variable in (bank.gate, bank.up, bank.down):
            replace_variable(bank, variable, variable.numpy()[first:first + local])
        bank.num_experts = local
        paths.update(v.path for v in (bank.gate, bank.up, bank.down))
        layer.dispatch = all_to_all_dispatch(layer, process_set, size)
    return paths


class ExpertParallelStrategy(HorovodStrategy):
    """Horovod data parallelism whose MoE layers' experts are split over expert groups."""

    whole_model = False  # each rank holds E/N experts: no text sample at the end

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.size = self.mesh.mesh.expert
        self.expert_set = self.mesh.process_set("expert")
        self.expert_replica_set = self.mesh.process_set("expert_replica")
        group = self.mesh.mesh.group("expert", self.mesh.rank)
        self.expert_rank = group.index(self.mesh.rank)
        self.skip_set = self.expert_set  # fp16: the ranks a non-finite gradient must reach
        self.expert_paths = set()  # paths of the variables this rank holds E/N experts of
        self._optimizer = None

    def build_model(self, task):
        """The task's model (with --activation_checkpointing its blocks recomputed, the
        all-to-alls included: every rank repeats them in the same order), each MoE layer
        holding this rank's experts and dispatching through the expert group."""
        model = super().build_model(task)
        self.expert_paths = split_experts(model, self.size, self.expert_rank, self.expert_set)
        self._model = model
        if self.is_chief:
            print(self.describe(model), flush=True)
        return model

    def describe(self, model):
        """The rank grid and which experts each rank holds (printed at the start of a run)."""
        return f"{self.mesh.mesh.describe()}\n{self._describe_experts(model)}"

    def _describe_experts(self, model):
        total = sum(math.prod(v.shape) for v in model.trainable_variables)
        experts = sum(math.prod(v.shape) for v in model.trainable_variables
                      if v.path in self.expert_paths)
        return (f"expert parallel: each expert group of "
                f"{self.size} ranks splits the experts, expert rank r holding experts "
                f"r*E/{self.size}..(r+1)*E/{self.size}-1 of every MoE layer ({experts:,} expert "
                f"and {total - experts:,} replicated parameters on this rank)")

    # ---- the step ----------------------------------------------------------------------------
    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        # Horovod ops have no XLA kernels: the all-to-alls sit inside the forward/backward.
        return super().make_forward_backward(loss_fn, variables, scale_loss, False)

    def make_validation_step(self, task, model, jit_compile):
        return super().make_validation_step(task, model, False)

    def _is_expert(self):
        return [v.path in self.expert_paths for v in self._model.trainable_variables]

    def all_reduce_gradients(self, grads):
        """Non-expert gradients averaged over data (HorovodStrategy's, with its stop flag);
        expert gradients summed over the expert-replica group and divided by the data size.
        fp16: a non-finite value anywhere skips the step on every rank."""
        return self._sync_split(grads, super().all_reduce_gradients)

    def _sync_split(self, grads, sync_dense):
        """`sync_dense` of the non-expert gradients; the expert ones summed over the
        expert-replica group and divided by the data size; fp16: a non-finite value anywhere
        skips the step on every rank."""
        expert = self._is_expert()
        dense = iter(sync_dense([g for g, e in zip(grads, expert) if not e]))
        mine = [tf.convert_to_tensor(g) for g, e in zip(grads, expert) if e]
        if self.expert_replica_set is not None:  # Horovod: the same experts' gradients, summed
            mine = hvd.grouped_allreduce(mine, op=hvd.Sum, process_set=self.expert_replica_set)
        mine = iter([g / self.num_replicas for g in mine])
        grads = [next(mine) if e else next(dense) for e in expert]
        if self._loss_scale() is not None:
            grads = skip_everywhere(grads, self.skip_set)
        return grads

    def _sum_expert_squares(self, squares):
        return all_reduce_sum(squares, self.expert_set)

    def build_optimizer(self, train, variables):
        from tfbig.optim import build_optimizer

        replicated = [v.path not in self.expert_paths for v in variables]
        self._optimizer = self._prepare_optimizer(build_optimizer(
            train, variables, sum_over_shards=self._sum_expert_squares, replicated=replicated))
        return self._optimizer

    def global_norm(self, grads):
        """The whole model's gradient norm: expert slices' squares summed over the group."""
        expert = self._is_expert()
        squares = [tf.reduce_sum(tf.square(g)) for g, e in zip(grads, expert) if e]
        others = [tf.reduce_sum(tf.square(g)) for g, e in zip(grads, expert) if not e]
        return tf.sqrt(self._sum_expert_squares(tf.add_n(squares)) + tf.add_n(others))

    def broadcast_variables(self, variables):
        """Non-expert state from the data axis's first rank; each rank's experts (weights and
        optimizer slots) from the rank of the first expert group holding the same experts."""
        owners = slot_owners(self._optimizer) if self._optimizer is not None else {}
        expert = [getattr(v, "path", None) in self.expert_paths
                  or owners.get(id(v)) in self.expert_paths
                  for v in variables]
        super().broadcast_variables([v for v, e in zip(variables, expert) if not e])
        root = self.mesh.mesh.group("expert_replica", self.mesh.rank)[0]
        from tfbig.distribute import horovod_keras

        horovod_keras.broadcast_variables([v for v, e in zip(variables, expert) if e],
                                          root_rank=root,
                                          process_set=self.expert_replica_set)

    def state_bytes(self):
        """Bytes of parameters this rank holds, its experts' and the replicated rest."""
        nbytes = lambda v: math.prod(v.shape) * np.dtype(v.dtype).itemsize  # noqa: E731
        variables = self._model.trainable_variables
        experts = sum(nbytes(v) for v in variables if v.path in self.expert_paths)
        total = sum(nbytes(v) for v in variables)
        return {"parameters": total, "expert_parameters": experts,
                "replicated_parameters": total - experts}

    def gather_full(self, variables, values=None):
        """[full numpy array] of each variable (or of `values`): expert slices gathered from
        the expert group in expert order; a collective, every rank of the group calls it."""
        out = []
        for i, v in enumerate(variables):
            value = tf.convert_to_tensor(v if values is None else values[i])
            if v.path in self.expert_paths and self.expert_set is not None:
                value = hvd.allgather(value, process_set=self.expert_set)  # Horovod
            out.append(value.numpy())
        return out

    # ---- checkpoints: each rank of the first expert group writes its experts ---------------
    def weight_pieces(self, model):
        experts = types.SimpleNamespace(rank=self.expert_rank, size=self.size)
        return cut_pieces(super().weight_pieces(model), model,
                          {p: (0, 1) for p in self.expert_paths}, experts)

    @property
    def restores_checkpoint(self):
        # the first expert group (of each tensor rank); the broadcast gives the rest
        return self.mesh.coords["data"] < self.size

    def checkpoint_dir(self, model_dir):
        return self._piece_dir(model_dir) if self.restores_checkpoint else None

    def _piece_dir(self, model_dir):
        return piece_dir(model_dir, "expert", self.expert_rank)

    def restore_dir(self, model_dir):
        """This rank's piece; `model_dir` itself for a single-device checkpoint (a converted
        one included: every rank of the first expert group cuts its experts from it)."""
        saved = read_layout(model_dir, LAYOUT_FILE)
        if saved is None:
            self._refuse_other_pieces(model_dir)
            return model_dir if tf.train.latest_checkpoint(model_dir) else piece_dir(
                model_dir, "expert", self.expert_rank)
        if zero_checkpoint.read_layout(model_dir) is not None:
            raise ValueError(f"--model_dir={model_dir} was written with --expert_parallel and "
                             f"--zero_stage (zero.json): its optimizer state is sliced over "
                             f"data ranks; resume it with the flags it was written with")
        if saved["expert_parallel"] != self.size:
            raise ValueError(f"--model_dir={model_dir} was written with --expert_parallel="
                             f"{saved['expert_parallel']}; this run has {self.size}: resume "
                             f"with the same degree")
        return piece_dir(model_dir, "expert", self.expert_rank)

    def _refuse_other_pieces(self, model_dir):
        """A checkpoint of per-rank pieces of another layout is not a single-device one."""
        for layouts, flag in ((zero_checkpoint, "--zero_stage"),
                              (tensor_layout, "--tensor_parallel"),
                              (stage_checkpoint, "--pipeline_stages")):
            if layouts.read_layout(model_dir) is not None:
                raise ValueError(
                    f"--model_dir={model_dir} was written with {flag} ({layouts.LAYOUT_FILE}): "
                    f"--expert_parallel={self.size} starts from a single-device checkpoint "
                    f"only; consolidate it into one first (python -m tfbig.commands."
                    f"consolidate {model_dir} OUT_DIR) or resume it with its own flags")

    def restore(self, trainer, path):
        """This rank's piece (its experts; the rest as every piece holds it), or its experts
        cut from a single-device checkpoint, the optimizer's slots with them."""
        if read_layout(trainer.cfg.train.model_dir, LAYOUT_FILE) is None:
            group = types.SimpleNamespace(rank=self.expert_rank, size=self.size)
            return restore_from_single_device(trainer, path, group,
                                              {p: (0, 1) for p in self.expert_paths},
                                              own_rng=False)
        trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, LAYOUT_FILE, {"expert_parallel": self.size,
                                                  "expert_variables": sorted(self.expert_paths)})
