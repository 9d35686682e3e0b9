"""A user task's declared tensor layout (tfbig.tasks.user_layout.declared_layout,
tfbig.layouts.tensor_layout.split_declared_model, the collectives of
tfbig.distribute.tensor_parallel) in one process: the T ranks of a tensor group run as T
threads whose all-reduces and all-gathers meet in memory (ThreadCollectives stands in for
Horovod), so the split MyModel (examples/own_model.py: vocabulary, attention heads and
feed-forward pairs all declared) is compared with the unsplit one on logits and on every
weight's gradient, the ranks' slices joined. What the degree must divide is refused by name.
The multi-process proof (horovodrun, trained weights) is tests/distribute/test_api_parallel.py.
"""
import os
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
from equality import GRADIENT_ATOL, GRADIENT_RTOL  # noqa: E402

import own_model  # noqa: E402

from tfbig.distribute import tensor_collectives, tensor_layers, tensor_parallel  # noqa: E402
from tfbig.layouts.tensor_plan import TensorGroup  # noqa: E402,E501
from tfbig.layouts.tensor_layout import join_slices, split_declared_model
from tfbig.errors import UsageError  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402,E501
from tfbig.tasks.user_layout import declared_layout, fresh_layer_names
from tfbig.tasks.user_adapter import UserTask


class ThreadCollectives:
    """Horovod's allreduce (Sum) and allgather (along axis 0) among `size` threads, one per
    tensor rank; a rank is told by its process set (`process_set.rank`). The sum adds the
    ranks' values in rank order, the same on every rank, as Horovod's does."""

    Sum = "sum"

    def __init__(self, size):
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots = [None] * size

    def _exchange(self, x, rank):
        self.slots[rank] = tf.convert_to_tensor(x)
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody writes the next collective's value before all have read
        return values

    def allreduce(self, x, op=None, process_set=None):
        assert op == self.Sum
        return tf.add_n(self._exchange(x, process_set.rank))

    def allgather(self, x, process_set=None):
        return tf.concat(self._exchange(x, process_set.rank), axis=0)


class Rank:
    """The process set of a thread-simulated tensor rank."""

    def __init__(self, rank):
        self.rank = rank


def seeded(build):
    keras.utils.set_random_seed(0)  # every process of a run initialises from --seed
    return build()


def forward_backward(model, inputs, targets):
    """(logits, {path: gradient}) of one batch."""
    with tf.GradientTape() as tape:
        logits = model(inputs, training=True)
        loss = own_model.loss_fn(targets, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    return logits.numpy(), {v.path: tf.convert_to_tensor(g).numpy()  # embeddings: IndexedSlices
                            for v, g in zip(model.trainable_variables, grads)}


def in_threads(work, size):
    """[work(rank) for each rank], each in its own thread (their collectives meet)."""
    results, errors = [None] * size, []

    def one(rank):
        try:
            results[rank] = work(rank)
        except Exception as error:  # noqa: BLE001 - re-raised below, the others released
            errors.append(error)
            tensor_collectives.hvd.barrier.abort()

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# MyModel's SIZE has 2 heads; a group of 4 splits a 4-head twin.
SIZES = {2: own_model.SIZE, 4: {**own_model.SIZE, "num_heads": 4}}


@pytest.mark.parametrize("size", sorted(SIZES))
def test_my_model_with_heads_vocab_and_ffn_split_equals_the_unsplit_model(monkeypatch, size):
    """Each rank holds 1/T of the declared variables (slices of the single-device
    initialisation) under their single-device paths and in the same order; T threads' split
    models give the unsplit model's logits on every rank and
    its gradients: the split variables' joined from the ranks' slices, the replicated ones
    (LayerNorms, position table, the attention output and row biases) whole on every rank."""
    monkeypatch.setattr(tensor_collectives, "hvd", ThreadCollectives(size))
    model_fn = lambda: own_model.model_fn(SIZES[size])  # noqa: E731
    task = UserTask(FunctionTask(model_fn, tensor_layout=own_model.LAYOUT))
    with fresh_layer_names():
        full = seeded(model_fn)
    ranks = [seeded(lambda: split_declared_model(
        task, TensorGroup(Rank(rank), rank, size), wrap=tensor_layers.wrap))
        for rank in range(size)]
    splits = ranks[0][1]
    attention = "my_model/transformer_block/multi_head_attention"
    assert splits[f"{attention}/query/kernel"] == (1, 1)  # (H, N, d): the heads axis
    assert splits[f"{attention}/query/bias"] == (0, 1)  # (N, d)
    assert splits[f"{attention}/attention_output/kernel"] == (0, 1)  # (N, d, H)
    assert f"{attention}/attention_output/bias" not in splits  # added once, after the sum
    assert splits["my_model/token_and_position_embedding/embedding/embeddings"] == (0, 1)
    assert "my_model/token_and_position_embedding/embedding_1/embeddings" not in splits
    assert splits["my_model/dense_4/kernel"] == splits["my_model/dense_4/bias"] == (-1, 1)
    assert len(splits) == 2 * (7 + 3) + 1 + 2  # per block: q, k, v (W, b), out W; W, b; W
    for model, _ in ranks:
        assert [v.path for v in model.trainable_variables] == \
            [v.path for v in full.trainable_variables]
        assert model.transformer_blocks[0].att.num_heads == SIZES[size]["num_heads"] // size
    held = [{v.path: v.numpy() for v in model.trainable_variables} for model, _ in ranks]
    for v in full.trainable_variables:  # the slices of the single-device initialisation
        if v.path in splits:
            joined = join_slices([weights[v.path] for weights in held], *splits[v.path])
        else:
            joined = held[-1][v.path]
        np.testing.assert_array_equal(joined, v.numpy(), err_msg=v.path)

    examples = own_model.sequences(4, seed=3)
    inputs, targets = examples[:, :-1], examples[:, 1:]
    logits, grads = forward_backward(full, inputs, targets)
    results = in_threads(lambda rank: forward_backward(ranks[rank][0], inputs, targets), size)
    for rank_logits, _ in results:
        np.testing.assert_allclose(rank_logits, logits, rtol=1e-5, atol=1e-6)
    for v in full.trainable_variables:
        pieces = [rank_grads[v.path] for _, rank_grads in results]
        if v.path in splits:
            assert pieces[0].size == v.numpy().size // size, v.path
            ours = join_slices(pieces, *splits[v.path])
        else:
            np.testing.assert_array_equal(pieces[0], pieces[-1], err_msg=v.path)
            ours = pieces[0]
        assert np.any(grads[v.path]), v.path  # a gradient that could be wrong
        # T partial sums added in another order: a few float32 ulps of the largest entries
        atol = max(GRADIENT_ATOL, 1e-6 * np.abs(grads[v.path]).max())
        np.testing.assert_allclose(ours, grads[v.path], rtol=GRADIENT_RTOL, atol=atol,
                                   err_msg=v.path)


@pytest.mark.parametrize("layout, message", [
    pytest.param({"transformer_blocks.*.att": "heads"},
     "--tensor_parallel=3 does not divide my_model/transformer_block/multi_head_attention's "
     "num_heads=2", id="heads"),
    pytest.param({"embedding_layer.token_emb": "vocab"},
     "--tensor_parallel=3 does not divide my_model/token_and_position_embedding/embedding's "
     "vocabulary (input_dim)=32", id="vocab_embedding"),
    pytest.param({"output_layer": "vocab"},
                 "--tensor_parallel=3 does not divide my_model/dense_4's vocabulary (units)=32",
                 id="vocab_dense"),
])
def test_a_degree_that_does_not_divide_the_heads_or_the_vocabulary_is_refused(layout, message):
    task = UserTask(FunctionTask(own_model.model_fn, tensor_layout=layout))
    with pytest.raises(ValueError) as error:
        split_declared_model(task, TensorGroup(None, 0, 3))
    assert message in str(error.value)


@pytest.mark.parametrize("layout, message", [
    pytest.param({"output_layer": "heads"}, "'my_model/dense_4' (Dense) is split by 'column', "
                 "'row' or 'vocab'; 'heads' splits MultiHeadAttention layers", id="heads_dense"),
    pytest.param({"embedding_layer.token_emb": "row"}, "(Embedding) is split by 'vocab'; 'row' "
                 "splits Dense layers", id="row_embedding"),
    pytest.param({"embedding_layer.pos_emb": "heads"}, "(Embedding) is split by 'vocab'; "
                 "'heads' splits MultiHeadAttention layers", id="heads_embedding"),
    pytest.param({"transformer_blocks.0.layernorm1": "column"}, "names LayerNormalization "
                 "'layer_normalization', not a built keras.layers.Dense, MultiHeadAttention or "
                 "Embedding", id="layer_norm"),
    pytest.param({"transformer_blocks.0.ffn.layers.0": "vocab"}, "the vocab-split Dense "
                 "'my_model/transformer_block/sequential/dense' has activation 'relu', which "
                 "would act on each rank's slice of the logits", id="vocab_activation"),
    pytest.param({"*/multi_head_attention/key": "heads"}, "names 'my_model/transformer_block/"
                 "multi_head_attention/key/kernel', not the weights of a keras.layers.Dense, "
                 "MultiHeadAttention or Embedding; only those are split (a MultiHeadAttention "
                 "as a whole, by 'heads')", id="attention_projection"),
])
def test_a_kind_on_a_layer_it_does_not_split_is_refused_by_name(my_model, layout, message):
    with pytest.raises(UsageError) as error:
        declared_layout(my_model, layout, "MyTask")
    assert message in str(error.value)
    assert str(error.value).startswith(f"MyTask.tensor_layout[{next(iter(layout))!r}]")


@pytest.fixture(scope="module")
def my_model():
    with fresh_layer_names():
        return own_model.model_fn()


def functional_model():
    """A functional Keras model with an attention whose probabilities drop out."""
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(16, 8)(inputs)
    x = keras.layers.MultiHeadAttention(2, 4, dropout=0.5)(x, x)
    x = keras.layers.Dropout(0.5)(x)
    return keras.Model(inputs, keras.layers.Dense(16)(x))


def test_a_functional_model_splits_by_layer_path_and_its_attention_drops_its_own_heads(
        monkeypatch):
    """Layers named by their paths (a functional model has no attributes to name them by):
    the split model gives the unsplit one's logits (inference, T = 2 threads); the dropout of
    a split attention's probabilities draws each rank's own mask (its seed state offset by
    the rank), the dropout of the replicated activations the same mask on every rank."""
    monkeypatch.setattr(tensor_collectives, "hvd", ThreadCollectives(2))
    layout = {"embedding": "vocab", "multi_head_attention": "heads", "dense": "vocab"}
    task = UserTask(FunctionTask(functional_model, tensor_layout=layout))
    with fresh_layer_names():
        full = seeded(functional_model)
    ranks = [seeded(lambda: split_declared_model(
        task, TensorGroup(Rank(rank), rank, 2), wrap=tensor_layers.wrap))
        for rank in range(2)]
    assert len(ranks[0][1]) == 1 + 7 + 2
    states = [{v.path: v.numpy() for v in model.variables if "seed_generator" in v.path}
              for model in [full] + [model for model, _ in ranks]]
    attention = "multi_head_attention/seed_generator/seed_generator_state"
    assert len(states[0]) == 2 and attention in states[0]
    for path, value in states[0].items():
        offsets = (0, 1) if path == attention else (0, 0)
        for rank, offset in enumerate(offsets):
            np.testing.assert_array_equal(states[1 + rank][path], value + offset, err_msg=path)
    inputs = np.random.default_rng(0).integers(0, 16, (2, 8))
    expected = full(inputs).numpy()
    results = in_threads(lambda rank: ranks[rank][0](inputs).numpy(), 2)
    for logits in results:
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


def test_a_single_device_checkpoint_restores_into_each_ranks_declared_slices(tmp_path):
    """A tensor-parallel run of a user task started on a single-device checkpoint (tfbig's
    restore_from_single_device, here for each rank in one process): every weight and optimizer
    slot is its slice of the single-device state, the replicated ones whole."""
    from tfbig.api import configure
    from tfbig.training.consolidate import OfflineSlice
    from tfbig.checkpoints.checkpoint import state_arrays
    from tfbig.training.trainer import Trainer

    class SliceOnLoad(OfflineSlice):
        def restore(self, trainer, path):
            tensor_parallel.restore_from_single_device(trainer, path, self.group, self.splits)

    def task(layout=None):
        return UserTask(FunctionTask(own_model.model_fn, own_model.loss_fn,
                                     own_model.dataset_fn, tensor_layout=layout))

    config = configure(max_steps=2, batch_size=8, xla=False, peak_tflops=1.0,
                       model_dir=str(tmp_path))
    single = Trainer(config, task=task())
    rng = np.random.default_rng(0)  # a trained state: every weight and slot its own values
    for v in single.model.variables + single.optimizer.variables:
        if v.dtype.startswith("float") and len(v.shape):
            v.assign(rng.normal(size=v.shape).astype(v.dtype))
    single.step.assign(2)
    path = single.save()
    full = state_arrays(single, {})
    pieces = []
    for rank in range(2):
        trainer = Trainer(config, strategy=SliceOnLoad(config, rank, 2, path),
                          task=task(own_model.LAYOUT))
        assert trainer.restored_from == path and int(trainer.step.numpy()) == 2
        pieces.append(state_arrays(trainer, trainer.strategy.splits))
    assert set(pieces[0]) == set(full)
    assert sum(piece is not None for _, piece in pieces[0].values()) == 3 * 23  # W, m, v
    for name, (value, _) in full.items():
        piece = pieces[0][name][1]
        values = [p[name][0] for p in pieces]
        if piece is not None:
            np.testing.assert_array_equal(join_slices(values, *piece), value, err_msg=name)
        else:
            for held in values:
                np.testing.assert_array_equal(held, value, err_msg=name)
