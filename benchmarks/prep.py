"""Data preparation throughput: MB/s of text through `prepare` from plain .jsonl and from
.jsonl.zst, with 1 and 2 workers, vs the tokenizer alone.

Text: the embedded Shakespeare scenes, repeated `--copies` times, written as `--files` JSONL
files (one scene per line) and as their zstd-compressed copies (`x.jsonl.zst`, level 3, as
the Pile). A tokenizer is trained once beforehand and passed to every run (`tokenizer=`), so
the runs measure reading (and decompressing) + tokenizing + packing + writing shards +
manifest, end to end (process start-up and planning included), not tokenizer training.
"Tokenizer alone" is `Tokenizer.encode` on the same documents, already in memory, in one
thread. MB counts the documents' uncompressed UTF-8 bytes (MiB).

    python benchmarks/prep.py --copies=4

Prints one JSON line last: `zst_vs_plain` = MB/s from .zst / MB/s from .jsonl (1 worker; goal
>= 0.8), `scaling_2_workers` = 2 workers / 1 worker from .jsonl (goal >= 1.7 on an idle
machine; a compressed file is one piece, so .zst scales over files: `zst_scaling_2_workers`),
`ratio` = prepare with 1 worker / tokenizer alone; with the load average and CPU model.
"""

import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import subprocess
import tempfile
import time
from collections import Counter

import zstandard
from absl import app, flags

from tfbig.data import prepare, source_spec, sources, Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_integer("copies", 4, "Times the ~5 MB corpus is repeated.")
flags.DEFINE_integer("seq_length", 1024, "seq_length of the prepared records.")
flags.DEFINE_integer("vocab_size", 8000, "Tokenizer vocabulary size.")
flags.DEFINE_float("shard_size_mb", 2, "Target shard size (several shards, so 2 workers have work to split; "
                   "a .zst file is one piece, so at most one shard per file).")
flags.DEFINE_integer("repeats", 2, "Timed runs of each configuration; the best is reported.")
flags.DEFINE_integer("files", 4, "Input files the text is spread over (a .zst file is one piece).")


def scenes() -> list[str]:
    """The embedded corpus's documents."""
    spec = source_spec.SourceSpec()
    return [doc for piece in sources.plan_pieces(spec, 1 << 20) for doc in sources.read_documents(piece, spec, Counter())]


def tokenizer_mb_per_s(tokenizer: Tokenizer, documents: list[str], megabytes: float) -> float:
    start = time.perf_counter()
    for document in documents:
        tokenizer.encode(document)
    return megabytes / (time.perf_counter() - start)


def prepare_mb_per_s(inputs: list[str], output_dir: str, tokenizer: str, num_workers: int, megabytes: float) -> float:
    start = time.perf_counter()
    prepare(inputs, output_dir, FLAGS.seq_length, FLAGS.vocab_size, FLAGS.shard_size_mb, num_workers,
            tokenizer=tokenizer, validation_fraction=0)
    return megabytes / (time.perf_counter() - start)


def write_inputs(documents: list[str], scratch: str) -> dict[str, list[str]]:
    """{"plain": [.jsonl files], "zst": [their .jsonl.zst copies]}."""
    inputs = {"plain": [], "zst": []}
    for index in range(FLAGS.files):
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in documents[index::FLAGS.files]).encode()
        plain = os.path.join(scratch, f"part{index}.jsonl")
        with open(plain, "wb") as file:
            file.write(lines)
        with open(plain + ".zst", "wb") as file:
            file.write(zstandard.ZstdCompressor(level=3).compress(lines))
        inputs["plain"].append(plain)
        inputs["zst"].append(plain + ".zst")
    return inputs


def cpu_model() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")


def main(argv):
    del argv
    documents = scenes() * FLAGS.copies
    megabytes = sum(len(doc.encode()) for doc in documents) / 2**20
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        inputs = write_inputs(documents, scratch)
        compressed_mb = sum(os.path.getsize(path) for path in inputs["zst"]) / 2**20
        tokenizer = Tokenizer.train(documents[:len(documents) // FLAGS.copies], FLAGS.vocab_size,
                                    os.path.join(scratch, "spm"))
        alone = max(tokenizer_mb_per_s(tokenizer, documents, megabytes) for _ in range(FLAGS.repeats))
        runs = {}
        for repeat in range(FLAGS.repeats):  # interleaved, so load changes hit every configuration alike
            for kind in ("plain", "zst"):
                for workers in (1, 2):
                    out = os.path.join(scratch, f"out-{kind}-{workers}-{repeat}")
                    speed = prepare_mb_per_s(inputs[kind], out, tokenizer.path, workers, megabytes)
                    runs[kind, workers] = max(runs.get((kind, workers), 0.0), speed)
    _record.emit({"benchmark": "prep", "text_mb": round(megabytes, 1), "zst_mb": round(compressed_mb, 1),
                      "files": FLAGS.files, "tokenizer_alone_mb_per_s": round(alone, 2),
                      "plain_1_worker_mb_per_s": round(runs["plain", 1], 2),
                      "plain_2_workers_mb_per_s": round(runs["plain", 2], 2),
                      "zst_1_worker_mb_per_s": round(runs["zst", 1], 2),
                      "zst_2_workers_mb_per_s": round(runs["zst", 2], 2),
                      "zst_vs_plain": round(runs["zst", 1] / runs["plain", 1], 3),
                      "scaling_2_workers": round(runs["plain", 2] / runs["plain", 1], 3),
                      "zst_scaling_2_workers": round(runs["zst", 2] / runs["zst", 1], 3),
                      "ratio": round(runs["plain", 1] / alone, 3), "cpus": os.cpu_count(),
                      "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpu": cpu_model()})


if __name__ == "__main__":
    app.run(main)
