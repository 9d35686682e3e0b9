"""Compressed inputs streamed (.gz/.bz2/.xz/.zst), the Pile's layout (groups), and damage named."""
import bz2
import gzip
import json
import lzma
import os
import random
from collections import Counter

import pytest
import zstandard

from tfbig.data import load_manifest, prepare, source_spec, sources

SEQ, VOCAB = 16, 400
COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": lambda data: zstandard.ZstdCompressor(level=3).compress(data)}
COMPONENTS = ("Pile-CC", "Github")


def _pile_lines(document_maker, count=60, seed=0) -> list[bytes]:
    rng = random.Random(seed)
    return [json.dumps({"text": document_maker(rng, 6), "meta": {"pile_set_name": COMPONENTS[i % 3 == 2]}}).encode()
            + b"\n" for i in range(count)]


@pytest.fixture(scope="module")
def pile(tmp_path_factory, document_maker):
    """x.jsonl and its four compressed copies (the .zst one in two frames, as pzstd writes), Pile-shaped."""
    directory = tmp_path_factory.mktemp("pile")
    lines = _pile_lines(document_maker)
    data = b"".join(lines)
    (directory / "x.jsonl").write_bytes(data)
    for suffix, compress in COMPRESS.items():
        halves = (data[:len(data) // 3], data[len(data) // 3:]) if suffix == ".zst" else (data,)
        (directory / f"x.jsonl{suffix}").write_bytes(b"".join(compress(part) for part in halves))
    return directory, lines


@pytest.fixture(scope="module")
def tokenizer_file(multi_shard_dir):
    return os.path.join(multi_shard_dir, "tokenizer.model")


def _prep(inputs, output, tokenizer_file, **kwargs):
    return prepare([str(path) for path in inputs], str(output), SEQ, VOCAB, shard_size_mb=64,
                   tokenizer=tokenizer_file, validation_fraction=0, **kwargs)


def _shard_bytes(manifest) -> list[bytes]:
    return [open(path, "rb").read() for path in manifest.shard_paths("train")]


def test_each_compressed_format_gives_the_plain_files_shards(pile, tokenizer_file, tmp_path):
    directory, _ = pile
    plain = _prep([directory / "x.jsonl"], tmp_path / "plain", tokenizer_file)
    assert plain.split("train").records > 20
    for suffix in COMPRESS:
        manifest = _prep([directory / f"x.jsonl{suffix}"], tmp_path / suffix[1:], tokenizer_file)
        assert _shard_bytes(manifest) == _shard_bytes(plain), suffix
        assert manifest.split("train").tokens == plain.split("train").tokens
        assert manifest.split("train").bytes == plain.split("train").bytes


def test_pile_components_filtered_grouped_and_counted(pile, tokenizer_file, tmp_path):
    directory, lines = pile
    records = [json.loads(line) for line in lines]
    wanted = Counter(r["meta"]["pile_set_name"] for r in records)
    source = directory / "x.jsonl.zst"
    kept = _prep([source], tmp_path / "cc", tokenizer_file, jsonl_group_field="meta.pile_set_name",
                 jsonl_groups=("Pile-CC",))
    assert kept.info["groups"]["train"]["Pile-CC"]["documents"] == wanted["Pile-CC"]
    assert set(kept.info["groups"]["train"]) == {"Pile-CC"}
    assert kept.info["skipped"]["train"] == {"group:Github": wanted["Github"]}
    # The kept shards equal shards of a plain file holding only the Pile-CC lines.
    only = tmp_path / "only.jsonl"
    only.write_bytes(b"".join(line for line, r in zip(lines, records) if r["meta"]["pile_set_name"] == "Pile-CC"))
    assert _shard_bytes(kept) == _shard_bytes(_prep([only], tmp_path / "only", tokenizer_file))

    both = _prep([source], tmp_path / "both", tokenizer_file, jsonl_group_field="meta.pile_set_name",
                 jsonl_groups=COMPONENTS, shard_by_group=True)
    by_group = {group: both.split("train").of_group(group) for group in COMPONENTS}
    assert [s.file for s in by_group["Pile-CC"].shards] == ["train-pile-cc-00000-of-00001.tfrecord"]
    assert [s.file for s in by_group["Github"].shards] == ["train-github-00000-of-00001.tfrecord"]
    assert by_group["Pile-CC"].records == kept.split("train").records
    assert both.info["skipped"]["train"] == {}
    for group in COMPONENTS:
        assert both.info["groups"]["train"][group]["documents"] == wanted[group]
    assert load_manifest(both.data_dir).split("train").of_group("Github").tokens == by_group["Github"].tokens
    with pytest.raises(ValueError, match="--shard_by_group needs --jsonl_groups"):
        _prep([source], tmp_path / "bad", tokenizer_file, jsonl_group_field="meta.pile_set_name", shard_by_group=True)


def _read_all(path, **spec):
    spec = source_spec.SourceSpec(inputs=(str(path),), **spec)
    pieces = sources.plan_pieces(spec, 1 << 20)
    return [doc for piece in pieces for doc in sources.read_documents(piece, spec, Counter())]


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_truncated_file_names_the_file_and_the_byte(pile, tmp_path, suffix):
    data = (pile[0] / f"x.jsonl{suffix}").read_bytes()
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(data[:len(data) - 100])
    unit = "frame" if suffix == ".zst" else "member"
    with pytest.raises(ValueError, match=rf"cut\.jsonl\{suffix}: truncated: the file ends at byte {len(data) - 100}, "
                                         rf"inside a \w+ {unit} that starts at byte \d+"):
        _read_all(cut)
    damaged = bytearray(data)
    damaged[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    bad = tmp_path / f"bad.jsonl{suffix}"
    bad.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=rf"bad\.jsonl\{suffix}: corrupt \w+ data in bytes \[0, \d+\)"):
        _read_all(bad)


def test_malformed_line_in_a_compressed_file_names_file_and_line(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(5)]
    lines[3] = '{"text": "broken'
    path = tmp_path / "m.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(ValueError, match=r"m\.jsonl\.zst: line 4 \(byte 54\): invalid JSON"):
        _read_all(path)
    with pytest.raises(ValueError, match=r"m\.jsonl\.zst: line 1 \(byte 0\): no string at "
                                         r"--jsonl_group_field='meta\.pile_set_name'"):
        _read_all(path, jsonl_group_field="meta.pile_set_name")


def test_unknown_compression_suffix_is_refused_with_the_list(tmp_path):
    path = tmp_path / "x.jsonl.lz4"
    path.write_bytes(b"\x04\x22\x4d\x18")
    with pytest.raises(ValueError, match=r"x\.jsonl\.lz4: unknown compression suffix '\.lz4'; "
                                         r"expected one of \.bz2, \.gz, \.xz, \.zst"):
        _read_all(path)
    with pytest.raises(ValueError, match=r"unknown compression suffix '\.lz4'"):
        _read_all(tmp_path)  # found by a directory search: refused too, not passed over


def test_compressed_text_files_whole_or_one_document_per_line(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress("first line\nsecond line\n".encode()))
    (tmp_path / "b.md.xz").write_bytes(lzma.compress("# title\nbody\n".encode()))
    assert _read_all(tmp_path) == ["first line\nsecond line\n", "# title\nbody\n"]
    assert _read_all(tmp_path, doc_per_line=True) == ["first line", "second line", "# title", "body"]
