"""A Hugging Face `tokenizer.json` (the fast tokenizer Llama 3, Llama 2, Mistral, Qwen 2/3 and
SmolLM checkpoints ship) through the `tokenizers` library.

The same public surface as tfbig's SentencePiece `Tokenizer` and GPT-2's `ByteLevelBPE`
(vocab_size, eos_id, pad_id, piece_id, encode, encode_batch, decode, piece_byte_lengths,
files), so tfbig-prep, training and generation take it. The file carries its own
normalizer, pre-tokenizer, model (BPE, byte-level or SentencePiece-style with byte fallback) and
decoder; text is encoded without the special tokens a template would add (no <s> or
<|begin_of_text|>: tfbig-prep packs documents, each ended by the end-of-document token).

The end-of-document token is found in the file itself, so the same file gives the same id
wherever it is copied: the first of END_OF_DOCUMENT it holds (Llama 3's <|end_of_text|>,
GPT-2's, Qwen's and SmolLM's <|endoftext|>, Llama 2's and Mistral's </s>, Gemma's <eos>).

Example:
    tok = TokenizerJson.load("Llama-3.2-1B/tokenizer.json")
    tok.decode(tok.encode("Héllo, wörld!")) == "Héllo, wörld!"
"""
import json
import os

import numpy as np

from tfbig.data.bpe import LibraryTokenizer

TOKENIZER_JSON = "tokenizer.json"
# A run directory's config.json "tokenizer" entry for this file (tfbig.data.tokenizer.for_run)
RUN_ENTRY = {"kind": "tokenizer_json", "vocab_file": TOKENIZER_JSON}
END_OF_DOCUMENT = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def is_tokenizer_json(path: str) -> bool:
    """Whether a tokenizer file is a Hugging Face tokenizer.json (by its name)."""
    return os.path.basename(path) == TOKENIZER_JSON


def _has_type(node, kind) -> bool:
    """Whether a tokenizer.json component (or one in its Sequence) is of type `kind`."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


class TokenizerJson(LibraryTokenizer):
    """A loaded tokenizer.json with the ids the rest of tfbig needs."""

    def __init__(self, backend, path):
        self.backend = backend  # tokenizers.Tokenizer
        self.path = path

    @classmethod
    def load(cls, path: str) -> "TokenizerJson":
        """Load `path`; a clear error names it when it is missing or not a tokenizer.json."""
        from tokenizers import Tokenizer as Backend

        if not os.path.isfile(path):
            raise ValueError(f"{path}: file not found (a Hugging Face tokenizer.json)")
        try:
            backend = Backend.from_file(path)
        except Exception as error:  # the library raises a bare Exception for a bad file
            raise ValueError(f"{path}: cannot read it as a Hugging Face tokenizer.json "
                             f"({error})") from error
        return cls(backend, path)

    def files(self) -> dict:
        """{file name: path} of what this tokenizer is loaded from (to copy it elsewhere)."""
        return {TOKENIZER_JSON: self.path}

    @property
    def vocab_size(self) -> int:
        """Number of ids: one past the largest, added tokens included."""
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def eos_id(self) -> int:
        """The id of the first of END_OF_DOCUMENT this file holds."""
        for piece in END_OF_DOCUMENT:
            index = self.backend.token_to_id(piece)
            if index is not None:
                return index
        raise ValueError(f"{self.path} has none of the end-of-document tokens "
                         f"{list(END_OF_DOCUMENT)}")

    @property
    def pad_id(self) -> int:
        """The end-of-document id stands in (these checkpoints define no padding token)."""
        return self.eos_id

    def piece_id(self, piece: str) -> int:
        """Id of a token string such as "</s>" (raises if it is not in the file)."""
        index = self.backend.token_to_id(piece)
        if index is None:
            raise ValueError(f"{piece!r} is not in tokenizer {self.path}")
        return index

    def piece_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of source text each id stands for (0 for special tokens), int64 [vocab]:
        a byte-level BPE's token counts its byte stand-ins, a SentencePiece-style token its
        text with "▁" as a space, a byte-fallback token <0xNN> one byte."""
        from tfbig.data.bpe import _byte_of_char

        spec = json.loads(self.backend.to_str())
        byte_level = _has_type(spec.get("decoder"), "ByteLevel")
        special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
        byte_of = _byte_of_char()
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for piece, index in self.backend.get_vocab(with_added_tokens=True).items():
            if piece in special:
                continue
            if byte_level:
                lengths[index] = sum(1 for c in piece if c in byte_of)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                lengths[index] = 1
            else:
                lengths[index] = len(piece.replace("\u2581", " ").encode())
        return lengths
