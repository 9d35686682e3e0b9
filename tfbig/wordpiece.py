"""WordPiece tokenisation for BERT, through tensorflow-text's BertTokenizer.

Text -> basic split (whitespace, punctuation, CJK characters; optional lowercasing with accent
stripping, as BERT's uncased releases) -> greedy longest-match word pieces ("##" suffixes) ->
ids from vocab.txt (one piece per line, id = line number; unknown words -> [UNK]).

Example:
    tokenizer = WordPieceTokenizer("runs/bert-base/vocab.txt", lowercase=True)
    tokenizer.encode("Hello, world!")        # [7592, 1010, 2088, 999]
"""
import os

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
        self._tokenizer = tf_text.BertTokenizer(
            vocab_file, lower_case=lowercase, token_out_type=tf.int64,
            unknown_token="[UNK]" if "[UNK]" in self.pieces else None)

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
