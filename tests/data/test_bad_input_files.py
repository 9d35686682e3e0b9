"""tfbig-prep on inputs that are not what their names say: a binary file among the text files
is named, skipped and counted (not handed to SentencePiece as thousands of rare characters), and
a MediaWiki XML dump is read as a dump whatever its file is called (plain or compressed)."""
import bz2
import gzip
import os
import random
import shutil
from collections import Counter

import pytest

from tfbig.data import file_kinds, prepare, source_spec, sources

from test_wikipedia import ADA_TEXT, _dump

ENGINE_TEXT = "Analytical Engine\n\nThe Analytical Engine was designed by Charles Babbage.\n"


def random_bytes(size, seed=1):
    return random.Random(seed).randbytes(size)


@pytest.fixture()
def corpus_with_binary(tmp_path, scene_files):
    """Eight scenes as .txt files and a 200 kB binary file beside them (a stray photo)."""
    root = tmp_path / "corpus"
    root.mkdir()
    for path in sorted(scene_files.iterdir())[:8]:
        shutil.copy(path, root / path.name)
    (root / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + random_bytes(200_000))
    return root


def test_a_binary_file_among_the_text_is_named_skipped_and_counted(corpus_with_binary, tmp_path, caplog):
    binary = str(corpus_with_binary / "photo.png")
    manifest = prepare([str(corpus_with_binary / "*")], str(tmp_path / "out"), seq_length=16,
                       vocab_size=320, shard_size_mb=0.05, validation_fraction=0.2)
    assert manifest.info["skipped_binary_files"] == [binary]
    assert f"{binary}: binary content" in caplog.text
    assert "skipped 1 binary file(s)" in caplog.text
    assert manifest.split("train").records > 0
    assert manifest.info["replaced_chars"] == 0  # nothing of the photo was decoded


def test_a_binary_file_named_txt_and_one_without_nul_bytes_are_binary(tmp_path):
    (tmp_path / "a.txt").write_bytes(random_bytes(5000))
    undecodable = bytes(b for b in random_bytes(20000, seed=2) if b)  # no NUL, mostly not UTF-8
    (tmp_path / "b.txt").write_bytes(undecodable)
    latin1 = ("Ça coûte très cher, dit-il à l'élève. " * 50).encode("latin-1")  # text, some bad bytes
    (tmp_path / "c.txt").write_bytes(latin1)
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(random_bytes(5000)))
    files = sorted(str(p) for p in tmp_path.iterdir())
    assert file_kinds.binary_files(files) == [files[0], files[1], files[3]]


def test_only_binary_input_is_refused_naming_the_files(tmp_path):
    (tmp_path / "x.txt").write_bytes(random_bytes(5000))
    with pytest.raises(ValueError, match=r"holds only binary files \(.*x\.txt\)"):
        sources.plan_pieces(source_spec.SourceSpec(inputs=(str(tmp_path / "x.txt"),)), 1 << 20)


def documents(inputs):
    spec = source_spec.SourceSpec(inputs=tuple(inputs))
    skipped = Counter()
    docs = [doc for piece in sources.plan_pieces(spec, 1 << 20)
            for doc in sources.read_documents(piece, spec, Counter(), skipped)]
    return docs, skipped


@pytest.mark.parametrize("name", ["sample.txt", "wiki-sample.bz2", "dump-renamed"])
def test_a_dump_is_recognised_by_its_content_whatever_its_name(tmp_path, name):
    dump = _dump(tmp_path / "dump.xml.bz2")  # the test dump, bz2-compressed
    xml = bz2.decompress(dump.read_bytes())
    path = tmp_path / "in" / name
    path.parent.mkdir()
    path.write_bytes(bz2.compress(xml) if name.endswith(".bz2") else
                     b'<?xml version="1.0" encoding="utf-8"?>\n' + xml)
    for inputs in ([str(path)], [str(path.parent)]):  # named, and found by the directory search
        docs, skipped = documents(inputs)
        assert docs == [ADA_TEXT, ENGINE_TEXT], inputs
        assert skipped == {"wikipedia:redirect": 1, "wikipedia:non-article": 2}


def test_text_that_mentions_mediawiki_is_still_text(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("How to read a dump: it starts with <mediawiki xmlns=...>\n")
    docs, _ = documents([str(path)])
    assert docs == [path.read_text()]
    assert sources.resolve_files((str(tmp_path),)) == [str(path)]
