"""WordPiece tokenisation for BERT, through tensorflow-text's BertTokenizer.

Text -> basic split (whitespace, punctuation, CJK characters; optional lowercasing with accent
stripping, as BERT's uncased releases) -> greedy longest-match word pieces ("##" suffixes) ->
ids from vocab.txt (one piece per line, id = line number; unknown words -> [UNK]).

Example:
    tokenizer = WordPieceTokenizer("runs/bert-base/vocab.txt", lowercase=True)
    tokenizer.encode("Hello, world!")        # [7592, 1010, 2088, 999]
"""
import os
import unicodedata

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text


class WordPieceTokenizer:
    """A BERT vocabulary file and its casing; `encode` gives the ids of one text."""

    def __init__(self, vocab_file, lowercase=True):
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"{vocab_file}: file not found (a WordPiece vocab.txt)")
        self.vocab_file = vocab_file
        self.lowercase = lowercase
        with open(vocab_file, encoding="utf-8") as file:
            self.pieces = [line.rstrip("\n") for line in file]
        self.vocab_size = len(self.pieces)
        if len(set(self.pieces)) != self.vocab_size:
            twice = sorted({p for p in self.pieces if self.pieces.count(p) > 1})[:5]
            raise ValueError(f"{vocab_file}: pieces listed twice {twice}; one piece per line")
        unknown = "[UNK]" if "[UNK]" in self.pieces else None
        self._tokenizer = tf_text.BertTokenizer(vocab_file, lower_case=lowercase,
                                                token_out_type=tf.int64, unknown_token=unknown)
        # For offsets: with lower_case, tensorflow-text reports them in the normalised text,
        # so char_spans normalises per character itself and splits with no normalisation.
        self._plain = tf_text.BertTokenizer(vocab_file, lower_case=False,
                                            token_out_type=tf.int64, unknown_token=unknown)
        self.path = vocab_file

    @classmethod
    def from_run(cls, run_dir, settings):
        """The tokenizer a converted run's config.json "tokenizer" entry names."""
        return cls(os.path.join(run_dir, settings["vocab_file"]), settings["lowercase"])

    def piece_id(self, piece):
        """Id of a special piece such as "[CLS]"; an error naming the vocabulary if absent."""
        if piece not in self.pieces:
            raise ValueError(f"{self.vocab_file} has no {piece!r}")
        return self.pieces.index(piece)

    def encode(self, text):
        """A list of int ids for `text`."""
        ragged = self._tokenizer.tokenize(tf.constant([text]))  # (1, words, pieces)
        return [int(i) for i in ragged.merge_dims(1, 2)[0].numpy()]

    def char_spans(self, text):
        """Token ids of `text` and each token's character span [start, end) in `text` (numpy
        arrays), for SQuAD answer positions. Raises ValueError if the per-character
        normalisation does not reproduce `encode` (a character whose lowercasing depends on its
        neighbours)."""
        ids = np.asarray(self.encode(text), np.int64)
        normalized, origin = text, np.arange(len(text))
        if self.lowercase:  # case fold (NFKC), NFD, drop accents: what lower_case=True does
            parts = [_fold(c) for c in text]
            normalized = "".join(parts)
            origin = np.repeat(np.arange(len(text)), [len(p) for p in parts]).astype(np.int64)
        tokens, starts, ends = self._plain.tokenize_with_offsets(tf.constant([normalized]))
        tokens, starts, ends = (x.merge_dims(1, 2)[0].numpy() for x in (tokens, starts, ends))
        if not np.array_equal(tokens, ids):
            raise ValueError(f"{self.vocab_file}: cannot locate the word pieces of a text in it "
                             f"(per-character lowercasing differs): {text[:60]!r}")
        char_of_byte = np.repeat(np.arange(len(normalized)),
                                 [len(c.encode("utf-8")) for c in normalized])
        return ids, origin[char_of_byte[starts]], origin[char_of_byte[ends - 1]] + 1


def _fold(char):
    """One character as BERT's uncased normalisation spells it."""
    folded = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", char).casefold())
    return "".join(c for c in folded if unicodedata.category(c) != "Mn")
