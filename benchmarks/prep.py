"""Data preparation throughput: MB/s of text through `prepare` (1 and 2 workers) vs the tokenizer alone.

Text: the embedded Shakespeare scenes, repeated `--copies` times, written as one JSONL
file (one scene per line). A tokenizer is trained once beforehand and passed to every
run (`tokenizer=`), so the runs measure reading + tokenizing + packing + writing
shards + manifest, end to end (process start-up and planning included), not tokenizer
training. "Tokenizer alone" is `Tokenizer.encode` on the same documents, already in
memory, in one thread. MB counts the documents' UTF-8 bytes (MiB).

    python benchmarks/prep.py --copies=4

Prints one JSON line last; `ratio` = prepare with 1 worker / tokenizer alone.
"""

import json
import os
import tempfile
import time
from collections import Counter

from absl import app, flags

from tfbig.data import Tokenizer, prepare, sources

FLAGS = flags.FLAGS
flags.DEFINE_integer("copies", 4, "Times the ~5 MB corpus is repeated.")
flags.DEFINE_integer("seq_length", 1024, "seq_length of the prepared records.")
flags.DEFINE_integer("vocab_size", 8000, "Tokenizer vocabulary size.")
flags.DEFINE_float("shard_size_mb", 8, "Target shard size (several shards, so 2 workers have work to split).")
flags.DEFINE_integer("repeats", 2, "Timed runs of each configuration; the best is reported.")


def scenes() -> list[str]:
    """The embedded corpus's documents."""
    spec = sources.SourceSpec()
    return [doc for piece in sources.plan_pieces(spec, 1 << 20) for doc in sources.read_documents(piece, spec, Counter())]


def tokenizer_mb_per_s(tokenizer: Tokenizer, documents: list[str], megabytes: float) -> float:
    start = time.perf_counter()
    for document in documents:
        tokenizer.encode(document)
    return megabytes / (time.perf_counter() - start)


def prepare_mb_per_s(jsonl: str, output_dir: str, tokenizer: str, num_workers: int, megabytes: float) -> float:
    start = time.perf_counter()
    prepare([jsonl], output_dir, FLAGS.seq_length, FLAGS.vocab_size, FLAGS.shard_size_mb, num_workers,
            tokenizer=tokenizer, validation_fraction=0.01)
    return megabytes / (time.perf_counter() - start)


def main(argv):
    del argv
    documents = scenes() * FLAGS.copies
    megabytes = sum(len(doc.encode()) for doc in documents) / 2**20
    with tempfile.TemporaryDirectory() as scratch:
        jsonl = os.path.join(scratch, "corpus.jsonl")
        with open(jsonl, "w") as file:
            file.writelines(json.dumps({"text": doc}) + "\n" for doc in documents)
        tokenizer = Tokenizer.train(documents[:len(documents) // FLAGS.copies], FLAGS.vocab_size,
                                    os.path.join(scratch, "spm"))
        alone = max(tokenizer_mb_per_s(tokenizer, documents, megabytes) for _ in range(FLAGS.repeats))
        runs = {}
        for workers in (1, 2):
            runs[workers] = max(prepare_mb_per_s(jsonl, os.path.join(scratch, f"out{workers}-{r}"), tokenizer.path,
                                                 workers, megabytes) for r in range(FLAGS.repeats))
    print(json.dumps({"benchmark": "prep", "text_mb": round(megabytes, 1),
                      "tokenizer_alone_mb_per_s": round(alone, 2),
                      "prepare_1_worker_mb_per_s": round(runs[1], 2), "prepare_2_workers_mb_per_s": round(runs[2], 2),
                      "ratio": round(runs[1] / alone, 3), "ratio_2_workers": round(runs[2] / alone, 3),
                      "cpus": os.cpu_count()}))


if __name__ == "__main__":
    app.run(main)
