"""tfbig.data.inspect reads back what prep wrote: shard rows, token rows, documents."""
import numpy as np

from tfbig.data import Tokenizer, load_manifest
from tfbig.data.inspect import document_lengths, read_token_rows, shard_table


def test_rows_and_table_agree_with_the_manifest(gpt_data):
    manifest = load_manifest(gpt_data)
    table = shard_table(manifest)
    for name, split in manifest.splits.items():
        rows = [r for r in table if r["split"] == name]
        assert sum(r["records"] for r in rows) == split.records
        assert sum(r["tokens"] for r in rows) == split.tokens
        ids = read_token_rows(manifest, name)
        assert ids.shape == (split.records, manifest.seq_length + 1)
        assert ids.size == split.tokens and ids.dtype == np.int64
    assert all(0 < r["tokens_per_byte"] < 1 for r in table)
    first = read_token_rows(manifest, "train", limit=3)
    np.testing.assert_array_equal(first, read_token_rows(manifest, "train")[:3])
    text = Tokenizer.load(manifest.tokenizer_path).decode(first[0].tolist())
    assert any(word in text for word in ("ROMEO", "JULIET", "NURSE", "MERCUTIO", "TYBALT"))


def test_document_lengths_split_the_stream_at_eos():
    eos = 2
    rows = np.array([[5, 6, 2, 7], [8, 9, 9, 2], [4, 2, 6, 6]])  # docs of 2, 4 and 1 tokens
    assert document_lengths(rows, eos) == [2, 4, 1]  # the trailing 6, 6 is cut: left out
    assert document_lengths(np.zeros((0, 4), np.int64), eos) == []
