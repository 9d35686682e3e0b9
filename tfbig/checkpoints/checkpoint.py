"""What goes into a checkpoint for a Keras 3 model, keyed so it survives a new process.

`tf.train.Checkpoint(model=keras_model)` does not reach every variable of a Keras 3 subclassed
model (layers held in lists are invisible to TF's tracking), so tfbig saves the model's
variables explicitly, keyed by their Keras path without the model's own name
("block_0/attn/qkv/kernel"). Dropout seed-generator states, whose names carry a process-wide
counter, are saved in layer order.
"""
import json
import os

import numpy as np


def model_key(model, variable):
    """A variable's checkpoint key: its Keras path below the model's own name."""
    prefix = model.name + "/"
    return variable.path[len(prefix):] if variable.path.startswith(prefix) else variable.path


def model_variables(model):
    """{path below the model: tf.Variable} for every weight of `model`."""
    return {model_key(model, v): v.value for v in model.variables
            if "seed_generator" not in v.path}


def rng_variables(model):
    """The model's random-generator states (dropout), in layer order."""
    return [v.value for v in model.variables if "seed_generator" in v.path]


def piece_dir(model_dir, kind, index):
    """Where a rank that saves piece `index` of a sharded model writes: piece 0 in `model_dir`
    (so the usual tools find the step and counters there), piece j in MODEL_DIR/KIND/NAME-j."""
    if index == 0:
        return model_dir
    name = {"zero": "shard", "tensor": "rank", "pipeline": "stage", "expert": "rank"}[kind]
    return os.path.join(model_dir, kind, f"{name}-{index}")


def piece_checkpoints(model_dir, kind, count, warn=print):
    """The newest intact checkpoint of piece 0 (in `model_dir`) and the same-numbered one of
    pieces 1..count-1 (each rank of the first replica saves its own); a missing one is named."""
    from tfbig.checkpoints import integrity

    latest, _ = integrity.newest_intact(model_dir, warn, keep_damaged=True)
    if latest is None:
        raise FileNotFoundError(f"--model_dir={model_dir} has no checkpoint")
    paths = [latest]
    for index in range(1, count):
        path = os.path.join(piece_dir(model_dir, kind, index), os.path.basename(latest))
        if not os.path.exists(path + ".index"):
            raise FileNotFoundError(f"{path}: {kind} piece {index} of {latest} is missing; "
                                    f"every rank of the first replica saves its own")
        paths.append(path)
    return paths


def reader_key(model, variable):
    """The key of a model variable in a tf.train.load_checkpoint reader of a tfbig checkpoint."""
    return ("model/" + model_key(model, variable).replace("/", ".S")
            + "/.ATTRIBUTES/VARIABLE_VALUE")


def write_layout(directory, filename, layout):
    """Write the JSON `layout` of a sharded checkpoint beside it, atomically."""
    path = os.path.join(directory, filename)
    with open(path + ".tmp", "w") as f:
        json.dump(layout, f, indent=1)
    os.replace(path + ".tmp", path)


def read_layout(model_dir, filename):
    """The JSON layout MODEL_DIR/FILENAME of a sharded checkpoint, or None when it is absent
    (the run did not use that layout)."""
    path = os.path.join(model_dir, filename)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def slot_owners(optimizer):
    """{id(optimizer slot variable): path of the weight it belongs to} (Adam/LAMB m and v)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under a LossScaleOptimizer
    out = {}
    for i, v in enumerate(inner._trainable_variables):
        for slots in (getattr(inner, "_momentums", []), getattr(inner, "_velocities", [])):
            if i < len(slots):
                out[id(slots[i])] = v.path
    return out


def state_variables(trainer):
    """{name: variable} of everything a checkpoint holds, named the same in every layout:
    model weights by path, optimizer variables by position, the counters by name."""
    seeds = [v for v in trainer.model.variables if "seed_generator" in v.path]
    named = {v.path: v for v in trainer.model.variables if "seed_generator" not in v.path}
    named.update({f"rng/{i}": v for i, v in enumerate(seeds)})
    named.update({f"optimizer/{i}": v for i, v in enumerate(trainer.optimizer.variables)})
    named.update({"step": trainer.step, "batches_consumed": trainer.batches_consumed,
                  "nonfinite_steps": trainer.nonfinite_steps})
    return named


def state_arrays(trainer, splits):
    """{name: (value, split of the model variable it belongs to or None)} of one rank."""
    owner = slot_owners(trainer.optimizer)  # optimizer slot -> the weight it belongs to
    out = {}
    for name, v in state_variables(trainer).items():
        path = name if not name.startswith("optimizer/") else owner.get(id(v))
        out[name] = (np.asarray(v.numpy()), splits.get(path) if path else None)
    return out
