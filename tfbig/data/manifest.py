"""`DATA_DIR/manifest.json`: what a prepared data directory holds. Written last by prep.

    {"schema_version": 1, "format": "gpt", "seq_length": T, "vocab_size": V,
     "tokenizer": "tokenizer.model", "tokenizer_sha256": "...", "eos_id": 2, "pad_id": 0,
     "splits": {"train": {"shards": [{"file": "train-00000-of-00004.tfrecord", "records": n,
                                      "tokens": n, "bytes": n, "sha256": "..."}, ...],
                          "records": n, "tokens": n, "bytes": n},
                "validation": {...}},
     "info": {...provenance: source, replaced_chars, prep settings...}}

`tokens` counts every token stored in the split's records (eos included); `bytes` counts
the UTF-8 source bytes those tokens spell, so bits per byte = nats per token / ln 2 *
tokens / bytes (`Manifest.bits_per_byte`).

Example:
    manifest = load_manifest("/data/shakespeare")
    manifest.check(format="gpt", seq_length=256, vocab_size=8000)
    files = manifest.shard_paths("train")
"""

import dataclasses
import json
import math
import os

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_REQUIRED = ("schema_version", "format", "seq_length", "vocab_size", "tokenizer", "eos_id", "pad_id", "splits")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard file and what it holds."""

    file: str  # name relative to the data directory
    records: int
    tokens: int
    bytes: int
    sha256: str
    group: str = ""  # per-group shards (tfbig-prep --shard_by_group): the JSONL group it holds


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """A split's shards and totals."""

    shards: tuple[ShardInfo, ...]

    @property
    def records(self) -> int:
        """Examples in the split."""
        return sum(shard.records for shard in self.shards)

    @property
    def tokens(self) -> int:
        """Tokens stored in the split's records (eos included)."""
        return sum(shard.tokens for shard in self.shards)

    @property
    def bytes(self) -> int:
        """UTF-8 bytes of source text those tokens spell."""
        return sum(shard.bytes for shard in self.shards)

    def of_group(self, group: str) -> "SplitInfo":
        """The shards holding one JSONL group (made with --shard_by_group)."""
        return SplitInfo(tuple(shard for shard in self.shards if shard.group == group))

    def __getitem__(self, key: str):
        """JSON-style access, as in manifest.json: split["tokens"] == split.tokens."""
        if key not in ("shards", "records", "tokens", "bytes"):
            raise KeyError(f"{key!r}: a split has shards, records, tokens and bytes")
        return getattr(self, key)

    def to_json(self) -> dict:
        """The split as in manifest.json."""
        shards = [{key: value for key, value in dataclasses.asdict(shard).items() if key != "group" or value}
                  for shard in self.shards]
        return {"shards": shards, "records": self.records, "tokens": self.tokens, "bytes": self.bytes}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A prepared data directory (see the module docstring for the JSON)."""

    data_dir: str
    format: str
    seq_length: int
    vocab_size: int
    tokenizer: str  # file name of the SentencePiece model, relative to data_dir
    eos_id: int
    pad_id: int
    splits: dict[str, SplitInfo]
    tokenizer_sha256: str = ""
    info: dict = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def path(self) -> str:
        """Path of manifest.json."""
        return os.path.join(self.data_dir, MANIFEST_NAME)

    @property
    def tokenizer_path(self) -> str:
        """Path of the tokenizer model, for `Tokenizer.load`."""
        return os.path.join(self.data_dir, self.tokenizer)

    def split(self, name: str) -> SplitInfo:
        """The split called `name`; ValueError naming the known splits otherwise."""
        if name not in self.splits:
            raise ValueError(f"{self.path}: no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]

    def shard_paths(self, split: str) -> list[str]:
        """Full paths of the split's shards, in manifest order."""
        return [os.path.join(self.data_dir, shard.file) for shard in self.split(split).shards]

    def check(self, format: str | None = None, seq_length: int | None = None, vocab_size: int | None = None) -> None:
        """Raise ValueError if the data does not match what the caller expects (None = any)."""
        for field, expected in (("format", format), ("seq_length", seq_length), ("vocab_size", vocab_size)):
            found = getattr(self, field)
            if expected is not None and found != expected:
                raise ValueError(f"{self.path}: {field} is {found!r} but {expected!r} was expected; "
                                 f"prepare the data again with {field}={expected!r} or change the model config")

    def check_tokenizer(self) -> None:
        """Raise FileNotFoundError naming this manifest and the file if the tokenizer it names
        (with merges.txt, for GPT-2's vocab.json) is not in the data directory."""
        files = [self.tokenizer_path]
        if self.tokenizer == "vocab.json":  # GPT-2's byte-level BPE: merges.txt beside it
            files.append(os.path.join(os.path.dirname(self.tokenizer_path), "merges.txt"))
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{self.path} names the tokenizer {self.tokenizer!r}, but {path} is missing; "
                    "copy it back beside the shards or prepare the data again (tfbig-prep)")

    def bits_per_byte(self, nats_per_token: float, split: str = "validation") -> float:
        """Convert a mean loss in nats per token into bits per source byte on `split`."""
        info = self.split(split)
        return nats_per_token / math.log(2) * info.tokens / info.bytes

    def to_json(self) -> dict:
        """The manifest.json content."""
        return {"schema_version": self.schema_version, "format": self.format, "seq_length": self.seq_length,
                "vocab_size": self.vocab_size, "tokenizer": self.tokenizer, "tokenizer_sha256": self.tokenizer_sha256,
                "eos_id": self.eos_id, "pad_id": self.pad_id,
                "splits": {name: split.to_json() for name, split in self.splits.items()}, "info": self.info}


def load_manifest(data_dir: str) -> Manifest:
    """Read and validate `data_dir/manifest.json`.

    Raises FileNotFoundError if it is missing and ValueError if it is not valid JSON,
    has another schema version or lacks a field; every message names the file.
    """
    path = os.path.join(data_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared data directory "
                                "(run tfbig-prep --output_dir=... first, or check the path)")
    try:
        with open(path) as file:
            content = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); prepare the data again") from error
    return _from_json(content, data_dir, path)


def _from_json(content: dict, data_dir: str, path: str) -> Manifest:
    missing = [key for key in _REQUIRED if not isinstance(content, dict) or key not in content]
    if missing:
        raise ValueError(f"{path} lacks field(s) {missing}; expected a tfbig manifest")
    if content["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version is {content['schema_version']!r} but this tfbig reads "
                         f"{SCHEMA_VERSION}; prepare the data again or update tfbig")
    try:
        splits = {name: SplitInfo(tuple(ShardInfo(**shard) for shard in split["shards"]))
                  for name, split in content["splits"].items()}
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: malformed 'splits' ({error!r})") from error
    fields = {key: content[key] for key in _REQUIRED if key != "splits"}
    return Manifest(data_dir=data_dir, splits=splits, tokenizer_sha256=content.get("tokenizer_sha256", ""),
                    info=content.get("info", {}), **fields)


def write_manifest(manifest: Manifest) -> None:
    """Write manifest.json atomically (temp file, fsync, rename)."""
    temporary = manifest.path + ".tmp"
    with open(temporary, "w") as file:
        json.dump(manifest.to_json(), file, indent=1)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, manifest.path)
