"""Input pipeline: prepared shards -> batches of features, one pipeline per input worker.

    manifest (checked) -> this pipeline's files -> parallel interleaved reads, each file
    checked against its manifest record count -> [record sharding] -> shuffle -> repeat
    -> skip -> batch -> parse -> prefetch

Sharding across input pipelines (`tf.distribute.InputContext`, or anything with
`num_input_pipelines` and `input_pipeline_id`): by file when there are at least as many
files as pipelines, else by record (every pipeline reads all files in the same fixed
order and keeps every n-th record). Either way each record goes to exactly one pipeline.
tf.data's own auto-sharding is switched off, since this already did it.

Example:
    dataset = make_dataset("/data/shakespeare", "train", batch_size=8, seq_length=256)
    batch = next(iter(dataset))  # {"input_ids": int32 [8, 257]}
"""

import functools

import numpy as np
import tensorflow as tf

from tfbig.data import formats, mixture
from tfbig.data.manifest import load_manifest

READ_BUFFER_BYTES = 8 << 20
MAX_PARALLEL_FILES = 8
CHECK_BLOCK_RECORDS = 256
_DTYPES = {"int64": tf.int64, "float32": tf.float32}


def make_dataset(data_dir: str, split: str, batch_size: int, *, format: str = "gpt",
                 seq_length: int | None = None, vocab_size: int | None = None,
                 input_context: tf.distribute.InputContext | None = None,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True,
                 deterministic: bool = False, skip_corrupt: bool = False,
                 skip_batches: int = 0, drop_remainder: bool = True,
                 shuffle_buffer: int = 10_000) -> tf.data.Dataset:
    """Batches of one split of a prepared data directory.

    Args:
      data_dir: directory holding manifest.json (made by tfbig-prep / `prepare`), or a weighted
        mixture of such directories ("a:0.6,b:0.4" or a mixture file, see `tfbig.data.mixture`):
        its train split mixes the sources by weight, its validation split is all of theirs.
      split: "train" or "validation".
      batch_size: examples per batch this pipeline yields (for tf.distribute, the
        per-replica batch: `input_context.get_per_replica_batch_size(global_batch)`).
      format, seq_length, vocab_size: what the model expects; checked against the
        manifest (None skips a check).
      input_context: which input pipeline this is; None means the only one.
      seed: shuffle seed.
      shuffle: shuffle files and records; False reads shards one after another in
        manifest order, always in the same order (evaluation, tests).
      repeat: loop forever.
      deterministic: fixed element order, so the same seed gives the same batches.
      skip_corrupt: a corrupt or truncated shard is logged and its damaged tail
        skipped, instead of raising an error that names it.
      skip_batches: drop the first n batches (exact resume with deterministic=True).
      drop_remainder: drop a final partial batch.
      shuffle_buffer: records in the shuffle buffer.

    Returns:
      A dataset of feature dicts; for "gpt": {"input_ids": int32 [batch_size, seq_length + 1]}.
    """
    if mixture.is_mixture(data_dir):
        return make_mixture_dataset(
            data_dir, split, batch_size, format=format, seq_length=seq_length, vocab_size=vocab_size,
            input_context=input_context, seed=seed, shuffle=shuffle, repeat=repeat, deterministic=deterministic,
            skip_corrupt=skip_corrupt, skip_batches=skip_batches, drop_remainder=drop_remainder,
            shuffle_buffer=shuffle_buffer)
    manifest = load_manifest(data_dir)
    manifest.check(format=format, seq_length=seq_length, vocab_size=vocab_size)
    records = split_records(manifest, split, input_context, seed, shuffle, repeat, deterministic, skip_corrupt,
                            shuffle_buffer)
    if skip_batches:  # skipping records before batching equals skipping batches, unparsed
        records = records.skip(skip_batches * batch_size)
    return batched(records, manifest, format, batch_size, drop_remainder, deterministic or not shuffle)


def split_records(manifest, split: str, input_context, seed: int, shuffle: bool, repeat: bool,
                  deterministic: bool, skip_corrupt: bool, shuffle_buffer: int) -> tf.data.Dataset:
    """Serialized records of one split for this input pipeline: sharded, shuffled, repeated."""
    shards = manifest.split(split).shards
    if not shards:
        raise ValueError(f"{manifest.path}: split {split!r} has no shards")
    files = [(path, shard.records) for path, shard in zip(manifest.shard_paths(split), shards)]
    num_pipelines, pipeline_id = _pipeline(input_context)
    by_file = len(files) >= num_pipelines
    if by_file:
        files = files[pipeline_id::num_pipelines]
    _check_not_empty(manifest, split, files, by_file, num_pipelines, pipeline_id)
    ordered = deterministic or not shuffle  # without shuffle, keep manifest order
    # Record sharding needs one order in all pipelines (whatever their seeds): files unshuffled, reads ordered.
    records = _read(files, shuffle and by_file, seed, ordered or not by_file, skip_corrupt)
    if not by_file:
        records = records.shard(num_pipelines, pipeline_id)
    if shuffle:
        records = records.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        records = records.repeat()
    return records


def batched(records: tf.data.Dataset, manifest, format: str, batch_size: int, drop_remainder: bool,
            ordered: bool) -> tf.data.Dataset:
    """Serialized records -> parsed feature batches, prefetched."""
    options = manifest.info.get("format_options", {})  # e.g. ALBERT's max_predictions_per_seq
    parse = _parser(formats.get_format(format).features(manifest.seq_length, **options))
    batches = records.batch(batch_size, drop_remainder=drop_remainder)
    batches = batches.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=ordered)
    return batches.prefetch(tf.data.AUTOTUNE).with_options(_options(ordered))


def make_mixture_dataset(spec: str, split: str, batch_size: int, *, format: str = "gpt", seq_length=None,
                         vocab_size=None, input_context=None, seed: int = 0, shuffle: bool = True,
                         repeat: bool = True, deterministic: bool = False, skip_corrupt: bool = False,
                         skip_batches: int = 0, drop_remainder: bool = True, shuffle_buffer: int = 10_000):
    """`make_dataset` for a mixture (same arguments): train mixes the sources by weight (`tfbig.data.mixture`)."""
    manifest = mixture.mixture_manifest(spec)
    manifest.check(format=format, seq_length=seq_length, vocab_size=vocab_size)
    ordered = deterministic or not shuffle
    read = functools.partial(split_records, input_context=input_context, seed=seed, shuffle=shuffle,
                             deterministic=deterministic, skip_corrupt=skip_corrupt, shuffle_buffer=shuffle_buffer)
    if split != "train":  # every source's split, one after another
        records = read(manifest, split, repeat=repeat)
        return batched(records.skip(skip_batches * batch_size), manifest, format, batch_size,
                               drop_remainder, ordered)
    if not repeat:
        raise ValueError(f"--data_dir={spec!r}: a mixture's train split samples its sources forever; read it "
                         "with repeat=True (or read one source's directory)")
    sources = mixture.parse_mixture(spec)
    start = skip_batches * batch_size
    positions = mixture.source_counts(sources.probabilities, seed, start)  # where each source stopped
    streams = [read(mixture.source_manifest(data_dir, group), "train", repeat=True).skip(int(position))
               for data_dir, group, position in zip(sources.data_dirs, sources.groups, positions)]
    choices = _choice_dataset(sources.probabilities, seed, start)
    records = tf.data.Dataset.choose_from_datasets(streams, choices)
    return batched(records, manifest, format, batch_size, drop_remainder, ordered)


def _choice_dataset(probabilities: np.ndarray, seed: int, start: int):
    """Source indices of examples start, start + 1, ... (the same sequence as `mixture.block_choices`)."""
    def block(index):
        choices = tf.numpy_function(lambda b: mixture.block_choices(probabilities, seed, int(b)), [index], tf.int64)
        return tf.ensure_shape(choices, [mixture.CHOICE_BLOCK])

    blocks = tf.data.Dataset.range(start // mixture.CHOICE_BLOCK, np.iinfo(np.int64).max).map(block)
    return blocks.unbatch().skip(start % mixture.CHOICE_BLOCK)


def count_records(data_dir: str, split: str) -> int:
    """Records in a split, from the manifest (e.g. for steps per epoch)."""
    return load_manifest(data_dir).split(split).records


def _check_not_empty(manifest, split, files, by_file, num_pipelines, pipeline_id) -> None:
    """An empty pipeline would make repeat() spin or a replica starve: say so up front."""
    total = manifest.split(split).records
    mine = sum(count for _, count in files) if by_file else len(range(pipeline_id, total, num_pipelines))
    if not mine:
        raise ValueError(f"{manifest.path}: split {split!r} gives input pipeline {pipeline_id} of {num_pipelines} "
                         f"no records ({total} records in {len(manifest.split(split).shards)} shards); "
                         "prepare more data or use fewer input pipelines")


def _pipeline(input_context) -> tuple[int, int]:
    if input_context is None:
        return 1, 0
    count, index = input_context.num_input_pipelines, input_context.input_pipeline_id
    if not 0 <= index < count:
        raise ValueError(f"input_pipeline_id={index} is outside [0, num_input_pipelines={count})")
    return count, index


def _read(files: list[tuple[str, int]], shuffle: bool, seed: int, deterministic: bool,
          skip_corrupt: bool) -> tf.data.Dataset:
    """Serialized records of `files`: shuffled files interleaved, or one file after another."""
    paths, counts = zip(*files)
    names = tf.data.Dataset.from_tensor_slices((list(paths), tf.constant(counts, tf.int64)))
    if shuffle:
        names = names.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    cycle_length = min(len(paths), MAX_PARALLEL_FILES) if shuffle else 1
    return names.interleave(lambda path, count: _checked_records(path, count, skip_corrupt),
                            cycle_length=cycle_length, num_parallel_calls=tf.data.AUTOTUNE,
                            deterministic=deterministic)


def _checked_records(path: tf.Tensor, expected: tf.Tensor, skip_corrupt: bool) -> tf.data.Dataset:
    """Records of one shard; at its end, the count read must equal the manifest's.

    TFRecordDataset's own DataLossError does not name the file, and an error can't be
    caught inside tf.data; so read errors end the file quietly (ignore_errors) and a
    short count then raises (or, with skip_corrupt, logs) a message naming the shard.
    Records are counted in blocks: per-record tf.data functions would cost more than
    the read itself.
    """
    records = tf.data.TFRecordDataset(path, buffer_size=READ_BUFFER_BYTES).ignore_errors(log_warning=skip_corrupt)
    blocks = records.batch(CHECK_BLOCK_RECORDS).map(lambda block: (block, False))
    blocks = blocks.concatenate(tf.data.Dataset.from_tensors((tf.constant([], tf.string), True)))  # end marker

    def count_and_check(count, element):
        block, is_end = element
        intact = tf.logical_or(tf.logical_not(is_end), tf.equal(count, expected))
        report = ["tfbig.data: shard", path, "is corrupt or truncated: read", count, "of", expected,
                  "records listed in manifest.json"]
        if skip_corrupt:
            check = tf.cond(intact, tf.no_op, lambda: _warn(report + ["; skipped the rest of it"]))
        else:
            check = tf.debugging.Assert(intact, report + ["; prepare the data again or pass skip_corrupt"])
        with tf.control_dependencies([check]):
            return count + tf.size(block, out_type=tf.int64), tf.identity(block)

    return blocks.scan(tf.constant(0, tf.int64), count_and_check).unbatch()  # the end marker is empty


def _warn(message: list) -> tf.Operation:
    with tf.control_dependencies([tf.print("WARNING:", *message)]):
        return tf.no_op()


def _parser(features: dict[str, tuple[str, int]]):
    spec = {name: tf.io.FixedLenFeature([length], _DTYPES[dtype]) for name, (dtype, length) in features.items()}

    def parse(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_example(serialized, spec)
        return {name: tf.cast(value, tf.int32) if value.dtype == tf.int64 else value
                for name, value in parsed.items()}

    return parse


def _options(deterministic: bool) -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = deterministic
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options
