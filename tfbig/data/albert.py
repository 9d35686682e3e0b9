"""ALBERT pretraining examples: sentence-order pairs and masked-LM masking, in numpy.

Why it is built this way: docs/design/notes/data.md (tfbig.data.albert).
"""
import dataclasses
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from tfbig.data.wordpiece_vocab import is_special

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")
SHUFFLE_ROWS = 4096  # instances shuffled together before they are written
COPY_MIN_TOKENS = 4  # a copied line has at least this many tokens (copy_pair)


@dataclasses.dataclass(frozen=True)
class MaskingOptions:
    """How examples are masked (the prep flags of the same names)."""

    masked_lm_prob: float = 0.15  # share of tokens predicted
    max_predictions_per_seq: int = 20  # at most this many predictions per sequence
    max_ngram: int = 3  # spans of 1..max_ngram tokens (or words), weighted 1/n (ALBERT: 3)
    whole_word_masking: bool = False  # mask whole words (SentencePiece "▁" starts a word)
    short_seq_prob: float = 0.1  # share of documents packed to a random shorter length
    dupe_factor: int = 1  # times each document is used, with different pairs and masks
    copy_prob: float = 0.0  # share of pairs whose A is a copy of one line of B (copy_pair)

    def __post_init__(self):
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"--masked_lm_prob={self.masked_lm_prob}: expected 0 < p < 1")
        if not 0.0 <= self.copy_prob <= 1.0:
            raise ValueError(f"--copy_prob={self.copy_prob}: expected 0 <= p <= 1")
        for name in ("max_predictions_per_seq", "max_ngram", "dupe_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: expected >= 1")


@dataclasses.dataclass(frozen=True)
class MaskingVocab:
    """Per-id tables the masking needs, built once from the tokenizer.

    cls_id, sep_id, mask_id: the special ids. replacement_ids: ids a "random token" is drawn
    from (all but control, unknown and byte-fallback ids: a lone byte is no text).
    starts_word[id]: the piece begins a word ("▁" prefix, or not made of letters:
    punctuation, digits, bytes, newline). ends_word[id]:
    the next piece begins a word whatever it is (newline, control ids).
    """

    cls_id: int
    sep_id: int
    mask_id: int
    newline_id: int
    replacement_ids: np.ndarray
    starts_word: np.ndarray
    ends_word: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer):
        """Tables for a `tfbig.data.Tokenizer` (or any SentencePiece model with the pieces),
        or a `WordPieceVocab` (see from_wordpiece)."""
        if not hasattr(tokenizer, "processor"):
            return cls.from_wordpiece(tokenizer)
        sp = tokenizer.processor
        size = sp.GetPieceSize()
        special = np.array([sp.IsControl(i) or sp.IsUnknown(i) for i in range(size)])
        byte = np.array([sp.IsByte(i) for i in range(size)])
        pieces = [sp.IdToPiece(i) for i in range(size)]
        letters = np.array([p.replace("\u2581", "").isalpha() for p in pieces]) & ~byte
        starts = np.array([p.startswith("\u2581") for p in pieces]) | ~letters | special
        newline = sp.PieceToId("\n")
        ends = special.copy()
        if sp.IdToPiece(newline) == "\n":
            ends[newline] = True
        else:  # a released ALBERT model ends each line with [SEP] (tfbig.data.albert_spm)
            newline = getattr(tokenizer, "line_end_id", -1)
        return cls(tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]"),
                   tokenizer.piece_id("[MASK]"), newline if newline >= 0 and ends[newline] else -1,
                   np.flatnonzero(~(special | byte)), starts, ends)

    @classmethod
    def from_wordpiece(cls, vocab):
        """Tables for a tfbig.data.WordPieceVocab: a word is a piece and its "##" pieces;
        [SEP] ends each line (newline_id); specials are never a random replacement."""
        special = np.array([is_special(piece) for piece in vocab.pieces])
        starts = np.array([not piece.startswith("##") for piece in vocab.pieces]) | special
        sep = vocab.piece_id("[SEP]")
        return cls(vocab.piece_id("[CLS]"), sep, vocab.piece_id("[MASK]"), sep,
                   np.flatnonzero(~special), starts, special.copy())

    def word_starts(self, tokens):
        """Boolean (len,) array: token i begins a word."""
        tokens = np.asarray(tokens)
        starts = self.starts_word[tokens].copy()
        starts[1:] |= self.ends_word[tokens[:-1]]
        starts[:1] = True
        return starts


def mask_tokens(tokens, rng, vocab, options):
    """Choose and corrupt the predicted tokens of one [CLS] A [SEP] B [SEP] sequence.

    Returns (masked tokens (L,), sorted positions (n,), original ids at them (n,)).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    units = _candidate_units(tokens, vocab, options.whole_word_masking)
    budget = min(options.max_predictions_per_seq,
                 max(1, int(round(len(tokens) * options.masked_lm_prob))))
    chosen = _choose_spans(units, budget, options.max_ngram, rng)
    positions = np.sort(np.array(chosen, dtype=np.int64))
    masked = tokens.copy()
    action = rng.random(len(positions))  # per token: < 0.8 [MASK], < 0.9 random, else kept
    masked[positions[action < 0.8]] = vocab.mask_id
    randomised = positions[(action >= 0.8) & (action < 0.9)]
    masked[randomised] = rng.choice(vocab.replacement_ids, size=len(randomised))
    return masked, positions, tokens[positions]


def _candidate_units(tokens, vocab, whole_word):
    """Maskable units: single tokens, or whole words; [CLS] and [SEP] are never masked."""
    maskable = (tokens != vocab.cls_id) & (tokens != vocab.sep_id)
    index = np.flatnonzero(maskable)
    if not whole_word:
        return [[i] for i in index.tolist()]
    starts = vocab.word_starts(tokens) | ~maskable  # a special id closes the word before it
    units = []
    for i in index.tolist():
        if starts[i] or not units or units[-1][-1] != i - 1:
            units.append([i])
        else:
            units[-1].append(i)
    return units


def _choose_spans(units, budget, max_ngram, rng):
    """ALBERT's n-gram choice: from units in random order, spans of n ~ 1/n units that fit."""
    weights = 1.0 / np.arange(1, max_ngram + 1)
    chosen, covered = [], set()
    lengths = rng.choice(max_ngram, size=len(units), p=weights / weights.sum()) + 1
    for start in rng.permutation(len(units)).tolist():
        if len(chosen) >= budget:
            break
        n = min(int(lengths[start]), len(units) - start)  # spans stop at the last unit
        span = [i for unit in units[start:start + n] for i in unit]
        while len(chosen) + len(span) > budget and n > 1:  # shorter n-grams until it fits
            n -= 1
            span = [i for unit in units[start:start + n] for i in unit]
        if len(chosen) + len(span) > budget or covered.intersection(span):
            continue
        covered.update(span)
        chosen += span
    return chosen


def split_segments(ids, newline_id):
    """Cut a tokenized document after each newline token: its lines, newlines kept."""
    ids = np.asarray(ids, dtype=np.int64)
    if newline_id < 0:
        return [ids] if len(ids) else []
    cuts = np.flatnonzero(ids == newline_id) + 1
    return [segment for segment in np.split(ids, cuts) if len(segment)]


def document_segments(ids, vocab):
    """A document's segments (lines): cut after each newline token, which is text and stays
    (tfbig's SentencePiece), or after each [SEP] a tokenizer ends its lines with, which goes
    (WordPiece, a released ALBERT SentencePiece)."""
    segments = split_segments(ids, vocab.newline_id)
    if vocab.newline_id < 0 or vocab.newline_id != vocab.sep_id:
        return segments
    return [s[:-1] if s[-1] == vocab.sep_id else s for s in segments
            if len(s) > 1 or s[0] != vocab.sep_id]


def sentence_order_pairs(segments, max_num_tokens, rng, short_seq_prob=0.1):
    """Yield (tokens_a, tokens_b, swapped) from one document's segments (ALBERT's packing).

    Consecutive segments fill a chunk of about the target length; A is its first k >= 1
    segments, B the rest (a one-segment chunk is cut at a random token); half the pairs are
    returned as (B, A) with swapped=1. Pairs are truncated to max_num_tokens together.
    """
    target = max_num_tokens
    if rng.random() < short_seq_prob:
        target = int(rng.integers(2, max_num_tokens + 1))
    chunk, length = [], 0
    for i, segment in enumerate(segments):
        chunk.append(segment)
        length += len(segment)
        if i == len(segments) - 1 or length >= target:
            pair = _split_chunk(chunk, rng)
            if pair is not None:
                swapped = int(rng.random() < 0.5)
                a, b = pair[::-1] if swapped else pair
                yield (*_truncate_pair(a, b, max_num_tokens, rng), swapped)
            chunk, length = [], 0


def _split_chunk(chunk, rng):
    if len(chunk) >= 2:
        cut = int(rng.integers(1, len(chunk)))
        return np.concatenate(chunk[:cut]), np.concatenate(chunk[cut:])
    if len(chunk[0]) < 2:
        return None
    cut = int(rng.integers(1, len(chunk[0])))
    return chunk[0][:cut], chunk[0][cut:]


def _truncate_pair(a, b, max_num_tokens, rng):
    """Drop tokens from the longer side, at its front or back at random, until both fit."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_num_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]
    return np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)


def copy_pair(a, b, swapped, max_num_tokens, rng, newline_id, min_tokens=COPY_MIN_TOKENS):
    """(A, B) of a copy pair from a sentence pair, or None if it has no line to copy.

    B is the pair's text in document order (both halves) and A a copy of one of its lines of
    at least `min_tokens` tokens (without its newline); B is cut to a window around that line
    so that A and B fit max_num_tokens together. Masked tokens of either copy can be read off
    the other: the MLM loss rewards finding where A's words occur in B, the match a reading
    comprehension model makes between a question's quote and its context.
    """
    text = np.concatenate([b, a] if swapped else [a, b])
    lines = [line[:-1] if line[-1] == newline_id else line
             for line in split_segments(text, newline_id)]
    starts = np.cumsum([0] + [len(line) for line in split_segments(text, newline_id)])[:-1]
    room = max_num_tokens // 2  # A at most half the sequence: B keeps a context around it
    chosen = [i for i, line in enumerate(lines) if min_tokens <= len(line) <= room]
    if not chosen:
        return None
    i = chosen[int(rng.integers(len(chosen)))]
    copy, start = lines[i], int(starts[i])
    width = max_num_tokens - len(copy)  # B's tokens: a window of `text` holding the line
    lowest, highest = max(0, start + len(copy) - width), min(start, max(0, len(text) - width))
    first = int(rng.integers(lowest, highest + 1))
    return copy, text[first:first + width]


def make_instance(a, b, swapped, rng, vocab, options, seq_length):
    """One example's features (1-D arrays) from a sentence pair."""
    tokens = np.concatenate([[vocab.cls_id], a, [vocab.sep_id], b, [vocab.sep_id]])
    segment_ids = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)])
    masked, positions, labels = mask_tokens(tokens, rng, vocab, options)
    width, predictions = seq_length, options.max_predictions_per_seq
    return {"input_ids": _pad(masked, width), "input_mask": _pad(np.ones_like(tokens), width),
            "segment_ids": _pad(segment_ids, width),
            "masked_lm_positions": _pad(positions, predictions),
            "masked_lm_ids": _pad(labels, predictions),
            "masked_lm_weights": _pad(np.ones(len(positions), np.float32), predictions),
            "next_sentence_labels": np.array([swapped], np.int64)}


def _pad(values, width):
    out = np.zeros(width, dtype=np.float32 if values.dtype == np.float32 else np.int64)
    out[:len(values)] = values
    return out


def albert_features(seq_length, max_predictions_per_seq=20, **_):
    """Feature table of the "albert" format: {name: (dtype name, length)}."""
    t, p = seq_length, max_predictions_per_seq
    return {"input_ids": ("int64", t), "input_mask": ("int64", t), "segment_ids": ("int64", t),
            "masked_lm_positions": ("int64", p), "masked_lm_ids": ("int64", p),
            "masked_lm_weights": ("float32", p), "next_sentence_labels": ("int64", 1)}


def albert_examples(documents: Iterable[list[int]], seq_length: int, tokenizer, seed: int = 0,
                    rows_per_batch: int = 512, **options) -> Iterator[dict[str, np.ndarray]]:
    """Batches of {feature: (N, length)} arrays from tokenized documents (one shard's worth).

    `options` are MaskingOptions fields. Instances are shuffled in windows of SHUFFLE_ROWS;
    the random stream is seeded by `seed` and the first document, so each shard differs.
    """
    options = MaskingOptions(**options)
    if seq_length < 5:
        raise ValueError(f"--seq_length={seq_length}: an ALBERT pair needs at least 5 tokens")
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    if options.copy_prob and (vocab.newline_id < 0 or vocab.newline_id == vocab.sep_id):
        raise ValueError(f"--copy_prob={options.copy_prob} copies lines of text: it needs a "
                         "tokenizer that keeps newlines as a piece (tfbig's SentencePiece)")
    rng, pending = None, []
    for ids in documents:
        if rng is None:
            rng = np.random.default_rng([seed, zlib.crc32(np.asarray(ids, np.int64).tobytes())])
        segments = document_segments(ids, vocab)
        for _ in range(options.dupe_factor):
            for a, b, swapped in sentence_order_pairs(segments, seq_length - 3, rng,
                                                      options.short_seq_prob):
                copied = copy_pair(a, b, swapped, seq_length - 3, rng, vocab.newline_id) \
                    if options.copy_prob and rng.random() < options.copy_prob else None
                if copied is not None:  # label 0: A and B in order, A a line of B
                    a, b, swapped = *copied, 0
                pending.append(make_instance(a, b, swapped, rng, vocab, options, seq_length))
        if len(pending) >= SHUFFLE_ROWS:
            yield from _batches(pending, rng, rows_per_batch)
            pending = []
    if pending:
        yield from _batches(pending, rng, rows_per_batch)


def _batches(instances, rng, rows_per_batch):
    order = rng.permutation(len(instances))
    for start in range(0, len(order), rows_per_batch):
        rows = [instances[i] for i in order[start:start + rows_per_batch]]
        yield {name: np.stack([row[name] for row in rows]) for name in FEATURES}
