"""ZeRO stages 1-3 with MiCS partition groups on Horovod (`--zero_stage=1|2|3 --shard_degree=N`).

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.zero).
"""
import math

import keras
import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import model_key, piece_dir, write_layout
from tfbig.distribute import recompute, zero3
from tfbig.distribute.base import accumulate_gradients
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.distribute.horovod_keras import average_gradients, hvd
from tfbig.distribute.zero3 import Partition
from tfbig.layouts import zero_checkpoint
from tfbig.layouts.tensor_layout import then_cut
from tfbig.optim import build_optimizer, no_decay_variables, rebuild_optimizer

LAYOUT_FILE = zero_checkpoint.LAYOUT_FILE


class ZeroStrategy(HorovodStrategy):
    """Horovod data parallelism with the model state sharded over partition groups."""

    name = "horovod"
    compiled_step = None  # the update sums norms over the slices' ranks (Horovod ops)
    keeps_initial_values = False  # stage 3: each variable's initialiser, after its slice is cut
    restored_from = None  # the checkpoint this rank's slices were restored from

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        if self.options.hvd_fp16_allreduce:
            raise ValueError("--hvd_fp16_allreduce is not supported with --zero_stage: the "
                             "sharded path reduce-scatters float32 gradients")
        self.stage = self.parallel.zero_stage
        self._lay_out_partition()
        self._shard_of = {}  # stage 3: id(model variable) -> its slice variable

    # ---- the layout ----------------------------------------------------------------------
    def _lay_out_partition(self):
        """This rank's partition and replica groups on `self.mesh` (again after elastic
        Horovod changed the world)."""
        self.partition_set = self.mesh.process_set("partition")
        self.replica_set = self.mesh.process_set("replica")
        self.num_shards = self.mesh.mesh.shard_degree
        self.shard_index = self.partition_set.rank() if self.partition_set else 0
        replicas = self.mesh.mesh.group("replica", self.mesh.rank)
        self.replica_index = replicas.index(self.mesh.rank)
        place = (self.partition_set, self.num_shards, self.shard_index)
        if getattr(self, "partition", None) is None:
            self.partition = Partition(*place)
        else:  # stage 3: the model's gathers hold this one
            self.partition.__init__(*place)

    def _own_slice(self, variable):
        return self.partition.own(variable, variable.shape)

    def state_bytes(self):
        """{name: bytes} of the model state this rank holds (model, master slices, slots):
        the bytes of the values its variables hold (a stage-3 model variable holds none)."""
        nbytes = lambda vs: sum(  # noqa: E731
            0 if getattr(v, "_value", True) is None  # Keras: never given a value
            else math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in vs)
        slots = [v for kind in self._slot_kinds() for v in kind]
        return {"parameters": nbytes(self.model_variables), "master_slices": nbytes(self.shards),
                "optimizer_slots": nbytes(slots)}

    def gather_full(self, variables, values=None):
        """[full numpy array] of each model variable (or of `values`: slices with stage 3,
        full otherwise); a collective of the partition group with stage 3."""
        if self.stage < 3:
            return [np.asarray(v) for v in (values if values is not None else variables)]
        slices = values if values is not None else [self._shard_of[id(v)] for v in variables]
        return [t.numpy() for t in self.partition.gather(slices, [v.shape for v in variables])]

    # ---- stage 3: the model without values, gathered per layer ---------------------------
    def build_model(self, task):
        if self.stage < 3:
            self._model = super().build_model(task)
            return self._model
        memory = getattr(self.cfg, "pipeline", None)
        offload = bool(memory and memory.offload_activations)
        recompute.check_offload(offload, False)
        # Stage 3 recomputes every gathered layer (zero3.py): --activation_checkpointing is
        # implied, --offload_activations keeps the saved layer inputs on the host.
        model, self._initialisers = self._unmaterialised_model(task)
        blocks = task.blocks(model) if hasattr(task, "blocks") else None  # a user task's
        whole = frozenset(id(v) for v in model.trainable_variables if not self._sliced(v))
        zero3.Gatherer(self.partition, self._shard_of, offload, whole).install(model, blocks)
        self._model = model
        return model

    def _unmaterialised_model(self, task):
        """(the task's model, its trainable variables holding no value; {id: initialiser})."""
        return zero3.build_unmaterialised(task)

    def _sliced(self, variable):
        """Whether `variable` is sliced over the partition group (expert_zero keeps a rank's
        experts whole: stage 3 reads them as they are)."""
        return True

    # ---- optimizer over the slices -------------------------------------------------------
    def build_optimizer(self, train, variables):
        self.model_variables = list(variables)
        self._set_shards([self._new_shard(v) for v in variables])
        for v in variables if self.stage == 3 and not self.keeps_initial_values else ():
            self._initialisers.pop(id(v), None)  # sliced: a loaded value is freed
        self.optimizer = build_optimizer(train, self.shards, no_decay=self._no_decay_shards(),
                                         **self._norm_options(variables))
        return self.optimizer

    def _set_shards(self, shards):
        """`shards` (one per model variable, in order) as the slices the optimizer updates."""
        self.shards = shards
        self._shard_of.update({id(v): s for v, s in zip(self.model_variables, shards)})

    def _no_decay_shards(self):
        excluded = {id(v) for v in no_decay_variables(self.model_variables)}
        return [s for s, v in zip(self.shards, self.model_variables) if id(v) in excluded]

    @property
    def _slot_ids(self):
        return {id(v) for kind in self._slot_kinds() for v in kind}

    def _slot_kinds(self):
        """The optimizer's slots, one list per kind (Adam's and LAMB's m and v), each in the
        order of the slices."""
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        return [inner._momentums, inner._velocities]  # Keras Adam/LAMB slots

    # ---- a new world (elastic Horovod) ---------------------------------------------------
    def sliced_ids(self):
        """ids of the variables this rank holds slices in (the optimizer slots; with stage 3
        the model's trainable variables, which hold no value): laid out in each world."""
        return self._slot_ids | {id(v) for v in self.model_variables if self.stage == 3}

    def _sliced_kinds(self):
        return ([self.shards] if self.stage == 3 else []) + self._slot_kinds()

    def whole_slices(self):
        """[full float32 numpy value per model variable] of each kind of slice (stage 3: the
        parameters; the optimizer slots): the state as one device holds it (a collective of
        the partition group). From then on, no initial value is needed again."""
        shapes = [v.shape for v in self.model_variables]
        whole = [[t.numpy() for t in self.partition.gather(list(kind), shapes)]
                 for kind in self._sliced_kinds()]
        self._initialisers = {}
        return whole

    def lay_out_slices(self, whole=None):
        """This rank's slices on `self.mesh` (elastic Horovod: a new world): stages 1-2's
        master slices of the model variables' values and, given `whole` (`whole_slices()` of
        any world), the slices of its values. Slices of another size are new variables."""
        self._lay_out_partition()
        shapes = [v.shape for v in self.model_variables]
        if any(s.shape[0] != self.partition.slice_size(shape)
               for s, shape in zip(self.shards, shapes)):
            if whole is None and self.restored_from:
                raise RuntimeError(
                    f"the world changed to {self.mesh.mesh.size} ranks before its first "
                    f"elastic commit: the lost ranks' slices exist only in "
                    f"{self.restored_from}; start the job again (tfbig-launch --max_restarts "
                    f"does) to resume from it")
            fresh = whole is None and self.stage == 3  # a new run: its initialisers again
            self._set_shards([self._new_shard(v, None if fresh else np.zeros(
                self.partition.slice_size(v.shape), np.float32)) for v in self.model_variables])
            rebuild_optimizer(self.optimizer, self.shards, self._no_decay_shards())
        self._assign_master_slices()
        for kind, values in zip(self._sliced_kinds(), whole or ()):
            for piece, value, shape in zip(kind, values, shapes):
                piece.assign(self.partition.own(value, shape))

    def _new_shard(self, variable, value=None):
        """The float32 variable the optimizer updates for model variable `variable`: its
        slice (stages 1-2: the master copy; stage 3: the parameter itself)."""
        value = self._initial_slice(variable) if value is None else value
        return keras.Variable(value, dtype="float32", trainable=True,
                              autocast=self.stage < 3,  # gathered in float32
                              name=variable.path.replace("/", "__") + "__zero_slice")

    def _initial_slice(self, variable):
        if self.stage < 3:
            return self._own_slice(variable)
        return zero3.initial_slice(variable, self._initialisers[id(variable)], self.partition)

    def _norm_options(self, variables):
        """How the optimizer's norms see whole variables (tensor_zero adds the tensor group)."""
        return dict(sum_over_shards=self._sum_over_partition)

    def _sum_over_partition(self, value):
        if self.partition_set is None:
            return value
        return hvd.allreduce(value, op=hvd.Sum, process_set=self.partition_set)

    # ---- gradients ----------------------------------------------------------------------
    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        if self.stage == 1:
            return super().make_forward_backward(loss_fn, variables, scale_loss, jit_compile)
        self._scale_loss = scale_loss
        if self.stage == 3:  # gradients of the slices, reduce-scattered layer by layer inside
            variables, jit_compile, to_slices = self.shards, False, list
        else:
            to_slices = self._reduce_scatter
        micro_step = tf.function(
            lambda micro: accumulate_gradients(loss_fn, variables, micro, scale_loss),
            jit_compile=jit_compile, autograph=False)

        def forward_backward(batch):  # stages 2-3: accumulate into the slice, never in full
            num_micro = tf.nest.flatten(batch)[0].shape[0]
            loss_sum, slices, metric_sums = 0.0, None, None
            for i in range(num_micro):  # unrolled: the reduce-scatter cannot sit in XLA
                loss, grads, metrics = micro_step(tf.nest.map_structure(
                    lambda t: t[i:i + 1], batch))
                scattered = to_slices(grads)
                slices = scattered if slices is None else [a + g for a, g in
                                                            zip(slices, scattered)]
                loss_sum += loss
                metric_sums = metrics if metric_sums is None else {
                    k: metric_sums[k] + metrics[k] for k in metrics}
            scale = 1.0 / num_micro
            return (loss_sum * scale, [g * scale for g in slices],
                    {k: v * scale for k, v in metric_sums.items()})

        return tf.function(forward_backward, autograph=False)

    def make_validation_step(self, task, model, jit_compile):
        # Stage 3 gathers inside the forward: Horovod ops have no XLA kernels.
        return super().make_validation_step(task, model, jit_compile and self.stage < 3)

    def _reduce_scatter(self, grads):
        """Full-size gradients -> this rank's slices, averaged over the partition group."""
        # Horovod: one grouped reduce-scatter inside the partition group (hop 1).
        return self.partition.scatter(grads, [v.shape for v in self.model_variables])

    def all_reduce_gradients(self, grads):
        """Slices of the gradients averaged over all data-parallel ranks (2-hop sync)."""
        return self._sync_slices(self._reduce_scatter(grads) if self.stage == 1 else grads)

    def _sync_slices(self, slices):
        """Slices averaged over the replica groups; the stop request and a non-finite slice
        agreed over every rank (a non-finite one poisons every slice: the step is skipped)."""
        # Horovod: the slices averaged across the replica groups (hop 2).
        slices = average_gradients(slices, process_set=self.replica_set)
        nonfinite = tf.cast(tf.logical_not(tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(s)) for s in slices])), tf.float32)
        flags = tf.stack([self._stop_requested.read_value(), nonfinite])
        if self.process_set is not None:  # Horovod: agree on stop and skip over all ranks
            flags = hvd.allreduce(flags, op=hvd.Sum, process_set=self.process_set)
        self._stop_agreed.assign(flags[0])
        poison = tf.where(flags[1] > 0, tf.constant(float("nan")), 0.0)
        return [s + poison for s in slices]

    def global_norm(self, grads):
        squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
        return tf.sqrt(self._sum_over_partition(squares))

    def apply_gradients(self, optimizer, grads, variables):
        optimizer.apply(grads, self.shards)
        if self.stage == 3:
            return  # the parameters are the slices: gathered when a layer runs
        self._assign_gathered(self.shards, variables)

    def _assign_gathered(self, shards, variables):
        """Each of `variables` set to its updated slices in `shards`, gathered over the
        partition group."""
        values = [tf.convert_to_tensor(s.value) for s in shards]
        if self.partition_set is not None:  # Horovod: the updated slices, gathered
            values = hvd.grouped_allgather(values, process_set=self.partition_set)
        for variable, full in zip(variables, values):
            n = variable.shape.num_elements()
            variable.assign(tf.cast(tf.reshape(full[:n], variable.shape), variable.dtype))

    # ---- state: broadcast, checkpoints ---------------------------------------------------
    def broadcast_variables(self, variables):
        """Rank 0's parameters and counters to all; optimizer slots stay per slice."""
        self.check_one_step()
        held = self.sliced_ids()  # every rank made or restored its own slices
        super().broadcast_variables([v for v in variables if id(v) not in held])
        self._assign_master_slices()

    def _assign_master_slices(self):
        """Stages 1-2: each master slice from the model variable's (broadcast) value."""
        for shard, variable in zip(self.shards, self.model_variables if self.stage < 3 else ()):
            shard.assign(self._own_slice(variable))

    def check_one_step(self):
        """Raise unless every rank's slices are of one optimizer step (a collective)."""
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        if self.process_set is not None:  # every slice must come from the same step
            steps = hvd.allgather(tf.reshape(tf.cast(inner.iterations, tf.int64), [1]),
                                  process_set=self.process_set).numpy()
            if len(set(steps.tolist())) > 1:
                raise ValueError(f"the ZeRO slices restored by the ranks are from different "
                                 f"optimizer steps {steps.tolist()} (a save was cut short?); "
                                 f"remove the newer checkpoints so every shard directory's "
                                 f"newest one is of the same step")

    def held(self, variables):
        """Stage 3: each model variable's slice in its place (the model's hold no values)."""
        return [self._shard_of.get(id(v), v) if self.stage == 3 else v for v in variables]

    def checkpoint_model(self, model):
        """Stage 3: the slices, under the keys of the model variables they are slices of."""
        if self.stage < 3:
            return super().checkpoint_model(model)
        return {model_key(model, v): (self._shard_of[id(v)] if v.trainable else v).value
                for v in model.variables if "seed_generator" not in v.path}

    def weight_pieces(self, model):
        """Stage 3: each trainable weight's flat slice, held by its shard."""
        pieces = super().weight_pieces(model)
        for v in self.model_variables if self.stage == 3 else ():
            if not self._sliced(v):
                continue
            entry = pieces[model_key(model, v)]
            entry[0] = self._shard_of[id(v)]
            entry[1] = then_cut(entry[1], lambda full, v=v: self.partition.own(full, v.shape))
        return pieces

    @property
    def restores_checkpoint(self):
        return True  # every rank restores the optimizer slices of its position

    @property
    def checkpoint_pieces(self):
        return self.num_shards * super().checkpoint_pieces

    def _shard_dir(self, model_dir):
        return piece_dir(model_dir, "zero", self.shard_index)

    def restore_dir(self, model_dir):
        saved = self._check_layout(model_dir)
        self._resharding = None
        if saved is not None and not self._same_files(saved):
            self._resharding = (model_dir, saved)  # every piece is read: see zero_checkpoint
            return model_dir  # position 0's directory has the newest step
        return self._shard_dir(model_dir)

    def restore(self, trainer, path):
        self.restored_from = path
        if not getattr(self, "_resharding", None):
            return trainer.checkpoint.restore(path).assert_existing_objects_matched()
        model_dir, saved = self._resharding
        if self.is_chief:
            print(f"re-sharding {path}: saved as {saved}, loaded as {self._layout()}")
        return zero_checkpoint.restore_resharded(
            trainer.checkpoint, model_dir, saved, path, self._model, self.model_variables,
            self.optimizer, self.partition)

    def checkpoint_dir(self, model_dir):
        return self._shard_dir(model_dir) if self.replica_index == 0 else None

    def _layout(self):
        m = self.mesh.mesh
        return {"zero_stage": self.stage, "shard_degree": m.shard_degree, "data": m.data,
                "world_size": m.size}

    def _same_files(self, saved):
        """Whether a checkpoint saved with layout `saved` has this run's pieces (stages 1 and
        2 save the same; the number of replica groups does not change a piece)."""
        return (saved["shard_degree"] == self.num_shards and saved["zero_stage"] in (1, 2, 3)
                and (saved["zero_stage"] == 3) == (self.stage == 3))

    def _check_layout(self, model_dir):
        """The layout `model_dir`'s checkpoint was saved with (None: no checkpoint yet); a
        plain checkpoint counts as stage 0 over one piece."""
        saved = zero_checkpoint.read_layout(model_dir)
        if saved is not None and "expert_parallel" in saved:
            raise ValueError(f"--model_dir={model_dir} was written with --expert_parallel="
                             f"{saved['expert_parallel']} (zero.json): resume it with the "
                             f"flags it was written with")
        if saved is None and tf.train.latest_checkpoint(model_dir):
            return {"zero_stage": 0, "shard_degree": 1, "data": 1, "world_size": 1}
        return saved

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, LAYOUT_FILE, self._layout())

