"""A split layer's `call` wrapped with the collectives (tfbig.distribute.tensor_collectives):
column- and row-parallel Dense layers, attention heads, vocabulary embeddings and logits, and
the sequence-parallel regions between them. The layer itself is unchanged Keras code.
"""
from keras import ops

from tfbig.layouts.tensor_layout import einsum_specs
from tfbig.distribute.tensor_collectives import (copy_to_region, from_first_rank, gather_last_axis,
                                                 gather_sequence, gather_whole_sequence,
                                                 reduce_from_region, scatter_sequence,
                                                 sequence_chunk)


def _replicated_head(layer, group):
    """The call of a key or value projection kept whole on every tensor rank (more ranks than
    key/value heads: tfbig.layouts.tensor_layout._shrink_grouped_heads): the columns of the one
    head this rank's query heads read (rank t: head t // (T / kv)), its weights read through
    copy_to_region, so the gradients of the ranks sharing a head are summed (the others add
    zeros)."""
    kv, head_size = layer.replicated_heads
    first = group.rank // (group.size // kv) * head_size
    ps = group.process_set

    def call(x, *args, **kwargs):
        kernel = copy_to_region(ops.cast(layer.kernel, x.dtype), ps)  # a tensor, not the
        y = ops.matmul(x, kernel[:, first:first + head_size])  # variable (custom_gradient)
        if layer.use_bias:
            bias = copy_to_region(ops.cast(layer.bias, y.dtype), ps)
            y = y + bias[first:first + head_size]
        return y

    return call


def _entering_attention(call, enter, process_set):
    """A Keras MultiHeadAttention's call with its query, value and key entering the split
    region once each (self-attention passes one tensor: one all-reduce backward), their Keras
    masks kept."""
    from keras.src import backend

    def attention_call(query, value, key=None, *args, **kwargs):
        entered = {}

        def into(x):
            if x is not None and id(x) not in entered:
                entered[id(x)] = enter(x, process_set)
                mask = backend.get_keras_mask(x)
                if mask is not None:
                    backend.set_keras_mask(entered[id(x)], mask)
            return None if x is None else entered[id(x)]

        return call(into(query), into(value), into(key), *args, **kwargs)

    return attention_call


def _reduced_projection(layer, leave, process_set):
    """An EinsumDense's call (a MultiHeadAttention's output projection over this rank's heads)
    with its partial sums reduced over the group before its bias is added, once."""
    def projection_call(x, *args, **kwargs):
        y = leave(ops.einsum(layer.equation, x, layer.kernel), process_set)
        y = y if layer.bias is None else ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    return projection_call


def _own_rows(x, axis, local, group):
    """`x` as a row-split layer with `local` rows per rank takes it: already this rank's
    slice (after a column-split layer) as is; whole (replicated) -> entering the region
    (its gradient summed over the group), then this rank's `local` entries along `axis`."""
    width = x.shape[axis]
    if width == local:
        return x
    if width != local * group.size:
        raise ValueError(f"a row-split layer with {local} rows per tensor rank got an input "
                         f"of width {width} on axis {axis}: neither its slice nor the whole "
                         f"({local * group.size})")
    x = copy_to_region(x, group.process_set)
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(group.rank * local, (group.rank + 1) * local)
    return x[tuple(index)]


def _einsum_row(layer, axis, leave, group):
    """An EinsumDense's call with its kernel split on a contracted axis (`axis`): its input
    taken on the matching axis (_own_rows), the partial products summed over the group, the
    bias added once."""
    inputs, kernel, _ = einsum_specs(layer.equation)
    letter = kernel[axis]
    index = inputs.index(letter)  # after an ellipsis: counted from the end
    position = index - len(inputs) if "..." in inputs[:index] else index

    def einsum_row_call(x, *args, **kwargs):
        x = _own_rows(x, position, layer.kernel.shape[axis], group)
        y = leave(ops.einsum(layer.equation, x, layer.kernel), group.process_set)
        y = y if layer.bias is None else ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    return einsum_row_call


def _reversible_vocab(layer, call, enter, leave, group):
    """A vocabulary-split ReversibleEmbedding (keras-hub's token embedding): the lookup as
    the "vocab" kind; the reverse projection over a tied table gives this rank's slice of the
    logits, gathered whole; over an untied (replicated) table, unchanged."""
    def reversible_call(inputs, reverse=False):
        if reverse:
            if not layer.tie_weights:
                return call(inputs, reverse=True)
            return gather_last_axis(call(enter(inputs, group.process_set), reverse=True),
                                    group)
        local = ops.cast(inputs, "int32") - group.rank * layer.input_dim
        inside = (local >= 0) & (local < layer.input_dim)
        rows = call(ops.where(inside, local, 0))
        return leave(rows * ops.cast(inside[..., None], rows.dtype), group.process_set)

    return reversible_call


def wrap(layer, split, group):
    kind, ps = split.kind, group.process_set
    call = layer.call
    if group.sequence_parallel and split.sequence:
        # into the split region: all-gather; out of it: reduce-scatter
        enter, leave = gather_sequence, scatter_sequence
    else:  # into it: identity (all-reduce backward); out of it: all-reduce
        enter, leave = copy_to_region, reduce_from_region
    if kind in ("column", "einsum_column"):
        layer.call = lambda x, *args, **kwargs: call(enter(x, ps), *args, **kwargs)
    elif kind == "row":
        def row_call(x, *args, **kwargs):
            x = _own_rows(x, -1, layer.kernel.shape[0], group)
            y = leave(ops.matmul(x, layer.kernel), ps)
            return y + layer.bias if layer.use_bias else y

        layer.call = row_call
    elif kind == "einsum_row":
        layer.call = _einsum_row(layer, split.axis, leave, group)
    elif kind == "vocab" and getattr(layer, "tie_weights", None) is not None:
        layer.call = _reversible_vocab(layer, call, enter, leave, group)
    elif kind == "vocab":
        def vocab_call(ids, *args, **kwargs):
            local = ops.cast(ids, "int32") - group.rank * layer.input_dim
            inside = (local >= 0) & (local < layer.input_dim)
            rows = call(ops.where(inside, local, 0), *args, **kwargs)
            return leave(rows * ops.cast(inside[..., None], rows.dtype), ps)

        layer.call = vocab_call
    elif kind == "keras_heads":  # a declared Keras MultiHeadAttention
        layer.call = _entering_attention(call, enter, ps)
        layer.output_dense.call = _reduced_projection(layer.output_dense, leave, ps)
    elif kind == "vocab_logits":  # a declared output Dense: the task's loss sees all logits
        layer.call = lambda x, *args, **kwargs: gather_last_axis(
            call(enter(x, ps), *args, **kwargs), group)
    elif kind == "shared_column" and getattr(layer, "replicated_heads", None):
        layer.call = _replicated_head(layer, group)
    elif kind == "shared_norm":  # one scale for every rank's heads: its gradient summed
        layer.call = lambda x, *args, **kwargs: layer.normalize(
            x, copy_to_region(ops.cast(layer.scale, "float32"), ps))
    elif kind in ("vocab_input", "region_input"):
        layer.call = lambda *args, **kwargs: enter(call(*args, **kwargs), ps)
    elif kind == "positions" and group.sequence_parallel:
        layer.call = lambda *args, **kwargs: sequence_chunk(call(*args, **kwargs), group)
    elif kind == "segments" and group.sequence_parallel:
        layer.call = lambda *args, **kwargs: sequence_chunk(call(*args, **kwargs), group, 1)
    elif kind == "sequence_output" and group.sequence_parallel:
        def whole_call(*args, **kwargs):
            sequence, *rest = call(*args, **kwargs)
            return (gather_whole_sequence(sequence, group), *rest)

        layer.call = whole_call
    elif kind == "sequence_first" and group.sequence_parallel:
        layer.call = lambda x, *args, **kwargs: call(from_first_rank(x, group), *args, **kwargs)
