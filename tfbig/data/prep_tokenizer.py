"""tfbig-prep's tokenizer step: reuse the one a directory already holds, copy a given one
(checked against --format and --vocab_size), or train SentencePiece on a sample of the
training pieces; each recorded by its sha256 so a changed tokenizer reshards."""
import dataclasses
import json
import math
import os
import shutil
from collections import Counter

from absl import logging

from tfbig.data import shards, source_spec, sources
from tfbig.data.prep_output import pieces_key
from tfbig.data.tokenizer import (Tokenizer, is_byte_level_bpe, load_tokenizer, tokenizer_files,
                                  tokenizer_sha256)
from tfbig.data.tokenizer_json import TOKENIZER_JSON, is_tokenizer_json
from tfbig.data.wordpiece_vocab import WordPieceVocab

TOKENIZER_NAME = "tokenizer.model"


WORDPIECE_NAME = "vocab.txt"  # --format=bert: a WordPiece vocabulary (tfbig.data.WordPieceVocab)


BPE_NAME = "vocab.json"  # GPT-2's byte-level BPE (--tokenizer=a GPT-2 directory), merges.txt beside it


def tokenizer_name(format: str, kind: str = "") -> str:
    """File name of the tokenizer next to the shards of `format` (kind: "byte_level_bpe" for
    GPT-2's vocab.json, "tokenizer_json" for a Hugging Face tokenizer.json, "" otherwise)."""
    if kind == "byte_level_bpe":
        return BPE_NAME
    if kind == "tokenizer_json":
        return TOKENIZER_JSON
    return WORDPIECE_NAME if format == "bert" else TOKENIZER_NAME


def recorded_tokenizer_name(settings: dict) -> str:
    return tokenizer_name(settings["format"], settings.get("tokenizer_kind", ""))


def tokenizer_step(output_dir, given, train, spec, vocab_size, seed, sample_mb, existing, overwrite,
                    format="gpt", name=TOKENIZER_NAME) -> str:
    """Put the tokenizer in output_dir as `name` (tokenizer.model; vocab.txt for bert; vocab.json +
    merges.txt for a given byte-level BPE): copy, reuse or train; return its sha256."""
    target = os.path.join(output_dir, name)
    if given:
        _check_tokenizer_kind(given, format)
        sha = _checked_tokenizer_sha(given, vocab_size)
        if not overwrite and existing.get("tokenizer_sha256", (sha,))[0] != sha:
            raise ValueError(f"{output_dir} holds shards made with a tokenizer of sha256 "
                             f"{existing['tokenizer_sha256'][0][:12]}... (see {existing['tokenizer_sha256'][1]}) "
                             f"but --tokenizer={given} has sha256 {sha[:12]}...; "
                             "choose another --output_dir or pass --overwrite")
        if not _holds_tokenizer(target, sha):
            for file_name, source in sorted(tokenizer_files(given).items(), key=lambda f: f[0] == name):
                copy = os.path.join(output_dir, name if source == given else file_name)
                shutil.copyfile(source, copy + ".tmp")  # the named file last: it marks the copy done
                os.replace(copy + ".tmp", copy)
        return sha
    recipe = {"vocab_size": vocab_size, "seed": seed, "sample_mb": sample_mb,
              "model_type": "wordpiece" if format == "bert" else "bpe",
              "trained_on": pieces_key(train), "spec": dataclasses.asdict(spec)}
    reused = _reusable_tokenizer(target, recipe)
    if reused:
        return reused
    if not overwrite and "tokenizer_sha256" in existing:
        old = existing.get("vocab_size", ("?", ""))[0]
        raise ValueError(f"{output_dir} holds shards whose tokenizer was trained on other input or settings "
                         f"(vocab_size={old}, see {existing['tokenizer_sha256'][1]}); this run would train a new "
                         f"one (vocab_size={vocab_size}) on {spec.describe()}; choose another --output_dir or "
                         "pass --overwrite")
    return _train_tokenizer(target, recipe, train, spec, vocab_size, seed, sample_mb)


def _holds_tokenizer(target: str, sha: str) -> bool:
    """Whether output_dir already holds the tokenizer of sha256 `sha` as `target` (and merges.txt)."""
    try:
        return tokenizer_sha256(target) == sha
    except OSError:
        return False


DECODER_FORMATS = ("gpt", "completion")  # a decoder's data: no [CLS], [SEP] or [MASK] needed


def _check_tokenizer_kind(source: str, format: str) -> None:
    if is_tokenizer_json(source) and format not in DECODER_FORMATS:
        raise ValueError(f"--tokenizer={source} is a Hugging Face tokenizer.json (a decoder's: no "
                         f"[CLS], [SEP] or [MASK]); --format={format} needs its own tokenizer "
                         f"(tokenizer.json is for --format=gpt)")
    if is_byte_level_bpe(source) and format not in DECODER_FORMATS:
        raise ValueError(f"--tokenizer={source} is GPT-2's byte-level BPE, which has no [CLS], [SEP] "
                         f"or [MASK]; --format={format} needs its own tokenizer (BPE is for --format=gpt)")
    if (format == "bert") != source.endswith(".txt"):
        expected = "a WordPiece vocab.txt" if format == "bert" else "a SentencePiece .model file"
        raise ValueError(f"--tokenizer={source}: --format={format} needs {expected}")
    if format in DECODER_FORMATS and hasattr(load_tokenizer(source), "line_end_id"):
        raise ValueError(f"--tokenizer={source} is a released ALBERT SentencePiece model (no "
                         "newline piece, no end-of-document id); it prepares --format=albert")


def _checked_tokenizer_sha(source: str, vocab_size: int) -> str:
    loaded = load_tokenizer(source)
    if loaded.vocab_size != vocab_size:
        raise ValueError(f"--tokenizer={source} has vocab_size={loaded.vocab_size} but --vocab_size={vocab_size}; "
                         "make them agree")
    try:
        eos = loaded.eos_id
    except ValueError:  # a BPE vocabulary without <|endoftext|>
        eos = -1
    if eos < 0:
        raise ValueError(f"--tokenizer={source} has no end-of-document (eos) piece; train it with eos_id set")
    return tokenizer_sha256(source)


def _reusable_tokenizer(target: str, recipe: dict) -> str | None:
    """sha256 of target if a sidecar says it was trained with exactly this recipe."""
    try:
        with open(target + ".json") as file:
            record = json.load(file)
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("recipe") != json.loads(json.dumps(recipe)) or not os.path.isfile(target):
        return None
    sha = shards.file_sha256(target)
    return sha if sha == record.get("sha256") else None


def _train_tokenizer(target, recipe, train, spec, vocab_size, seed, sample_mb) -> str:
    texts = (doc for piece in _sample(train, sample_mb * 2**20) for doc in sources.read_documents(piece, spec, Counter()))
    kind = recipe["model_type"]
    logging.info("training a %d-token %s tokenizer on up to %.0f MB of %s", vocab_size, kind, sample_mb, spec.describe())
    if kind == "wordpiece":
        WordPieceVocab.train(texts, vocab_size, target)
    else:
        Tokenizer.train(texts, vocab_size, target + ".training", seed=seed)
        os.replace(target + ".training.model", target)
    sha = shards.file_sha256(target)
    shards._write_json(target + ".json", {"recipe": recipe, "sha256": sha})
    return sha


def _sample(pieces: list[source_spec.Piece], budget: float) -> list[source_spec.Piece]:
    """Every k-th piece, so the sample spans the whole input and stays under budget."""
    total = sum(piece.size for piece in pieces)
    return pieces[::max(1, math.ceil(total / budget))]
