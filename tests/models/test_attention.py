"""Blockwise attention (tfbig.models.attention) against dense attention, in float32: outputs and
gradients of every input and weight (causal and bidirectional, padding, uneven final blocks,
XLA), dropout masks drawn again in the backward, partial results merged through their
log-sum-exp, a generation with the key/value cache, a GPT and a BERT trained a few steps, and
no (T, T) tensor per head in the traced graph."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfbig.models.generation import Generator
from tfbig.models.attention import blockwise_attention, merge_attention
from tfbig.models.bert import BertConfig, BertForPretraining
from tfbig.models.gpt import GPT, GPTConfig
from tfbig.models.layers import MultiHeadAttention

RTOL = 1e-5


def close(actual, expected):
    """Equal within rtol 1e-5, and 1e-6 of the tensor's largest entry for entries near 0 (the
    gradient of the key bias is 0 in exact arithmetic: what is left is rounding)."""
    expected = np.asarray(expected)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=1e-6 * scale)


def padding(batch, length):
    """1 for real tokens: the first sequence whole, the second with its last 4 tokens padded."""
    mask = np.ones((batch, length), "int32")
    mask[1, -4:] = 0
    return mask


def attention_pair(causal, block_size, hidden=32, heads=4):
    """A dense and a blockwise layer with the same weights."""
    keras.utils.set_random_seed(0)
    dense = MultiHeadAttention(hidden, heads, causal=causal, attention="dense")
    blockwise = MultiHeadAttention(hidden, heads, causal=causal, attention="blockwise",
                                   attention_block_size=block_size)
    dense.build((None, None, hidden))
    blockwise.build((None, None, hidden))
    for a, b in zip(dense.weights, blockwise.weights):
        b.assign(a.numpy() + np.random.default_rng(1).normal(0, 0.2, a.shape))  # biases too
        a.assign(b.numpy())
    return dense, blockwise


def outputs_and_gradients(layer, x, mask, jit_compile):
    weight = tf.constant(np.random.default_rng(2).normal(size=x.shape), tf.float32)

    @tf.function(jit_compile=jit_compile)
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, mask)
            loss = tf.reduce_sum(y * weight)
        return [y] + tape.gradient(loss, [x] + layer.trainable_variables)

    return [t.numpy() for t in run(tf.constant(x))]


# (causal, length, block_size, padded)
CASES = {"causal": (True, 16, 4, False), "causal uneven": (True, 11, 4, False),
         "bidirectional padded uneven": (False, 11, 4, True),
         "bidirectional padded, one block longer than T": (False, 7, 16, True)}


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_equals_dense_outputs_and_gradients(case, jit_compile):
    causal, length, block_size, padded = CASES[case]
    dense, blockwise = attention_pair(causal, block_size)
    x = np.random.default_rng(0).normal(size=(2, length, 32)).astype("float32")
    mask = padding(2, length) if padded else None
    expected = outputs_and_gradients(dense, x, mask, jit_compile)
    actual = outputs_and_gradients(blockwise, x, mask, jit_compile)
    assert len(actual) == 2 + 4  # y, dx, and the qkv and proj kernels and biases
    for a, e in zip(actual, expected):
        close(a, e)


def dense_reference(q, k, v, causal=False, query_offset=0, keep=None, rate=0.0):
    """softmax attention with every (T, S) tensor formed; `keep`: a (B, nh, T, S) dropout mask."""
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        visible = tf.range(k.shape[1])[None, :] <= query_offset + tf.range(q.shape[1])[:, None]
        scores = tf.where(visible, scores, -1e9)
    lse = tf.transpose(tf.reduce_logsumexp(scores, axis=-1), (0, 2, 1))  # (B, T, nh)
    probs = tf.nn.softmax(scores, axis=-1)
    if keep is not None:
        probs = tf.where(keep, probs / (1 - rate), 0.0)
    return tf.einsum("bhqk,bkhd->bqhd", probs, v), lse


def qkv(length, keys=None, size=8, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=(2, n, 2, size)), tf.float32)
            for n in (length, keys or length, keys or length)]


def gradients(attend, q, k, v):
    """Output, log-sum-exp and the gradients of q, k, v of a loss that reads both outputs."""
    rng = np.random.default_rng(3)
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out, lse = attend(q, k, v)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * rng.normal(size=out.shape)) + tf.reduce_sum(
            tf.where(tf.math.is_finite(lse), lse, 0.0) * rng.normal(size=lse.shape))
    return [out, lse] + tape.gradient(loss, [q, k, v])


def test_dropout_masks_are_drawn_again_in_the_backward():
    q, k, v = qkv(10)
    seed = tf.constant([7, 3])
    # with one-hot values the output is the dropped-out probabilities themselves: the mask
    one_hot = tf.broadcast_to(tf.eye(10)[None, :, None, :], (2, 10, 2, 10))
    dropped, _ = blockwise_attention(q, k, one_hot, dropout=0.3, seed=seed, block_size=4)
    keep = tf.transpose(dropped, (0, 2, 1, 3)) > 0  # (B, nh, T, S)
    assert 0.15 < 1 - tf.reduce_mean(tf.cast(keep, tf.float32)) < 0.45
    actual = gradients(lambda *t: blockwise_attention(*t, dropout=0.3, seed=seed, block_size=4),
                       q, k, v)
    expected = gradients(lambda *t: dense_reference(*t, keep=keep, rate=0.3), q, k, v)
    for a, e in zip(actual, expected):
        close(a, e)
    other, _ = blockwise_attention(q, k, one_hot, dropout=0.3, seed=seed + 1, block_size=4)
    assert np.any((other.numpy() > 0) != (dropped.numpy() > 0))  # another seed, other masks


def test_layer_dropout_draws_new_masks_each_call_and_none_outside_training():
    keras.utils.set_random_seed(0)
    layer = MultiHeadAttention(16, 2, dropout=0.5, causal=True, attention="blockwise",
                               attention_block_size=4)
    x = np.random.default_rng(0).normal(size=(1, 9, 16)).astype("float32")
    first, second = layer(x, training=True), layer(x, training=True)
    assert np.abs(first - second).max() > 1e-3
    dense = MultiHeadAttention.from_config({**layer.get_config(), "attention": "dense"})
    dense.build(x.shape)
    dense.set_weights(layer.get_weights())
    close(layer(x), dense(x))


@pytest.mark.parametrize("causal", [True, False])
def test_partial_results_merge_into_attention_over_all_keys(causal):
    # What a context-parallel step needs: keys split in two pieces, each piece's (out, lse),
    # merged; the second piece's keys start at position 6, so the queries sit at offset -6.
    q, k, v = qkv(11)

    def split(q, k, v):
        first = blockwise_attention(q, k[:, :6], v[:, :6], causal=causal, block_size=4)
        second = blockwise_attention(q, k[:, 6:], v[:, 6:], causal=causal, query_offset=-6,
                                     block_size=4)
        return merge_attention(*first, *second)

    for a, e in zip(gradients(split, q, k, v), gradients(
            lambda *t: dense_reference(*t, causal=causal), q, k, v)):
        close(a, e)


def test_queries_after_the_keys_start_see_keys_up_to_their_position():
    # a key/value cache: 3 new queries at positions 9..11 of 12 cached keys
    q, k, v = qkv(3, keys=12)
    for a, e in zip(gradients(lambda *t: blockwise_attention(*t, causal=True, query_offset=9,
                                                             block_size=5), q, k, v),
                    gradients(lambda *t: dense_reference(*t, causal=True, query_offset=9),
                              q, k, v)):
        close(a, e)


def test_lengths_known_only_at_run_time():
    # an export's signature leaves T open: the tiling is then computed in the graph
    dense, blockwise = attention_pair(True, 4)
    run = lambda layer: tf.function(layer, input_signature=[  # noqa: E731
        tf.TensorSpec((None, None, 32))])
    for length in (3, 10):
        x = np.random.default_rng(length).normal(size=(2, length, 32)).astype("float32")
        close(run(blockwise)(x), dense(x))


def test_mixed_precision_keeps_float32_statistics():
    q, k, v = qkv(11)
    half = [tf.cast(t, tf.bfloat16) for t in (q, k, v)]
    out, lse, *grads = gradients(lambda *t: blockwise_attention(*t, causal=True, block_size=4),
                                 *half)
    assert out.dtype == tf.bfloat16 and lse.dtype == tf.float32
    assert all(g.dtype == tf.bfloat16 for g in grads)
    expected, expected_lse = dense_reference(q, k, v, causal=True)
    np.testing.assert_allclose(tf.cast(out, tf.float32), expected, atol=0.05)
    np.testing.assert_allclose(lse, expected_lse, atol=0.05)


def gpt(attention, seq_length=20):
    keras.utils.set_random_seed(0)
    model = GPT(GPTConfig(vocab_size=97, seq_length=seq_length, num_layers=2, hidden_size=32,
                          num_heads=4, attention=attention, attention_block_size=8))
    model.build()
    return model


def test_generation_with_the_cache_gives_the_same_tokens():
    prompt = np.random.default_rng(1).integers(0, 97, size=(2, 5))
    dense, blockwise = gpt("dense", seq_length=40), gpt("blockwise", seq_length=40)
    expected = Generator(dense)(prompt, 20, temperature=0.0)
    np.testing.assert_array_equal(Generator(blockwise)(prompt, 20, temperature=0.0), expected)


def train(model, inputs, loss_fn, steps=3):
    # SGD: Adam's first steps move each weight by about lr * sign(gradient), so a gradient
    # that is 0 in exact arithmetic (the key bias's) moves by +-lr on its rounding alone
    optimizer = keras.optimizers.SGD(0.5)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(model(inputs, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)
        return loss

    return [float(step()) for _ in range(steps)], [v.numpy() for v in model.trainable_variables]


def gpt_loss(ids):
    return lambda logits: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        ids[:, 1:], logits[:, :-1]))


def test_gpt_trained_blockwise_equals_dense():
    ids = tf.constant(np.random.default_rng(0).integers(0, 97, size=(2, 20)), tf.int32)
    expected_losses, expected = train(gpt("dense"), ids, gpt_loss(ids))
    losses, weights = train(gpt("blockwise"), ids, gpt_loss(ids))
    close(losses, expected_losses)
    for a, e in zip(weights, expected):
        close(a, e)


def bert(attention):
    keras.utils.set_random_seed(0)
    model = BertForPretraining(BertConfig(vocab_size=101, hidden_size=32, num_heads=4,
                                          num_layers=2, seq_length=16, dropout=0.0,
                                          attention=attention, attention_block_size=4))
    model.build()
    return model


def test_bert_trained_blockwise_with_padding_equals_dense():
    rng = np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(0, 101, (2, 11)).astype("int32"),
              "segment_ids": (np.arange(11) >= 5).astype("int32")[None].repeat(2, 0),
              "input_mask": padding(2, 11), "masked_lm_positions": np.array([[1, 3], [2, 6]])}
    labels = tf.constant([[5, 9], [11, 40]])

    def loss(out):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels, out["mlm_logits"])) + tf.reduce_mean(out["nsp_logits"] ** 2)

    expected_losses, expected = train(bert("dense"), inputs, loss)
    losses, weights = train(bert("blockwise"), inputs, loss)
    close(losses, expected_losses)
    for a, e in zip(weights, expected):
        close(a, e)


def graph_shapes(graph, seen=None):
    """Static shapes of every tensor of a traced graph and of the loop and branch bodies in it."""
    seen = set() if seen is None else seen
    for op in graph.get_operations():
        for output in op.outputs:
            if output.shape.rank is not None:
                yield tuple(output.shape)
        for attr in ("body", "cond", "then_branch", "else_branch", "f"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            if name not in seen:
                seen.add(name)
                yield from graph_shapes(graph._get_function(name).graph, seen)


@pytest.mark.parametrize("attention,holds_scores", [("dense", True), ("blockwise", False)])
def test_training_graph_holds_no_sequence_by_sequence_tensor(attention, holds_scores):
    length = 64
    layer = MultiHeadAttention(24, 2, causal=True, attention=attention,
                               attention_block_size=16)
    layer.build((None, None, 24))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) ** 2)
        return tape.gradient(loss, [x] + layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((1, length, 24))).graph
    shapes = list(graph_shapes(graph))
    square = [s for s in shapes if sum(d == length for d in s) >= 2]
    assert bool(square) == holds_scores, square
    tiles = [s for s in shapes if s[-2:] == (16, 16)]  # the walk reaches the loop bodies
    assert bool(tiles) != holds_scores


def test_unknown_attention_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--attention='flash': expected one of auto \| dense"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="--attention_block_size=0"):
        BertConfig(attention_block_size=0)


def attention_step_peak(attention, length, block_size=128):
    """The CPU allocator's peak above what was held, of one forward and backward of a
    4-head causal attention over `length` tokens (a TensorFlow graph, no XLA)."""
    from tfbig.training.measure import allocator_peak

    keras.utils.set_random_seed(0)
    layer = MultiHeadAttention(64, 4, causal=True, attention=attention,
                               attention_block_size=block_size)
    layer.build((None, None, 64))
    x = tf.random.normal((1, length, 64))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) ** 2)
        return tape.gradient(loss, [x] + layer.trainable_variables)

    return allocator_peak(lambda: [t.numpy() for t in step()], repeats=2)


def test_allocator_peak_holds_tiles_not_the_score_matrix():
    # (1, 4, 1024, 1024) float32 scores are 16 MiB; a (1, 4, 128, 128) tile is 256 KiB. The
    # loops start the next tile only after the last (an unordered TensorFlow while loop once
    # formed up to 10 x 10 tiles at the same time: as much as dense attention holds here).
    dense, blockwise = attention_step_peak("dense", 1024), attention_step_peak("blockwise", 1024)
    assert blockwise < 0.15 * dense, (blockwise, dense)  # here 0.05 (0.27 unordered)


@pytest.mark.slow
def test_allocator_peak_grows_linearly_in_sequence_length():
    blockwise = attention_step_peak("blockwise", 2048)  # 6.5 MiB here; dense: 194 MiB
    assert attention_step_peak("blockwise", 4096) < 2.5 * blockwise
