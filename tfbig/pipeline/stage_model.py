"""One pipeline stage of a model, held alone by one process: what a cross-rank pipeline rank
builds, saves and updates.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.stage_model).
"""
import collections
import contextlib
import dataclasses

import tensorflow as tf

from tfbig.checkpoints.checkpoint import model_key
from tfbig.pipeline.layers import layer_sequence


class StageModel:
    """The variables one pipeline rank holds, under the model's name (what checkpoints key on).

    `model` is the whole Keras model object; its other stages' weights are empty placeholders.
    """

    def __init__(self, model, variables):
        self.model = model
        self.name = model.name
        self.config = getattr(model, "config", None)
        self.variables = variables

    @property
    def trainable_variables(self):
        return [v for v in self.variables if v.trainable]

    @property
    def non_trainable_variables(self):
        return [v for v in self.variables if not v.trainable]


def every_weight(pieces, stage):
    """`pieces` (Strategy.weight_pieces of StageModel `stage`) with the weights of the other
    stages, which no variable of this rank holds."""
    held = {id(v) for v in stage.variables}
    for v in stage.model.variables:
        if id(v) not in held and "seed_generator" not in v.path:
            pieces.setdefault(model_key(stage.model, v), [None, None, None])
    return pieces


def _contains(parts, path):
    """Whether name-scope components `parts` contain `path` ('embedding/token') in a row."""
    pattern = path.split("/")
    return any(parts[i:i + len(pattern)] == pattern for i in range(len(parts)))


def held_scopes(specs, plan, stage_index):
    """(scopes of every stage's layers, scopes this stage holds: its own and those it reads)."""
    every = [s for spec in specs for s in spec.scopes]
    stage = plan[stage_index]
    mine = [s for spec in specs[stage.start:stage.stop] for s in spec.scopes + spec.reads]
    return every, mine


@contextlib.contextmanager
def hold_only(every, mine, placeholders):
    """Variables created under a scope in `every` but none in `mine` become empty
    placeholders (their tf.Variable ids are added to the set `placeholders`)."""
    def creator(next_creator, **kwargs):
        parts = tf.get_current_name_scope().split("/")
        if any(_contains(parts, s) for s in mine) or not any(_contains(parts, s) for s in every):
            return next_creator(**kwargs)
        dtype = kwargs.get("dtype") or tf.float32
        kwargs.update(initial_value=tf.zeros([0], dtype), shape=tf.TensorShape([0]))
        variable = next_creator(**kwargs)
        placeholders.add(id(variable))
        return variable

    with tf.variable_creator_scope(creator):
        yield


@dataclasses.dataclass
class BuiltStage:
    """What building one stage gives: the held view and who uses which weight."""

    model: StageModel
    layers: list  # PipeLayers of the whole model (other stages' weights are placeholders)
    stage_layers: list  # this stage's PipeLayers
    owned: set  # ids of the trainable weights this stage owns
    shared: list  # trainable weights used by more than one stage (the same list on all ranks)


def build_stage_model(task, plan, specs, stage_index, device, build=None):
    """Build `task`'s model holding only stage `stage_index` of `plan` (on `device`).
    `build()` makes the model (default `task.build_model`; a tensor-parallel stage passes
    one building its tensor rank's slices: tfbig.pipeline.tensor_stage)."""
    every, mine = held_scopes(specs, plan, stage_index)
    placeholders = set()
    whole = getattr(task, "builds_whole_model", False)
    with tf.device(device), (contextlib.nullcontext() if whole else
                             hold_only(every, mine, placeholders)):
        model = (build or task.build_model)()
    if whole:  # a user task: its specs' scopes are weight paths; the others' are dropped
        every, mine = set(every), set(mine)
        placeholders = {id(v.value) for v in model.variables
                        if v.path in every and v.path not in mine}
    layers = layer_sequence(model, task)
    names = [layer.name for layer in layers]
    if names != [spec.name for spec in specs]:
        raise ValueError(f"tfbig/pipeline/layers.py: layer names {names} differ from the "
                         f"cost model's {[spec.name for spec in specs]}")
    stage = plan[stage_index]
    stage_layers = layers[stage.start:stage.stop]
    held = [v for v in model.variables if id(v.value) not in placeholders]
    _check_held(stage_layers, held, stage_index)
    users = collections.defaultdict(set)
    for s in plan:
        for layer in layers[s.start:s.stop]:
            for v in layer.variables:
                users[id(v)].add(s.index)
    owned = {id(v) for layer in stage_layers for m in layer.modules
             for v in m.trainable_variables}
    shared = [v for v in model.trainable_variables if len(users[id(v)]) > 1]
    return BuiltStage(StageModel(model, held), layers, stage_layers, owned, shared)


def _check_held(stage_layers, held, stage_index):
    ids = {id(v) for v in held}
    missing = [v.path for layer in stage_layers for v in layer.variables + layer.rng_state
               if id(v) not in ids]
    if missing:
        raise RuntimeError(f"stage {stage_index} uses {missing} but did not create them: the "
                           f"scopes/reads of its layers in tfbig/pipeline/layers.py do not "
                           f"match the model's name scopes")


def owners(layers, plan):
    """{variable path: index of the stage owning it} over the whole model."""
    return {v.path: s.index for s in plan for layer in layers[s.start:s.stop]
            for m in layer.modules for v in m.trainable_variables}
