"""The Horovod backends of tensor-parallel and ZeRO fine-tuning (see finetune_parallel): the
pretraining strategies, driven by a fine-tuning command's own training step
(tfbig.distribute.finetune.train_step), writing one single-device checkpoint from the chief."""
import math
import types

import keras
import tensorflow as tf

from tfbig.distribute import recompute
from tfbig.distribute.tensor_parallel import TensorParallelStrategy
from tfbig.distribute.tensor_zero import TensorZeroStrategy
from tfbig.distribute.zero import ZeroStrategy


def _static_shapes(grads, variables):
    """A word-table gradient made dense outside the forward/backward's graph has no static
    shape; ZeRO's slicing needs it."""
    return [tf.ensure_shape(g, v.shape) for g, v in zip(grads, variables)]


class _ChiefWritesWhole:
    """Fine-tuning output: the chief writes one single-device checkpoint, whatever the layout."""

    def checkpoint_dir(self, model_dir):
        return model_dir if self.is_chief else None

    def after_checkpoint(self, directory):
        """No layout file: the checkpoint is a single-device one."""

    def assembled_model(self, model):
        """On the chief, a single-device model of `model`'s class holding the whole weights
        (gather_full: the tensor group's slices joined, ZeRO-3's partition group's slices
        gathered); `model` on the other ranks. A collective: every rank calls it."""
        held = [v for v in model.variables if "seed_generator" not in v.path]
        values = self.gather_full(held)  # Horovod: all-gather over the tensor/partition group
        if not self.is_chief:
            return model
        full = type(model).from_config(model.get_config())
        full.build()
        by_path = {v.path: v for v in full.variables}
        for variable, value in zip(held, values):
            by_path[variable.path].assign(value)
        return full


class _SplitModel:
    """What a tensor-parallel backend needs from a fine-tuning command's step."""

    compiles_forward_backward = False  # the collectives run inside the forward and backward

    def build_optimizer(self, train, variables):
        self._variables = list(variables)  # tfbig-squad leaves the unused pooler out
        return super().build_optimizer(train, variables)

    @property
    def _trainable(self):
        """What the gradients are of (sequence-parallel sums and norms pair them by position)."""
        return getattr(self, "_variables", None) or self._model.trainable_variables


class TensorParallelFineTune(_ChiefWritesWhole, _SplitModel, TensorParallelStrategy):
    """--tensor_parallel for tfbig-classify / tfbig-squad: the backbone split by its plan
    (tensor_layout.PLANS), the task head replicated."""


class TensorZeroFineTune(_ChiefWritesWhole, _SplitModel, TensorZeroStrategy):
    """--tensor_parallel with --zero_stage=1: each tensor rank's optimizer state sharded over
    its partition group (tfbig.distribute.tensor_zero; fp32)."""

    def all_reduce_gradients(self, grads):
        return super().all_reduce_gradients(_static_shapes(grads, self.model_variables))


class ZeroFineTune(_ChiefWritesWhole, ZeroStrategy):
    """--zero_stage=1|2|3 for tfbig-classify / tfbig-squad (one micro-batch per step).

    Stage 3 starts from the command's single-device model (its backbone restored from
    --init_checkpoint, its head initialised): each rank keeps its slices of it and drops it,
    so the parameters are whole once per rank at the start (a model fine-tuned here is one a
    device holds: tfbig-train's stage 3 avoids even that with deferred initialisation). The
    model trained is its unmaterialised twin, gathered per layer (zero3.PLANS: the backbone
    as in pretraining, the task head one more gathered layer). Weights the command does not
    train (tfbig-squad's pooler: the backbone still runs it) keep frozen slices
    (`frozen_variables`: the model variables they are slices of)."""

    def build_model(self, task):
        if self.stage < 3:
            return super().build_model(task)
        full = task.build_model()  # the single-device model: restored, head initialised
        twin = types.SimpleNamespace(build_model=lambda: _twin(full))
        model = super().build_model(twin)  # values-free, its layers gathered (zero3)
        values = {v.path: v for v in full.trainable_variables}
        self._initialisers = {id(v): _constant(values[v.path]) for v in model.trainable_variables}
        for v, source in zip(recompute.seed_states(model), recompute.seed_states(full),
                             strict=True):  # dropout states by position (names differ)
            v.assign(source.value)
        return model

    def build_optimizer(self, train, variables):
        optimizer = super().build_optimizer(train, variables)
        self.frozen_variables = []
        if self.stage == 3:  # slices of the weights the optimizer does not update
            for v in self._model.trainable_variables:
                if id(v) not in self._shard_of:
                    self.frozen_variables.append(v)
                    self._shard_of[id(v)] = keras.Variable(
                        self._initial_slice(v), dtype="float32", trainable=False,
                        autocast=False, name=v.path.replace("/", "__") + "__zero_frozen")
            self._initialisers = {}  # the single-device model's values are freed
        return optimizer

    def state_bytes(self):
        held = super().state_bytes()
        if getattr(self, "frozen_variables", None):
            slices = [self._shard_of[id(v)] for v in self.frozen_variables]
            held["frozen_slices"] = sum(math.prod(s.shape) * 4 for s in slices)
        return held

    def broadcast_variables(self, variables):
        """Stage 3: the frozen weights hold no value either (every rank cut its own slices)."""
        frozen = {id(v) for v in getattr(self, "frozen_variables", [])}
        super().broadcast_variables([v for v in variables if id(v) not in frozen])

    def assembled_model(self, model):
        """Stages 1-2: `model` (every rank holds the whole parameters); stage 3 gathers."""
        return model if self.stage < 3 else super().assembled_model(model)

    def all_reduce_gradients(self, grads):
        """Stage 1: the command's step gives full gradients (reduce-scattered by the parent);
        stages 2-3: its forward/backward (the strategy's make_forward_backward, one
        micro-batch) already gave this rank's slices."""
        if self.stage == 1:
            grads = _static_shapes(grads, self.model_variables)
        return super().all_reduce_gradients(grads)


def _twin(model):
    """A model of `model`'s class and config (the same variable paths), built."""
    twin = type(model).from_config(model.get_config())
    twin.build()
    return twin


def _constant(variable):
    """An initialiser (zero3.initial_slice's) returning `variable`'s value."""
    return lambda shape, dtype=None: variable.value
