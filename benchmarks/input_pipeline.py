"""Input pipeline throughput: tokens/s from `make_dataset` vs a plain sequential read of the same shards,
for 1, 2, 4 and 8 input pipelines (one pipeline of N measured alone: what each data-parallel
replica's process does on its own host).

The baseline is the least work that still yields the same batches: one
`tf.data.TFRecordDataset` over the shard files in order, batch, `tf.io.parse_example`,
cast to int32 — no interleave, shuffle, integrity check or prefetch. Both are consumed
by the same Python loop for the same number of batches, after a warm-up pass (page cache).

    python benchmarks/input_pipeline.py                       # prepares Shakespeare in a temp dir
    python benchmarks/input_pipeline.py --data_dir=/data/x --batch_size=16
    python benchmarks/input_pipeline.py --compare_with=/work/main   # also "before": that tree's tfbig

Prints one JSON line last: {"raw_tokens_per_s", "pipelines": {"N": {"reader_tokens_per_s",
"ratio"}}, "ratio" (the worst), ...}; with --compare_with, "before" holds the same figures
measured with the other tree's `make_dataset` on the same data in the same run.
"""

import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

import tensorflow as tf

from tfbig.data import load_manifest, make_dataset, prepare

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "Prepared data directory; default: prepare the embedded corpus in a temp dir.")
flags.DEFINE_integer("seq_length", 1024, "seq_length when preparing the embedded corpus.")
flags.DEFINE_float("shard_size_mb", 1.0, "Shard size when preparing the embedded corpus (several files).")
flags.DEFINE_integer("batch_size", 8, "Examples per batch.")
flags.DEFINE_integer("num_tokens", 30_000_000, "Tokens to read per measurement.")
flags.DEFINE_integer("repeats", 3, "Measurements per reader; the best is reported.")
flags.DEFINE_list("num_pipelines", ["1", "2", "4", "8"], "Input pipeline counts to measure (pipeline 0 of each).")
flags.DEFINE_string("compare_with", "", "A tfbig source tree (e.g. the main branch's checkout): measure its "
                    "make_dataset too, on the same data, as \"before\".")


def raw_dataset(files: list[str], batch_size: int, seq_length: int) -> tf.data.Dataset:
    """The baseline: sequential TFRecord read + parse, repeated."""
    spec = {"input_ids": tf.io.FixedLenFeature([seq_length + 1], tf.int64)}
    dataset = tf.data.TFRecordDataset(files).repeat().batch(batch_size, drop_remainder=True)
    return dataset.map(lambda s: {"input_ids": tf.cast(tf.io.parse_example(s, spec)["input_ids"], tf.int32)})


def tokens_per_second(dataset: tf.data.Dataset, num_batches: int) -> float:
    """Tokens per second of iterating `num_batches` batches in a Python loop."""
    iterator = iter(dataset)
    next(iterator)  # build the pipeline before timing
    start, tokens = time.perf_counter(), 0
    for _ in range(num_batches):
        tokens += int(tf.size(next(iterator)["input_ids"]))
    return tokens / (time.perf_counter() - start)


def file_read_mb_per_s(files: list[str]) -> float:
    """Plain Python read of the files (for context: the disk/page-cache ceiling)."""
    start, size = time.perf_counter(), 0
    for path in files:
        with open(path, "rb") as file:
            while block := file.read(1 << 22):
                size += len(block)
    return size / 2**20 / (time.perf_counter() - start)


def reader_rates(data_dir: str, num_batches: int) -> dict:
    """{N: tokens/s of pipeline 0 of N input pipelines} of this interpreter's tfbig."""
    rates = {}
    for count in map(int, FLAGS.num_pipelines):
        context = tf.distribute.InputContext(num_input_pipelines=count, input_pipeline_id=0)
        rates[count] = max(tokens_per_second(make_dataset(data_dir, "train", FLAGS.batch_size, seed=r,
                                                          input_context=context), num_batches)
                           for r in range(FLAGS.repeats))
    return rates


def other_tree_rates(tree: str, data_dir: str) -> dict:
    """`reader_rates` with the tfbig of source tree `tree` (a child process; its last line)."""
    flags_ = [f"--data_dir={data_dir}", f"--batch_size={FLAGS.batch_size}", f"--num_tokens={FLAGS.num_tokens}",
              f"--repeats={FLAGS.repeats}", f"--num_pipelines={','.join(FLAGS.num_pipelines)}", "--rates_only"]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags_], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.abspath(tree)}, check=True)
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _figures(rates: dict, raw: float) -> dict:
    return {str(n): {"reader_tokens_per_s": round(rate), "ratio": round(rate / raw, 3)} for n, rate in rates.items()}


flags.DEFINE_bool("rates_only", False, "Internal (--compare_with): print only the reader rates of --data_dir.")


def main(argv):
    del argv
    if FLAGS.rates_only:
        manifest = load_manifest(FLAGS.data_dir)
        num_batches = max(1, FLAGS.num_tokens // (FLAGS.batch_size * (manifest.seq_length + 1)))
        print(json.dumps(reader_rates(FLAGS.data_dir, num_batches)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = FLAGS.data_dir or prepare(None, os.path.join(scratch, "data"), FLAGS.seq_length, 8000,
                                             FLAGS.shard_size_mb, num_workers=2).data_dir
        manifest = load_manifest(data_dir)
        files = manifest.shard_paths("train")
        num_batches = max(1, FLAGS.num_tokens // (FLAGS.batch_size * (manifest.seq_length + 1)))
        file_mb_s = file_read_mb_per_s(files)  # also warms the page cache
        raw = max(tokens_per_second(raw_dataset(files, FLAGS.batch_size, manifest.seq_length), num_batches)
                  for _ in range(FLAGS.repeats))
        after = reader_rates(data_dir, num_batches)
        before = other_tree_rates(FLAGS.compare_with, data_dir) if FLAGS.compare_with else None
    result = {"benchmark": "input_pipeline", "raw_tokens_per_s": round(raw), "pipelines": _figures(after, raw),
              "ratio": round(min(after.values()) / raw, 3)}
    if before:
        result["before"] = {"tree": FLAGS.compare_with, "pipelines": _figures(before, raw),
                            "ratio": round(min(before.values()) / raw, 3)}
    result.update({"raw_baseline": "TFRecordDataset(files) sequential + batch + parse_example",
                   "measured": "pipeline 0 of N alone, tokens/s it yields",
                   "file_read_mb_per_s": round(file_mb_s, 1), "shards": len(files),
                   "seq_length": manifest.seq_length, "batch_size": FLAGS.batch_size,
                   "tokens_per_measurement": num_batches * FLAGS.batch_size * (manifest.seq_length + 1),
                   "cpus": os.cpu_count()})
    _record.emit(result)


if __name__ == "__main__":
    app.run(main)
