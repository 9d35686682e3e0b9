"""Input reading: files, line ranges, JSONL, Markdown plays, bad input."""
import json
import random
from collections import Counter

import pytest

from tfbig.data import shakespeare, source_spec, sources


def _documents(spec, piece_bytes=1 << 20):
    replaced = Counter()
    docs = [d for p in sources.plan_pieces(spec, piece_bytes) for d in sources.read_documents(p, spec, replaced)]
    return docs, replaced


@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 1000, 1 << 20])
def test_line_ranges_give_every_line_to_exactly_one_piece(tmp_path, piece_bytes):
    rng = random.Random(piece_bytes)
    lines = [" ".join("x" * rng.randint(1, 9) for _ in range(rng.randint(1, 8))) + f" {i}" for i in range(300)]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines[:150]) + "\n\n\n" + "\n".join(lines[150:]))  # blank lines, no final \\n
    docs, _ = _documents(source_spec.SourceSpec(inputs=(str(path),), doc_per_line=True), piece_bytes)
    assert docs == lines


def test_jsonl_field_and_errors_name_file_line_and_offset(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"doc {i}\nline two", "id": i}) for i in range(5)) + "\n")
    docs, _ = _documents(source_spec.SourceSpec(inputs=(str(path),), jsonl_field="body"), 16)
    assert docs == [f"doc {i}\nline two" for i in range(5)]
    with pytest.raises(ValueError, match=r"a\.jsonl: line 1 \(byte 0\).*'text'.*\['body', 'id'\]"):
        _documents(source_spec.SourceSpec(inputs=(str(path),)))
    path.write_text('{"text": "ok"}\n{"text": "two"}\n{not json\n')
    with pytest.raises(ValueError, match=r"a\.jsonl: line 3 \(byte 31\): invalid JSON"):
        _documents(source_spec.SourceSpec(inputs=(str(path),)), piece_bytes=20)  # the bad line is in the 2nd piece


def test_directory_glob_and_whole_file_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second\nfile\n")
    (tmp_path / "sub" / "a.md").write_text("# first\n")
    (tmp_path / "notes.csv").write_text("ignored,by,directory,search\n")
    (tmp_path / "empty.txt").write_text("  \n")
    docs, _ = _documents(source_spec.SourceSpec(inputs=(str(tmp_path),)))
    assert docs == ["second\nfile\n", "# first\n"]  # sorted paths; whitespace-only file dropped
    docs, _ = _documents(source_spec.SourceSpec(inputs=(str(tmp_path / "**" / "*.md"),)))
    assert docs == ["# first\n"]


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good \xff\xfe text \xef\xbf\xbd kept\n")  # two bad bytes, one real U+FFFD
    docs, replaced = _documents(source_spec.SourceSpec(inputs=(str(path),)))
    assert docs == ["good \ufffd\ufffd text \ufffd kept\n"]
    assert replaced == {str(path): 2}


def test_empty_input_errors_name_the_input(tmp_path):
    with pytest.raises(ValueError, match="nothing-here"):
        sources.plan_pieces(source_spec.SourceSpec(inputs=(str(tmp_path / "nothing-here*.txt"),)), 1024)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"input .*empty\.txt is empty"):
        sources.plan_pieces(source_spec.SourceSpec(inputs=(str(tmp_path / "empty.txt"),)), 1024)


def test_play_markdown_is_stripped_into_scenes():
    markdown = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore. A platform.\n\n_FRANCISCO at his post_\n\n"
                "**BERNARDO**  \nWho's there?  \nStand.\n\n**FRANCISCO**  \n__\\[Aside]_ Nay, answer me.\n\n"
                "## ACT II\n\n### PROLOGUE\n\n### SCENE II. A room.\n\n*Enter KING*\n\n**KING**  \nWelcome.\n")
    assert shakespeare.play_scenes(markdown) == [
        "SCENE I. Elsinore. A platform.\n\nFRANCISCO at his post\n\nBERNARDO\nWho's there?\nStand.\n\n"
        "FRANCISCO\n[Aside] Nay, answer me.\n",
        "SCENE II. A room.\n\nEnter KING\n\nKING\nWelcome.\n",
    ]


def test_embedded_plays_split_by_named_plays():
    pieces = sources.plan_pieces(source_spec.SourceSpec(), 1 << 20)
    assert len(pieces) == 38
    train, validation = sources.split_pieces(pieces, 0.0, ("hamlet", "macbeth"))
    assert sorted(shakespeare.play_name(p.path) for p in validation) == ["hamlet", "macbeth"]
    assert len(train) == 36
    with pytest.raises(ValueError, match="unknown play.*'hamlett'"):
        sources.split_pieces(pieces, 0.0, ("hamlett",))


@pytest.mark.parametrize("kind", ["lines", "jsonl"])
def test_one_small_file_of_documents_splits_by_documents(tmp_path, kind):
    """The ALBERT post's corpus: one file, one article per line, far under a piece (1 MiB)."""
    articles = [f"article {i} " + "word " * (i % 7 + 3) for i in range(300)]
    path = tmp_path / ("corpus.txt" if kind == "lines" else "corpus.jsonl")
    path.write_text("\n".join(articles if kind == "lines" else
                              [json.dumps({"text": a}) for a in articles]) + "\n")
    spec = source_spec.SourceSpec(inputs=(str(path),), doc_per_line=kind == "lines")
    splits = [sources.plan_splits(spec, 1 << 20, 0.01) for _ in range(2)]
    assert splits[0] == splits[1]  # deterministic
    train, validation = ([d for p in part for d in sources.read_documents(p, spec, Counter())]
                         for part in splits[0])
    assert sorted(train + validation) == sorted(articles)  # every article once, whole
    assert 1 <= len(validation) <= 6  # about 1% of 300 articles


def test_validation_fraction_is_spread_and_checked():
    pieces = [source_spec.Piece("text", f"f{i}", size=1) for i in range(100)]
    train, validation = sources.split_pieces(pieces, 0.05, None)
    assert [p.path for p in validation] == ["f10", "f30", "f50", "f70", "f90"]
    assert len(train) == 95
    tfds = [source_spec.Piece("tfds", "wiki", 0, 10, size=1)]  # examples: no documents to hold out one by one
    with pytest.raises(ValueError, match="only 1 piece"):
        sources.split_pieces(tfds, 0.01, None)
    assert sources.split_pieces(pieces[:1], 0.0, None) == (pieces[:1], [])
    # One piece of documents: held out by document inside it.
    train, validation = sources.split_pieces(pieces[:1], 0.01, None)
    assert [(p.path, p.side, p.fraction) for p in train + validation] == [("f0", "train", 0.01),
                                                                          ("f0", "validation", 0.01)]


def test_hold_out_by_document_takes_every_1_over_fraction_th_document():
    held = [i for i in range(300) if source_spec.held_out_document(i, 0.01)]
    assert held == [49, 149, 249]  # 1% of 300, spread, the same every time
    assert sum(source_spec.held_out_document(i, 0.2) for i in range(1000)) == 200
