"""Reading a ZeRO run's checkpoint under another layout: re-sharding on load, whole weights.

A ZeRO checkpoint (tfbig.distribute.zero) is one file per partition position j of the first
replica group (position 0 in MODEL_DIR, j in MODEL_DIR/zero/shard-j) and MODEL_DIR/zero.json
({"zero_stage", "shard_degree", "data", "world_size"}). What each file holds under its keys:
    model/<path>                      stages 0-2: the full parameter; stage 3: slice j of it
    optimizer/_trainable_variables/i  stages 1-3: slice j of parameter i (the master slice)
    optimizer/_variables/p            m and v of parameter i: slice j (stage 0: whole)
    anything else                     counters, dropout states, loss scale: the same in every file
Slice j of a variable is elements j*S..(j+1)*S-1 of it flattened and zero-padded to N*S.

`resharded_checkpoint` writes, for the process asking, a checkpoint of its own layout (its
keys and shapes, taken from a `write` of its own fresh state): full values are assembled from
every saved slice, then cut for the new layout (any stage, any shard degree, 1 process or
many). `python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR` writes a single-device checkpoint that
resumes without --zero_stage; `assembled_weights` is what tfbig-generate/-export read.

Below every backend (the layer map: tfbig/__init__.py): no Strategy, no Horovod, no trainer.
"""
import os
import re
import tempfile

import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import model_key, piece_dir
from tfbig.checkpoints.checkpoint import read_layout as checkpoint_layout

LAYOUT_FILE = "zero.json"
OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def read_layout(model_dir):
    """MODEL_DIR/zero.json as a dict, or None when the run was not ZeRO-sharded."""
    return checkpoint_layout(model_dir, LAYOUT_FILE)


def piece_paths(model_dir, layout, latest):
    """`latest` (position 0's newest intact checkpoint) and the same-numbered one of every
    other partition position; a missing piece is named."""
    paths = [latest]
    for j in range(1, layout["shard_degree"]):
        path = os.path.join(piece_dir(model_dir, "zero", j), os.path.basename(latest))
        if not os.path.exists(path + ".index"):
            raise FileNotFoundError(f"{path}: partition position {j}'s piece of {latest} is "
                                    f"missing (zero.json: {layout}); every position of the "
                                    f"first replica group saves its own")
        paths.append(path)
    return paths


def _escape(path):
    return path.replace(".", "..").replace("/", ".S")


def _inner_prefix(keys):
    """'optimizer/inner_optimizer/' under fp16 loss scaling, else 'optimizer/'."""
    return ("optimizer/inner_optimizer/"
            if any(k.startswith("optimizer/inner_optimizer/") for k in keys) else "optimizer/")


class SavedState:
    """Full values assembled from the pieces of a saved ZeRO checkpoint (or a plain one)."""

    def __init__(self, paths, layout):
        self.readers = [tf.train.load_checkpoint(p) for p in paths]
        self.stage = layout["zero_stage"]
        self.keys = set(self.readers[0].get_variable_to_shape_map())
        self.inner = _inner_prefix(self.keys)

    def _pieces(self, key):
        return [np.ravel(r.get_tensor(key)) for r in self.readers]

    def parameter(self, index, path, shape):
        model = "model/" + _escape(path) + SUFFIX
        if self.stage < 3 and model in self.keys:  # whole in every file
            return self.readers[0].get_tensor(model)
        key = model if model in self.keys else f"{self.inner}_trainable_variables/{index}{SUFFIX}"
        return self._joined(key, shape)

    def slot(self, position, shape):
        return self._joined(f"{self.inner}_variables/{position}{SUFFIX}", shape)

    def _joined(self, key, shape):
        if key not in self.keys:
            raise ValueError(f"the saved checkpoint has no {key!r}: it was written by another "
                             f"model or optimizer")
        flat = np.concatenate(self._pieces(key))
        return flat[:int(np.prod(shape))].reshape(shape)

    def other(self, key):
        if key not in self.keys:
            raise ValueError(f"the saved checkpoint has no {key!r}: it was written by another "
                             f"model, optimizer or precision")
        return self.readers[0].get_tensor(key)


def _fit(full, shape, partition):
    """`full` as the new layout holds it: whole, or this position's flattened slice."""
    if tuple(shape) == full.shape:
        return full
    return partition.own(full, full.shape).numpy()


def _slot_owners(optimizer):
    """{position in the inner optimizer's variables: index of the parameter it belongs to}."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    index = {id(v): i for i, v in enumerate(inner._trainable_variables)}
    owners = {}
    for slots in (inner._momentums, inner._velocities):
        for i, slot in enumerate(slots):
            owners[id(slot)] = i
    return {p: owners[id(v)] for p, v in enumerate(inner._variables) if id(v) in owners}, index


def resharded_values(checkpoint, saved, model, variables, optimizer, partition, scratch):
    """{key: value} for `checkpoint` (this process's layout) from the SavedState `saved`."""
    checkpoint.save_counter  # noqa: B018 - created on first use; a saved checkpoint has one
    fresh = checkpoint.write(os.path.join(scratch, "layout"))  # this layout's keys and shapes
    reader = tf.train.load_checkpoint(fresh)
    shapes = reader.get_variable_to_shape_map()
    by_path = {"model/" + _escape(model_key(model, v)) + SUFFIX: i
               for i, v in enumerate(variables)}
    slot_owner, _ = _slot_owners(optimizer)
    inner = _inner_prefix(shapes)
    pattern = re.compile(re.escape(inner) + r"_(trainable_variables|variables)/(\d+)/")
    full_shapes = [tuple(v.shape) for v in variables]

    def parameter(i):
        return saved.parameter(i, model_key(model, variables[i]), full_shapes[i])

    values = {}
    for key, shape in shapes.items():
        match = pattern.match(key)
        if key == OBJECT_GRAPH:
            values[key] = reader.get_tensor(key)
        elif key in by_path:
            values[key] = _fit(parameter(by_path[key]), shape, partition)
        elif match and match.group(1) == "trainable_variables":
            values[key] = _fit(parameter(int(match.group(2))), shape, partition)
        elif match and int(match.group(2)) in slot_owner:
            position = int(match.group(2))
            full = saved.slot(position, full_shapes[slot_owner[position]])
            values[key] = _fit(full, shape, partition)
        else:
            values[key] = saved.other(key)
    return values, reader.get_variable_to_dtype_map()


def write_bundle(prefix, values, dtypes):
    """A TF checkpoint with exactly these keys (object graph included)."""
    keys = sorted(values)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=keys, shape_and_slices=[""] * len(keys),
                      tensors=[tf.constant(values[k], dtype=dtypes[k]) for k in keys])
    return prefix


def restore_resharded(checkpoint, model_dir, layout, latest, model, variables, optimizer,
                      partition):
    """Restore `checkpoint` from the ZeRO run `model_dir` saved with `layout`, re-sharded for
    this process's `partition` (its position among the new shard degree)."""
    saved = SavedState(piece_paths(model_dir, layout, latest), layout)
    with tempfile.TemporaryDirectory() as scratch:
        values, dtypes = resharded_values(checkpoint, saved, model, variables, optimizer,
                                          partition, scratch)
        path = write_bundle(os.path.join(scratch, "resharded"), values, dtypes)
        checkpoint.restore(path).assert_existing_objects_matched()


def assembled_weights(model_dir, model, warn=print):
    """{variable path: full array} of `model`'s weights (built at single-device size) from
    the newest checkpoint of ZeRO run `model_dir` (tfbig-generate, tfbig-export)."""
    from tfbig.checkpoints import integrity

    latest, _ = integrity.newest_intact(model_dir, warn, keep_damaged=True)
    if latest is None:
        raise FileNotFoundError(f"--model_dir={model_dir} has no checkpoint")
    layout = read_layout(model_dir)
    saved = SavedState(piece_paths(model_dir, layout, latest), layout)
    return {v.path: saved.parameter(i, model_key(model, v), tuple(v.shape))
            for i, v in enumerate(model.trainable_variables)}
