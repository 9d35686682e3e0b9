"""GPT-2's byte-level BPE tokenizer (vocab.json + merges.txt), through the `tokenizers` library.

The same public surface as tfbig's SentencePiece `Tokenizer` (vocab_size, eos_id, pad_id,
piece_id, encode, encode_batch, decode, piece_byte_lengths), so generation and evaluation take
either. GPT-2 splits text with its regex (no prefix space added), maps every byte to a printable
character and merges by rank; "<|endoftext|>" is its one special token (end of document, and
the padding id, as GPT-2 has none). Every byte sequence encodes, so decode(encode(t)) == t.

Example:
    tok = ByteLevelBPE.load("runs/gpt2/vocab.json", "runs/gpt2/merges.txt")
    tok.decode(tok.encode("Héllo, wörld!")) == "Héllo, wörld!"
"""
import json
import os
from collections.abc import Iterable

import numpy as np

END_OF_TEXT = "<|endoftext|>"
# A run directory's config.json "tokenizer" entry for these files (tfbig.data.tokenizer.for_run)
RUN_ENTRY = {"kind": "byte_level_bpe", "vocab_file": "vocab.json", "merges_file": "merges.txt"}


def _byte_of_char():
    """GPT-2's printable stand-in character for each byte, inverted: {char: byte}."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class LibraryTokenizer:
    """Encoding and decoding through a Hugging Face `tokenizers.Tokenizer` (`self.backend`),
    shared by the byte-level BPE tfbig trains and a checkpoint's tokenizer.json."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text (the library picks its own threads)."""
        del num_threads
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens (<|endoftext|>, ...) decode to nothing."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def char_spans(self, text: str):
        """(ids, starts, ends) of `text`: its token ids and each token's character span
        [start, end) from the library's offsets, a leading space a token carries (byte-level
        BPE's "Ġcat", SentencePiece's "▁cat") left out (tfbig.data.squad.features)."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        spaced = np.array([text[s:s + 1].isspace() for s in starts.tolist()], bool) & (
            ends > starts + 1)
        return np.asarray(encoding.ids, np.int64), starts + spaced, ends


class ByteLevelBPE(LibraryTokenizer):
    """A loaded GPT-2 vocabulary and merge list with the ids the rest of tfbig needs."""

    def __init__(self, backend, vocab, path, merges_path):
        self.backend = backend  # tokenizers.Tokenizer
        self.vocab = vocab  # {token string: id}
        self.path = path  # the vocab.json
        self.merges_path = merges_path

    @classmethod
    def load(cls, vocab_file: str, merges_file: str) -> "ByteLevelBPE":
        """Load vocab.json and merges.txt; a clear error names the file that is wrong."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers

        for path, what in ((vocab_file, "the BPE vocabulary"), (merges_file, "the BPE merges")):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: file not found ({what}; a GPT-2 tokenizer is "
                                 "vocab.json + merges.txt)")
        try:
            with open(vocab_file, encoding="utf-8") as file:
                vocab = json.load(file)
        except ValueError as error:
            raise ValueError(f"{vocab_file}: not a JSON token -> id map ({error})") from error
        try:
            backend = Backend(models.BPE.from_file(vocab_file, merges_file))
        except Exception as error:  # the library raises a bare Exception for a bad merge line
            raise ValueError(f"{merges_file}: cannot read it as the merges of {vocab_file} "
                             f"({error})") from error
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        if END_OF_TEXT in vocab:
            backend.add_special_tokens([END_OF_TEXT])
        return cls(backend, vocab, vocab_file, merges_file)

    def files(self) -> dict:
        """{file name: path} of what this tokenizer is loaded from (to copy it elsewhere)."""
        return {"vocab.json": self.path, "merges.txt": self.merges_path}

    @property
    def vocab_size(self) -> int:
        """Number of ids (entries of vocab.json)."""
        return len(self.vocab)

    @property
    def eos_id(self) -> int:
        """The id of <|endoftext|>, which ends every GPT-2 document."""
        return self.piece_id(END_OF_TEXT)

    @property
    def pad_id(self) -> int:
        """GPT-2 has no padding token; <|endoftext|> stands in (as in its own tooling)."""
        return self.eos_id

    def piece_id(self, piece: str) -> int:
        """Id of a token string such as "<|endoftext|>" (raises if it is not in vocab.json)."""
        if piece not in self.vocab:
            raise ValueError(f"{piece!r} is not in tokenizer {self.path}")
        return self.vocab[piece]

    def piece_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of source text each id stands for (0 for <|endoftext|>), int64 [vocab]."""
        byte_of = _byte_of_char()
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for piece, index in self.vocab.items():
            if piece != END_OF_TEXT:
                lengths[index] = sum(1 for c in piece if c in byte_of)
        return lengths
