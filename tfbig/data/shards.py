"""Writing shards in parallel processes, each exactly once, resumable after a crash.

A worker reads its shard's pieces, tokenizes them (the expensive part), packs examples,
and writes `NAME.tmp`, renamed to `NAME` when complete; then it writes the sidecar
`NAME.done` (JSON: counts, sha256, and a fingerprint of everything that decided the
shard's content). A later run reuses a shard only if its sidecar fingerprint matches
and the file's sha256 still equals the recorded one; otherwise it writes it again.

Example:
    results = write_shards(jobs, num_workers=4)  # one dict per job, in job order
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np
from absl import logging

from tfbig.data import formats, source_spec, sources, tfrecord
from tfbig.data.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs to write one shard; small and picklable."""

    split: str
    index: int
    num_shards: int
    pieces: tuple[source_spec.Piece, ...]
    spec: source_spec.SourceSpec
    output_dir: str
    format: str
    seq_length: int
    tokenizer_path: str
    tokenizer_sha256: str
    vocab_size: int
    seed: int = 0
    format_options: tuple[tuple[str, object], ...] = ()  # sorted (name, value) pairs
    group: str = ""  # write only this JSONL group's documents (per-group shards); "" = all kept groups
    count_skipped: bool = True  # count skipped documents (once per piece when groups share pieces)

    @property
    def options(self) -> dict:
        """Keyword options of the record format (e.g. ALBERT's masking settings)."""
        return dict(self.format_options)

    @property
    def file(self) -> str:
        """Shard file name, e.g. train-00003-of-00008.tfrecord, or train-pile_cc-00003-of-00008.tfrecord."""
        group = f"-{group_slug(self.group)}" if self.group else ""
        return f"{self.split}{group}-{self.index:05d}-of-{self.num_shards:05d}.tfrecord"

    @property
    def path(self) -> str:
        """Full path of the shard file."""
        return os.path.join(self.output_dir, self.file)

    def config(self) -> dict:
        """The settings that make shards incompatible with each other when they differ."""
        config = {"format": self.format, "seq_length": self.seq_length, "vocab_size": self.vocab_size,
                  "tokenizer_sha256": self.tokenizer_sha256}
        return {**config, "format_options": self.options} if self.format_options else config

    def fingerprint(self) -> str:
        """Hash of everything that decides this shard's bytes."""
        content = {"file": self.file, "pieces": [p.key() for p in self.pieces],
                   "spec": dataclasses.asdict(self.spec), "seed": self.seed, "group": self.group, **self.config()}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def group_slug(group: str) -> str:
    """A file-name-safe form of a group name: 'Pile-CC' -> 'pile-cc', 'Wikipedia (en)' -> 'wikipedia_en'."""
    slug = "".join(c if c.isalnum() or c == "-" else "_" for c in group.lower()).strip("_")
    return "_".join(part for part in slug.split("_") if part) or "group"


def write_shards(jobs: list[ShardJob], num_workers: int) -> list[dict]:
    """Make sure every job's shard exists and is valid; returns their sidecar dicts in job order.

    `num_workers` processes (spawned, so the caller may have TensorFlow loaded); with 1,
    everything runs in this process. The first failure stops the run and is re-raised;
    shards finished before it stay valid for the next run.
    """
    if num_workers < 1:
        raise ValueError(f"--num_workers={num_workers}: expected >= 1")
    if num_workers == 1 or len(jobs) == 1:
        return [ensure_shard(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(num_workers, len(jobs)), mp_context=context) as pool:
        futures = [pool.submit(ensure_shard, job) for job in jobs]
        try:
            return [future.result() for future in futures]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def ensure_shard(job: ShardJob) -> dict:
    """Reuse the shard if its sidecar and sha256 check out, else write it."""
    done = completed(job)
    if done is not None:
        logging.info("%s: complete, reused", job.file)
        return {**done, "reused": True}
    return {**write_shard(job), "reused": False}


def completed(job: ShardJob) -> dict | None:
    """The sidecar of a finished, intact shard with this job's fingerprint, else None."""
    try:
        with open(job.path + ".done") as file:
            done = json.load(file)
    except (OSError, json.JSONDecodeError):
        return None
    if done.get("fingerprint") != job.fingerprint() or not os.path.isfile(job.path):
        return None
    if file_sha256(job.path) != done.get("sha256"):
        logging.warning("%s: sha256 differs from its .done record; writing it again", job.path)
        return None
    return done


def write_shard(job: ShardJob) -> dict:
    """Tokenize, pack and write one shard (temp file + rename), then its sidecar."""
    tokenizer, byte_lengths = _tokenizer(job.tokenizer_path, job.tokenizer_sha256)
    record_format = formats.get_format(job.format)
    replaced, skipped, groups = Counter(), Counter(), {}
    documents = _tokenized(job, tokenizer, replaced, skipped, groups)
    records = tokens = source_bytes = 0
    with tfrecord.RecordWriter(job.path + ".tmp") as writer:
        for batch in record_format.make_examples(documents, job.seq_length, tokenizer, job.seed, **job.options):
            writer.write(tfrecord.encode_examples(batch))
            ids = batch[record_format.token_feature]
            records, tokens = records + len(ids), tokens + ids.size
            source_bytes += int(byte_lengths[ids].sum())
    os.replace(job.path + ".tmp", job.path)
    done = {"file": job.file, "records": records, "tokens": tokens, "bytes": source_bytes,
            "sha256": writer.sha256.hexdigest(), "file_bytes": writer.num_bytes,
            "replaced": dict(replaced), "skipped": dict(skipped) if job.count_skipped else {}, "groups": groups,
            "group": job.group, "fingerprint": job.fingerprint(), "config": job.config()}
    _write_json(job.path + ".done", done)
    logging.info("%s: %d records, %d tokens, %.1f MB", job.file, records, tokens, writer.num_bytes / 1e6)
    return done


def _tokenized(job: ShardJob, tokenizer: Tokenizer, replaced: Counter, skipped: Counter,
               groups: dict) -> Iterator[list[int]]:
    """Token ids of the job's documents; counts documents and their tokens per group in `groups`."""
    for piece in job.pieces:
        for group, document in sources.read_records(piece, job.spec, replaced, skipped):
            if job.group and group != job.group:
                continue  # another group's shard holds it
            if isinstance(document, tuple):  # (prompt, completion): tfbig.data.completion
                ids = tuple(tokenizer.encode(part) for part in document)
                count = sum(len(part) for part in ids)
            else:
                ids = tokenizer.encode(document)
                count = len(ids)
            counts = groups.setdefault(group, {"documents": 0, "tokens": 0})
            counts["documents"], counts["tokens"] = counts["documents"] + 1, counts["tokens"] + count
            yield ids


_TOKENIZERS: dict[tuple[str, str], tuple[Tokenizer, np.ndarray]] = {}


def _tokenizer(path: str, sha256: str) -> tuple[Tokenizer, np.ndarray]:
    """Per-process cache: a worker loads the tokenizer once, not once per shard."""
    if (path, sha256) not in _TOKENIZERS:
        tokenizer = load_tokenizer(path)
        _TOKENIZERS[path, sha256] = tokenizer, tokenizer.piece_byte_lengths()
    return _TOKENIZERS[path, sha256]


def file_sha256(path: str) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: str, content: dict) -> None:
    with open(path + ".tmp", "w") as file:
        json.dump(content, file, indent=1)
    os.replace(path + ".tmp", path)
