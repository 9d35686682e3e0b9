"""Input pipeline: prepared shards -> batches of features, one pipeline per data-parallel replica.

    manifest (checked) -> global order (tfbig.data.order) -> this pipeline's positions ->
    read those records (seek + read) -> parse -> prefetch

Every pipeline reads from one global, seeded order of examples (a permutation per epoch): its
k-th batch is its slice of global batch k, positions

    start + k * batch_size * num_input_pipelines + input_pipeline_id * batch_size + [0, batch_size)

so the examples of a global batch, and their order, are the same for any number of pipelines
(`tf.distribute.InputContext`, or anything with `num_input_pipelines` and `input_pipeline_id`)
and `start` (a global example position) resumes exactly on any layout. Shards are checked
against their manifest record counts and CRCs when first indexed. tf.data's own auto-sharding
is switched off, since this already did it.

Example:
    dataset = make_dataset("/data/shakespeare", "train", batch_size=8, seq_length=256)
    batch = next(iter(dataset))  # {"input_ids": int32 [8, 257]}
"""

import os
import threading
import zlib

import numpy as np
import tensorflow as tf

from tfbig.data import formats, mixture
from tfbig.data.manifest import load_manifest
from tfbig.data.order import MixtureOrder, RecordReader

MAX_PARALLEL_FILES = 8  # reads in flight (each a numpy_function of preads)
READ_RECORDS = 64  # records one read fetches (whole batches of this pipeline)
_DTYPES = {"int64": tf.int64, "float32": tf.float32}


def make_dataset(data_dir: str, split: str, batch_size: int, *, format: str = "gpt",
                 seq_length: int | None = None, vocab_size: int | None = None,
                 input_context: tf.distribute.InputContext | None = None,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True,
                 deterministic: bool = False, skip_corrupt: bool = False,
                 skip_batches: int = 0, start: int = 0, drop_remainder: bool = True,
                 trace: str = "") -> tf.data.Dataset:
    """Batches of one split of a prepared data directory: this pipeline's slice of each global batch.

    Args:
      data_dir: directory holding manifest.json (made by tfbig-prep / `prepare`), or a weighted
        mixture of such directories ("a:0.6,b:0.4" or a mixture file, see `tfbig.data.mixture`):
        its train split mixes the sources by weight, its validation split is all of theirs.
      split: "train" or "validation".
      batch_size: examples per batch this pipeline yields (its slice of a global batch of
        batch_size x num_input_pipelines examples).
      format, seq_length, vocab_size: what the model expects; checked against the
        manifest (None skips a check).
      input_context: which input pipeline this is; None means the only one.
      seed: the seed of the global order.
      shuffle: a seeded permutation of the split per epoch; False reads it in manifest order
        (evaluation, tests).
      repeat: loop forever (epoch after epoch); False stops after the split's last record.
      deterministic: accepted for the callers' sake; the order never depends on it (always fixed).
      skip_corrupt: a corrupt or truncated shard is logged and its damaged tail
        skipped, instead of raising an error that names it.
      skip_batches: start after this pipeline's first n batches (n global batches).
      start: global example position of the first global batch (a resumed run: examples consumed).
      drop_remainder: drop a final partial batch.
      trace: a directory: append "position<TAB>crc32" of every example read to
        trace/pipeline-<id>-<pid>.tsv (--data_trace; read-ahead included, batches in any order).

    Returns:
      A dataset of feature dicts; for "gpt": {"input_ids": int32 [batch_size, seq_length + 1]}.
    """
    del deterministic
    num_pipelines, pipeline_id = _pipeline(input_context)
    start += skip_batches * batch_size * num_pipelines
    if mixture.is_mixture(data_dir):
        manifest = mixture.mixture_manifest(data_dir)
    else:
        manifest = load_manifest(data_dir)
    manifest.check(format=format, seq_length=seq_length, vocab_size=vocab_size)
    if mixture.is_mixture(data_dir) and split == "train":
        if not repeat:
            raise ValueError(f"--data_dir={data_dir!r}: a mixture's train split samples its sources forever; "
                             "read it with repeat=True (or read one source's directory)")
        sources = mixture.parse_mixture(data_dir)
        readers = [RecordReader.for_split(mixture.source_manifest(d, group), "train", (seed, i), shuffle,
                                          skip_corrupt)
                   for i, (d, group) in enumerate(zip(sources.data_dirs, sources.groups))]
        order, total = MixtureOrder(readers, sources.probabilities, seed), None
    else:
        order = RecordReader.for_split(manifest, split, seed, shuffle, skip_corrupt)
        readers, total = [order], None if repeat else order.num_records
    for reader in readers:
        check_record_lengths(manifest, reader, format)
    _check_not_empty(manifest, split, total, start, batch_size, num_pipelines, pipeline_id)
    records = _slices(order, total, start, batch_size, num_pipelines, pipeline_id, _tracer(trace, pipeline_id))
    return batched(records, manifest, format, batch_size, drop_remainder)


def _slices(order, total, start, batch_size, num_pipelines, pipeline_id, trace) -> tf.data.Dataset:
    """Serialized records, one batch of this pipeline's slice of each global batch. Repeating,
    `group` consecutive batches are read by one call (a Python call per batch of a few records
    costs more than its reads)."""
    stride = batch_size * num_pipelines
    first = start + pipeline_id * batch_size
    group = max(1, READ_RECORDS // batch_size) if total is None else 1
    stop = np.iinfo(np.int64).max if total is None else total
    firsts = tf.data.Dataset.range(first, stop, stride * group)

    def read(position):
        if total is None:
            positions = (position + stride * np.arange(group)[:, None] + np.arange(batch_size)).reshape(-1)
        else:
            positions = np.arange(position, min(position + batch_size, total), dtype=np.int64)
        return trace(positions, order.read(positions))

    def read_batches(position):
        records = tf.numpy_function(read, [position], tf.string, stateful=False)
        if total is None:
            return tf.reshape(tf.ensure_shape(records, [group * batch_size]), [group, batch_size])
        return tf.ensure_shape(records, [None])[None]

    batches = firsts.map(read_batches, num_parallel_calls=MAX_PARALLEL_FILES, deterministic=True)
    return batches.unbatch()


def _tracer(directory: str, pipeline_id: int):
    """positions, records -> records, appending "position<TAB>crc32" lines to a trace file if asked."""
    if not directory:
        return lambda positions, records: records
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"pipeline-{pipeline_id}-{os.getpid()}.tsv")
    lock = threading.Lock()

    def trace(positions, records):
        lines = "".join(f"{p}\t{zlib.crc32(r)}\n" for p, r in zip(positions.tolist(), records))
        with lock, open(path, "a") as file:
            file.write(lines)
        return records

    return trace


def batched(records: tf.data.Dataset, manifest, format: str, batch_size: int,
            drop_remainder: bool) -> tf.data.Dataset:
    """Batches of serialized records -> parsed feature batches, prefetched."""
    options = manifest.info.get("format_options", {})  # e.g. ALBERT's max_predictions_per_seq
    parse = _parser(formats.get_format(format).features(manifest.seq_length, **options))
    if drop_remainder:
        records = records.filter(lambda batch: tf.equal(tf.size(batch), batch_size))
        records = records.map(lambda batch: tf.ensure_shape(batch, [batch_size]))
    batches = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return batches.prefetch(tf.data.AUTOTUNE).with_options(_options())


def check_record_lengths(manifest, reader: RecordReader, format: str) -> None:
    """Refuse shards whose records are not as long as manifest.json's seq_length makes them (a
    manifest copied or edited beside other shards), before any batch is read: TensorFlow's
    ParseExample would fail mid-run instead. Reads the reader's first record; names both lengths."""
    options = manifest.info.get("format_options", {})
    expected = formats.get_format(format).features(manifest.seq_length, **options)
    longer = formats.get_format(format).features(manifest.seq_length + 1, **options)
    path = reader.paths[int(reader.shard[0])]
    example = tf.train.Example.FromString(reader.read_records(np.array([0]))[0])
    for name, (dtype, length) in expected.items():
        if name not in example.features.feature:
            raise ValueError(f"{path}: its records have no feature {name!r}, which {manifest.path} "
                             f"(format {format!r}) says they hold; prepare the data again")
        values = example.features.feature[name]
        found = len(values.int64_list.value if dtype == "int64" else values.float_list.value)
        if found == length:
            continue
        written = (f"; they were written with seq_length {manifest.seq_length + found - length}"
                   if longer[name][1] == length + 1 else "")
        raise ValueError(f"{path}: its records hold {found} {name} values, but {manifest.path} says "
                         f"seq_length {manifest.seq_length} ({length} values){written}. Give the "
                         "shards the manifest.json tfbig-prep wrote with them, or prepare the data again")


def count_records(data_dir: str, split: str) -> int:
    """Records in a split, from the manifest (e.g. for steps per epoch)."""
    return load_manifest(data_dir).split(split).records


def _check_not_empty(manifest, split, total, start, batch_size, num_pipelines, pipeline_id) -> None:
    """A pipeline with no records in a finite split would starve its replica: say so up front."""
    if total is None or start + pipeline_id * batch_size < total:
        return
    raise ValueError(f"{manifest.path}: split {split!r} gives input pipeline {pipeline_id} of {num_pipelines} "
                     f"no records ({total} records in {len(manifest.split(split).shards)} shards, "
                     f"{batch_size} per pipeline from position {start}); prepare more data or use fewer input pipelines")


def _pipeline(input_context) -> tuple[int, int]:
    if input_context is None:
        return 1, 0
    count, index = input_context.num_input_pipelines, input_context.input_pipeline_id
    if not 0 <= index < count:
        raise ValueError(f"input_pipeline_id={index} is outside [0, num_input_pipelines={count})")
    return count, index


def _parser(features: dict[str, tuple[str, int]]):
    spec = {name: tf.io.FixedLenFeature([length], _DTYPES[dtype]) for name, (dtype, length) in features.items()}

    def parse(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_example(serialized, spec)
        return {name: tf.cast(value, tf.int32) if value.dtype == tf.int64 else value
                for name, value in parsed.items()}

    return parse


def _options() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # No autotuning model thread: the reads are a fixed MAX_PARALLEL_FILES, the parse map then
    # runs as many calls as the cores and prefetch keeps its own buffer tuning. At the end of
    # training the iterator's teardown waited 30-55 s for that thread (a native stack sample of
    # the main job: RootDataset::Iterator's destructor, docs/results.md).
    options.autotune.enabled = False
    return options
