"""SentencePiece tokenizer shared by data preparation, training and generation.

Why it is built this way: docs/design/notes/data.md (tfbig.data.tokenizer).
"""

import hashlib
import io
import json
import os
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

from tfbig.data.tokenizer_json import RUN_ENTRY as JSON_RUN_ENTRY
from tfbig.data.tokenizer_json import TOKENIZER_JSON, TokenizerJson, is_tokenizer_json

CONTROL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
USER_DEFINED_SYMBOLS = ("\n",)
MAX_SENTENCE_BYTES = 4192  # SentencePiece skips longer training sentences


class Tokenizer:
    """A loaded SentencePiece model with the ids the rest of tfbig needs."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str | None = None):
        self.processor = processor
        self.path = path

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load a SentencePiece `.model` file (e.g. `DATA_DIR/tokenizer.model`)."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(path)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"cannot load tokenizer {path}: {error}; expected a SentencePiece .model file") from error
        return cls(processor, path)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, model_prefix: str, *,
              character_coverage: float = 0.9995, max_sentences: int = 5_000_000,
              num_threads: int = 2, seed: int = 0) -> "Tokenizer":
        """Train a BPE tokenizer on `texts` and write `{model_prefix}.model`.

        Args:
          texts: documents; each is split into lines for SentencePiece (newlines are a
            fixed token, so no piece spans one).
          vocab_size: total vocabulary including the 263 fixed ids above.
          model_prefix: output path without the `.model` suffix.
          character_coverage: share of characters that get their own piece; the rest
            are spelled with byte tokens.
          max_sentences: lines sampled for training (bounds memory on big corpora).
          num_threads: trainer threads.
          seed: SentencePiece's random seed (line sampling), for reproducible output.
        """
        spm.set_random_generator_seed(seed)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_training_lines(texts), model_writer=model,
                vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                add_dummy_prefix=False, split_digits=True,
                pad_id=0, unk_id=1, eos_id=2, bos_id=-1,
                control_symbols=list(CONTROL_SYMBOLS), user_defined_symbols=list(USER_DEFINED_SYMBOLS),
                character_coverage=character_coverage, input_sentence_size=max_sentences,
                shuffle_input_sentence=True, max_sentence_length=MAX_SENTENCE_BYTES,
                num_threads=num_threads, minloglevel=2)
        except RuntimeError as error:
            raise ValueError(f"SentencePiece training failed for vocab_size={vocab_size}: {error}. "
                             "A BPE vocabulary needs room for the 263 fixed ids plus every "
                             "character kept; try a larger --vocab_size or more text.") from error
        path = f"{model_prefix}.model"
        with open(path, "wb") as file:
            file.write(model.getvalue())
        return cls.load(path)

    def files(self) -> dict:
        """{file name: path} of what this tokenizer is loaded from (to copy it elsewhere)."""
        return {"tokenizer.model": self.path}

    @property
    def vocab_size(self) -> int:
        """Number of ids, including special and byte tokens."""
        return self.processor.GetPieceSize()

    @property
    def eos_id(self) -> int:
        """End-of-document id, placed after every document in GPT data."""
        return self.processor.eos_id()

    @property
    def pad_id(self) -> int:
        """Padding id."""
        return self.processor.pad_id()

    def piece_id(self, piece: str) -> int:
        """Id of a special piece such as "[MASK]" (raises if it is not in the vocabulary)."""
        index = self.processor.PieceToId(piece)
        if self.processor.IdToPiece(index) != piece:
            raise ValueError(f"{piece!r} is not in tokenizer {self.path}")
        return index

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no eos added)."""
        return self.processor.EncodeAsIds(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text; `num_threads` SentencePiece threads."""
        return self.processor.Encode(texts, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; control ids (eos, [CLS], ...) decode to nothing."""
        return self.processor.DecodeIds([int(i) for i in ids])

    def piece_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of source text each id stands for (0 for control ids), int64 [vocab]."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for index in range(self.vocab_size):
            if self.processor.IsByte(index):
                lengths[index] = 1
            elif not (self.processor.IsControl(index) or self.processor.IsUnknown(index)):
                lengths[index] = len(self.processor.IdToPiece(index).replace("\u2581", " ").encode())
        return lengths


def load_tokenizer(path: str):
    """A prep tokenizer from its file: a WordPiece vocab.txt (tfbig.data.WordPieceVocab, for
    --format=bert), GPT-2's byte-level BPE vocab.json with merges.txt beside it
    (tfbig.data.bpe.ByteLevelBPE), a Hugging Face tokenizer.json (Llama 3, Qwen, Mistral...:
    tfbig.data.tokenizer_json.TokenizerJson), a released ALBERT SentencePiece model (no newline
    piece: tfbig.data.albert_spm.AlbertSentencePiece, for --format=albert), or another
    SentencePiece .model (Tokenizer: tfbig's own, or a released Llama 2 / Mistral one)."""
    if path.endswith(".txt"):
        from tfbig.data.wordpiece_vocab import WordPieceVocab

        return WordPieceVocab.load(path)
    if is_tokenizer_json(path):
        return TokenizerJson.load(path)
    if is_byte_level_bpe(path):
        from tfbig.data.bpe import ByteLevelBPE

        return ByteLevelBPE.load(path, merges_file(path))
    tokenizer = Tokenizer.load(path)
    from tfbig.data.albert_spm import AlbertSentencePiece, is_released_albert

    if is_released_albert(tokenizer.processor):
        return AlbertSentencePiece(tokenizer.processor, path)
    return tokenizer


def is_byte_level_bpe(path: str) -> bool:
    """Whether a tokenizer file is GPT-2's vocab.json (its merges.txt beside it)."""
    return path.endswith(".json") and not is_tokenizer_json(path)


def merges_file(vocab_file: str) -> str:
    """The merges.txt beside a byte-level BPE vocab.json."""
    return os.path.join(os.path.dirname(vocab_file), "merges.txt")


DIRECTORY_TOKENIZERS = ("vocab.json", "tokenizer.json", "tokenizer.model", "vocab.txt", "spiece.model",
                        "30k-clean.model")


def tokenizer_file(path: str) -> str:
    """The tokenizer file --tokenizer names: a file as given; for a directory, the file its
    config.json "tokenizer" entry names (a tfbig-convert output or tfbig-train run), else the
    first it has of vocab.json (+ merges.txt, a Hugging Face GPT-2), tokenizer.json (a Hugging
    Face Llama, Mistral, Qwen...: the fast tokenizer), tokenizer.model (SentencePiece), vocab.txt
    (BERT's WordPiece: Hugging Face or Google), spiece.model (a Hugging Face ALBERT) or
    30k-clean.model (Google's ALBERT release)."""
    if not os.path.isdir(path):
        return path
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as file:
            entry = json.load(file).get("tokenizer")
        if isinstance(entry, dict) and entry.get("vocab_file"):
            return os.path.join(path, entry["vocab_file"])
    for name in DIRECTORY_TOKENIZERS:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"--tokenizer={path}: a directory without vocab.json + merges.txt (GPT-2's "
                     "byte-level BPE), tokenizer.json (Hugging Face), tokenizer.model "
                     "(SentencePiece), vocab.txt (WordPiece), "
                     "spiece.model or 30k-clean.model (ALBERT's SentencePiece)")


def tokenizer_files(path: str) -> dict:
    """{file name: path} of the files a tokenizer is made of: vocab.json and merges.txt for
    byte-level BPE, else the one file."""
    if is_byte_level_bpe(path):
        return {"vocab.json": path, "merges.txt": merges_file(path)}
    return {os.path.basename(path): path}


def tokenizer_sha256(path: str) -> str:
    """Hex sha256 of a tokenizer: of its file, or of vocab.json then merges.txt for BPE."""
    digest = hashlib.sha256()
    for name in (tokenizer_files(path).values() if is_byte_level_bpe(path) else (path,)):
        with open(name, "rb") as file:
            while block := file.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def run_tokenizer_files(path: str) -> tuple[dict, dict | None]:
    """What tfbig-train copies into --model_dir for the data's tokenizer `path`, and the
    config.json "tokenizer" entry that makes `for_run` read it: GPT-2's vocab.json + merges.txt
    with {"kind": "byte_level_bpe", ...}; a tokenizer.json with {"kind": "tokenizer_json", ...};
    a WordPiece vocab.txt as vocab.txt with {"vocab_file":
    "vocab.txt", "lowercase": ...} (a converted BERT's layout, which tfbig-classify,
    tfbig-squad and the Hugging Face export read); any other as tokenizer.model and no entry."""
    if is_byte_level_bpe(path):
        from tfbig.data.bpe import RUN_ENTRY

        return tokenizer_files(path), dict(RUN_ENTRY)
    if is_tokenizer_json(path):
        return {TOKENIZER_JSON: path}, dict(JSON_RUN_ENTRY)
    if path.endswith(".txt"):
        from tfbig.data.wordpiece_vocab import WordPieceVocab

        return {"vocab.txt": path}, {"vocab_file": "vocab.txt",
                                     "lowercase": WordPieceVocab.load(path).lowercase}
    return {"tokenizer.model": path}, None


def _training_lines(texts: Iterable[str]):
    """Non-empty lines of each text, cut to what SentencePiece accepts."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line.encode()[:MAX_SENTENCE_BYTES].decode(errors="ignore")


def for_run(model_dir: str):
    """The tokenizer a run directory carries: GPT-2's byte-level BPE (vocab.json + merges.txt,
    tfbig.data.bpe) when its config.json says {"tokenizer": {"kind": "byte_level_bpe", ...}}
    (a tfbig-convert of a GPT-2, or a tfbig-train run on such data), a tokenizer.json when it
    says {"kind": "tokenizer_json"} (a run on data prepared with one) or lists it among a
    converted Llama's "huggingface_files", else the SentencePiece tokenizer.model tfbig-train
    copies there (or a converted Llama 2 / Mistral brought). All answer the same calls
    (encode, decode, eos_id, vocab_size...)."""
    path = os.path.join(model_dir, "config.json")
    saved = {}
    if os.path.isfile(path):
        with open(path) as file:
            saved = json.load(file)
    entry = saved.get("tokenizer")
    if isinstance(entry, dict) and entry.get("kind") == "byte_level_bpe":
        from tfbig.data.bpe import ByteLevelBPE

        return ByteLevelBPE.load(os.path.join(model_dir, entry["vocab_file"]),
                                 os.path.join(model_dir, entry["merges_file"]))
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "tokenizer_json" or (kind == "huggingface_files"
                                    and TOKENIZER_JSON in entry.get("files", ())):
        return TokenizerJson.load(os.path.join(model_dir, TOKENIZER_JSON))
    return Tokenizer.load(os.path.join(model_dir, "tokenizer.model"))
