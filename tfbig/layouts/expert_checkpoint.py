"""An --expert_parallel run's checkpoint read as one model: each rank of the first expert group
wrote its E/N experts of every MoE layer (piece 0 in MODEL_DIR, piece r in
MODEL_DIR/expert/rank-r; tfbig.distribute.expert_parallel) and the rest whole; MODEL_DIR/
expert.json names the degree and the expert variables. `assembled_weights` joins each expert
variable's pieces along the expert axis, in expert rank order, and with --zero_stage=3 the other
weights' flat slices of the first G pieces (tfbig-generate, tfbig-convert --to=huggingface read a
run this way)."""
import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_checkpoints, piece_dir, reader_key
from tfbig.checkpoints.checkpoint import read_layout as checkpoint_layout
from tfbig.layouts import stage_checkpoint, tensor_layout, zero_checkpoint

LAYOUT_FILE = "expert.json"


def read_layout(model_dir):
    """MODEL_DIR/expert.json, or None when the run did not split experts."""
    return checkpoint_layout(model_dir, LAYOUT_FILE)


def assembled_weights(model_dir, model, warn=print):
    """{variable path: array} of `model`'s (the single-device model's) weights from the newest
    checkpoint of an expert-parallel run."""
    saved = read_layout(model_dir)
    stages = stage_checkpoint.read_layout(model_dir)
    if stages is not None:
        return _staged_weights(model_dir, model, saved, stages, warn)
    # with --zero_stage=3 (tfbig.distribute.expert_zero) piece r holds partition position
    # r mod G's flat slices of the other weights (groups of consecutive data ranks, as the
    # expert groups): the first G pieces joined
    zero = zero_checkpoint.read_layout(model_dir)
    slices = zero["shard_degree"] if zero is not None and zero["zero_stage"] == 3 else 0
    readers = [tf.train.load_checkpoint(path) for path in piece_checkpoints(
        model_dir, "expert", max(saved["expert_parallel"], slices), warn)]
    experts = set(saved["expert_variables"])
    # with --tensor_parallel (tfbig.distribute.expert_tensor): the rest joined from the tensor
    # ranks' pieces, the experts from tensor rank 0's expert pieces (each tensor rank's alike)
    split = (tensor_layout.assembled_weights(model_dir, model, warn)
             if tensor_layout.read_layout(model_dir) is not None else None)
    out = {}
    for v in model.variables:
        if "seed_generator" in v.path:
            continue
        key = reader_key(model, v)
        if v.path in experts:
            out[v.path] = np.concatenate([r.get_tensor(key)
                                          for r in readers[:saved["expert_parallel"]]])
        elif slices and v.trainable:
            flat = np.concatenate([r.get_tensor(key) for r in readers[:slices]])
            out[v.path] = flat[:int(np.prod(v.shape))].reshape(v.shape)
        else:
            out[v.path] = split[v.path] if split is not None else readers[0].get_tensor(key)
    return out


def _staged_weights(model_dir, model, saved, stages, warn):
    """assembled_weights of --pipeline_stages with --expert_parallel
    (tfbig.pipeline.expert_stage): the stages' pieces joined as a pipeline run's, each expert
    variable from its owner stage's expert pieces (pipeline/stage-k/expert/rank-e)."""
    out = stage_checkpoint.assembled_weights(model_dir, model, warn)
    owner, readers = stage_checkpoint.weight_owners(stages), {}
    for v in model.variables:
        if v.path not in saved["expert_variables"]:
            continue
        stage = owner[v.path]
        if stage not in readers:
            readers[stage] = [tf.train.load_checkpoint(path) for path in piece_checkpoints(
                piece_dir(model_dir, "pipeline", stage), "expert", saved["expert_parallel"],
                warn)]
        key = reader_key(model, v)
        out[v.path] = np.concatenate([r.get_tensor(key) for r in readers[stage]])
    return out
