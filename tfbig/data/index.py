"""Index shards written by other tools (e.g. tf-models-official's `create_pretraining_data.py`):
a manifest.json for standard BERT/ALBERT pretraining shards, so they train as they are.

Example:
    manifest = index_shards(["bert/train-*.tfrecord"], ["bert/dev.tfrecord"], "/data/bert", "sp.model")
"""

import os
import shutil

import numpy as np

from tfbig.data import manifest as manifest_lib
from tfbig.data import shards
from tfbig.data.albert import FEATURES, albert_features
from tfbig.data.tokenizer import Tokenizer


def index_shards(train_files, validation_files, output_dir, tokenizer_path):
    """Write `output_dir/manifest.json` for existing standard-format shards, so they train as
    they are (e.g. written by tf-models-official's `create_pretraining_data.py`).

    seq_length and max_predictions_per_seq are read from the first record; every record
    is counted and checked. The tokenizer the shards were made with is copied next to the
    manifest. Shard paths are stored relative to output_dir. Returns the Manifest.
    """
    os.makedirs(output_dir, exist_ok=True)
    tokenizer = Tokenizer.load(tokenizer_path)
    target = os.path.join(output_dir, "tokenizer.model")
    if os.path.abspath(tokenizer_path) != os.path.abspath(target):
        shutil.copyfile(tokenizer_path, target)
    byte_lengths = tokenizer.piece_byte_lengths()
    shapes, splits = {}, {}
    for split, files in (("train", train_files), ("validation", validation_files)):
        infos = []
        for path in files:
            records, tokens, source_bytes, shape = _scan_shard(path, byte_lengths, tokenizer.vocab_size)
            if shapes.setdefault("shape", shape) != shape:
                raise ValueError(f"{path}: (seq_length, max_predictions_per_seq) = {shape} but "
                                 f"earlier shards have {shapes['shape']}; index them separately")
            relative = os.path.relpath(os.path.abspath(path), os.path.abspath(output_dir))
            infos.append(manifest_lib.ShardInfo(relative, records, tokens, source_bytes,
                                                shards.file_sha256(path)))
        splits[split] = manifest_lib.SplitInfo(tuple(infos))
    if "shape" not in shapes:
        raise ValueError("no shard given: pass at least one training shard")
    seq_length, predictions = shapes["shape"]
    options = {"max_predictions_per_seq": predictions}
    manifest = manifest_lib.Manifest(
        output_dir, "albert", seq_length, tokenizer.vocab_size, "tokenizer.model",
        tokenizer.eos_id, tokenizer.pad_id, splits, shards.file_sha256(target),
        {"source": "indexed shards: " + ", ".join(train_files), "format_options": options,
         "features": albert_features(seq_length, predictions)})
    manifest_lib.write_manifest(manifest)
    return manifest


def _scan_shard(path, byte_lengths, vocab_size):
    """(records, real tokens, source bytes, (seq_length, max_predictions)) of one shard."""
    import tensorflow as tf  # reading foreign shards: TensorFlow's reader, only here

    records = tokens = source_bytes = 0
    shape = None
    try:
        for serialized in tf.data.TFRecordDataset(path).as_numpy_iterator():
            example = tf.train.Example.FromString(serialized).features.feature
            missing = [name for name in FEATURES if name not in example]
            if missing:
                raise ValueError(f"{path}: record {records} lacks feature(s) {missing}; expected "
                                 f"the standard BERT/ALBERT pretraining features {FEATURES} "
                                 "(create_pretraining_data.py without --use_v2_feature_names)")
            ids = np.array(example["input_ids"].int64_list.value, dtype=np.int64)
            mask = np.array(example["input_mask"].int64_list.value, dtype=bool)
            shape = shape or (len(ids), len(example["masked_lm_ids"].int64_list.value))
            if ids.max(initial=0) >= vocab_size:
                raise ValueError(f"{path}: record {records} has token id {ids.max()} >= the "
                                 f"tokenizer's vocab_size={vocab_size}; wrong --tokenizer?")
            records, tokens = records + 1, tokens + int(mask.sum())
            source_bytes += int(byte_lengths[ids[mask]].sum())
    except tf.errors.DataLossError as error:
        raise ValueError(f"{path} is corrupt or truncated after {records} records: "
                         f"{error.message}") from error
    if not records:
        raise ValueError(f"{path} holds no records")
    return records, tokens, source_bytes, shape
