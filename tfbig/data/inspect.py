"""Look inside a prepared directory: its shards, its records as token ids, its documents.

    manifest = load_manifest("runs/data")
    shard_table(manifest)                       # one dict per shard: records, tokens, bytes...
    ids = read_token_rows(manifest, "validation", limit=100)   # (100, seq_length + 1) int64
    document_lengths(ids, manifest.eos_id)      # tokens per document in those rows

Reading records imports TensorFlow (when called); the rest is numpy.
"""
import numpy as np


def shard_table(manifest):
    """One row per shard of every split: split, file, group, records, tokens, source bytes and
    tokens per byte (the tokenizer's compression on that shard)."""
    return [{"split": name, "file": shard.file, "group": shard.group, "records": shard.records,
             "tokens": shard.tokens, "bytes": shard.bytes,
             "tokens_per_byte": shard.tokens / shard.bytes if shard.bytes else 0.0}
            for name, split in sorted(manifest.splits.items()) for shard in split.shards]


def read_token_rows(manifest, split, limit=None):
    """The first `limit` records of `split` (all when None), in manifest order, as an int64
    array of their token feature (GPT: input_ids; ALBERT: the input ids)."""
    import tensorflow as tf

    from tfbig.data.formats import get_format

    fmt = get_format(manifest.format)
    name = fmt.token_feature
    kind, width = manifest.info["features"][name]
    if kind != "int64":
        raise ValueError(f"{manifest.path}: feature {name!r} is {kind}, expected int64 token ids")
    spec = {name: tf.io.FixedLenFeature([width], tf.int64)}
    records = tf.data.TFRecordDataset(manifest.shard_paths(split))
    if limit is not None:
        records = records.take(limit)
    rows = [tf.io.parse_single_example(r, spec)[name].numpy() for r in records]
    return np.stack(rows) if rows else np.zeros((0, width), np.int64)


def document_lengths(rows, eos_id):
    """Tokens of each document whose end (eos) lies in `rows`, read as one stream (GPT rows
    are consecutive cuts of the eos-separated documents); the eos itself is not counted. The
    piece after the last eos is cut off by the rows' end and left out."""
    stream = np.asarray(rows).reshape(-1)
    ends = np.flatnonzero(stream == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return (ends - starts).tolist()
