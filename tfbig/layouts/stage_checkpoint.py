"""Checkpoints of a pipeline whose stages live on different ranks: layout and assembly.

Each stage rank of data replica 0 saves the variables it holds (stage 0 in MODEL_DIR, stage k in
MODEL_DIR/pipeline/stage-k, tfbig.checkpoints.checkpoint.piece_dir) and the chief writes
MODEL_DIR/pipeline.json: the number of stages and the layers and weights each stage owns. A
weight held by several stages (a tied or shared one) is read from its owner. With
--tensor_parallel=T (tfbig.pipeline.tensor_stage) stage k's tensor rank t saves in
piece_dir(STAGE_DIR, "tensor", t) and the layout also holds "tensor_parallel" and "splits"
(weight path -> [axis, sections]); a split weight is joined from its owner stage's T pieces.

    assembled_weights(model_dir, model)   {path: array} of the single-device model
                                          (tfbig-generate and tfbig-export read it)
    named_state(trainer)                  a piece's state, named alike in every layout
                                          (tfbig.training.consolidate joins the pieces into a
                                          single-device checkpoint that resumes anywhere)

Below every backend (the layer map: tfbig/__init__.py): no Strategy, no trainer.
"""
import os
import re

import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_checkpoints, piece_dir
from tfbig.checkpoints.checkpoint import read_layout as checkpoint_layout
from tfbig.checkpoints.checkpoint import reader_key
from tfbig.layouts import zero_checkpoint
from tfbig.layouts.tensor_layout import join_slices

LAYOUT_FILE = "pipeline.json"


def layout(layers, plan, splits=None, tensor_parallel=1):
    """The JSON layout: {"pipeline_stages": K, "stages": [{"layers", "weights"}, ...]}, and
    with tensor_parallel T > 1 "tensor_parallel": T, "splits": {path: [axis, sections]}."""
    out = {"pipeline_stages": len(plan), "stages": [
        {"layers": [layer.name for layer in layers[s.start:s.stop]],
         "weights": sorted(v.path for layer in layers[s.start:s.stop] for m in layer.modules
                           for v in m.trainable_variables)} for s in plan]}
    if tensor_parallel > 1:
        out.update(tensor_parallel=tensor_parallel,
                   splits={path: list(piece) for path, piece in sorted(splits.items())})
    return out


def tensor_degree(saved):
    """The --tensor_parallel of a saved layout (1 for a pipeline-only run)."""
    return saved.get("tensor_parallel", 1)


def saved_splits(saved):
    """{weight path: (axis, sections)} of a saved layout's tensor-split weights."""
    return {path: tuple(piece) for path, piece in saved.get("splits", {}).items()}


def weight_owners(saved):
    """{weight path: the stage that owns it} (a tied or shared weight: its first holder's)."""
    return {path: s for s, stage in enumerate(saved["stages"]) for path in stage["weights"]}


def read_layout(model_dir):
    """MODEL_DIR/pipeline.json, or None when the run was not a cross-rank pipeline."""
    return checkpoint_layout(model_dir, LAYOUT_FILE)


def check_resume(model_dir, num_stages, tensor_parallel=1, zero=(0, 1)):
    """Refuse to resume a checkpoint of another layout: stages, tensor degree, or optimizer
    sharding `zero` (--zero_stage, partition group size; zero.json) (errors say what to do)."""
    saved = read_layout(model_dir)
    if saved is not None and (saved["pipeline_stages"], tensor_degree(saved)) != (
            num_stages, tensor_parallel):
        raise ValueError(f"--model_dir={model_dir} was written with --pipeline_stages="
                         f"{saved['pipeline_stages']} --tensor_parallel={tensor_degree(saved)}; "
                         f"this run has --pipeline_stages={num_stages} --tensor_parallel="
                         f"{tensor_parallel}. Resume with the same layout, or write a "
                         f"single-device checkpoint first: "
                         f"python -m tfbig.commands.consolidate {model_dir} OUT_DIR")
    if saved is None and tf.train.latest_checkpoint(model_dir):
        raise ValueError(f"--model_dir={model_dir} holds a checkpoint without pipeline stages "
                         f"({LAYOUT_FILE} is missing); resume it without --pipeline_stages or "
                         f"start another --model_dir")
    if saved is None:
        return  # nothing to resume
    sharded = zero_checkpoint.read_layout(model_dir)
    sharded = (sharded["zero_stage"], sharded["shard_degree"]) if sharded else (0, 1)
    if sharded != tuple(zero):
        raise ValueError(
            f"--model_dir={model_dir} was written with --zero_stage={sharded[0]} over "
            f"partition groups of {sharded[1]} data rank(s) ({zero_checkpoint.LAYOUT_FILE}); "
            f"this run has --zero_stage={zero[0]} over {zero[1]}: pipeline stages resume only "
            f"their own optimizer sharding. Resume with the same --zero_stage, --shard_degree "
            f"and number of data ranks, or start another --model_dir")


def stage_checkpoints(model_dir, saved, warn=print):
    """The newest intact checkpoint of stage 0 and the same-numbered one of every stage."""
    return piece_checkpoints(model_dir, "pipeline", saved["pipeline_stages"], warn)


def piece_paths(model_dir, saved, warn=print):
    """[[checkpoint of stage k, tensor rank t for each t] for each k], all of one number."""
    out = []
    for stage, path in enumerate(stage_checkpoints(model_dir, saved, warn)):
        stage_dir, name = piece_dir(model_dir, "pipeline", stage), os.path.basename(path)
        pieces = [path]
        for rank in range(1, tensor_degree(saved)):
            piece = os.path.join(piece_dir(stage_dir, "tensor", rank), name)
            if not os.path.exists(piece + ".index"):
                raise FileNotFoundError(f"{piece}: tensor rank {rank} of stage {stage} of "
                                        f"{path} is missing; every rank of the first replica "
                                        f"saves its own")
            pieces.append(piece)
        out.append(pieces)
    return out


def assembled_weights(model_dir, model, warn=print):
    """{variable path: array} of `model`'s weights from the newest checkpoint of a cross-rank
    pipeline run, each read from the stage that owns it (a tensor-split one joined from that
    stage's tensor ranks)."""
    saved = read_layout(model_dir)
    readers = [[tf.train.load_checkpoint(p) for p in stage]
               for stage in piece_paths(model_dir, saved, warn)]
    owner, splits = weight_owners(saved), saved_splits(saved)
    out = {}
    for v in model.variables:
        if "seed_generator" in v.path:
            continue
        stage, key = readers[owner.get(v.path, 0)], reader_key(model, v)
        piece = splits.get(v.path)
        out[v.path] = (stage[0].get_tensor(key) if piece is None else
                       join_slices([r.get_tensor(key) for r in stage], *piece))
    return out


def named_variables(trainer):
    """{name: variable} of a checkpoint's content, named alike in every layout: weights and
    optimizer variables by path (slots carry their weight's path), counters by name."""
    named = {v.path: v for v in trainer.model.variables if "seed_generator" not in v.path}
    named.update({f"optimizer:{_optimizer_key(v.path)}": v for v in trainer.optimizer.variables})
    named.update({"step": trainer.step, "batches_consumed": trainer.batches_consumed,
                  "nonfinite_steps": trainer.nonfinite_steps})
    return named


def _optimizer_key(path):
    """'adam_w_2/iteration' -> 'adam_w/iteration': Keras numbers the optimizers of a process."""
    owner, _, rest = path.partition("/")
    return re.sub(r"_\d+$", "", owner) + "/" + rest


def named_state(trainer):
    """{name: array} of `named_variables(trainer)`."""
    return {name: np.asarray(v.numpy()) for name, v in named_variables(trainer).items()}
