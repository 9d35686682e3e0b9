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
import re
import shutil
from collections import Counter

import numpy as np
from absl import logging

from tfbig.data import file_kinds, formats, shards, source_spec, sources, tfrecord
from tfbig.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, SplitInfo, load_manifest, write_manifest
from tfbig.data.tokenizer import (Tokenizer, is_byte_level_bpe, load_tokenizer, tokenizer_file,
                                  tokenizer_files, tokenizer_sha256)
from tfbig.data.wordpiece_vocab import WordPieceVocab

TOKENIZER_NAME = "tokenizer.model"
WORDPIECE_NAME = "vocab.txt"  # --format=bert: a WordPiece vocabulary (tfbig.data.WordPieceVocab)
BPE_NAME = "vocab.json"  # GPT-2's byte-level BPE (--tokenizer=a GPT-2 directory), merges.txt beside it


def tokenizer_name(format: str, byte_level_bpe: bool = False) -> str:
    """File name of the tokenizer next to the shards of `format`."""
    if byte_level_bpe:
        return BPE_NAME
    return WORDPIECE_NAME if format == "bert" else TOKENIZER_NAME


def _tokenizer_name(settings: dict) -> str:
    return tokenizer_name(settings["format"], settings.get("tokenizer_kind") == "byte_level_bpe")


PIECE_BYTES = 1 << 20  # input granularity: shards are runs of pieces
SAMPLE_BYTES = 256 << 10  # text tokenized up front to estimate shard sizes
_SHARD_FILE = re.compile(r"^(train|validation)(-[\w-]+)?-\d{5}-of-\d{5}\.tfrecord(?P<suffix>\.done|\.tmp)?$")


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
            format_options: dict | None = None, runner: str = "local", beam_options: tuple[str, ...] = ()) -> Manifest:
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
    """
    spec = source_spec.SourceSpec(tuple(inputs or ()), doc_per_line, jsonl_field, jsonl_group_field, tuple(jsonl_groups),
                              tfds_name, tfds_split, tfds_validation_split, tfds_text_key, tfds_data_dir)
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
    binary = _skipped_binary_files(spec)
    settings = {"format": format, "seq_length": seq_length, "vocab_size": vocab_size, "seed": seed,
                "shard_size_mb": shard_size_mb, "spec": dataclasses.asdict(spec), "shard_by_group": shard_by_group}
    tokenizer = tokenizer_file(tokenizer) if tokenizer else None
    if tokenizer and is_byte_level_bpe(tokenizer):
        settings["tokenizer_kind"] = "byte_level_bpe"  # only then: other prep keys stay as they were
    if format_options:  # copy_prob=0 (no copy pairs) is left out: earlier directories still match
        settings["format_options"] = {name: value for name, value in sorted(format_options.items())
                                      if name != "copy_prob" or value}
    os.makedirs(output_dir, exist_ok=True)
    existing = _existing_config(output_dir)
    _refuse_conflicts(output_dir, existing, {"format": format, "seq_length": seq_length}, overwrite)
    tokenizer_sha = _tokenizer_step(output_dir, tokenizer, train, spec, vocab_size, seed,
                                    tokenizer_sample_mb, existing, overwrite, format,
                                    _tokenizer_name(settings))
    key = _prep_key(settings, train, validation, tokenizer_sha)
    manifest = _finished(output_dir, key, overwrite)
    if manifest is not None:
        return manifest
    jobs = _plan_jobs(output_dir, spec, settings, {"train": train, "validation": validation}, tokenizer_sha)
    results = _write(jobs, num_workers, runner, beam_options)
    manifest = _manifest(output_dir, settings, jobs, results, spec, key, record_format)
    if binary:
        manifest = dataclasses.replace(manifest, info={**manifest.info, "skipped_binary_files": binary})
    write_manifest(manifest)
    _remove_stale_files(output_dir, manifest)
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


def _existing_config(output_dir: str) -> dict:
    """Settings of shards already in output_dir: {field: (value, where found)}."""
    found = {}
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    if os.path.isfile(manifest_path):
        manifest = load_manifest(output_dir)
        for field in ("format", "seq_length", "vocab_size", "tokenizer_sha256"):
            found[field] = (getattr(manifest, field), MANIFEST_NAME)
        found["prep_key"] = (manifest.info.get("prep_key"), MANIFEST_NAME)
    for name in sorted(os.listdir(output_dir)):
        if name.endswith(".tfrecord.done") and _SHARD_FILE.match(name):
            try:
                with open(os.path.join(output_dir, name)) as file:
                    config = json.load(file).get("config", {})
            except (OSError, json.JSONDecodeError):
                continue
            for field, value in config.items():
                found.setdefault(field, (value, name))
    return found


def _refuse_conflicts(output_dir: str, existing: dict, requested: dict, overwrite: bool) -> None:
    """ValueError naming both values if output_dir holds shards made with other settings."""
    if overwrite:
        return
    for field, value in requested.items():
        if field in existing and existing[field][0] != value:
            old, where = existing[field]
            raise ValueError(f"{output_dir} holds shards made with {field}={old!r} (see {where}) but "
                             f"{field}={value!r} was requested; choose another --output_dir or pass --overwrite")


# ---------------------------------------------------------------- tokenizer


def _tokenizer_step(output_dir, given, train, spec, vocab_size, seed, sample_mb, existing, overwrite,
                    format="gpt", name=TOKENIZER_NAME) -> str:
    """Put the tokenizer in output_dir as `name` (tokenizer.model; vocab.txt for bert; vocab.json +
    merges.txt for a given byte-level BPE): copy, reuse or train; return its sha256."""
    target = os.path.join(output_dir, name)
    if given:
        _check_tokenizer_kind(given, format)
        sha = _checked_tokenizer_sha(given, vocab_size)
        if not overwrite and existing.get("tokenizer_sha256", (sha,))[0] != sha:
            raise ValueError(f"{output_dir} holds shards made with a tokenizer of sha256 "
                             f"{existing['tokenizer_sha256'][0][:12]}... (see {existing['tokenizer_sha256'][1]}) "
                             f"but --tokenizer={given} has sha256 {sha[:12]}...; "
                             "choose another --output_dir or pass --overwrite")
        if not _holds_tokenizer(target, sha):
            for file_name, source in sorted(tokenizer_files(given).items(), key=lambda f: f[0] == name):
                copy = os.path.join(output_dir, name if source == given else file_name)
                shutil.copyfile(source, copy + ".tmp")  # the named file last: it marks the copy done
                os.replace(copy + ".tmp", copy)
        return sha
    recipe = {"vocab_size": vocab_size, "seed": seed, "sample_mb": sample_mb,
              "model_type": "wordpiece" if format == "bert" else "bpe",
              "trained_on": _pieces_key(train), "spec": dataclasses.asdict(spec)}
    reused = _reusable_tokenizer(target, recipe)
    if reused:
        return reused
    if not overwrite and "tokenizer_sha256" in existing:
        old = existing.get("vocab_size", ("?", ""))[0]
        raise ValueError(f"{output_dir} holds shards whose tokenizer was trained on other input or settings "
                         f"(vocab_size={old}, see {existing['tokenizer_sha256'][1]}); this run would train a new "
                         f"one (vocab_size={vocab_size}) on {spec.describe()}; choose another --output_dir or "
                         "pass --overwrite")
    return _train_tokenizer(target, recipe, train, spec, vocab_size, seed, sample_mb)


def _holds_tokenizer(target: str, sha: str) -> bool:
    """Whether output_dir already holds the tokenizer of sha256 `sha` as `target` (and merges.txt)."""
    try:
        return tokenizer_sha256(target) == sha
    except OSError:
        return False


def _check_tokenizer_kind(source: str, format: str) -> None:
    if is_byte_level_bpe(source) and format != "gpt":
        raise ValueError(f"--tokenizer={source} is GPT-2's byte-level BPE, which has no [CLS], [SEP] "
                         f"or [MASK]; --format={format} needs its own tokenizer (BPE is for --format=gpt)")
    if (format == "bert") != source.endswith(".txt"):
        expected = "a WordPiece vocab.txt" if format == "bert" else "a SentencePiece .model file"
        raise ValueError(f"--tokenizer={source}: --format={format} needs {expected}")
    if format == "gpt" and hasattr(load_tokenizer(source), "line_end_id"):
        raise ValueError(f"--tokenizer={source} is a released ALBERT SentencePiece model (no "
                         "newline piece, no end-of-document id); it prepares --format=albert")


def _checked_tokenizer_sha(source: str, vocab_size: int) -> str:
    loaded = load_tokenizer(source)
    if loaded.vocab_size != vocab_size:
        raise ValueError(f"--tokenizer={source} has vocab_size={loaded.vocab_size} but --vocab_size={vocab_size}; "
                         "make them agree")
    try:
        eos = loaded.eos_id
    except ValueError:  # a BPE vocabulary without <|endoftext|>
        eos = -1
    if eos < 0:
        raise ValueError(f"--tokenizer={source} has no end-of-document (eos) piece; train it with eos_id set")
    return tokenizer_sha256(source)


def _reusable_tokenizer(target: str, recipe: dict) -> str | None:
    """sha256 of target if a sidecar says it was trained with exactly this recipe."""
    try:
        with open(target + ".json") as file:
            record = json.load(file)
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("recipe") != json.loads(json.dumps(recipe)) or not os.path.isfile(target):
        return None
    sha = shards.file_sha256(target)
    return sha if sha == record.get("sha256") else None


def _train_tokenizer(target, recipe, train, spec, vocab_size, seed, sample_mb) -> str:
    texts = (doc for piece in _sample(train, sample_mb * 2**20) for doc in sources.read_documents(piece, spec, Counter()))
    kind = recipe["model_type"]
    logging.info("training a %d-token %s tokenizer on up to %.0f MB of %s", vocab_size, kind, sample_mb, spec.describe())
    if kind == "wordpiece":
        WordPieceVocab.train(texts, vocab_size, target)
    else:
        Tokenizer.train(texts, vocab_size, target + ".training", seed=seed)
        os.replace(target + ".training.model", target)
    sha = shards.file_sha256(target)
    shards._write_json(target + ".json", {"recipe": recipe, "sha256": sha})
    return sha


def _sample(pieces: list[source_spec.Piece], budget: float) -> list[source_spec.Piece]:
    """Every k-th piece, so the sample spans the whole input and stays under budget."""
    total = sum(piece.size for piece in pieces)
    return pieces[::max(1, math.ceil(total / budget))]


# ---------------------------------------------------------------- plan and run


def _pieces_key(pieces: list[source_spec.Piece]) -> str:
    return hashlib.sha256(json.dumps([p.key() for p in pieces]).encode()).hexdigest()


def _prep_key(settings: dict, train, validation, tokenizer_sha: str) -> str:
    content = {**settings, "train": _pieces_key(train), "validation": _pieces_key(validation),
               "tokenizer_sha256": tokenizer_sha}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _finished(output_dir: str, key: str, overwrite: bool) -> Manifest | None:
    """The existing manifest if it was made by the same key and all shards check out.

    A manifest made with a different key is refused (unless overwrite); an invalid or
    stale one is removed so no reader trusts it while shards are rewritten.
    """
    path = os.path.join(output_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    manifest = load_manifest(output_dir)
    if manifest.info.get("prep_key") != key and not overwrite:
        raise ValueError(f"{output_dir} already holds data prepared from other input or settings "
                         f"(source {manifest.info.get('source')!r}, shard_size_mb "
                         f"{manifest.info.get('shard_size_mb')}, ...); choose another --output_dir or pass --overwrite")
    if manifest.info.get("prep_key") == key and _shards_intact(manifest):
        logging.info("%s: already prepared and intact; nothing to do", output_dir)
        return manifest
    os.remove(path)
    return None


def _shards_intact(manifest: Manifest) -> bool:
    for split in manifest.splits.values():
        for shard in split.shards:
            path = os.path.join(manifest.data_dir, shard.file)
            if not os.path.isfile(path) or shards.file_sha256(path) != shard.sha256:
                logging.warning("%s is missing or damaged; writing it again", path)
                return False
    return True


def _plan_jobs(output_dir, spec, settings, splits: dict, tokenizer_sha: str) -> list[shards.ShardJob]:
    tokenizer_path = os.path.join(output_dir, _tokenizer_name(settings))
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
    name = _tokenizer_name(settings)
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


def _remove_stale_files(output_dir: str, manifest: Manifest) -> None:
    """Delete shard files (and sidecars, temps) of older runs that the new manifest does not list."""
    keep = {shard.file for split in manifest.splits.values() for shard in split.shards}
    for name in os.listdir(output_dir):
        match = _SHARD_FILE.match(name)
        if not match:
            continue
        if match["suffix"] == ".tmp" or name.removesuffix(match["suffix"] or "") not in keep:
            os.remove(os.path.join(output_dir, name))


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
