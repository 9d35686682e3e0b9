"""WordPiece vocabularies for BERT data: train one on a corpus, or load a `vocab.txt`.

Why it is built this way: docs/design/notes/data.md (tfbig.data.wordpiece_vocab).
"""
import os
from collections.abc import Iterable

import numpy as np

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def is_special(piece: str) -> bool:
    """[CLS], [unused3], ...: pieces no text produces."""
    return len(piece) > 2 and piece.startswith("[") and piece.endswith("]")


class WordPieceVocab:
    """A WordPiece vocabulary (one piece per line, id = line number) with the prep interface
    of tfbig.data.Tokenizer (vocab_size, eos_id, pad_id, piece_id, encode, piece_byte_lengths)."""

    def __init__(self, pieces: list[str], path: str):
        self.pieces, self.path = pieces, path
        self._ids = {piece: index for index, piece in enumerate(pieces)}
        if len(self._ids) != len(pieces):
            twice = sorted({p for p in pieces if pieces.count(p) > 1})[:5]
            raise ValueError(f"{path}: pieces listed twice {twice}; one piece per line")
        missing = [piece for piece in SPECIALS if piece not in self._ids]
        if missing:
            raise ValueError(f"{path}: no {missing} in the vocabulary; a BERT vocab.txt has "
                             f"{list(SPECIALS)}")
        self.lowercase = not any(c.isupper() for p in pieces if not is_special(p) for c in p)
        from tokenizers import Tokenizer as _Rust
        from tokenizers import models, pre_tokenizers

        self._rust = _Rust(models.WordPiece(self._ids, unk_token="[UNK]",
                                            max_input_chars_per_word=100))
        self._rust.normalizer = _normalizer(self.lowercase)
        self._rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self.sep_id = self._ids["[SEP]"]

    @classmethod
    def load(cls, path: str) -> "WordPieceVocab":
        """Read a vocab.txt (e.g. Google's BERT release or a tfbig-prep --format=bert one)."""
        try:
            with open(path, encoding="utf-8") as file:
                pieces = [line.rstrip("\n") for line in file]
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read WordPiece vocabulary {path}: {error}") from error
        return cls(pieces, path)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, path: str) -> "WordPieceVocab":
        """Train an uncased vocabulary of exactly `vocab_size` pieces on `texts`, write `path`."""
        from tokenizers import Tokenizer as _Rust
        from tokenizers import models, pre_tokenizers, trainers

        rust = _Rust(models.WordPiece(unk_token="[UNK]"))
        rust.normalizer = _normalizer(lowercase=True)
        rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                            show_progress=False, continuing_subword_prefix="##")
        rust.train_from_iterator((line for text in texts for line in text.split("\n")
                                  if line.strip()), trainer)
        learned = sorted(rust.get_vocab().items(), key=lambda item: item[1])
        pieces = [piece for piece, _ in learned]
        if len(pieces) > vocab_size:
            raise ValueError(f"--vocab_size={vocab_size} is below the {len(pieces)} pieces the "
                             "text's characters need; give a larger --vocab_size")
        pieces += [f"[unused{i}]" for i in range(vocab_size - len(pieces))]
        with open(path + ".tmp", "w", encoding="utf-8") as file:
            file.writelines(piece + "\n" for piece in pieces)
        os.replace(path + ".tmp", path)
        return cls.load(path)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def eos_id(self) -> int:
        """[SEP]: it ends every line (sentence) of a document."""
        return self.sep_id

    @property
    def pad_id(self) -> int:
        return self._ids["[PAD]"]

    def piece_id(self, piece: str) -> int:
        """Id of a piece such as "[MASK]" (raises naming the file if it is not there)."""
        if piece not in self._ids:
            raise ValueError(f"{piece!r} is not in WordPiece vocabulary {self.path}")
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, each non-empty line followed by [SEP]."""
        lines = [line for line in text.split("\n") if line.strip()]
        ids = []
        for encoding in self._rust.encode_batch(lines, add_special_tokens=False):
            if encoding.ids:
                ids += encoding.ids + [self.sep_id]
        return ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Pieces joined ("##" pieces glued to the one before), specials dropped."""
        words = []
        for piece in (self.pieces[int(i)] for i in ids):
            if is_special(piece):
                continue
            if piece.startswith("##") and words:
                words[-1] += piece[2:]
            else:
                words.append(piece)
        return " ".join(words)

    def piece_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each piece without its "##" (0 for specials), int64 [vocab]: the
        manifest's byte counts, approximate for WordPiece (whitespace and case are lost)."""
        return np.array([0 if is_special(p) else len(p.removeprefix("##").encode())
                         for p in self.pieces], dtype=np.int64)


def _normalizer(lowercase: bool):
    from tokenizers import normalizers

    bert = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                      strip_accents=lowercase, lowercase=lowercase)
    # Uncased: NFKC first ("…" -> "..."), as tensorflow-text's case folding does.
    return normalizers.Sequence([normalizers.NFKC(), bert]) if lowercase else bert
