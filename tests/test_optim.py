"""tfbig.optim.rebuild_optimizer: an optimizer made to update other variables (elastic ZeRO's
slices in a new world) behaves and saves as one built for them, its step and loss scale kept."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfbig.config import TrainConfig
from tfbig.optim import build_optimizer, rebuild_optimizer


def train_config(precision):
    t = TrainConfig()
    t.max_steps, t.warmup_steps, t.weight_decay, t.precision = 10, 2, 0.1, precision
    return t


def variables(seed, sizes=(3, 2)):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=n).astype(np.float32), name=f"w{i}")
            for i, n in enumerate(sizes)]


def grads(step, sizes=(3, 2)):
    return [tf.constant(np.full(n, 0.1 * (step + 1) + i, np.float32))
            for i, n in enumerate(sizes)]


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_a_rebuilt_optimizer_steps_and_saves_as_a_fresh_one(tmp_path, precision):
    t = train_config(precision)
    old = variables(0, (6, 4))
    rebuilt = build_optimizer(t, old)
    rebuilt.apply(grads(0, (6, 4)), old)  # one step on the old variables: step 1
    new = variables(1)
    rebuild_optimizer(rebuilt, new, no_decay=[new[1]])

    reference = variables(1)
    fresh = build_optimizer(t, reference, no_decay=[reference[1]])
    fresh_inner = getattr(fresh, "inner_optimizer", fresh)
    fresh_inner.iterations.assign(1)  # the rebuilt one keeps its step count
    inner = getattr(rebuilt, "inner_optimizer", rebuilt)
    assert int(inner.iterations) == 1
    assert [v.shape for v in inner._momentums] == [(3,), (2,)]
    for step in range(1, 4):
        rebuilt.apply(grads(step), new)
        fresh.apply(grads(step), reference)
    for a, b in zip(new, reference):  # the same schedule, slots and decay (w1 none)
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(inner.iterations) == 4

    saved = tf.train.Checkpoint(optimizer=rebuilt).save(os.path.join(tmp_path, "rebuilt"))
    fresh_saved = tf.train.Checkpoint(optimizer=fresh).save(os.path.join(tmp_path, "fresh"))
    assert tf.train.list_variables(saved) == tf.train.list_variables(fresh_saved)
    target = variables(2)
    restored = build_optimizer(t, target)
    tf.train.Checkpoint(optimizer=restored).restore(saved).assert_existing_objects_matched()
    restored_inner = getattr(restored, "inner_optimizer", restored)
    assert int(restored_inner.iterations) == 4
    for a, b in zip(restored_inner._velocities, inner._velocities):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
