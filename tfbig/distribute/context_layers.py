"""What context parallelism does to a model's layers (tfbig.distribute.context_parallel): the
sequence cut (`ContextGroup`), the collectives along it, the attention over the group's keys
and values, and the wraps a context plan puts on layers (a model's `layout().context`, or a
user task's `context_layout`). The layers themselves are unchanged Keras code.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.context_parallel).
"""
import dataclasses

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record  # stop_recording: no public equivalent

from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.tensor_collectives import on_sequence_axis
from tfbig.layouts.tensor_plan import resolve_plan_layers
from tfbig.models.attention import blockwise_attention, blockwise_attention_backward
from tfbig.models.layout import layout_of


@dataclasses.dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context group and the sequence cut it implies."""

    process_set: object
    rank: int
    size: int
    seq_length: int

    @property
    def chunk(self):
        return self.seq_length // (2 * self.size)

    def positions(self, rank=None):
        """The positions rank `rank` (default: this one) holds: chunks i and 2C-1-i."""
        i, c, last = self.rank if rank is None else rank, self.chunk, 2 * self.size - 1
        return np.concatenate([np.arange(i * c, (i + 1) * c),
                               np.arange((last - i) * c, (last - i + 1) * c)]).astype(np.int32)

    def offsets(self):
        """The first position of each of this rank's two chunks."""
        return self.rank * self.chunk, (2 * self.size - 1 - self.rank) * self.chunk

    def gathered_positions(self):
        """The position of each row of an all-gather (rank 0's rows, then rank 1's...)."""
        return np.concatenate([self.positions(r) for r in range(self.size)])


def check_sequence(seq_length, size, user=False):
    """Refuse a sequence the 2C chunks do not divide evenly (`user`: a user task's, whose
    tokens_per_example gives its length)."""
    if seq_length % (2 * size):
        fix = ("set the task's tokens_per_example to its sequence length" if user else
               f"choose a --seq_length divisible by {2 * size}")
        raise ValueError(f"--context_parallel={size}: the sequence length {seq_length} "
                         + ("(the task's tokens_per_example) " if user else "")
                         + f"is not a multiple of 2 x {size} (each rank holds 2 of {2 * size} "
                         f"equal chunks); {fix}")


def local_rows(x, group, axis=1):
    """This rank's rows of a whole-sequence tensor (B, T, ...) along `axis` (no communication)."""
    return tf.gather(x, group.positions(), axis=axis)


def _all_gather_in_order(x, group):
    """(B, T/C, ...) of every rank -> (B, T, ...) in sequence order."""
    y = on_sequence_axis(lambda t: hvd.allgather(t, process_set=group.process_set), x)
    y = tf.ensure_shape(y, [x.shape[0], group.seq_length] + list(x.shape[2:]))
    return tf.gather(y, np.argsort(group.gathered_positions()), axis=1)


def _reduce_scatter_in_order(dy, group):
    """(B, T, ...) gradient of a gathered whole on every rank -> the sum over the group of
    this rank's rows (B, T/C, ...), in the rank's own row order."""
    by_rank = tf.gather(dy, group.gathered_positions(), axis=1)
    return on_sequence_axis(lambda t: hvd.reducescatter(
        t, op=hvd.Sum, process_set=group.process_set), by_rank)


def gather_keys_values(x, group):
    """(B, T/C, ...) keys/values -> (B, T, ...) forward; backward every rank's gradient of the
    whole is summed and each rank keeps its own rows (a reduce-scatter)."""
    @tf.custom_gradient
    def gather(x):
        return _all_gather_in_order(x, group), lambda dy: _reduce_scatter_in_order(dy, group)

    return gather(x)


def gather_whole_sequence(x, group):
    """(B, T/C, H) -> (B, T, H) for a region every context rank computes alike (the heads);
    backward this rank's rows of the gradient, times C: the data x context average of the
    gradients then sums the C ranks' parts instead of averaging them."""
    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            return local_rows(dy, group) * tf.cast(group.size, dy.dtype)

        return _all_gather_in_order(x, group), grad

    return gather(x)


def first_row_everywhere(x, group):
    """Rank 0's `x` (the [CLS] row: position 0 is on rank 0) on every rank forward; backward
    the gradient, times C (as gather_whole_sequence), goes to rank 0's `x` only."""
    keep = tf.cast(group.rank == 0, x.dtype)

    @tf.custom_gradient
    def first(x):
        y = hvd.allreduce(x * keep, op=hvd.Sum, process_set=group.process_set)
        return y, lambda dy: dy * keep * tf.cast(group.size, dy.dtype)

    return first(x)


def context_attention(layer, group):
    """A replacement for `layer.attend` (tfbig.models.layers.MultiHeadAttention, Llama's
    grouped-query attention): this rank's two query chunks against the keys and values of the
    whole context group."""
    def attend(q, k, v, input_mask=None, training=False, cache_index=None):
        if cache_index is not None:
            raise ValueError("--context_parallel: a key/value cache (generation) runs on one "
                             "process; load the checkpoint with tfbig-generate")
        rate = layer.dropout if training else 0.0
        seed = layer.attn_dropout.seed_generator.next() if rate else None
        return attend_over_group(q, tf.concat([k, v], axis=-1), group, causal=layer.causal,
                                 key_mask=input_mask, block_size=layer.attention_block_size,
                                 dropout=rate, seed=seed)

    return attend


def keras_context_attention(layer, group):
    """A replacement for keras.layers.MultiHeadAttention's `_compute_attention` (a user model's
    attention, declared in its task's context_layout): this rank's query chunks against the
    projected keys and values of the whole context group, causal by global position when the
    layer is called with use_causal_mask=True."""
    def compute(query, key, value, attention_mask=None, training=None,
                return_attention_scores=False, use_causal_mask=False):
        if attention_mask is not None or return_attention_scores:
            raise ValueError(f"--context_parallel: {layer.path} was called with an attention "
                             f"mask or for its scores; a context-parallel attention takes no "
                             f"mask but its causal one (use_causal_mask=True)")
        rate = layer._dropout if training else 0.0
        seed = layer._dropout_layer.seed_generator.next() if rate else None
        return attend_over_group(query, tf.concat([key, value], axis=-1), group,
                                 causal=use_causal_mask, dropout=rate, seed=seed), None

    return compute


def attend_over_group(q, kv, group, seed=None, **options):
    """Blockwise attention of this rank's queries q (B, T/C, nh, hs) over the keys and values
    of every rank of `group` (kv: this rank's (B, T/C, kv, 2 hs); grouped-query attention's kv
    heads, fewer than nh, are gathered as they are and repeated to the query heads after), each
    of its two chunks with its position offset. The gathered keys and values are not kept for the backward: it
    gathers them again (one more all-gather per layer for O(T) less memory), differentiates
    with the forward's saved output and log-sum-exp (`blockwise_attention_backward`) and
    reduce-scatters their gradients. `options`: blockwise_attention's causal, key_mask,
    block_size, dropout."""
    width, c = kv.shape[-1] // 2, group.chunk
    groups = q.shape[2] // kv.shape[2]  # query heads per key/value head

    def chunks(q, whole):
        k, v = _repeat_heads(whole[..., :width], groups), _repeat_heads(whole[..., width:], groups)
        for half, offset in enumerate(group.offsets()):
            chunk_seed = None if seed is None else seed + tf.constant([half, 0], seed.dtype)
            yield (q[:, half * c:(half + 1) * c], k, v,
                   dict(options, query_offset=offset, seed=chunk_seed))

    @tf.custom_gradient
    def attend(q, kv):
        with record.stop_recording():  # keep nothing of the whole for the outer tape
            results = [blockwise_attention(q_i, k, v, **opts)
                       for q_i, k, v, opts in chunks(q, _all_gather_in_order(kv, group))]

        def grad(d_out):
            with tf.control_dependencies([d_out]):  # gather when the backward gets here
                whole = _all_gather_in_order(kv, group)
            dq, dk, dv = [], 0.0, 0.0
            for half, (q_i, k, v, opts) in enumerate(chunks(q, whole)):
                dq_i, dk_i, dv_i = blockwise_attention_backward(
                    q_i, k, v, *results[half], d_out[:, half * c:(half + 1) * c], **opts)
                dq, dk, dv = dq + [dq_i], dk + dk_i, dv + dv_i
            d_whole = tf.concat([_sum_groups(dk, groups), _sum_groups(dv, groups)],
                                axis=-1)  # (B, T, kv, 2 hs)
            return tf.concat(dq, axis=1), _reduce_scatter_in_order(d_whole, group)

        return tf.concat([out for out, _ in results], axis=1), grad  # (B, T/C, nh, hs)

    return attend(q, kv)


def _repeat_heads(x, groups):
    """(B, T, kv, hs) -> (B, T, kv * groups, hs), query head h reading key/value head h // groups."""
    return x if groups == 1 else tf.repeat(x, groups, axis=2)


def _sum_groups(dx, groups):
    """The gradient of _repeat_heads: (B, T, kv * groups, hs) -> (B, T, kv, hs)."""
    if groups == 1:
        return dx
    batch, length = tf.shape(dx)[0], tf.shape(dx)[1]
    heads, hs = dx.shape[2], dx.shape[3]
    return tf.reduce_sum(tf.reshape(dx, [batch, length, heads // groups, groups, hs]), axis=3)


def summed_over(group, values):
    """Each of `values` summed over the context group, in one all-reduce (Horovod's gradient:
    the ranks' gradients summed)."""
    sizes = [int(np.prod(v.shape)) for v in values]  # static: (E,), (E,), ()
    flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
    summed = hvd.allreduce(flat, op=hvd.Sum, process_set=group.process_set)
    return [tf.reshape(part, v.shape) for part, v in zip(tf.split(summed, sizes), values)]


def wrap(layer, kind, group):
    call = layer.call
    if kind == "tokens":  # an Embedding(token_ids): this rank's rows
        layer.call = lambda token_ids, *args, **kwargs: call(local_rows(token_ids, group), *args,
                                                             **kwargs)
    elif kind == "rope_positions":  # rotary embeddings at this rank's positions
        positions = group.positions().astype(np.float32)
        layer.positions = lambda length, start_index: tf.constant(positions)
    elif kind == "inputs":  # Embeddings(token_ids, segment_ids=None, ...): this rank's rows
        def inputs_call(token_ids, segment_ids=None, *args, **kwargs):
            segments = None if segment_ids is None else local_rows(segment_ids, group)
            return call(local_rows(token_ids, group), segments, *args, **kwargs)

        layer.call = inputs_call
    elif kind == "positions":  # the table read at this rank's positions
        layer.call = lambda positions, *args, **kwargs: call(
            tf.constant(group.positions()), *args, **kwargs)
    elif kind == "attention" and hasattr(layer, "attend"):
        layer.attend = context_attention(layer, group)
    elif kind == "attention":  # a keras MultiHeadAttention (a user model's)
        layer._compute_attention = keras_context_attention(layer, group)
    elif kind == "output":  # the outputs the loss reads: gathered whole on every context rank
        layer.call = lambda *args, **kwargs: gather_whole_sequence(call(*args, **kwargs), group)
    elif kind == "whole_sequence":  # a backbone: (sequence, pooled) -> sequence gathered
        def whole_call(*args, **kwargs):
            sequence, *rest = call(*args, **kwargs)
            return (gather_whole_sequence(sequence, group), *rest)

        layer.call = whole_call
    elif kind == "routing_sums":  # an MoE layer: its router's statistics over whole sequences
        if layer.capacity_factor > 0:
            raise ValueError(f"--context_parallel with --capacity_factor="
                             f"{layer.capacity_factor:g}: an expert's capacity is filled in "
                             f"token order over the whole batch, and each context rank holds "
                             f"part of every sequence; use dropless routing "
                             f"(--capacity_factor=0) or --context_parallel=1")
        layer.token_sums = lambda *values: summed_over(group, values)
    elif kind == "first_row":
        layer.call = lambda x, *args, **kwargs: call(first_row_everywhere(x, group), *args,
                                                     **kwargs)
    else:
        raise ValueError(f"unknown context-parallel wrap {kind!r}")


# what a user task's context_layout may say of a layer -> the layer it must be
USER_KINDS = {"tokens": keras.layers.Embedding, "positions": keras.layers.Embedding,
              "attention": keras.layers.MultiHeadAttention, "output": keras.layers.Layer}


def user_plan(model, declared, name):
    """A user task's context_layout ({attribute path: kind}) as a plan, each entry checked on
    the built model: its kind known, its path naming layers of that kind (an attention with
    keys and values of one width)."""
    for path, kind in declared.items():
        if kind not in USER_KINDS:
            raise ValueError(f"{name}.context_layout[{path!r}] = {kind!r}: expected one of "
                             f"{sorted(USER_KINDS)}")
        layers = resolve_plan_layers(model, path)
        bad = [layer for layer in layers if not isinstance(layer, USER_KINDS[kind]) or (
            kind == "attention" and layer._key_dim != layer._value_dim)]
        if not layers or bad:
            found = ", ".join(f"{type(b).__name__} {b.path}" for b in bad) or "no layer"
            raise ValueError(f"{name}.context_layout[{path!r}] = {kind!r} names {found}; "
                             f"expected a keras.layers.{USER_KINDS[kind].__name__}"
                             + (" with value_dim equal to key_dim" if kind == "attention"
                                else ""))
    return list(declared.items())


def plan_for(model, task=None):
    """The context plan of `task` (a user task's context_layout, `user_plan`) or of `model`
    (its `layout().context`: attribute path -> what the wrap does there,
    tfbig.models.layout); refused by name where there is none."""
    declared = getattr(task, "context_layout", None)
    if declared:
        return user_plan(model, declared, getattr(task, "user_name", type(task).__name__))
    plan = layout_of(model).context
    if not plan:
        raise ValueError(f"--context_parallel: no context-parallel plan for "
                         f"{type(model).__name__} (GPT, Llama, BERT and ALBERT pretraining declare one "
                         f"in their layout(), tfbig.models.layout); run it with "
                         f"--context_parallel=1")
    return plan


def apply_plan(model, task, group):
    """Wrap `model`'s layers (and, for GPT, the task's per-token loss) for context `group`."""
    for pattern, kind in plan_for(model, task):
        layers = resolve_plan_layers(model, pattern)
        if not layers:
            raise ValueError(f"--context_parallel: {type(model).__name__} has no {pattern}")
        for layer in layers:
            wrap(layer, kind, group)
    if layout_of(model).local_loss:  # a causal LM's labels are cut like its inputs
        if getattr(task, "format", "") == "completion":
            raise ValueError("--context_parallel: completion data (tfbig-prep "
                             "--format=completion) carries a loss mask per token, which is not "
                             "cut over the context ranks; fine-tune with --context_parallel=1")
        whole = task.vocab_cross_entropy
        task.vocab_cross_entropy = lambda labels, logits: whole(local_rows(labels, group),
                                                                logits)
