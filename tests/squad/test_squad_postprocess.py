"""n-best post-processing: valid spans only, max_answer_length, windows, null score."""
import numpy as np

from tfbig.data.squad.features import Example, convert_examples
from tfbig.data.squad.postprocess import apply_null_threshold, best_spans

CONTEXT = "VIOLA\nWhat country, friends, is this?\n\nCAPTAIN\nThis is Illyria, lady.\n"


def setup(tokenizer, max_seq_length=64, stride=16):
    examples = [Example("q", "Who says: 'This is Illyria, lady.'?", CONTEXT, "CAPTAIN",
                        CONTEXT.index("CAPTAIN"))]
    features = convert_examples(examples, tokenizer, max_seq_length, stride, 24)
    shape = features.arrays["input_ids"].shape
    return examples, features, np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def position_of(features, feature, text):
    """Feature positions (first, last) whose context span is `text`."""
    from tfbig.data.squad.features import char_span

    row = features.arrays["context_token"][feature]
    for first in np.flatnonzero(row >= 0):
        for last in np.flatnonzero(row >= 0):
            if first <= last:
                begin, end = char_span(features, feature, first, last)
                if CONTEXT[begin:end] == text:
                    return first, last
    raise AssertionError(text)


def _max_context(features, feature, text):
    try:
        first, _ = position_of(features, feature, text)
    except AssertionError:
        return False
    return bool(features.arrays["max_context"][feature, first])


def _window_chars(features, feature):
    from tfbig.data.squad.features import char_span

    row = np.flatnonzero(features.arrays["context_token"][feature] >= 0)
    return range(*char_span(features, feature, row[0], row[-1]))


def test_the_best_valid_span_wins(qa_tokenizer):
    examples, features, starts, ends = setup(qa_tokenizer)
    first, last = position_of(features, 0, "CAPTAIN")
    starts[0, first], ends[0, last] = 5.0, 5.0
    starts[0, 1], ends[0, 1] = 9.0, 9.0  # a question token: never an answer
    starts[0, first + 1], ends[0, first] = 4.0, 1.0  # end before start: invalid
    answers, diffs, nbest = best_spans(examples, features, starts, ends)
    assert answers == {"q": "CAPTAIN"}
    assert nbest["q"][0] == {"text": "CAPTAIN", "score": 10.0}
    assert [c["score"] for c in nbest["q"]] == sorted((c["score"] for c in nbest["q"]),
                                                     reverse=True)
    assert len({c["text"] for c in nbest["q"]}) == len(nbest["q"])  # no duplicates
    assert diffs["q"] == 0.0 - 10.0  # null score ([CLS]) minus the best span


def test_max_answer_length_excludes_long_spans(qa_tokenizer):
    examples, features, starts, ends = setup(qa_tokenizer)
    first, _ = position_of(features, 0, "VIOLA")
    _, last = position_of(features, 0, "lady")
    starts[0, first], ends[0, last] = 10.0, 10.0
    long_answer = best_spans(examples, features, starts, ends, max_answer_length=40)[0]["q"]
    assert long_answer.startswith("VIOLA") and long_answer.endswith("lady")
    short = best_spans(examples, features, starts, ends, max_answer_length=3)[0]["q"]
    assert len(short) < 20


def test_windows_and_null_threshold(qa_tokenizer):
    examples, features, starts, ends = setup(qa_tokenizer, max_seq_length=40, stride=4)
    assert len(features) > 2
    starts[:, 0], ends[:, 0] = 3.0, 3.0  # null score 6 in every window...
    starts[1:, 0] = -2.0  # ...but the smallest over windows counts: 1
    best = [f for f in range(len(features)) if _max_context(features, f, "CAPTAIN")]
    assert len(best) == 1  # CAPTAIN is in several windows, the most central one proposes it
    first, last = position_of(features, best[0], "CAPTAIN")
    others = 0
    for feature in range(len(features)):  # other windows score it higher: not their call
        chars = _window_chars(features, feature)
        whole = CONTEXT.index("CAPTAIN") in chars and CONTEXT.index("CAPTAIN") + 6 in chars
        if feature != best[0] and whole:
            other_first, other_last = position_of(features, feature, "CAPTAIN")
            starts[feature, other_first], ends[feature, other_last] = 5.0, 5.0
            others += 1
    assert others >= 1
    starts[best[0], first], ends[best[0], last] = 2.0, 1.0
    answers, diffs, _ = best_spans(examples, features, starts, ends)
    assert answers["q"] == "CAPTAIN" and diffs["q"] == 1.0 - 3.0
    assert apply_null_threshold(answers, diffs, -2.5) == {"q": ""}
    assert apply_null_threshold(answers, diffs, 0.0) == {"q": "CAPTAIN"}
