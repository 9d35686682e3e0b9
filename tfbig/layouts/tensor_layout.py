"""Tensor-parallel layouts as data, without Horovod: which layers are split how, each rank's
slice of a variable, and reading a tensor-parallel run on one process.

A *plan* (tfbig.layouts.tensor_plan) maps attribute paths below the model to a `Split`.
`split_model` builds the single-device model (every rank starts from the single-device
initialisation), an unbuilt twin whose planned layers are shrunk to 1/T, and copies rank t's
slice into it; the Horovod backend (tfbig.distribute.tensor_parallel) also wraps the split
layers' calls with the collectives. `assembled_weights` (tfbig-generate, tfbig-export) reads
the pieces each rank saved (tfbig.checkpoints.checkpoint.state_arrays: a rank's whole state).

Below every backend (the layer map: tfbig/__init__.py): no Strategy, no Horovod, no trainer.
"""
import os

import keras
import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_checkpoints
from tfbig.checkpoints.checkpoint import read_layout as checkpoint_layout
from tfbig.checkpoints.checkpoint import model_key, reader_key
from tfbig.layouts import zero_checkpoint
from tfbig.layouts.tensor_plan import plan_for, resolve_plan_layers
from tfbig.models.layout import Split

LAYOUT_FILE = "tensor.json"


def _divide(value, size, what):
    if value % size:
        raise ValueError(f"--tensor_parallel={size} does not divide {what}={value}; choose a "
                         f"tensor-parallel degree among its divisors")
    return value // size


# ---- how each kind shrinks a layer, wraps its call, and slices its variables ----------------
def _shrink(layer, split, size):
    kind = split.kind
    if kind == "heads":
        layer.num_heads = _divide(layer.num_heads, size, "num_heads")
        layer.hidden_size = layer.num_heads * layer.head_size  # this rank's attention width
    elif kind == "grouped_heads":
        _shrink_grouped_heads(layer, size)
    elif kind == "width":
        layer.intermediate_size = _divide(layer.intermediate_size, size, "intermediate_size")
    elif kind in ("column", "shared_column", "vocab_column") and not getattr(
            layer, "replicated_heads", None):  # a replicated key/value projection: whole
        what = "vocab_size" if kind == "vocab_column" else f"{layer.name} units"
        _divide(layer.units // split.sections, size, what)
        layer.units //= size
    elif kind == "vocab_bias":
        layer.vocab_size = _divide(layer.vocab_size, size, "vocab_size")
    elif kind == "vocab":
        layer.input_dim = _divide(layer.input_dim, size, "vocab_size (pad the vocabulary "
                                  "with tfbig-prep --vocab_size)")


def _shrink_grouped_heads(layer, size):
    """A grouped-query attention (Llama's) reduced to 1/T of its query heads and of its
    key/value heads (rank t's query heads read only rank t's). With T a multiple of the
    key/value heads (Megatron replicates them), each rank's query heads read one head: the
    key and value projections stay whole (`replicated_heads`: the wrap takes that head's
    columns, their gradients summed over the group); refused otherwise."""
    kv, heads = layer.num_kv_heads, layer.num_heads
    if kv % size and (size % kv or heads % size):
        raise ValueError(f"--tensor_parallel={size} neither divides num_kv_heads={kv} nor is "
                         f"a multiple of it dividing num_heads={heads}: grouped-query "
                         f"attention splits whole key/value heads (each with its {heads // kv} "
                         f"query heads) or replicates them; choose a degree dividing {kv}, or "
                         f"a multiple of {kv} dividing {heads}")
    layer.num_heads = _divide(heads, size, "num_heads")
    if kv % size:  # each rank: one key/value head, its projections' columns of the whole
        for projection in (layer.key, layer.value):
            projection.replicated_heads = (kv, layer.head_size)
        layer.num_kv_heads = 1
    else:
        layer.num_kv_heads //= size


def _variable_splits(layer, split):
    """[(variable, (axis, sections))] of the variables a split layer holds in pieces."""
    if split.kind in ("column", "shared_column", "vocab_column") and not getattr(
            layer, "replicated_heads", None):  # a replicated key/value projection: whole
        pieces = [(layer.kernel, (-1, split.sections))]
        if getattr(layer, "bias", None) is not None:
            pieces.append((layer.bias, (-1, split.sections)))
        return pieces
    if split.kind == "row":
        return [(layer.kernel, (0, 1))]  # the bias is replicated
    if split.kind == "vocab":
        return [(layer.embeddings, (0, 1))]
    if split.kind == "vocab_bias":
        return [(layer.bias, (0, 1))]
    return []


def take_slice(full, axis, sections, rank, size):
    """Rank `rank`'s piece of the full array: along `axis`, each of `sections` equal blocks
    cut into `size` parts, part `rank` of each. A lazily stacked array (an expert rank's
    experts of a Hugging Face checkpoint, tfbig.checkpoints.bundle.Stacked) cut along its
    first axis reads only the rows it keeps."""
    if hasattr(full, "rows") and axis % full.ndim == 0 and sections == 1:
        rows = full.shape[0] // size
        return full.rows(rank * rows, (rank + 1) * rows)
    blocks = np.split(np.asarray(full), sections, axis=axis)
    return np.concatenate([np.split(b, size, axis=axis)[rank] for b in blocks], axis=axis)


def then_cut(first, second):
    """The cut applying `first` (None: none) and then `second` (Strategy.weight_pieces)."""
    return second if first is None else (lambda full: second(first(full)))


def cut_pieces(pieces, model, splits, group):
    """`pieces` (Strategy.weight_pieces of `model`) with each split weight cut to rank
    `group.rank`'s slice (a split (axis, sections, group) to that group's rank's) and its full
    shape `group.size` times the slice's along the axis."""
    for v in model.variables:
        entry = pieces.get(model_key(model, v))
        if v.path not in splits or entry is None or entry[0] is None:
            continue
        axis, sections, *cut = splits[v.path]
        g = cut[0] if cut else group
        entry[1] = then_cut(entry[1], lambda full, a=axis, s=sections, g=g: take_slice(
            full, a, s, g.rank, g.size))
        axis %= len(entry[2])
        entry[2] = tuple(d * g.size if i == axis else d for i, d in enumerate(entry[2]))
    return pieces


def join_slices(pieces, axis, sections):
    """The inverse of take_slice over all ranks' pieces (in rank order)."""
    per_rank = [np.split(np.asarray(p), sections, axis=axis) for p in pieces]
    return np.concatenate([np.concatenate([p[s] for p in per_rank], axis=axis)
                           for s in range(sections)], axis=axis)


def split_model(task, group, wrap=None):
    """(local model, {variable path: (axis, sections)}) for rank `group.rank`: the
    single-device model's initialisation and frozen layers, with every planned layer
    holding its slice.
    `wrap(layer, split, group)` inserts the collectives into each split layer's call."""
    if getattr(task, "tensor_layout", None):  # a user task's declared layout
        return split_declared_model(task, group, wrap)
    full = task.build_model()
    plan = plan_for(full)
    local = type(full).from_config(full.get_config())
    for source, twin in zip(full._flatten_layers(), local._flatten_layers(), strict=True):
        twin.trainable = source.trainable  # frozen stays frozen (the span model's pooler)
    layers = [(layer, split) for pattern, split in plan for layer in resolve_plan_layers(local, pattern)]
    for layer, split in layers:
        _shrink(layer, split, group.size)
    local.build((None, task.seq_length))
    splits = {}
    for layer, split in layers:
        if wrap is not None:
            wrap(layer, split, group)
        splits.update({v.path: piece for v, piece in _variable_splits(layer, split)})
    projects = any(split.kind == "vocab_input" for _, split in plan)  # not fine-tuning models
    if projects and not any(split.kind == "vocab_input" for _, split in layers):
        raise ValueError("--tensor_parallel: this model has no LayerNorm before its "
                         "vocabulary projection (post-LN GPT); tensor parallelism needs the "
                         "pre-LN layout (the default)")
    if group.sequence_parallel:
        _check_sequence_parallel(local, layers, task.seq_length, group.size)
    own_masks = own_mask_states(local, group)
    # Weights by path; dropout generator states by position (their names count generators
    # created in the process, so the twin's differ from the full model's).
    full_seeds = [v for v in full.variables if "seed_generator" in v.path]
    local_seeds = [v for v in local.variables if "seed_generator" in v.path]
    full_values = {v.path: v for v in full.variables if "seed_generator" not in v.path}
    for v in local.variables:
        if "seed_generator" in v.path or not _held(v):
            continue
        value = full_values[v.path].numpy()
        if v.path in splits:
            value = take_slice(value, *splits[v.path], group.rank, group.size)
        v.assign(value)
    for source, v in zip(full_seeds, local_seeds, strict=True):
        if not _held(v):
            continue
        value = source.numpy()
        if id(v) in own_masks:
            value = value + np.asarray(group.rank, value.dtype)  # this rank's heads' masks
        v.assign(value)
    return local, splits


def split_declared_model(task, group, wrap=None):
    """split_model for a task that declares its layout as data (tfbig.tasks.user: Keras
    layers by path and kind): its model is built at full size, then each declared layer's
    variables are replaced, in place and under the same paths, by rank `group.rank`'s slices
    (the twin of split_model would need the model's config). Kinds: "column" / "row" (a
    Dense's units / input rows), "heads" (a MultiHeadAttention's heads: its query, key, value
    and output projections sliced on the heads axis), "vocab" (an Embedding's rows, or the
    output Dense's columns, its logits gathered whole for the task's loss)."""
    if group.sequence_parallel:
        raise ValueError("--sequence_parallel: a declared tensor_layout splits layers along "
                         "their width, not the sequence; run it without --sequence_parallel")
    model = task.build_model()
    splits = {}
    for layer, kind, axis in task.declared_layout(model, group.size):
        split, pieces = _shrink_declared(layer, kind, axis, group)
        for owner, variable, piece in pieces:
            replace_variable(owner, variable, take_slice(
                variable.numpy(), *piece, group.rank, group.size))
            splits[variable.path] = piece
        if wrap is not None:
            wrap(layer, split, group)
    return model, splits


def _shrink_declared(layer, kind, axis, group):
    """(Split, [(owning layer, variable, (axis, sections))]) of a declared layer, its sizes
    shrunk to rank `group.rank`'s 1/T (`axis`: the kernel axis a LayoutMap splits)."""
    size, path = group.size, layer.path
    if isinstance(layer, keras.layers.EinsumDense):
        return _shrink_einsum(layer, kind, axis, size)
    if kind == "heads":
        return Split("keras_heads"), _shrink_attention(layer, group)
    if kind == "vocab" and isinstance(layer, keras.layers.Embedding):
        layer.input_dim = _divide(layer.input_dim, size, f"{path}'s vocabulary (input_dim)")
        return Split("vocab"), [(layer, layer.embeddings, (0, 1))]
    if kind == "row":
        rows = _divide(layer.kernel.shape[0], size, f"{path}'s input width")
        layer.input_spec = keras.InputSpec(min_ndim=2, axes={-1: rows})
        return Split("row"), [(layer, layer.kernel, (0, 1))]  # the bias is replicated
    split = Split("column" if kind == "column" else "vocab_logits")
    what = f"{path}'s units" if kind == "column" else f"{path}'s vocabulary (units)"
    layer.units = _divide(layer.units, size, what)
    return split, [(layer, v, (-1, 1)) for v in (layer.kernel, layer.bias) if v is not None]


def _shrink_einsum(layer, kind, axis, size):
    """An EinsumDense's kernel split on `axis` (a LayoutMap's): an output axis ("column",
    its bias sliced with it when the bias spans it) or a contracted one ("row", the bias
    added once after the sum)."""
    _divide(layer.kernel.shape[axis], size, f"{layer.path}'s kernel axis {axis} "
            f"(shape {tuple(layer.kernel.shape)})")
    pieces = [(layer, layer.kernel, (axis, 1))]
    if kind == "column" and layer.bias is not None:
        _, kernel, output = einsum_specs(layer.equation)
        spanned = [c for c in output if c in (layer.bias_axes or "")]
        letter = kernel[axis]
        if letter in spanned:
            first = min(output.index(c) for c in spanned)
            pieces.append((layer, layer.bias, (output.index(letter) - first, 1)))
    return Split("einsum_" + kind, axis=axis), pieces


def einsum_specs(equation):
    """(input letters, kernel letters, output letters) of an EinsumDense equation."""
    operands, output = equation.split("->")
    inputs, kernel = operands.split(",")
    return inputs, kernel, output


def _shrink_attention(attention, group):
    """A keras MultiHeadAttention reduced to heads rank*N/T .. (rank+1)*N/T - 1: the query,
    key, value (and gate) projections' kernels (H, N, d) and biases (N, d) sliced on N, the
    output projection's kernel (N, d, H) on N (its bias replicated: added once, after the
    sum). Its attention dropout draws this rank's own mask (the state offset by the rank)."""
    heads = _divide(attention.num_heads, group.size, f"{attention.path}'s num_heads")
    attention._num_heads = heads  # read by get_config only; the shapes come from the kernels
    projections = [attention.query_dense, attention.key_dense, attention.value_dense]
    projections += [attention._gate_dense] if getattr(attention, "_use_gate", False) else []
    pieces = []
    for projection in projections:
        projection.partial_output_shape = (*projection.partial_output_shape[:-2], heads,
                                           projection.partial_output_shape[-1])
        pieces += [(projection, v, (len(v.shape) - 2, 1))
                   for v in (projection.kernel, projection.bias) if v is not None]
    output = attention.output_dense
    pieces.append((output, output.kernel, (0, 1)))
    for state in _attention_mask_states(attention):
        state.assign(state.numpy() + np.asarray(group.rank, state.dtype))
    return pieces


def _attention_mask_states(attention):
    """The seed-generator states of a MultiHeadAttention's dropout of attention probabilities
    (none when its dropout is 0)."""
    return [v for v in attention._dropout_layer.non_trainable_variables
            if "seed_generator" in v.path]


def replace_variable(layer, variable, value):
    """Put a new variable holding `value` in `variable`'s place in `layer` (its attribute and
    its position among the layer's weights, so optimizer slots keep their order), under the
    same path."""
    parent, name = variable.path.rsplit("/", 1)
    scope, owner = parent.rsplit("/", 1) if "/" in parent else ("", parent)
    with keras.name_scope(owner, override_parent=scope):
        new = keras.Variable(value, dtype=variable.dtype, trainable=variable.trainable,
                             name=name)
    weights = layer._trainable_variables if variable.trainable else \
        layer._non_trainable_variables
    weights[[id(v) for v in weights].index(id(variable))] = new
    attribute = next(k for k, v in vars(layer).items() if v is variable)
    object.__setattr__(layer, attribute, new)  # past Keras' tracker: it would append it


def _held(variable):
    """False for a weight another pipeline stage holds (an empty placeholder on this rank:
    tfbig.pipeline.stage_model.hold_only); True otherwise."""
    return tuple(variable.value.shape) == tuple(variable.shape)


def own_mask_states(model, group, task=None):
    """ids of the dropout generator states of `model` (a rank's split model) that draw a mask
    of their own on each tensor rank (their state is the single-device one + the rank): a
    family's own_mask layers, a declared layout's split MultiHeadAttention layers (`task`)."""
    if getattr(task, "tensor_layout", None):
        return {id(v) for layer, kind, _ in task.declared_layout(model) if kind == "heads"
                for v in _attention_mask_states(layer)}
    own = ("own_mask", "sequence_mask") if group.sequence_parallel else ("own_mask",)
    return {id(v) for pattern, split in plan_for(model) if split.kind in own
            for layer in resolve_plan_layers(model, pattern)
            for v in layer.non_trainable_variables if "seed_generator" in v.path}


def _check_sequence_parallel(model, layers, seq_length, size):
    # a family with a plan chunks its position embedding (GPT, BERT, ALBERT) or, with rotary
    # positions applied on the gathered sequence, declares its chunk's dropout masks (Llama)
    if not any(split.kind in ("positions", "sequence_mask") for _, split in layers):
        raise ValueError(f"--sequence_parallel: no sequence-parallel plan for "
                         f"{type(model).__name__}; GPT, ALBERT, BERT pretraining and the "
                         f"dense Llama have one (an MoE Llama has none: its routers' losses "
                         f"are over a replica's whole batch). Run it without "
                         f"--sequence_parallel")
    if seq_length % size:
        raise ValueError(f"--sequence_parallel with --tensor_parallel={size}: the sequence "
                         f"length {seq_length} must be a multiple of {size} (each rank holds "
                         f"an equal chunk of positions)")
    if any(getattr(layer, "replicated_heads", None) for layer, _ in layers):
        raise ValueError(f"--sequence_parallel with --tensor_parallel={size} above the "
                         f"key/value heads (replicated: their gradients are summed over the "
                         f"group already); drop one, or choose a degree dividing num_kv_heads")


# ---- reading a tensor-parallel run on one process ----------------------------------------
def read_layout(model_dir):
    """MODEL_DIR/tensor.json ({"tensor_parallel": T, "splits": {path: [axis, sections]}}) or
    None when the run was not tensor-parallel."""
    return _with_tuples(checkpoint_layout(model_dir, LAYOUT_FILE))


def _with_tuples(layout):
    if layout is not None:
        layout["splits"] = {p: tuple(v) for p, v in layout["splits"].items()}
    return layout


def rank_checkpoints(model_dir, layout, warn=print):
    """The newest intact checkpoint of tensor rank 0 and the same-numbered one of every other
    rank (each rank saves its own; a missing or damaged piece is named)."""
    return piece_checkpoints(model_dir, "tensor", layout["tensor_parallel"], warn)


def assembled_weights(model_dir, model, warn=print):
    """{variable path: full array} of `model`'s weights (built at single-device size) from a
    tensor-parallel run's newest checkpoint, each split variable joined from the ranks."""
    layout = read_layout(model_dir)
    paths = rank_checkpoints(model_dir, layout, warn)
    readers = [tf.train.load_checkpoint(p) for p in paths]
    zero = zero_checkpoint.read_layout(model_dir)
    index = {}  # ZeRO-3: each tensor rank's pieces sliced over its data ranks
    if zero is not None and zero["zero_stage"] == 3:
        states = [zero_checkpoint.SavedState(zero_checkpoint.piece_paths(
            os.path.dirname(p), zero, p), zero) for p in paths]
        index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    out = {}
    for v in model.variables:
        if "seed_generator" in v.path:
            continue
        key = reader_key(model, v)
        piece = layout["splits"].get(v.path)
        if id(v) in index:
            shape = list(v.shape)
            if piece is not None:
                shape[piece[0]] //= layout["tensor_parallel"]
            pieces = [s.parameter(index[id(v)], model_key(model, v), tuple(shape))
                      for s in states]
        else:
            pieces = [r.get_tensor(key) for r in readers]
        out[v.path] = pieces[0] if piece is None else join_slices(pieces, *piece)
    return out
