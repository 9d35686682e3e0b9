"""SQuAD features: exact character offsets, windows, and answers recovered exactly from features."""
import numpy as np
import pytest
import sentencepiece as spm

from tfbig.data.squad.features import (Example, char_span, convert_examples,
    examples_from_dataset, token_char_spans, windows)
from tfbig.data import Tokenizer

TRICKY = "  Naïve café —  ‘quoted’ text\twith tabs,\nnew lines\n\nand  DOUBLE  spaces ½."


def test_token_spans_cover_the_text_exactly(qa_tokenizer):
    ids, starts, ends = token_char_spans(qa_tokenizer, TRICKY)
    assert len(ids) == len(starts) == len(ends) > 10
    rebuilt, covered = [], 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        piece = qa_tokenizer.processor.IdToPiece(int(ids[i]))
        if s < covered:  # a byte token of a character an earlier byte token began
            assert qa_tokenizer.processor.IsByte(int(ids[i])) and e == covered
            continue
        gap = TRICKY[covered:s]
        assert gap in ("", " ") and (gap == "" or piece.startswith("\u2581"))  # only the ▁ space
        rebuilt.append(gap + TRICKY[s:e])
        covered = e
    assert "".join(rebuilt) == TRICKY and ends[-1] == len(TRICKY)


def answers_recovered(examples, features):
    """{qid: [texts of the labelled spans of its features]}."""
    found = {}
    arrays = features.arrays
    for feature in range(len(features)):
        example = examples[arrays["example_index"][feature]]
        first, last = int(arrays["start_positions"][feature]), int(arrays["end_positions"][feature])
        if first:
            begin, end = char_span(features, feature, first, last)
            found.setdefault(example.qid, []).append(example.context[begin:end])
        else:
            assert last == 0
    return found


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_answers_are_recovered_exactly_from_features(qa_sets, qa_tokenizer, version):
    examples = examples_from_dataset(qa_sets[version, "dev"])
    features = convert_examples(examples, qa_tokenizer, max_seq_length=96, doc_stride=32,
                                max_query_length=32)
    found = answers_recovered(examples, features)
    answerable = [e for e in examples if not e.is_impossible]
    assert len(answerable) > 300
    for example in examples:
        if example.is_impossible:
            assert example.qid not in found  # every window says [CLS]
        else:
            assert found[example.qid] and set(found[example.qid]) == {example.answer_text}
    assert len(features) > len(examples)  # long contexts were cut into several windows


def test_handmade_answers_at_edges_and_across_windows(qa_tokenizer):
    context = "ORSINO\nIf music be the food of love, play on;\nÉlan — café,  VIOLA\nend"
    cases = [("ORSINO", 0), ("end", len(context) - 3), ("VIOLA", context.index("VIOLA")),
             ("café", context.index("café")), ("music be the food", context.index("music"))]
    examples = [Example(f"q{i}", "Who?", context, text, start) for i, (text, start) in
                enumerate(cases)]
    for max_seq_length, stride in ((64, 16), (16, 3)):  # one window; many small windows
        features = convert_examples(examples, qa_tokenizer, max_seq_length, stride, 8)
        found = answers_recovered(examples, features)
        for example in examples:
            assert set(found[example.qid]) == {example.answer_text}, max_seq_length


def test_windows_cover_every_token_and_max_context_picks_one():
    spans = windows(100, 30, 13)
    covered = np.zeros(100, int)
    for start, length in spans:
        covered[start:start + length] += 1
    assert covered.min() >= 1 and spans[-1][0] + spans[-1][1] == 100
    assert windows(10, 30, 13) == [(0, 10)]


def test_each_context_token_has_exactly_one_max_context_window(qa_tokenizer):
    context = " ".join(f"word{i}" for i in range(120))
    examples = [Example("q", "Where?", context, is_impossible=True)]
    features = convert_examples(examples, qa_tokenizer, 48, 10, 8)
    arrays = features.arrays
    counts = np.zeros(int(arrays["context_token"].max()) + 1, int)
    for row in range(len(features)):
        tokens = arrays["context_token"][row][arrays["max_context"][row]]
        np.add.at(counts, tokens, 1)
    assert len(features) > 3 and (counts == 1).all()


def test_feature_layout(qa_tokenizer):
    features = convert_examples([Example("q", "Who says so?", "VIOLA\nSo I say.\n", "VIOLA", 0)],
                                qa_tokenizer, 32, 8, 8)
    arrays = features.arrays
    n = int(arrays["input_mask"][0].sum())
    ids = arrays["input_ids"][0]
    sep = qa_tokenizer.piece_id("[SEP]")
    assert ids[0] == qa_tokenizer.piece_id("[CLS]") and ids[n - 1] == sep and (ids[n:] == 0).all()
    first_sep = int(np.flatnonzero(ids == sep)[0])
    assert (arrays["segment_ids"][0, :first_sep + 1] == 0).all()
    assert (arrays["segment_ids"][0, first_sep + 1:n] == 1).all()
    assert arrays["start_positions"][0] == first_sep + 1  # VIOLA opens the context


def test_a_wrong_answer_offset_is_a_clear_error():
    dataset = {"data": [{"paragraphs": [{"context": "VIOLA\nHello", "qas": [
        {"id": "x", "question": "Who?", "answers": [{"text": "VIOLA", "answer_start": 3}]}]}]}]}
    with pytest.raises(ValueError, match="question x: answer 'VIOLA' is not at answer_start=3"):
        examples_from_dataset(dataset, "bad.json")


def test_a_normalising_tokenizer_is_a_clear_error(tmp_path):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["Hello  WORLD  again"] * 50),
                                   model_prefix=str(tmp_path / "nfkc"), vocab_size=18,
                                   minloglevel=2)  # default: nmt_nfkc, extra spaces removed
    with pytest.raises(ValueError, match="does not spell the text exactly"):
        token_char_spans(Tokenizer.load(str(tmp_path / "nfkc.model")), "Hello   WORLD  ½")
