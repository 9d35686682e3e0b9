"""SQuAD v1.1 / v2.0 JSON -> examples -> fixed-length features with exact character offsets.

A tfbig tokenizer spells its input exactly (identity normalisation, byte fallback), so every
context token has a character span: the characters its bytes cover, without the leading
space of a "▁" piece. An answer becomes the first and last context tokens overlapping its
characters, and a predicted token span becomes context[start of first : end of last].

Feature layout (BERT/ALBERT): [CLS] question [SEP] context window [SEP], segment 0 then 1,
zero-padded to max_seq_length; a decoder (Llama) puts its end-of-document token in both places
(`special_ids`): </s> question </s> context window </s>. A context longer than the room left is
cut into windows that start doc_stride tokens apart; a window without the whole answer (and
every window of an unanswerable question) labels the answer as position 0, the [CLS] (</s>)
token.

Example:
    examples, version = read_squad("dev-v2.0.json")
    features = convert_examples(examples, tokenizer, max_seq_length=384, doc_stride=128,
                                max_query_length=64)
    features.arrays["input_ids"]  # (num_features, 384)
"""
import dataclasses
import json

import numpy as np


@dataclasses.dataclass
class Example:
    """One question about one context."""

    qid: str
    question: str
    context: str
    answer_text: str = ""  # first gold answer ("" for unanswerable)
    answer_start: int = -1  # its character offset in context (-1: none)
    is_impossible: bool = False


@dataclasses.dataclass
class Features:
    """Model inputs plus what post-processing needs to map tokens back to text.

    arrays: input_ids, segment_ids, input_mask (N, T) int32; start_positions, end_positions
      (N,) int32 (training labels); example_index (N,) int32; context_token (N, T) int32:
      the context token index at each position, -1 outside the context window;
      max_context (N, T) bool: this window is the token's best (most centred) one.
    token_spans: per example, (starts, ends) character offsets of its context tokens.
    """

    arrays: dict
    token_spans: list

    def __len__(self):
        return len(self.arrays["input_ids"])


def read_squad(path):
    """Examples of a SQuAD JSON file and its version ("1.1" or "2.0")."""
    try:
        with open(path, encoding="utf-8") as file:
            dataset = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read SQuAD file {path}: {error}") from error
    if not isinstance(dataset, dict) or "data" not in dataset:
        raise ValueError(f"{path} is not SQuAD JSON: expected an object with a 'data' list")
    return examples_from_dataset(dataset, path), squad_version(dataset)


def squad_version(dataset):
    """"2.0" if the file has the v2 `is_impossible` field (or says v2), else "1.1"."""
    if str(dataset.get("version", "")).lstrip("v").startswith("2"):
        return "2.0"
    has_field = any("is_impossible" in qa for article in dataset["data"]
                    for paragraph in article["paragraphs"] for qa in paragraph["qas"])
    return "2.0" if has_field else "1.1"


def first_questions(dataset, count):
    """A SQuAD dict with the first `count` questions of `dataset` (in the file's order; a
    paragraph cut short keeps its first questions)."""
    paragraphs, taken = [], 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            qas = paragraph["qas"][:count - taken]
            if qas:
                paragraphs.append({"context": paragraph["context"], "qas": qas})
                taken += len(qas)
    return {"version": dataset["version"], "data": [{"title": "subset", "paragraphs": paragraphs}]}


def examples_from_dataset(dataset, name="dataset"):
    """Examples of a parsed SQuAD dict; answer offsets are checked against the context."""
    examples = []
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                impossible = bool(qa.get("is_impossible", False)) or not qa["answers"]
                example = Example(qa["id"], qa["question"], context, is_impossible=impossible)
                if not impossible:
                    answer = qa["answers"][0]
                    start, text = int(answer["answer_start"]), answer["text"]
                    if context[start:start + len(text)] != text:
                        raise ValueError(f"{name}: question {qa['id']}: answer {text!r} is not "
                                         f"at answer_start={start} of its context")
                    example.answer_text, example.answer_start = text, start
                examples.append(example)
    return examples


def token_char_spans(tokenizer, text, byte_lengths=None):
    """Token ids of `text` and each token's character span [start, end).

    The leading space of a "▁" piece is not part of its span. Raises ValueError if the
    tokenizer does not spell the text exactly (a normalising SentencePiece model). A WordPiece
    tokenizer (tfbig.data.wordpiece) and a released ALBERT SentencePiece model
    (tfbig.data.albert_spm) locate their pieces themselves (`char_spans`).
    """
    if hasattr(tokenizer, "char_spans"):
        return tokenizer.char_spans(text)
    byte_lengths = tokenizer.piece_byte_lengths() if byte_lengths is None else byte_lengths
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    encoded = text.encode("utf-8")
    ends = np.cumsum(byte_lengths[ids]) if len(ids) else np.zeros(0, np.int64)
    if (ends[-1] if len(ends) else 0) != len(encoded):
        raise ValueError(f"tokenizer {tokenizer.path} does not spell the text exactly (it "
                         f"normalises it); tfbig-squad needs a tfbig tokenizer (tfbig-prep)")
    starts = ends - byte_lengths[ids]
    leading_space = np.array([encoded[s:s + 1] == b" " for s in starts.tolist()], dtype=bool)
    spaced = np.array([tokenizer.processor.IdToPiece(int(i)).startswith("\u2581") for i in ids],
                      dtype=bool)
    starts = starts + (leading_space & spaced & (ends > starts + 1))
    char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
    char_of_byte = np.append(char_of_byte, len(text))
    return ids, char_of_byte[starts], char_of_byte[np.maximum(ends - 1, starts)] + 1


def answer_token_span(starts, ends, char_start, char_end):
    """First and last token overlapping characters [char_start, char_end)."""
    overlap = np.flatnonzero((ends > char_start) & (starts < char_end))
    if not len(overlap):
        raise ValueError(f"no token covers characters [{char_start}, {char_end})")
    return int(overlap[0]), int(overlap[-1])


def windows(num_tokens, room, doc_stride):
    """(start, length) of the context windows: `room` tokens each, doc_stride apart."""
    spans, start = [], 0
    while True:
        length = min(room, num_tokens - start)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, doc_stride)


def max_context_flags(spans, window):
    """For each token of spans[window]: is this the window where it has the most context?"""
    start, length = spans[window]
    flags = np.zeros(length, dtype=bool)
    for offset in range(length):
        position = start + offset
        best, best_score = None, None
        for index, (s, n) in enumerate(spans):
            if s <= position < s + n:
                score = min(position - s, s + n - 1 - position) + 0.01 * n
                if best_score is None or score > best_score:
                    best, best_score = index, score
        flags[offset] = best == window
    return flags


def convert_examples(examples, tokenizer, max_seq_length=384, doc_stride=128,
                     max_query_length=64, special_ids=None):
    """Features (see `Features`) of `examples`; questions are cut to max_query_length tokens.
    `special_ids`: the (first, separator) token ids; None: the tokenizer's [CLS] and [SEP]."""
    if max_query_length + 4 > max_seq_length:
        raise ValueError(f"--max_query_length={max_query_length} leaves no room for context in "
                         f"--max_seq_length={max_seq_length}")
    if doc_stride < 1:
        raise ValueError(f"--doc_stride={doc_stride}: expected >= 1")
    cls_id, sep_id = special_ids or (tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]"))
    byte_lengths = None if hasattr(tokenizer, "char_spans") else tokenizer.piece_byte_lengths()
    rows, token_spans, contexts = [], [], {}
    for index, example in enumerate(examples):
        if example.context not in contexts:  # questions share contexts: tokenize each once
            contexts[example.context] = token_char_spans(tokenizer, example.context, byte_lengths)
        ids, starts, ends = contexts[example.context]
        token_spans.append((starts, ends))
        answer = None
        if not example.is_impossible:
            answer = answer_token_span(starts, ends, example.answer_start,
                                       example.answer_start + len(example.answer_text))
        query = tokenizer.encode(example.question)[:max_query_length]
        spans = windows(len(ids), max_seq_length - len(query) - 3, doc_stride)
        for window, (start, length) in enumerate(spans):
            rows.append(_feature(index, query, ids, start, length, answer, cls_id, sep_id,
                                 max_seq_length, max_context_flags(spans, window)))
    arrays = {name: np.stack([row[name] for row in rows]) if rows else np.zeros((0,))
              for name in _ROW_FIELDS}
    return Features(arrays, token_spans)


_ROW_FIELDS = ("input_ids", "segment_ids", "input_mask", "start_positions", "end_positions",
               "example_index", "context_token", "max_context")


def _feature(index, query, ids, start, length, answer, cls_id, sep_id, width, max_context):
    offset = len(query) + 2  # context tokens start after [CLS] question [SEP]
    tokens = [cls_id, *query, sep_id, *ids[start:start + length].tolist(), sep_id]
    row = {name: np.zeros(width, np.int32) for name in ("input_ids", "segment_ids", "input_mask")}
    row["input_ids"][:len(tokens)] = tokens
    row["segment_ids"][offset:len(tokens)] = 1
    row["input_mask"][:len(tokens)] = 1
    row["context_token"] = np.full(width, -1, np.int32)
    row["context_token"][offset:offset + length] = np.arange(start, start + length)
    row["max_context"] = np.zeros(width, bool)
    row["max_context"][offset:offset + length] = max_context
    first, last = 0, 0
    if answer is not None and start <= answer[0] and answer[1] < start + length:
        first, last = answer[0] - start + offset, answer[1] - start + offset
    row["start_positions"], row["end_positions"] = np.int32(first), np.int32(last)
    row["example_index"] = np.int32(index)
    return row


def char_span(features, feature, first, last):
    """Character span [start, end) in the context of feature positions first..last."""
    arrays = features.arrays
    example = int(arrays["example_index"][feature])
    starts, ends = features.token_spans[example]
    return int(starts[arrays["context_token"][feature, first]]), \
        int(ends[arrays["context_token"][feature, last]])
