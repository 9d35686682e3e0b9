"""make_dataset: per-pipeline coverage, determinism, exact skip, corruption, manifest checks."""
import os
import zlib
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

from tfbig.data import count_records, make_dataset
from tfbig.data import load_manifest
from tfbig.data.order import RecordReader


def _rows(dataset, limit=None) -> list[tuple]:
    batches = dataset if limit is None else dataset.take(limit)
    return [tuple(row) for batch in batches for row in batch["input_ids"].numpy().tolist()]


def _pipeline(data_dir, count, index, batch_size=4, **kwargs):
    context = tf.distribute.InputContext(num_input_pipelines=count, input_pipeline_id=index)
    return make_dataset(data_dir, "train", batch_size, input_context=context, **kwargs)


@pytest.mark.parametrize("data_dir_fixture,count", [
    ("multi_shard_dir", 2), ("multi_shard_dir", 3), ("single_shard_dir", 3), ("multi_shard_dir", 10)])
def test_global_batches_do_not_depend_on_the_number_of_pipelines(request, data_dir_fixture, count):
    data_dir = request.getfixturevalue(data_dir_fixture)
    one = _rows(make_dataset(data_dir, "train", 4 * count, seed=7), 25)  # 25 global batches, past an epoch
    parts = [_rows(_pipeline(data_dir, count, index, seed=7), 25) for index in range(count)]
    for step in range(25):  # pipeline i holds the i-th contiguous quarter... of each global batch
        assert sum((part[step * 4:(step + 1) * 4] for part in parts), []) == one[step * 4 * count:(step + 1) * 4 * count]
    # One epoch of the global order holds every record exactly once.
    records = count_records(data_dir, "train")
    epoch = Counter(_rows(make_dataset(data_dir, "train", 1, seed=7), records))
    assert epoch == Counter(_rows(make_dataset(data_dir, "train", 1, shuffle=False, repeat=False)))
    # Not one every pipeline and a copy: the slices differ.
    assert parts[0][:4] != parts[1][:4]


def test_a_resume_at_a_global_position_reads_what_the_straight_run_reads(multi_shard_dir):
    straight = _rows(make_dataset(multi_shard_dir, "train", 12, seed=2), 10)
    # Three pipelines stopped after 4 global batches of 12; resumed as two pipelines at position 48.
    resumed = [_rows(_pipeline(multi_shard_dir, 2, index, 6, seed=2, start=48), 6) for index in range(2)]
    for step in range(6):
        assert resumed[0][step * 6:(step + 1) * 6] + resumed[1][step * 6:(step + 1) * 6] == \
            straight[(4 + step) * 12:(5 + step) * 12]


def test_data_trace_lists_what_each_pipeline_read(multi_shard_dir, tmp_path):
    _rows(_pipeline(multi_shard_dir, 2, 1, seed=3, trace=str(tmp_path)), 3)
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("pipeline-1-") and path.name.endswith(".tsv")
    lines = sorted(tuple(map(int, line.split("\t"))) for line in path.read_text().splitlines())  # read in parallel
    positions = [p for p, _ in lines[:12]]
    assert positions == [p for step in range(3) for p in range(step * 8 + 4, step * 8 + 8)]  # its halves
    reader = RecordReader.for_split(load_manifest(multi_shard_dir), "train", 3, shuffle=True)
    assert [crc for _, crc in lines[:12]] == [zlib.crc32(r) for r in reader.read(np.array(positions))]


def test_batches_are_int32_and_drop_remainder(multi_shard_dir):
    batches = list(make_dataset(multi_shard_dir, "train", 7, repeat=False))
    assert all(b["input_ids"].shape == (7, 17) and b["input_ids"].dtype == tf.int32 for b in batches)
    assert len(batches) == count_records(multi_shard_dir, "train") // 7
    assert set(batches[0]) == {"input_ids"}


def test_deterministic_mode_repeats_batches_exactly(multi_shard_dir):
    def first_batches(seed):
        return _rows(make_dataset(multi_shard_dir, "train", 8, seed=seed, deterministic=True, ), 30)

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
    with pytest.raises(ValueError, match=os.path.basename(bad) + " is corrupt or truncated: read .* records listed "
                                         "in manifest.json; prepare the data again or pass --skip_corrupt"):
        make_dataset(data_dir, "train", 4, repeat=False)
    with pytest.raises(ValueError, match=os.path.basename(bad)):
        make_dataset(data_dir, "train", 4, shuffle=False, repeat=True)


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
        make_dataset(single_shard_dir, "validation", 1, input_context=context, repeat=False)
    last = tf.distribute.InputContext(num_input_pipelines=records + 1, input_pipeline_id=records - 1)
    assert len(_rows(make_dataset(single_shard_dir, "validation", 1, input_context=last, repeat=False))) == 1
    # Repeating, a global batch larger than the split runs on into the next epoch: no pipeline starves.
    assert len(_rows(make_dataset(single_shard_dir, "validation", 1, input_context=context), 3)) == 3


def test_validation_split_reads(multi_shard_dir):
    rows = _rows(make_dataset(multi_shard_dir, "validation", 2, shuffle=False, repeat=False, drop_remainder=False))
    assert len(rows) == count_records(multi_shard_dir, "validation") > 0
    assert np.array(rows).max() < 400
