"""Tokenizer: fixed special ids, exact round trip of any text, byte accounting."""
import random

import pytest

from tfbig.data import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, document_maker):
    rng = random.Random(1)
    texts = [document_maker(rng, 40) for _ in range(20)]
    return Tokenizer.train(texts, vocab_size=400, model_prefix=str(tmp_path_factory.mktemp("tok") / "t"))


def test_special_ids_are_fixed(tokenizer):
    assert (tokenizer.pad_id, tokenizer.eos_id) == (0, 2)
    assert [tokenizer.piece_id(p) for p in ("<unk>", "[CLS]", "[SEP]", "[MASK]", "\n")] == [1, 3, 4, 5, 6]
    assert tokenizer.vocab_size == 400
    assert tokenizer.processor.IdToPiece(7) == "<0x00>"


@pytest.mark.parametrize("text", [
    "The king  is dead.\n\nLong live   the king!\n",
    "  leading spaces and trailing \t tabs \n",
    "Unicode never seen in training: 日本語, émoji 🎭, Ελληνικά, zero\u200bwidth",
    "[MASK] [CLS] </s> <pad> are plain text here",
])
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 0 not in ids and 1 not in ids and 2 not in ids  # no pad, unk or eos from plain text


def test_piece_byte_lengths_sum_to_utf8_length(tokenizer):
    lengths = tokenizer.piece_byte_lengths()
    text = "Sweet prince — 🎭 good night!\n  Flights of angels"
    assert lengths[tokenizer.encode(text)].sum() == len(text.encode("utf-8"))
    assert lengths[[0, 1, 2, 3, 4, 5]].sum() == 0 and lengths[6] == 1


def test_load_round_trips_and_bad_file_names_path(tokenizer, tmp_path):
    again = Tokenizer.load(tokenizer.path)
    assert again.encode("good lord") == tokenizer.encode("good lord")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model"):
        Tokenizer.load(str(bad))


def test_too_small_vocab_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        Tokenizer.train(["some text here"] * 10, vocab_size=100, model_prefix=str(tmp_path / "t"))
