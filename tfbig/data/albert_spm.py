"""A released ALBERT SentencePiece model (`spiece.model`, `30k-clean.model`) as a prep tokenizer.

Why it is built this way: docs/design/notes/data.md (tfbig.data.albert_spm).
"""
import unicodedata
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

SPECIALS = ("[CLS]", "[SEP]", "[MASK]")
UNDERLINE = "\u2581"


def is_released_albert(processor: spm.SentencePieceProcessor) -> bool:
    """Whether a loaded SentencePiece model is a released ALBERT one rather than tfbig's own
    (which keeps the newline as a piece of its own) or a released decoder's (Llama 2, Mistral:
    no [CLS])."""
    def holds(piece):
        return processor.IdToPiece(processor.PieceToId(piece)) == piece

    return not holds("\n") and holds("[CLS]")


def preprocess_text(text: str, lowercase: bool) -> str:
    """ALBERT's text preparation: collapsed whitespace, no accents, lower-cased if uncased."""
    text = " ".join(text.strip().split())
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return text.lower() if lowercase else text


class AlbertSentencePiece:
    """A released ALBERT SentencePiece model with the prep interface of tfbig.data.Tokenizer
    (vocab_size, eos_id, pad_id, piece_id, encode, decode, piece_byte_lengths), and SQuAD's
    `char_spans`. line_ends: `encode` ends each line with [SEP] (prep) or not (one segment)."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str, line_ends: bool = True):
        self.processor, self.path, self.line_ends = processor, path, line_ends
        pieces = [processor.IdToPiece(i) for i in range(processor.GetPieceSize())]
        missing = [p for p in SPECIALS if processor.PieceToId(p) == processor.unk_id()]
        if missing:
            raise ValueError(f"{path}: no {missing} in this SentencePiece model; an ALBERT "
                             f"model has {list(SPECIALS)} (control symbols)")
        text_pieces = [p for index, p in enumerate(pieces)  # [CLS]... may be user-defined
                       if not processor.IsControl(index) and p not in SPECIALS]
        self.lowercase = not any(c.isupper() for p in text_pieces for c in p)
        self.line_end_id = processor.PieceToId("[SEP]")

    @classmethod
    def load(cls, path: str) -> "AlbertSentencePiece":
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(path)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"cannot load tokenizer {path}: {error}; expected a SentencePiece "
                             ".model file") from error
        return cls(processor, path)

    @property
    def vocab_size(self) -> int:
        return self.processor.GetPieceSize()

    @property
    def eos_id(self) -> int:
        """[SEP]: it ends every line (segment) of a document."""
        return self.line_end_id

    @property
    def pad_id(self) -> int:
        return max(self.processor.pad_id(), 0)  # ALBERT's <pad> is 0

    def piece_id(self, piece: str) -> int:
        """Id of a piece such as "[MASK]" (raises naming the file if it is not there)."""
        index = self.processor.PieceToId(piece)
        if self.processor.IdToPiece(index) != piece:
            raise ValueError(f"{piece!r} is not in tokenizer {self.path}")
        return index

    def encode_line(self, line: str) -> list[int]:
        """Ids of one line as ALBERT's create_pretraining_data.py gives them (no [SEP])."""
        pieces = []
        for piece in self.processor.EncodeAsPieces(preprocess_text(line, self.lowercase)):
            pieces += _digits_then_comma(self.processor, piece) if _is_digits_comma(piece) \
                else [piece]
        return [self.processor.PieceToId(p) for p in pieces]

    def char_spans(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids of `text` as one segment (`encode_line`) and each id's character span [start, end)
        in `text` itself (numpy arrays), through ALBERT's preparation (collapsed whitespace,
        dropped accents, lower case): for SQuAD answer positions. The space of a "▁" piece is
        not part of its span; a piece of one character that NFKD spells as several ("½")
        shares that character's span with its neighbours."""
        prepared, origin = prepared_with_origin(text, self.lowercase)
        char_of_byte = np.repeat(np.arange(len(prepared) + 1),
                                 [len(c.encode()) for c in prepared] + [1])
        ids, starts, ends = [], [], []
        for piece in self.processor.Encode(prepared, return_type="proto").pieces:
            start, end = int(char_of_byte[piece.begin]), int(char_of_byte[piece.end])
            if piece.piece.startswith(UNDERLINE) and end > start + 1 and prepared[start] == " ":
                start += 1
            pieces = _digits_then_comma(self.processor, piece.piece) \
                if _is_digits_comma(piece.piece) else [piece.piece]
            for sub in pieces:  # "1990," -> "1990" then "," in the span's characters
                length = end - start if len(pieces) == 1 else len(sub.replace(UNDERLINE, ""))
                ids.append(self.processor.PieceToId(sub))
                starts.append(start)
                ends.append(min(start + length, end))
                start = ends[-1]
        starts, ends = np.array(starts, np.int64), np.array(ends, np.int64)
        origin = np.append(origin, len(text))
        return (np.array(ids, np.int64), origin[starts],
                np.where(ends > starts, origin[np.maximum(ends - 1, 0)] + 1, origin[starts]))

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, each non-empty line followed by [SEP] (line_ends=False: the ids of
        the whole text as one segment, `encode_line`)."""
        if not self.line_ends:
            return self.encode_line(text)
        ids = []
        for line in text.split("\n"):
            line_ids = self.encode_line(line) if line.strip() else []
            if line_ids:
                ids += line_ids + [self.line_end_id]
        return ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (SentencePiece's decoding; control ids decode to nothing)."""
        return self.processor.DecodeIds([int(i) for i in ids])

    def piece_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each piece ("▁" as a space; 0 for control and unknown ids), int64
        [vocab]: the manifest's byte counts, approximate (case and accents are lost)."""
        sp = self.processor
        return np.array([0 if sp.IsControl(i) or sp.IsUnknown(i) else
                         len(sp.IdToPiece(i).replace(UNDERLINE, " ").encode())
                         for i in range(self.vocab_size)], dtype=np.int64)


def _is_digits_comma(piece: str) -> bool:
    """A piece "x9," (a digit then a comma at its end), which ALBERT splits in two."""
    return len(piece) > 1 and piece[-1] == "," and piece[-2].isdigit()


def _digits_then_comma(processor: spm.SentencePieceProcessor, piece: str) -> list[str]:
    """"▁1990," -> the pieces of "1990" (keeping "▁" only if `piece` had it), then ","."""
    pieces = processor.EncodeAsPieces(piece[:-1].replace(UNDERLINE, ""))
    if piece[0] != UNDERLINE and pieces and pieces[0].startswith(UNDERLINE):
        pieces = pieces[1:] if len(pieces[0]) == 1 else [pieces[0][1:]] + pieces[1:]
    return pieces + [","]


def prepared_with_origin(text: str, lowercase: bool) -> tuple[str, np.ndarray]:
    """`preprocess_text(text, lowercase)` and, for each of its characters, the index of the
    character of `text` it comes from (a collapsed run of whitespace: its first character).
    Raises ValueError if preparing character by character does not give preprocess_text's
    result."""
    chars, origin, space = [], [], None
    for index, char in enumerate(text):
        if char.isspace():
            space = index if chars and space is None else space
            continue
        if space is not None:
            chars.append(" ")
            origin.append(space)
            space = None
        kept = [c for c in unicodedata.normalize("NFKD", char) if not unicodedata.combining(c)]
        chars += kept
        origin += [index] * len(kept)
    prepared, origin = "".join(chars), np.array(origin, np.int64)
    if lowercase and len(prepared.lower()) == len(prepared):
        prepared = prepared.lower()  # whole text: a final sigma depends on its neighbours
    elif lowercase:  # a letter whose lower case is longer ("İ"): one character at a time
        parts = [c.lower() for c in prepared]
        prepared, origin = "".join(parts), np.repeat(origin, [len(p) for p in parts])
    if prepared != preprocess_text(text, lowercase):
        raise ValueError(f"cannot locate ALBERT's prepared text in the original: {text[:60]!r}")
    return prepared, origin
