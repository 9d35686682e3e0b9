"""make_dataset: per-pipeline coverage, determinism, exact skip, corruption, manifest checks."""
import os
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

from tfbig.data import count_records, make_dataset
from tfbig.data import load_manifest


def _rows(dataset, limit=None) -> list[tuple]:
    batches = dataset if limit is None else dataset.take(limit)
    return [tuple(row) for batch in batches for row in batch["input_ids"].numpy().tolist()]


def _pipeline(data_dir, count, index, **kwargs):
    context = tf.distribute.InputContext(num_input_pipelines=count, input_pipeline_id=index)
    return make_dataset(data_dir, "train", 4, input_context=context, repeat=False, drop_remainder=False, **kwargs)


@pytest.mark.parametrize("data_dir_fixture,count,by_file", [
    ("multi_shard_dir", 2, True), ("multi_shard_dir", 3, True), ("single_shard_dir", 3, False),
    ("multi_shard_dir", 10, False)])
def test_pipelines_cover_every_record_exactly_once(request, data_dir_fixture, count, by_file):
    data_dir = request.getfixturevalue(data_dir_fixture)
    files = len(load_manifest(data_dir).split("train").shards)
    assert (files >= count) == by_file
    everything = Counter(_rows(make_dataset(data_dir, "train", 4, repeat=False, drop_remainder=False)))
    assert sum(everything.values()) == count_records(data_dir, "train")
    # Each pipeline shuffles with its own seed: coverage must not depend on seeds agreeing.
    parts = [Counter(_rows(_pipeline(data_dir, count, index, seed=index))) for index in range(count)]
    assert all(parts), "every pipeline gets records"
    assert sum(parts, Counter()) == everything


def test_batches_are_int32_and_drop_remainder(multi_shard_dir):
    batches = list(make_dataset(multi_shard_dir, "train", 7, repeat=False))
    assert all(b["input_ids"].shape == (7, 17) and b["input_ids"].dtype == tf.int32 for b in batches)
    assert len(batches) == count_records(multi_shard_dir, "train") // 7
    assert set(batches[0]) == {"input_ids"}


def test_deterministic_mode_repeats_batches_exactly(multi_shard_dir):
    def first_batches(seed):
        return _rows(make_dataset(multi_shard_dir, "train", 8, seed=seed, deterministic=True, shuffle_buffer=64), 30)

    assert first_batches(5) == first_batches(5)
    assert first_batches(5) != first_batches(6)


def test_skip_batches_equals_dropping_the_first_batches(multi_shard_dir):
    def rows(skip, count):
        return _rows(make_dataset(multi_shard_dir, "train", 8, seed=1, deterministic=True, skip_batches=skip), count)

    assert rows(3, 40) == rows(0, 43)[3 * 8:]
    # Past the end of an epoch too (the data repeats).
    epoch = count_records(multi_shard_dir, "train") // 8
    assert rows(epoch + 2, 3) == rows(0, epoch + 5)[(epoch + 2) * 8:]


def _damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    if how == "flip":
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    else:
        data = data[:len(data) * 2 // 3]
    open(path, "wb").write(data)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_shard_error_names_the_shard(copy_of, multi_shard_dir, how):
    data_dir = copy_of(multi_shard_dir)
    bad = load_manifest(data_dir).shard_paths("train")[1]
    _damage(bad, how)
    with pytest.raises(tf.errors.InvalidArgumentError, match=os.path.basename(bad) + ".*corrupt or truncated"):
        _rows(make_dataset(data_dir, "train", 4, repeat=False))
    with pytest.raises(tf.errors.InvalidArgumentError, match=os.path.basename(bad)):
        _rows(make_dataset(data_dir, "train", 4, shuffle=False, repeat=True), 10_000)


def test_skip_corrupt_skips_and_logs(copy_of, multi_shard_dir, capfd):
    data_dir = copy_of(multi_shard_dir)
    manifest = load_manifest(data_dir)
    bad = manifest.shard_paths("train")[2]
    _damage(bad, "flip")
    rows = _rows(make_dataset(data_dir, "train", 1, repeat=False, shuffle=False, skip_corrupt=True))
    shards = manifest.split("train").shards
    intact = sum(shard.records for shard in shards) - shards[2].records
    assert intact <= len(rows) < intact + shards[2].records  # the damaged shard's tail is gone
    clean = _rows(make_dataset(multi_shard_dir, "train", 1, repeat=False, shuffle=False))
    assert rows[:shards[0].records + shards[1].records] == clean[:shards[0].records + shards[1].records]
    logged = capfd.readouterr().err
    assert os.path.basename(bad) in logged and "skipped the rest of it" in logged


def test_manifest_mismatch_is_a_clear_error(multi_shard_dir):
    path = os.path.join(multi_shard_dir, "manifest.json")
    with pytest.raises(ValueError, match=rf"{path}: seq_length is 16 but 128 was expected"):
        make_dataset(multi_shard_dir, "train", 4, seq_length=128)
    with pytest.raises(ValueError, match=r"vocab_size is 400 but 8000 was expected"):
        make_dataset(multi_shard_dir, "train", 4, vocab_size=8000)
    with pytest.raises(ValueError, match=r"format is 'gpt' but 'bert' was expected"):
        make_dataset(multi_shard_dir, "train", 4, format="bert")
    with pytest.raises(ValueError, match=r"input_pipeline_id=2 is outside \[0, num_input_pipelines=2\)"):
        make_dataset(multi_shard_dir, "train", 4, input_context=tf.distribute.InputContext(2, 2))


def test_a_pipeline_without_records_is_an_error(single_shard_dir):
    records = count_records(single_shard_dir, "validation")
    context = tf.distribute.InputContext(num_input_pipelines=records + 1, input_pipeline_id=records)
    with pytest.raises(ValueError, match=rf"input pipeline {records} of {records + 1} no records"):
        make_dataset(single_shard_dir, "validation", 1, input_context=context)
    last = tf.distribute.InputContext(num_input_pipelines=records + 1, input_pipeline_id=records - 1)
    assert len(_rows(make_dataset(single_shard_dir, "validation", 1, input_context=last, repeat=False))) == 1


def test_validation_split_reads(multi_shard_dir):
    rows = _rows(make_dataset(multi_shard_dir, "validation", 2, shuffle=False, repeat=False, drop_remainder=False))
    assert len(rows) == count_records(multi_shard_dir, "validation") > 0
    assert np.array(rows).max() < 400
