"""Start/end logits -> answer text: n-best spans, null answers and the v2 threshold.

For each question, every window (feature) proposes spans from its `n_best_size` best start
and end positions: both inside the context, end >= start, at most `max_answer_length`
tokens, and the start in the window where it has the most context. A span scores
start_logit + end_logit. The null score is the smallest [CLS] score over the windows
(BERT's rule); `score_diff` = null score - best span score, and a v2.0 question is
answered "" when score_diff > threshold.

Example:
    best, diffs, nbest = best_spans(examples, features, start_logits, end_logits)
    predictions = apply_null_threshold(best, diffs, threshold=0.0)
"""
import numpy as np

from tfbig.data.squad.features import char_span


def best_spans(examples, features, start_logits, end_logits, n_best_size=20,
               max_answer_length=30):
    """Best non-null answer per question, its score_diff, and the n-best list.

    Returns (answers {qid: text}, score_diff {qid: float}, nbest {qid: [{text, score}]}).
    A question with no valid span gets "" and score_diff +inf.
    """
    by_example = {}
    for feature, example in enumerate(features.arrays["example_index"].tolist()):
        by_example.setdefault(example, []).append(feature)
    answers, diffs, nbest = {}, {}, {}
    for index, example in enumerate(examples):
        candidates, null_score = {}, np.inf
        for feature in by_example.get(index, []):
            starts, ends = start_logits[feature], end_logits[feature]
            null_score = min(null_score, float(starts[0] + ends[0]))
            for (first, last), score in _feature_spans(features, feature, starts, ends,
                                                       n_best_size, max_answer_length):
                begin, end = char_span(features, feature, first, last)
                text = example.context[begin:end]
                candidates[text] = max(score, candidates.get(text, -np.inf))
        ranked = sorted(candidates.items(), key=lambda item: -item[1])[:n_best_size]
        nbest[example.qid] = [{"text": text, "score": score} for text, score in ranked]
        answers[example.qid] = ranked[0][0] if ranked else ""
        diffs[example.qid] = null_score - ranked[0][1] if ranked else float("inf")
    return answers, diffs, nbest


def _feature_spans(features, feature, starts, ends, n_best_size, max_answer_length):
    """Valid ((first, last), score) spans from one feature's top start and end positions."""
    context = features.arrays["context_token"][feature] >= 0
    max_context = features.arrays["max_context"][feature]
    top_starts = np.argsort(-starts)[:n_best_size]
    top_ends = np.argsort(-ends)[:n_best_size]
    for first in top_starts.tolist():
        if not (context[first] and max_context[first]):
            continue
        for last in top_ends.tolist():
            if context[last] and first <= last < first + max_answer_length:
                yield (first, last), float(starts[first] + ends[last])


def apply_null_threshold(answers, diffs, threshold):
    """v2.0 predictions: "" where score_diff > threshold, else the best span."""
    return {qid: ("" if diffs[qid] > threshold else text) for qid, text in answers.items()}
