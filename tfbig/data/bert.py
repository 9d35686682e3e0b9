"""BERT pretraining examples: next-sentence pairs and whole-word masking, in numpy.

Why it is built this way: docs/design/notes/data.md (tfbig.data.bert).
"""
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from tfbig.data.albert import (MaskingOptions, MaskingVocab, _batches, _truncate_pair,
                               albert_features, document_segments, make_instance)

DOCUMENTS_PER_WINDOW = 1000  # documents a random next segment is drawn from
BERT_MASKING = {"max_ngram": 1, "whole_word_masking": True}  # defaults over MaskingOptions

bert_features = albert_features  # the same seven features


def next_sentence_pairs(documents, index, max_num_tokens, rng, short_seq_prob=0.1):
    """Yield (tokens_a, tokens_b, is_random_next) from documents[index] (lists of segments)."""
    segments = documents[index]
    target = max_num_tokens
    if rng.random() < short_seq_prob:
        target = int(rng.integers(2, max_num_tokens + 1))
    chunk, length, i = [], 0, 0
    while i < len(segments):
        chunk.append(segments[i])
        length += len(segments[i])
        if i == len(segments) - 1 or length >= target:
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            a = np.concatenate(chunk[:a_end])
            random_next = len(documents) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
            if random_next:
                b = _random_segments(documents, index, target - len(a), rng)
                i -= len(chunk) - a_end  # the unused segments are read again
            else:
                b = np.concatenate(chunk[a_end:]) if a_end < len(chunk) else a[:0]
            if len(a) and len(b):
                yield (*_truncate_pair(a, b, max_num_tokens, rng), int(random_next))
            chunk, length = [], 0
        i += 1


def _random_segments(documents, index, target_length, rng):
    """Segments of a uniformly drawn other document, from a random start, >= target_length."""
    other = int(rng.integers(len(documents) - 1))
    other += other >= index
    segments = documents[other]
    tokens, start = [], int(rng.integers(len(segments)))
    for segment in segments[start:]:
        tokens.append(segment)
        if sum(map(len, tokens)) >= target_length:
            break
    return np.concatenate(tokens)


def bert_examples(documents: Iterable[list[int]], seq_length: int, tokenizer, seed: int = 0,
                  rows_per_batch: int = 512, **options) -> Iterator[dict[str, np.ndarray]]:
    """Batches of {feature: (N, length)} arrays from WordPiece-encoded documents (one shard).

    `options` are MaskingOptions fields (BERT_MASKING where not given). The random stream is seeded by `seed` and the first
    document, so each shard differs and a rerun is identical.
    """
    options = MaskingOptions(**{**BERT_MASKING, **options})
    if options.copy_prob:
        raise ValueError(f"--copy_prob={options.copy_prob}: copy pairs are made for "
                         "--format=albert only")
    if seq_length < 5:
        raise ValueError(f"--seq_length={seq_length}: a BERT pair needs at least 5 tokens")
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    rng, window = None, []
    for ids in documents:
        if rng is None:
            rng = np.random.default_rng([seed, zlib.crc32(np.asarray(ids, np.int64).tobytes())])
        segments = document_segments(ids, vocab)
        if segments:
            window.append(segments)
        if len(window) >= DOCUMENTS_PER_WINDOW:
            yield from _window_examples(window, rng, vocab, options, seq_length, rows_per_batch)
            window = []
    if window:
        yield from _window_examples(window, rng, vocab, options, seq_length, rows_per_batch)


def _window_examples(window, rng, vocab, options, seq_length, rows_per_batch):
    instances = []
    for _ in range(options.dupe_factor):
        for index in range(len(window)):
            for a, b, label in next_sentence_pairs(window, index, seq_length - 3, rng,
                                                   options.short_seq_prob):
                instances.append(make_instance(a, b, label, rng, vocab, options, seq_length))
    if instances:
        yield from _batches(instances, rng, rows_per_batch)
