"""Raw text in, TFRecord shards + tokenizer + manifest out: the whole data preparation job.

`tfbig-prep` maps its flags onto `prepare`; `tfbig-train` calls it with no input to get
the embedded Shakespeare corpus in `default_data_dir(...)`.

Steps: cut the input into pieces and hold out validation pieces; train the tokenizer on
training text (or copy the given one); plan shards of about `shard_size_mb`; write them
in `num_workers` processes (reusing complete ones); write manifest.json last.

A finished directory is never changed silently: a second run with the same settings and
input returns its manifest after checking every shard's sha256; a run with other
settings (seq_length, tokenizer, input, shard size...) is refused unless `overwrite`.

Example:
    manifest = prepare(["corpus/"], "/data/corpus", seq_length=1024, vocab_size=32000, num_workers=8)
"""

import dataclasses
import fcntl
import hashlib
import json
import math
import os
from collections import Counter

import numpy as np
from absl import logging

from tfbig.data import file_kinds, formats, shards, source_spec, sources, tfrecord
from tfbig.data.manifest import Manifest, ShardInfo, SplitInfo, write_manifest
from tfbig.data.prep_output import (existing_config, finished_preparation, pieces_key,
                                    refuse_conflicts, remove_stale_files)
from tfbig.data.prep_tokenizer import recorded_tokenizer_name, tokenizer_step
from tfbig.data.tokenizer import (is_byte_level_bpe, load_tokenizer, tokenizer_file,
                                  tokenizer_sha256)
from tfbig.data.tokenizer_json import is_tokenizer_json

PIECE_BYTES = 1 << 20  # input granularity: shards are runs of pieces
SAMPLE_BYTES = 256 << 10  # text tokenized up front to estimate shard sizes


def default_data_dir(seq_length: int, vocab_size: int = 8000) -> str:
    """Cache directory for the embedded corpus: $TFBIG_CACHE (or ~/.cache/tfbig)/shakespeare-T{seq}-V{vocab}."""
    root = os.environ.get("TFBIG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tfbig")
    return os.path.join(root, f"shakespeare-T{seq_length}-V{vocab_size}")


def prepare_locked(output_dir: str, **kwargs) -> str:
    """prepare() under a host-wide file lock beside output_dir, so the processes of one host
    (horovodrun, tfbig-launch) that all ask for the same cached data build it once."""
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
    with open(output_dir.rstrip("/") + ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            prepare(None, output_dir, **kwargs)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return output_dir


def prepare(inputs: list[str] | None = None, output_dir: str | None = None, seq_length: int = 1024,
            vocab_size: int = 8000, shard_size_mb: float = 1024, num_workers: int = 1, format: str = "gpt", *,
            tokenizer: str | None = None, doc_per_line: bool = False, jsonl_field: str = "text",
            jsonl_group_field: str = "", jsonl_groups: tuple[str, ...] = (), shard_by_group: bool = False,
            tfds_name: str = "", tfds_split: str = "train", tfds_text_key: str = "text",
            tfds_data_dir: str | None = None, tfds_validation_split: str = "", validation_fraction: float = 0.01,
            validation_plays: tuple[str, ...] = sources.DEFAULT_VALIDATION_PLAYS,
            tokenizer_sample_mb: float = 512, overwrite: bool = False, seed: int = 0,
            format_options: dict | None = None, runner: str = "local", beam_options: tuple[str, ...] = (),
            prompt_field: str = "prompt") -> Manifest:
    """Prepare a data directory and return its manifest.

    Args:
      inputs: files, directories or globs of .txt/.md/.jsonl and Wikipedia .xml dumps, plain or
        .gz/.bz2/.xz/.zst (streamed); None (and no tfds_name) means the embedded Shakespeare plays.
      output_dir: where shards, tokenizer.model and manifest.json go; None means
        `default_data_dir(seq_length, vocab_size)` for the embedded corpus.
      seq_length: tokens the model sees per example (records hold seq_length + 1).
      vocab_size: size of the tokenizer to train (checked against a given one).
      shard_size_mb: target size of one shard file, in MiB.
      num_workers: processes that tokenize and write shards.
      format: record format, a key of `tfbig.data.FORMATS`.
      tokenizer: an existing tokenizer to use (copied next to the shards) instead of training
        one: a SentencePiece .model, a WordPiece vocab.txt (format "bert"), GPT-2's byte-level
        BPE vocab.json with merges.txt beside it (format "gpt"), or a directory holding one
        (a Hugging Face GPT-2, a tfbig-convert output: `tokenizer_file`).
      doc_per_line, jsonl_field, jsonl_group_field, jsonl_groups, tfds_*: see `tfbig.data.SourceSpec`.
      shard_by_group: each shard holds one of `jsonl_groups` (file names carry the group), so one
        prep writes per-component shards (e.g. of the Pile); the manifest lists each shard's group.
      validation_fraction: share of input pieces (files, 1 MiB line ranges, TFDS example
        ranges) held out; unused with tfds_validation_split.
      validation_plays: embedded corpus only: plays held out for validation.
      tokenizer_sample_mb: at most this much training text trains the tokenizer.
      overwrite: replace a directory prepared with other settings instead of refusing.
      seed: tokenizer training seed (and the format's, if it uses randomness).
      format_options: keyword options of the record format (e.g. for "albert" the
        `tfbig.data.MaskingOptions` fields), recorded in the manifest.
      runner: "local" (num_workers processes on this host) or an Apache Beam runner ("direct",
        "dataflow", "spark", "flink", "portable"; see `tfbig.data.beam`): the same shards and manifest.
      beam_options: extra Beam pipeline options (e.g. "--project=p", "--region=r") for a Beam runner.
      prompt_field: format "completion": the .jsonl field of each record's prompt (jsonl_field
        holds its completion; tfbig.data.completion).
    """
    spec = source_spec.SourceSpec(tuple(inputs or ()), doc_per_line, jsonl_field, jsonl_group_field, tuple(jsonl_groups),
                              tfds_name, tfds_split, tfds_validation_split, tfds_text_key, tfds_data_dir,
                              prompt_field if format == "completion" else "")
    if format == "completion" and not tokenizer:
        raise ValueError("--format=completion: pass --tokenizer (the tokenizer of the checkpoint "
                         "to fine-tune, or its directory); it is not trained on the pairs")
    if shard_by_group and not jsonl_groups:
        raise ValueError("--shard_by_group needs --jsonl_groups: the groups to write shards of (e.g. "
                         "--jsonl_group_field=meta.pile_set_name --jsonl_groups=Pile-CC,Github)")
    output_dir = _output_dir(output_dir, spec, seq_length, vocab_size)
    # tfbig owns its cache of the embedded corpus: data there from an older recipe is rebuilt,
    # not refused (a user's own --output_dir still needs --overwrite)
    overwrite = overwrite or _in_embedded_cache(output_dir, spec)
    record_format = formats.get_format(format)
    _check_positive(seq_length=seq_length, vocab_size=vocab_size, shard_size_mb=shard_size_mb, num_workers=num_workers)
    if runner != "local":
        from tfbig.data import beam

        beam.runner_name(runner)  # an unknown runner is refused before any work
    train, validation = sources.plan_splits(spec, _piece_bytes(shard_size_mb), validation_fraction, validation_plays)
    plain = sorted({p.path for p in train + validation if p.kind != "jsonl"})
    if format == "completion" and plain:
        raise ValueError(f"--format=completion reads .jsonl records with a prompt and a completion "
                         f"field; {', '.join(plain[:3])} is not a .jsonl file")
    binary = _skipped_binary_files(spec)
    settings = {"format": format, "seq_length": seq_length, "vocab_size": vocab_size, "seed": seed,
                "shard_size_mb": shard_size_mb, "spec": dataclasses.asdict(spec), "shard_by_group": shard_by_group}
    tokenizer = tokenizer_file(tokenizer) if tokenizer else None
    if tokenizer and is_byte_level_bpe(tokenizer):
        settings["tokenizer_kind"] = "byte_level_bpe"  # only then: other prep keys stay as they were
    elif tokenizer and is_tokenizer_json(tokenizer):
        settings["tokenizer_kind"] = "tokenizer_json"
    if format_options:  # copy_prob=0 (no copy pairs) is left out: earlier directories still match
        settings["format_options"] = {name: value for name, value in sorted(format_options.items())
                                      if name != "copy_prob" or value}
    os.makedirs(output_dir, exist_ok=True)
    existing = existing_config(output_dir)
    refuse_conflicts(output_dir, existing, {"format": format, "seq_length": seq_length}, overwrite)
    tokenizer_sha = tokenizer_step(output_dir, tokenizer, train, spec, vocab_size, seed,
                                    tokenizer_sample_mb, existing, overwrite, format,
                                    recorded_tokenizer_name(settings))
    key = _prep_key(settings, train, validation, tokenizer_sha)
    manifest = finished_preparation(output_dir, key, overwrite)
    if manifest is not None:
        return manifest
    jobs = _plan_jobs(output_dir, spec, settings, {"train": train, "validation": validation}, tokenizer_sha)
    results = _write(jobs, num_workers, runner, beam_options)
    manifest = _manifest(output_dir, settings, jobs, results, spec, key, record_format)
    if binary:
        manifest = dataclasses.replace(manifest, info={**manifest.info, "skipped_binary_files": binary})
    write_manifest(manifest)
    remove_stale_files(output_dir, manifest)
    _log_summary(manifest)
    return manifest


def _write(jobs, num_workers: int, runner: str, beam_options: tuple[str, ...]) -> list[dict]:
    if runner == "local":
        return shards.write_shards(jobs, num_workers)
    from tfbig.data import beam  # optional extra

    return beam.write_shards(jobs, runner, num_workers, tuple(beam_options))


def _skipped_binary_files(spec: source_spec.SourceSpec) -> list[str]:
    """The input files skipped as binary (`file_kinds.binary_files`), each named in a warning."""
    binary = file_kinds.binary_files(sources.resolve_files(spec.inputs)) if spec.inputs else []
    for path in binary:
        logging.warning("%s: binary content (NUL bytes, or more than %d%% undecodable as UTF-8): skipped",
                        path, round(file_kinds.BINARY_SHARE * 100))
    if binary:
        logging.warning("skipped %d binary file(s) among the inputs; listed in the manifest's "
                        "info.skipped_binary_files", len(binary))
    return binary


def _in_embedded_cache(output_dir: str, spec: source_spec.SourceSpec) -> bool:
    """Whether output_dir is a directory of tfbig's embedded-corpus cache (default_data_dir)."""
    cache = os.path.dirname(default_data_dir(1, 1))
    return (not spec.inputs and not spec.tfds_name
            and os.path.dirname(os.path.abspath(output_dir)) == os.path.abspath(cache)
            and os.path.basename(output_dir.rstrip("/")).startswith("shakespeare-"))


def _output_dir(output_dir: str | None, spec: source_spec.SourceSpec, seq_length: int, vocab_size: int) -> str:
    if output_dir:
        return output_dir
    if spec.inputs or spec.tfds_name:
        raise ValueError("--output_dir is required when --input or --tfds_name is given")
    return default_data_dir(seq_length, vocab_size)


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"--{name}={value}: expected a positive number")


def _piece_bytes(shard_size_mb: float) -> int:
    """Pieces well under a shard (a shard is a run of pieces), at most 1 MiB."""
    return int(min(PIECE_BYTES, max(1024, shard_size_mb * 2**20 / 4)))


# ---------------------------------------------------------------- existing directory


# ---------------------------------------------------------------- tokenizer


# ---------------------------------------------------------------- plan and run


def _prep_key(settings: dict, train, validation, tokenizer_sha: str) -> str:
    content = {**settings, "train": pieces_key(train), "validation": pieces_key(validation),
               "tokenizer_sha256": tokenizer_sha}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _plan_jobs(output_dir, spec, settings, splits: dict, tokenizer_sha: str) -> list[shards.ShardJob]:
    tokenizer_path = os.path.join(output_dir, recorded_tokenizer_name(settings))
    ratio = _record_bytes_per_source_byte(splits["train"], spec, tokenizer_path, settings["seq_length"])
    target = settings["shard_size_mb"] * 2**20 / ratio  # source bytes per shard
    # Per-group shards: every group's shards read the same runs of pieces and keep their own
    # documents, so a group's shards are smaller than --shard_size_mb by its share of the text.
    record_groups = spec.jsonl_groups if settings["shard_by_group"] else ("",)
    jobs = []
    for split, pieces in splits.items():
        runs = _balanced_groups(pieces, target)
        text = sum(piece.size for piece in pieces)
        logging.info("%s: %d shard(s) of ~%.1f MiB from %.1f MiB of text in %d piece(s)", split,
                     len(runs) * len(record_groups), text / max(len(runs), 1) / target * settings["shard_size_mb"],
                     text / 2**20, len(pieces))
        jobs += [shards.ShardJob(split, index, len(runs), tuple(run), spec, output_dir, settings["format"],
                                 settings["seq_length"], tokenizer_path, tokenizer_sha, settings["vocab_size"],
                                 settings["seed"], tuple(settings.get("format_options", {}).items()),
                                 group=group, count_skipped=group == record_groups[0])
                 for group in record_groups for index, run in enumerate(runs)]
    _check_group_names(record_groups)
    return jobs


def _check_group_names(groups) -> None:
    slugs = Counter(shards.group_slug(group) for group in groups)
    clashes = sorted(group for group in groups if slugs[shards.group_slug(group)] > 1)
    if clashes:
        raise ValueError(f"--jsonl_groups {clashes} give the same shard file name "
                         f"({shards.group_slug(clashes[0])}); --shard_by_group needs distinct names")


def _record_bytes_per_source_byte(pieces, spec, tokenizer_path: str, seq_length: int) -> float:
    """Estimate shard bytes per byte of source text by tokenizing a small sample."""
    tokenizer, text_bytes, ids = load_tokenizer(tokenizer_path), 0, []
    for piece in pieces:
        for document in sources.read_documents(piece, spec, Counter()):
            document = "".join(document) if isinstance(document, tuple) else document  # a pair
            ids += tokenizer.encode(document)
            text_bytes += len(document.encode())
            if text_bytes >= SAMPLE_BYTES:
                break
        if text_bytes >= SAMPLE_BYTES:
            break
    if not ids:
        return 1.0
    width = min(len(ids), seq_length + 1)
    record = len(tfrecord.frame_records(tfrecord.encode_examples({"ids": np.array([ids[:width]])})))
    return record / width * len(ids) / text_bytes


def _balanced_groups(pieces: list[source_spec.Piece], target: float) -> list[list[source_spec.Piece]]:
    """Cut the pieces into ceil(total / target) runs of about equal size."""
    if not pieces:
        return []
    sizes = np.cumsum([piece.size for piece in pieces])
    count = max(1, math.ceil(sizes[-1] / target))
    owner = np.minimum((sizes - 1) * count // max(sizes[-1], 1), count - 1)  # group of each piece
    groups = [[] for _ in range(count)]
    for piece, index in zip(pieces, owner.tolist()):
        groups[index].append(piece)
    return [group for group in groups if group]


def _manifest(output_dir, settings, jobs, results, spec, key, record_format) -> Manifest:
    name = recorded_tokenizer_name(settings)
    tokenizer = load_tokenizer(os.path.join(output_dir, name))
    splits = {}
    for split in ("train", "validation"):
        infos = [ShardInfo(r["file"], r["records"], r["tokens"], r["bytes"], r["sha256"], job.group)
                 for job, r in zip(jobs, results) if job.split == split]
        splits[split] = SplitInfo(tuple(infos))
    counts = _group_counts(jobs, results)
    if not splits["train"].records:
        raise ValueError(f"input {spec.describe()} gave no training example of {settings['seq_length'] + 1} tokens; "
                         "give more text or a smaller --seq_length")
    replaced = sum((Counter(r["replaced"]) for r in results), Counter())
    info = {"source": spec.describe(), "prep_key": key, "shard_size_mb": settings["shard_size_mb"],
            "replaced_chars": sum(replaced.values()), "replaced_chars_by_file": dict(replaced.most_common(100)),
            "features": record_format.features(settings["seq_length"], **settings.get("format_options", {})),
            "format_options": settings.get("format_options", {}), "validation_split": _held_out_by(jobs),
            **counts}
    info = json.loads(json.dumps(info))  # as load_manifest will see it
    return Manifest(output_dir, settings["format"], settings["seq_length"], tokenizer.vocab_size, name,
                    tokenizer.eos_id, tokenizer.pad_id, splits, tokenizer_sha256(tokenizer.path), info)


def _held_out_by(jobs) -> dict:
    """How the validation split was held out, for the manifest: whole pieces (files, line ranges,
    plays) or, for an input of too few pieces, documents inside them (`source_spec.held_out_document`)."""
    sides = [piece for job in jobs for piece in job.pieces if piece.side]
    if not sides:
        return {"by": "piece"}
    return {"by": "document", "fraction": sides[0].fraction,
            "rule": "document i of each piece (a paragraph of a one-document file) is held out when "
                    "floor((i + 1) * fraction + 0.5) > floor(i * fraction + 0.5)"}


def _group_counts(jobs, results) -> dict:
    """Per split: documents and their tokens per JSONL group, and skipped documents per reason."""
    groups, skipped = {}, {}
    for job, result in zip(jobs, results):
        split_groups = groups.setdefault(job.split, {})
        for group, counts in result.get("groups", {}).items():
            total = split_groups.setdefault(group, {"documents": 0, "tokens": 0})
            total["documents"] += counts["documents"]
            total["tokens"] += counts["tokens"]
        split_skipped = skipped.setdefault(job.split, Counter())
        split_skipped.update(result.get("skipped", {}))
    counts = {"skipped": {split: dict(sorted(c.items())) for split, c in skipped.items()}}
    if any(group for split_groups in groups.values() for group in split_groups):
        counts["groups"] = {split: dict(sorted(g.items())) for split, g in groups.items()}
    return counts


def _log_summary(manifest: Manifest) -> None:
    for name, split in manifest.splits.items():
        logging.info("%s: %d shards, %d records, %d tokens, %d source bytes", name, len(split.shards),
                     split.records, split.tokens, split.bytes)
        if split.shards and not split.records:
            logging.warning("%s split has no complete record of seq_length + 1 tokens", name)
    for split, reasons in manifest.info.get("skipped", {}).items():
        for reason, count in reasons.items():
            logging.info("%s: skipped %d document(s): %s", split, count, reason)
    for path, count in manifest.info["replaced_chars_by_file"].items():
        logging.warning("%s: %d undecodable byte sequence(s) replaced with U+FFFD", path, count)
    logging.info("wrote %s", manifest.path)
