"""Record formats: how tokenized documents become examples, and which features to parse back.

Adding a format (e.g. "albert") is one `Format` entry in `FORMATS`: a feature table for
the reader and an example builder for prep. A format may take options (prep flags such as
ALBERT's max_predictions_per_seq): prep passes them to both functions as keywords and
records them in the manifest (`info["format_options"]`) for the reader. This module imports
no TensorFlow, so prep worker processes stay light.

GPT format ("gpt"): documents are tokenized, each followed by `eos_id`, concatenated,
and cut into rows of exactly `seq_length + 1` tokens (inputs are row[:-1], targets
row[1:]). Each shard packs its own documents; its last partial row is dropped.

    feature      dtype   shape
    input_ids    int64   [seq_length + 1]
"""

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from tfbig.data import albert, bert, completion

ROWS_PER_BATCH = 512  # examples built, serialized and written together


@dataclasses.dataclass(frozen=True)
class Format:
    """One record format.

    features: (seq_length, **options) -> {feature name: (dtype name, length)} of
      fixed-length features.
    make_examples: (token-id documents, seq_length, tokenizer, seed, **options) -> batches
      of {feature name: (N, length) array}.
    token_feature: the feature whose ids are counted as the split's tokens and bytes.
    """

    features: Callable[[int], dict[str, tuple[str, int]]]
    make_examples: Callable[..., Iterator[dict[str, np.ndarray]]]
    token_feature: str


def gpt_features(seq_length: int) -> dict[str, tuple[str, int]]:
    """GPT rows: `seq_length + 1` token ids."""
    return {"input_ids": ("int64", seq_length + 1)}


def gpt_examples(documents: Iterable[list[int]], seq_length: int, tokenizer, seed: int = 0,
                 rows_per_batch: int = ROWS_PER_BATCH) -> Iterator[dict[str, np.ndarray]]:
    """Pack documents, each followed by eos, into (N, seq_length + 1) batches; drop the tail."""
    del seed  # packing is deterministic
    width, eos = seq_length + 1, np.array([tokenizer.eos_id], dtype=np.int64)
    pending, count = [], 0
    for ids in documents:
        pending += [np.asarray(ids, dtype=np.int64), eos]
        count += len(ids) + 1
        if count >= width * rows_per_batch:
            rows, rest = _rows(pending, width)
            yield {"input_ids": rows}
            pending, count = [rest], len(rest)
    rows, _ = _rows(pending, width)
    if len(rows):
        yield {"input_ids": rows}


def _rows(pieces: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    full = len(stream) // width * width
    return stream[:full].reshape(-1, width), stream[full:]


FORMATS = {
    "gpt": Format(gpt_features, gpt_examples, token_feature="input_ids"),
    # BERT/ALBERT pretraining features (sentence-order pairs, static masks): tfbig.data.albert.
    "albert": Format(albert.albert_features, albert.albert_examples,
                     token_feature="input_ids"),
    # The same features from WordPiece ids, next-sentence pairs: tfbig.data.bert.
    "bert": Format(bert.bert_features, bert.bert_examples, token_feature="input_ids"),
    # Prompt-completion pairs, one per row, the loss on the completion: tfbig.data.completion.
    "completion": Format(completion.completion_features, completion.completion_examples,
                         token_feature="input_ids"),
}


def get_format(name: str) -> Format:
    """The `Format` called `name`; ValueError naming the known ones otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]
